"""The PostgreSQL side of the latest-checkpoint cache (``storage/latest.py``): what an entry holds, the
SQL that proves it, and how a put or a put_writes turns the entry before it into the next.

An entry (:class:`Image`) is an image of the rows ``get_tuple`` of a thread's latest checkpoint reads:
the checkpoint row, the blob rows at its channel versions, its pending writes; each row with its key and
its ``xmin``, the id of the transaction that wrote that version of the row. A row's content is fixed by
its key and its xmin, since one transaction writes at most one version of a row here: blobs are inserted
once, and the one update a put's own transaction may make to its new checkpoint (the keep-checkpoints
prune detaching it from a deleted parent) happens before the put reads the row back. So when the
database's latest checkpoint, and the rows a full read would join to it, carry exactly the keys and
xmins an entry records, the entry is what the full read would return: whoever wrote to the thread since
(another replica, a delete, a prune, a TTL sweep, a copy), it shows there.

Proving it (:data:`TOKEN_SQL`) reads the head row (its channel versions) and the blob and write rows by
key, without their values, and sends only ids and xmins. A 32-bit xid comes round again only after some
four billion transactions: a row rewritten with the very same key, xid and different content would need
that many transactions between two reads of an idle thread still held in the cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.postgres.base import UPSERT_CHECKPOINTS_SQL
from langgraph.checkpoint.serde.types import _DeltaSnapshot

# The full read, with each row's xmin: PostgresSaver's ``SELECT_SQL`` plus the xmins, latest checkpoint.
READ_SQL = """
SELECT thread_id, checkpoint, checkpoint_ns, checkpoint_id, parent_checkpoint_id, metadata,
    xmin::text AS row_xmin,
    (
        SELECT array_agg(array[bl.channel::bytea, bl.type::bytea, bl.blob, bl.xmin::text::bytea])
        FROM jsonb_each_text(checkpoint -> 'channel_versions')
        INNER JOIN checkpoint_blobs bl
            ON bl.thread_id = checkpoints.thread_id
            AND bl.checkpoint_ns = checkpoints.checkpoint_ns
            AND bl.channel = jsonb_each_text.key
            AND bl.version = jsonb_each_text.value
    ) AS channel_values,
    (
        SELECT array_agg(array[cw.task_id::text::bytea, cw.channel::bytea, cw.type::bytea, cw.blob,
                               convert_to(cw.task_path, 'UTF8'), cw.idx::text::bytea, cw.xmin::text::bytea])
        FROM checkpoint_writes cw
        WHERE cw.thread_id = checkpoints.thread_id
            AND cw.checkpoint_ns = checkpoints.checkpoint_ns
            AND cw.checkpoint_id = checkpoints.checkpoint_id
    ) AS pending_writes
FROM checkpoints
WHERE thread_id = %s AND checkpoint_ns = %s
ORDER BY checkpoint_id DESC LIMIT 1
"""

# The proof: the latest checkpoint's id and xmin, the xmins of the blob rows at its channel versions
# and the keys and xmins of its writes: the rows READ_SQL would read, without their values.
TOKEN_SQL = """
SELECT checkpoint_id, xmin::text AS row_xmin,
    (
        SELECT array_agg(array[bl.channel, bl.xmin::text])
        FROM jsonb_each_text(checkpoint -> 'channel_versions')
        INNER JOIN checkpoint_blobs bl
            ON bl.thread_id = checkpoints.thread_id
            AND bl.checkpoint_ns = checkpoints.checkpoint_ns
            AND bl.channel = jsonb_each_text.key
            AND bl.version = jsonb_each_text.value
    ) AS blobs,
    (
        SELECT array_agg(array[cw.task_id, cw.idx::text, cw.xmin::text])
        FROM checkpoint_writes cw
        WHERE cw.thread_id = checkpoints.thread_id
            AND cw.checkpoint_ns = checkpoints.checkpoint_ns
            AND cw.checkpoint_id = checkpoints.checkpoint_id
    ) AS writes
FROM checkpoints
WHERE thread_id = %s AND checkpoint_ns = %s
ORDER BY checkpoint_id DESC LIMIT 1
"""

# PostgresSaver's checkpoint upsert, answering the row's xmin (the put's transaction: its blobs carry
# the same) and its parent: what a put's image needs, with no statement of its own.
UPSERT_RETURNING_SQL = (
    UPSERT_CHECKPOINTS_SQL.strip().rstrip(";") + "\nRETURNING xmin::text AS row_xmin, parent_checkpoint_id"
)

# The same upsert for a put whose parent is checked (the saver's ``pruned_table``): the row's values go
# through reducing_saver_refuse_pruned_parent first, which raises for a parent the keep-checkpoints policy
# deleted (the put's whole pipeline then rolls back). The check is part of the statement that writes the
# row: no statement of its own. Same parameters, same answer; made from PostgresSaver's own upsert, so
# what it writes on a conflict stays upstream's.
_UPSERT_VALUES = "VALUES (%s, %s, %s, %s, %s, %s)"
_CHECKED_PUT = """WITH put (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata) AS (
    VALUES (%s::text, %s::text, %s::text, %s::text, %s::jsonb, %s::jsonb)
), checked AS MATERIALIZED (
    SELECT put.*, reducing_saver_refuse_pruned_parent(thread_id, checkpoint_ns, parent_checkpoint_id)
    FROM put
)
"""


def _checking_parent(upsert: str) -> str:
    insert, values, conflict = upsert.partition(_UPSERT_VALUES)
    if not values:
        raise RuntimeError(
            f"PostgresSaver's checkpoint upsert has no {_UPSERT_VALUES!r} to check: {upsert!r}"
        )
    return (
        _CHECKED_PUT
        + insert.strip()
        + "\nSELECT thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata FROM checked"
        + conflict
    )


UPSERT_CHECKING_PARENT_SQL = _checking_parent(UPSERT_RETURNING_SQL)

# Last in a put's pipeline when a keep-checkpoints prune follows the upsert: the transaction's xid as
# row xmins show it, and the new checkpoint's row as the prune leaves it (its parent may be gone).
PUT_PROBE_SQL = """
SELECT mod(pg_current_xact_id()::text::bigint, 4294967296)::text AS xid, xmin::text AS row_xmin,
    parent_checkpoint_id
FROM checkpoints WHERE thread_id = %s AND checkpoint_ns = %s AND checkpoint_id = %s
"""

#: A blob row: type, value (``None`` for an "empty" row), xmin.
BlobRow = tuple[bytes, bytes | None, str]
#: A write row in PostgresSaver's read order (task id, channel, type, value, task path, idx; bytes), xmin.
WriteRow = tuple[list[Any], str]


class Image:
    """The rows of one thread namespace's latest checkpoint, keyed and with their xmins. A put builds the
    next image; put_writes mark an image's writes unknown; an image built by a put turns the put's
    checkpoint and metadata into their JSONB reading on first use (:meth:`load`): most puts are followed
    by another put, not by a read."""

    __slots__ = (
        "thread_id",
        "checkpoint_ns",
        "checkpoint_id",
        "row_xmin",
        "parent_checkpoint_id",
        "checkpoint",
        "metadata",
        "blobs",
        "writes",
        "size",
        "_unread",
        "_params",
        "_versions",
        "_blob_token",
        "_write_token",
    )

    def __init__(
        self,
        *,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str,
        row_xmin: str,
        parent_checkpoint_id: str | None,
        checkpoint: dict[str, Any] | None,
        metadata: Any,
        blobs: dict[str, BlobRow],
        writes: dict[tuple[str, str], WriteRow] | None,
        versions: dict[str, str | None],
        unread: tuple[Any, Any] | None = None,
    ) -> None:
        self.thread_id, self.checkpoint_ns, self.checkpoint_id = thread_id, checkpoint_ns, checkpoint_id
        self.row_xmin, self.parent_checkpoint_id = row_xmin, parent_checkpoint_id
        #: ``writes`` is ``None`` once writes came after the image was made: its answer is read in full.
        self.checkpoint, self.metadata, self.blobs, self.writes = checkpoint, metadata, blobs, writes
        #: The checkpoint and metadata as the put stored them, until :meth:`load` reads them as JSONB would.
        self._unread = unread
        self._params = (thread_id, checkpoint_ns)
        self._versions = versions
        #: Bytes of blob and write values (what the cache's bound counts).
        self.size = sum(len(row[1] or b"") for row in blobs.values()) + sum(
            len(row[0][3] or b"") for row in (writes or {}).values()
        )
        # The proof's expected rows, built on the first proof (most images made by puts are never read).
        self._blob_token: frozenset[tuple[str, str]] | None = None
        self._write_token: frozenset[tuple[str, str, str]] | None = None

    @classmethod
    def from_row(cls, value: Mapping[str, Any]) -> Image:
        """The image of a :data:`READ_SQL` row."""
        blobs = {c.decode(): (t, b, x.decode()) for c, t, b, x in value["channel_values"] or ()}
        writes = {
            (w[0].decode(), w[5].decode()): (w[:6], w[6].decode()) for w in value["pending_writes"] or ()
        }
        versions = value["checkpoint"].get("channel_versions") or {}
        return cls(
            thread_id=value["thread_id"],
            checkpoint_ns=value["checkpoint_ns"],
            checkpoint_id=value["checkpoint_id"],
            row_xmin=value["row_xmin"],
            parent_checkpoint_id=value["parent_checkpoint_id"],
            checkpoint=value["checkpoint"],
            metadata=value["metadata"],
            blobs=blobs,
            writes=writes,
            versions={channel: _text(version) for channel, version in versions.items()},
        )

    @property
    def versions(self) -> dict[str, str | None]:
        """Channel -> version, as ``jsonb_each_text`` reads the checkpoint's ``channel_versions``; ``None``
        for a version whose reading is not known here (:func:`_text`), which matches none."""
        return self._versions

    def load(self) -> bool:
        """Read a put's checkpoint and metadata as JSONB returns them; ``False`` when that cannot be told
        here (``json_image``): the entry is of no use then."""
        unread = self._unread
        if unread is not None:
            stored, (config, metadata) = unread
            checkpoint = json_image(stored)
            metadata = json_image(get_serializable_checkpoint_metadata(config, metadata))
            if checkpoint is None or metadata is None:
                return False
            self.checkpoint, self.metadata, self._unread = checkpoint, metadata, None
        return self.checkpoint is not None

    @property
    def token_params(self) -> tuple[str, str]:
        """:data:`TOKEN_SQL`'s parameters."""
        return self._params

    def proven_by(self, row: Mapping[str, Any] | None) -> bool:
        """Whether a :data:`TOKEN_SQL` row shows the database holding exactly this image's rows."""
        if row is None or self.writes is None:
            return False
        if self._blob_token is None:
            self._blob_token = frozenset((channel, blob[2]) for channel, blob in self.blobs.items())
            self._write_token = frozenset((*key, write[1]) for key, write in self.writes.items())
        return (
            row["checkpoint_id"] == self.checkpoint_id
            and row["row_xmin"] == self.row_xmin
            and frozenset(map(tuple, row["blobs"] or ())) == self._blob_token
            and frozenset(map(tuple, row["writes"] or ())) == self._write_token
        )

    def row(self) -> dict[str, Any]:
        """The image as PostgresSaver's read returns its row (for ``_load_checkpoint_tuple``)."""
        return {
            "thread_id": self.thread_id,
            "checkpoint": self.checkpoint,
            "checkpoint_ns": self.checkpoint_ns,
            "checkpoint_id": self.checkpoint_id,
            "parent_checkpoint_id": self.parent_checkpoint_id,
            # A copy each time: the nested checkpoint is spread by the loader, the metadata is not.
            "metadata": dict(self.metadata) if isinstance(self.metadata, dict) else self.metadata,
            "channel_values": [[c.encode(), t, b] for c, (t, b, _) in self.blobs.items()] or None,
            "pending_writes": [row for row, _ in (self.writes or {}).values()] or None,
        }


def _text(version: Any) -> str | None:
    """A channel version as ``jsonb_each_text`` prints it; ``None`` for a kind whose printing differs from
    Python's (a float) or is not a version."""
    if isinstance(version, str):
        return version
    if isinstance(version, int) and not isinstance(version, bool):
        return str(version)
    return None


def json_image(value: Any) -> Any:
    """``value`` as it reads back from a JSONB column, or ``None`` when that cannot be told here.

    Lists and tuples read back as lists, and numbers as they were, except floats written with an exponent
    (JSONB keeps the decimal: ``1e20`` reads back as an int) and ``-0.0``: those, ints beyond 64 bits and
    keys that are not strings make an image unknown (the next read goes to the database).
    """
    try:
        image = orjson.loads(orjson.dumps(value))
    except (TypeError, ValueError):
        return None
    return None if _changes_in_jsonb(image) else image


def _changes_in_jsonb(value: Any) -> bool:
    """Whether ``value``, as ``orjson.loads`` gives it (plain dicts, lists, floats, ...), holds a float JSONB
    does not read back as it is. Run on every checkpoint a put's image turns into its JSONB reading: the
    walk only calls itself for containers and floats, never for the strings and ints most values are."""
    kind = type(value)
    if kind is float:
        return not math.isfinite(value) or "e" in repr(value) or (value == 0 and math.copysign(1, value) < 0)
    if kind is dict:
        items: Any = value.values()
    elif kind is list:
        items = value
    else:
        return False
    for item in items:
        kind = type(item)
        if (kind is dict or kind is list or kind is float) and _changes_in_jsonb(item):
            return True
    return False


def after_put(
    previous: Image | None,
    probe: Mapping[str, Any] | None,
    serde: Any,
    *,
    config: RunnableConfig,
    checkpoint: Checkpoint,
    metadata: CheckpointMetadata,
    new_versions: ChannelVersions,
) -> Image | None:
    """The image of a checkpoint a put just committed, as PostgresSaver's ``put`` stored it, or ``None``
    when some row it reads is not known here.

    ``probe`` is the put's own read of its checkpoint row (:data:`UPSERT_RETURNING_SQL`, or
    :data:`PUT_PROBE_SQL` after a prune). Blob rows the put wrote carry the row's xmin. A channel the put
    did not write keeps the row, or the absence of a row, the previous image recorded at the same
    version; a channel at a version the previous image does not know makes the image unknown. Rows
    believed wrongly (a blob the put's ``ON CONFLICT DO NOTHING`` left as it was) only make the next
    proof fail. The checkpoint and metadata are read as JSONB would return them on first use.
    """
    if probe is None or probe.get("xid", probe["row_xmin"]) != probe["row_xmin"]:
        return None
    xid = probe["row_xmin"]
    configurable = config["configurable"]
    stored = checkpoint.copy()
    inline = dict(checkpoint["channel_values"])
    blob_values = {}
    for channel, value in checkpoint["channel_values"].items():
        if isinstance(value, _DeltaSnapshot):
            return None
        if not (value is None or isinstance(value, (str, int, float, bool))):
            blob_values[channel] = inline.pop(channel)
    stored["channel_values"] = inline
    versions = {
        channel: _text(version) for channel, version in (checkpoint.get("channel_versions") or {}).items()
    }
    if None in versions.values():
        return None
    known = previous.versions if previous is not None else {}
    blobs: dict[str, BlobRow] = {}
    for channel, version in versions.items():
        if channel in blob_values and channel in new_versions:
            if _text(new_versions[channel]) != version:
                return None
            kind, data = serde.dumps_typed(blob_values[channel])
            blobs[channel] = (kind.encode(), None if data is None else bytes(data), xid)
        elif previous is not None and known.get(channel) == version:
            if channel in previous.blobs:
                blobs[channel] = previous.blobs[channel]
        elif channel not in new_versions:
            return None  # a version neither this put nor the image before it wrote
    return Image(
        thread_id=str(configurable["thread_id"]),
        checkpoint_ns=configurable["checkpoint_ns"],
        checkpoint_id=checkpoint["id"],
        row_xmin=xid,
        parent_checkpoint_id=probe["parent_checkpoint_id"],
        checkpoint=None,
        metadata=None,
        blobs=blobs,
        writes={},
        versions=versions,
        unread=(stored, (config, metadata)),
    )


def after_writes(current: Image | None, checkpoint_id: str) -> Image | None:
    """The image once a put_writes to ``checkpoint_id`` committed: its blob rows stay known (the next
    put builds on them), its writes no longer are, so the checkpoint's answer is read in full until a
    put moves on. Writes rarely come between a put and a read of the same checkpoint: LangGraph writes
    a step's outcome, then puts the next checkpoint."""
    if current is not None and current.checkpoint_id == checkpoint_id:
        # In place: a read proving the image meanwhile compares with the database, which has the writes
        # once they are committed, so it cannot take the image as current either way.
        current.writes = None
    return current  # writes to another checkpoint leave this one's answer as it was


__all__ = [
    "PUT_PROBE_SQL",
    "READ_SQL",
    "TOKEN_SQL",
    "UPSERT_CHECKING_PARENT_SQL",
    "UPSERT_RETURNING_SQL",
    "Image",
    "after_put",
    "after_writes",
]
