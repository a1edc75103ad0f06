"""The serializer the service gives its inner saver: client bytes in, the same bytes out.

Channel values and pending writes reach the service as :class:`Blob` objects, the client's own
``(type, bytes)``. ``VerbatimSerde.dumps_typed`` returns a blob's pair unchanged, so PostgresSaver
stores exactly the client's bytes and a stock PostgresSaver reading the database gets the real values
back.

SqliteSaver serializes the whole checkpoint and InMemorySaver the checkpoint and its metadata: those
structures hold blobs among plain JSON-like data, so they are written as msgpack under the type
``"reducing-saver/msgpack"``, where each blob is an extension of its own. Loading never imports or
calls anything: the only extension decoded is the blob's.
"""

from __future__ import annotations

from typing import Any

import ormsgpack

from reducing_saver.wire import Blob

#: The serde type of structures the service itself encoded.
STRUCTURE_TYPE = "reducing-saver/msgpack"
_BLOB_EXT = 100
_OPTIONS = ormsgpack.OPT_NON_STR_KEYS


def _pack_blob(obj: Any) -> ormsgpack.Ext:
    if isinstance(obj, Blob):
        return ormsgpack.Ext(_BLOB_EXT, ormsgpack.packb((obj.type, obj.data)))
    raise TypeError(f"cannot store a {type(obj).__name__} value: the service only stores client blobs")


def _unpack_blob(code: int, data: bytes) -> Blob:
    if code != _BLOB_EXT:
        raise ValueError(f"unexpected msgpack extension {code} in a stored structure")
    type_, raw = ormsgpack.unpackb(data)
    return Blob(type_, raw)


class VerbatimSerde:
    """``SerializerProtocol`` for an inner saver that stores client blobs verbatim."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        if isinstance(obj, Blob):
            return obj.type, obj.data
        return STRUCTURE_TYPE, ormsgpack.packb(obj, default=_pack_blob, option=_OPTIONS)

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        type_, raw = data
        if type_ == STRUCTURE_TYPE:
            return ormsgpack.unpackb(raw, ext_hook=_unpack_blob, option=_OPTIONS)
        return Blob(type_, bytes(raw))
