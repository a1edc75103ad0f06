"""The msgpack array header, read without decoding (service/msgpack_headers.py)."""

from __future__ import annotations

import ormsgpack
import pytest

from reducing_saver.service.msgpack_headers import array_length


@pytest.mark.parametrize(
    ("length", "first"),
    [(0, 0x90), (1, 0x91), (15, 0x9F), (16, 0xDC), (65535, 0xDC), (65536, 0xDD), (70000, 0xDD)],
)
def test_the_length_comes_from_each_header_form(length: int, first: int) -> None:
    data = ormsgpack.packb([None] * length)
    assert data[0] == first
    assert array_length(data) == length
    assert array_length(memoryview(data)) == length
    assert array_length(bytearray(data)) == length


def test_only_the_header_is_read() -> None:
    # An array 32 header claiming four billion elements, with none behind it.
    assert array_length(b"\xdd\xff\xff\xff\xff") == 0xFFFFFFFF
    assert array_length(b"\xdc\x00\x02") == 2


@pytest.mark.parametrize("data", [b"\xdc", b"\xdc\x01", b"\xdd", b"\xdd\x00\x00\x01"])
def test_a_truncated_header_has_no_length(data: bytes) -> None:
    assert array_length(data) is None


@pytest.mark.parametrize(
    "data", [None, b"", ormsgpack.packb({"a": 1}), ormsgpack.packb("text"), b"\xc0", b"\x8f"]
)
def test_what_is_not_an_array_has_no_length(data: bytes | None) -> None:
    assert array_length(data) is None
