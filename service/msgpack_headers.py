"""What the header of a msgpack value says, read without decoding the value."""

from __future__ import annotations


def array_length(data: bytes | bytearray | memoryview | None) -> int | None:
    """The length of the msgpack array ``data`` starts with, from its header alone (nothing decoded).

    Reads a fixarray (``0x90``-``0x9f``), an array 16 (``0xdc``) or an array 32 (``0xdd``) header.

    Returns:
        The array's length; ``None`` when ``data`` is empty or ``None``, does not start with an array
        header, or ends inside the header.
    """
    if not data:
        return None
    head = bytes(data[:5])
    first = head[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F
    if first == 0xDC and len(head) >= 3:
        return int.from_bytes(head[1:3], "big")
    if first == 0xDD and len(head) >= 5:
        return int.from_bytes(head[1:5], "big")
    return None


__all__ = ["array_length"]
