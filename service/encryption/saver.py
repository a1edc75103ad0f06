"""``EncryptingSaver``: the service's savers, storing every value of a conversation as an envelope.

It sits between the reducing saver (which reads the messages channel in plain text) and the backend's
saver (which stores what it is given). On the way down it seals, on the way up it opens:

* channel values: every value of ``channel_values``, inline primitives included (they become blobs, so
  PostgresSaver's JSONB holds none of them), bound to (thread, namespace, channel, version);
* pending writes: bound to (thread, namespace, checkpoint, task, index, channel);
* metadata values, except :data:`PLAIN_METADATA_KEYS` (LangGraph, the sweeps and ``delete_for_runs`` read
  them in the database), each bound to (thread, namespace, checkpoint, key).

A sealed channel value or write is a blob of serde type :data:`ENVELOPE_TYPE`, which no stock reader
knows (a stock PostgresSaver fails with "Unknown serialization type"); a sealed metadata value is the
string :data:`METADATA_PREFIX` + base64. The tenant (tenant mode: the stored thread id's prefix) picks
the derived key. ``required`` refuses to read a plain value (:class:`PlainTextRefused`), ``migrate``
reads it as it is; both write only envelopes.

``list`` filters on sealed metadata keys after opening (the database cannot compare ciphertext); the
limit then counts matches, so such a list reads the thread's checkpoints up to the limit-th match.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any, Literal, cast

import ormsgpack
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    get_checkpoint_metadata,
)

from reducing_saver.service.encryption.envelope import Cipher, IntegrityError, PlainTextRefused, key_id_of
from reducing_saver.service.storage.lifecycle import (
    DELTA_METADATA_KEYS,
    ThreadNotEmptyError,
    check_copy_ids,
    is_snapshot_value,
    refuse_delta_threads,
)
from reducing_saver.service.storage.outbox import CheckpointRecords
from reducing_saver.wire import RESERVED_TYPE_PREFIX, Blob
from reducing_saver.wire.capabilities import saver_capabilities, with_capabilities

Mode = Literal["off", "migrate", "required"]
#: The serde type of a sealed channel value or pending write (a client may not send reserved types).
ENVELOPE_TYPE = RESERVED_TYPE_PREFIX + "aesgcm"
#: The prefix of a sealed metadata value (a JSON string).
METADATA_PREFIX = ENVELOPE_TYPE + ":"
#: Metadata kept in plain text: LangGraph's own keys, the ones the TTL sweeps, ``prune`` and
#: ``delete_for_runs`` read in the database.
PLAIN_METADATA_KEYS = frozenset({"source", "step", "parents", "run_id", *DELTA_METADATA_KEYS})
#: Plaintext tags: a blob framed by hand (cheaper than msgpack: no copy through a packer), a blob as a
#: msgpack pair (long type names; all blobs sealed by earlier releases), the JSON of a primitive.
_BLOB, _MSGPACK_BLOB, _JSON = b"B", b"b", b"j"
_INDEX = struct.Struct(">i")


# -- the plaintext of one value --------------------------------------------------------------------


def _plain_bytes(value: Any) -> bytes:
    """A channel value or write as bytes: ``B``, the blob's type's length (one byte), type, data; or
    ``j`` and the JSON of an inline primitive."""
    if isinstance(value, Blob):
        kind = value.type.encode()
        if len(kind) < 256:
            return _BLOB + bytes((len(kind),)) + kind + value.data
        return _MSGPACK_BLOB + ormsgpack.packb([value.type, value.data])
    return _JSON + json.dumps(value).encode()


def _from_plain_bytes(raw: bytes) -> Any:
    tag = raw[:1]
    if tag == _BLOB:
        end = 2 + raw[1]
        return Blob(raw[2:end].decode(), raw[end:])
    if tag == _MSGPACK_BLOB:  # a type name of 256 bytes or more, and every blob sealed by earlier releases
        type_, data = ormsgpack.unpackb(raw[1:])
        return Blob(type_, data)
    return json.loads(raw[1:])


def _is_primitive(value: Any) -> bool:
    """Whether a stock PostgresSaver keeps ``value`` inline in the checkpoint row (not as a blob)."""
    return value is None or isinstance(value, (str, int, float, bool))


def is_sealed(value: Any) -> bool:
    """Whether a stored channel value, write or metadata value is an envelope."""
    if isinstance(value, Blob):
        return value.type == ENVELOPE_TYPE
    return isinstance(value, str) and value.startswith(METADATA_PREFIX)


def sealed_key_id(value: Any, *, write: bool = False) -> str | None:
    """The key id of a sealed value (``None`` for a plain one); ``write``: a pending write's blob."""
    if isinstance(value, Blob) and value.type == ENVELOPE_TYPE:
        return key_id_of(value.data[_INDEX.size :] if write else value.data)
    if isinstance(value, str) and value.startswith(METADATA_PREFIX):
        try:
            return key_id_of(base64.b64decode(value[len(METADATA_PREFIX) :]))
        except (binascii.Error, ValueError):
            return None
    return None


class Sealer:
    """Seals and opens each kind of stored value, bound to its place, under one mode.

    Args:
        cipher: The key ring's cipher.
        mode: ``"migrate"`` or ``"required"``.
        tenant_mode: Whether stored thread ids carry their tenant (``tenant:thread``).
    """

    def __init__(self, cipher: Cipher, mode: Mode, *, tenant_mode: bool) -> None:
        self.cipher = cipher
        self.mode = mode
        self.tenant_mode = tenant_mode

    def tenant(self, thread_id: str) -> str:
        """The tenant whose key seals a thread's values ("" in single-tenant mode)."""
        return thread_id.split(":", 1)[0] if self.tenant_mode else ""

    def plain(self, value: Any, where: str) -> Any:
        """A plain stored value, as it is under ``migrate``.

        Raises:
            PlainTextRefused: Under ``required``, naming ``where``.
        """
        if self.mode == "required":
            raise PlainTextRefused(
                f"{where}: the stored value is plain text, which --encryption required refuses to read "
                "(run the service with --encryption migrate and reducing-saver encrypt-sweep first)"
            )
        return value

    # channel values
    def seal_value(self, value: Any, thread_id: str, ns: str, channel: str, version: Any) -> Blob:
        context = ["blob", thread_id, ns, channel, str(version)]
        return Blob(ENVELOPE_TYPE, self.cipher.seal(_plain_bytes(value), self.tenant(thread_id), context))

    def open_value(self, value: Any, thread_id: str, ns: str, channel: str, version: Any) -> Any:
        where = f"thread {thread_id!r} namespace {ns!r} channel {channel!r}"
        if not is_sealed(value):
            return self.plain(value, where)
        context = ["blob", thread_id, ns, channel, str(version)]
        return _from_plain_bytes(self.cipher.open(value.data, self.tenant(thread_id), context, where))

    # pending writes
    def seal_write(
        self, value: Any, thread_id: str, ns: str, checkpoint_id: str, task_id: str, index: int, channel: str
    ) -> Blob:
        context = ["write", thread_id, ns, checkpoint_id, task_id, index, channel]
        sealed = self.cipher.seal(_plain_bytes(value), self.tenant(thread_id), context)
        return Blob(ENVELOPE_TYPE, _INDEX.pack(index) + sealed)

    def open_write(
        self, value: Any, thread_id: str, ns: str, checkpoint_id: str, task_id: str, channel: str
    ) -> tuple[int | None, Any]:
        """``(index, value)``: the write's authenticated index (``None`` for a plain write) and value."""
        where = f"thread {thread_id!r} checkpoint {checkpoint_id!r} pending write of task {task_id!r}"
        if not is_sealed(value):
            return None, self.plain(value, where)
        if len(value.data) < _INDEX.size:
            raise IntegrityError(f"{where}: integrity check failed: the stored ciphertext is malformed")
        (index,) = _INDEX.unpack_from(value.data)
        context = ["write", thread_id, ns, checkpoint_id, task_id, index, channel]
        plain = self.cipher.open(value.data[_INDEX.size :], self.tenant(thread_id), context, where)
        return index, _from_plain_bytes(plain)

    # metadata
    def seal_metadata(
        self, metadata: dict[str, Any], thread_id: str, ns: str, checkpoint_id: str
    ) -> dict[str, Any]:
        tenant = self.tenant(thread_id)
        sealed = {}
        for key, value in metadata.items():
            if key in PLAIN_METADATA_KEYS:
                sealed[key] = value
                continue
            envelope = self.cipher.seal(
                json.dumps(value).encode(), tenant, ["metadata", thread_id, ns, checkpoint_id, key]
            )
            sealed[key] = METADATA_PREFIX + base64.b64encode(envelope).decode()
        return sealed

    def open_metadata(
        self, metadata: dict[str, Any], thread_id: str, ns: str, checkpoint_id: str
    ) -> dict[str, Any]:
        tenant = self.tenant(thread_id)
        opened = {}
        for key, value in metadata.items():
            if key in PLAIN_METADATA_KEYS:
                opened[key] = value
                continue
            where = f"thread {thread_id!r} checkpoint {checkpoint_id!r} metadata {key!r}"
            if is_sealed(value):
                try:
                    envelope = base64.b64decode(value[len(METADATA_PREFIX) :], validate=True)
                except (binascii.Error, ValueError):
                    raise IntegrityError(
                        f"{where}: integrity check failed: the stored ciphertext is malformed"
                    ) from None
                context = ["metadata", thread_id, ns, checkpoint_id, key]
                opened[key] = json.loads(self.cipher.open(envelope, tenant, context, where))
            else:
                opened[key] = self.plain(value, where)
        return opened

    # whole checkpoints
    def seal_checkpoint(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        new_versions: ChannelVersions,
        channels: Collection[str] | None = None,
    ) -> Checkpoint:
        """The checkpoint with its channel values sealed: those of ``channels`` only when given (the
        others are left out, for a backend that would not store them)."""
        configurable = config["configurable"]
        thread_id, ns = configurable["thread_id"], configurable.get("checkpoint_ns", "")
        versions = checkpoint.get("channel_versions") or {}
        values = {
            channel: self.seal_value(
                value, thread_id, ns, channel, new_versions.get(channel, versions.get(channel))
            )
            for channel, value in (checkpoint.get("channel_values") or {}).items()
            if channels is None or channel in channels
        }
        return {**checkpoint, "channel_values": values}

    def open_tuple(self, item: CheckpointTuple) -> CheckpointTuple:
        configurable = item.config["configurable"]
        thread_id, ns = configurable["thread_id"], configurable.get("checkpoint_ns", "")
        checkpoint_id = configurable.get("checkpoint_id") or item.checkpoint["id"]
        versions = item.checkpoint.get("channel_versions") or {}
        values = {
            channel: self.open_value(value, thread_id, ns, channel, versions.get(channel))
            for channel, value in (item.checkpoint.get("channel_values") or {}).items()
        }
        writes, seen = [], set()
        for task_id, channel, value in item.pending_writes or ():
            index, opened = self.open_write(value, thread_id, ns, checkpoint_id, task_id, channel)
            if index is not None:
                if (task_id, index) in seen:  # one write's ciphertext copied over another index
                    raise IntegrityError(
                        f"thread {thread_id!r} checkpoint {checkpoint_id!r}: two pending writes of task "
                        f"{task_id!r} carry index {index}: integrity check failed (a write was copied)"
                    )
                seen.add((task_id, index))
            writes.append((task_id, channel, opened))
        return item._replace(
            checkpoint={**item.checkpoint, "channel_values": values},
            metadata=cast(
                CheckpointMetadata,
                self.open_metadata(dict(item.metadata or {}), thread_id, ns, checkpoint_id),
            ),
            pending_writes=writes,
        )


# -- the saver -------------------------------------------------------------------------------------


def _split_filter(filter: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """A list filter's plain keys (the database compares them) and its sealed ones (compared after)."""
    if not filter:
        return filter, {}
    plain = {k: v for k, v in filter.items() if k in PLAIN_METADATA_KEYS}
    sealed = {k: v for k, v in filter.items() if k not in PLAIN_METADATA_KEYS}
    return plain or None, sealed


class WrappedSaver(BaseCheckpointSaver):
    """A saver over a backend's saver: what it does not define itself, the backend's saver answers."""

    #: Attributes of the wrapper itself, never looked up on the inner saver (while not yet set).
    own_attributes: tuple[str, ...] = ("inner",)

    def __init__(self, inner: BaseCheckpointSaver) -> None:
        super().__init__(serde=inner.serde)
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        # The backend's own markers (keeps_big_ints_inline, lists_by_thread_prefix, ...).
        if name.startswith("_") or name in self.own_attributes:
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def config_specs(self) -> list:
        return self.inner.config_specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    def delete_thread(self, thread_id: str) -> None:
        return self.inner.delete_thread(thread_id)

    def inner_put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        records: CheckpointRecords | None,
    ) -> RunnableConfig:
        """The inner saver's ``put``, given ``records`` when the caller passed them: a put's outbox entries,
        which the service passes only where the backend writes them with the checkpoint
        (``Memory.with_checkpoint``); without them, ``put`` is called as LangGraph calls it."""
        if records is None:
            return self.inner.put(config, checkpoint, metadata, new_versions)
        return self.inner.put(config, checkpoint, metadata, new_versions, records=records)  # type: ignore[call-arg]


class EncryptingSaver(WrappedSaver):
    """A backend saver whose stored values are envelopes (see the module docstring).

    Build one with :func:`encrypting`, which gives it exactly the optional capabilities it supports of
    the inner saver's: ``prune`` and ``delete_for_runs`` (they read only plain columns and keys),
    ``copy_thread`` (which seals each value again for the target thread), and
    ``get_delta_channel_history``, read in one go by the backend with the place each sealed value is bound
    to (``placed_delta_history``) and opened here.

    The backend's keep-checkpoints rule reads only plain metadata (the DeltaChannel counters stay plain),
    so it applies to sealed threads as to plain ones.
    """

    capabilities: frozenset[str] = frozenset()

    own_attributes = ("inner", "sealer")

    def __init__(self, inner: BaseCheckpointSaver, sealer: Sealer) -> None:
        super().__init__(inner)
        self.sealer = sealer

    def __repr__(self) -> str:
        return f"EncryptingSaver({self.inner!r}, mode={self.sealer.mode!r})"

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        item = self.inner.get_tuple(config)
        return self.sealer.open_tuple(item) if item is not None else None

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        plain, sealed = _split_filter(filter)
        inner_limit = limit if not sealed else None
        listed = self.inner.list(config, filter=plain, before=before, limit=inner_limit)
        with closing(listed) as found:  # type: ignore[type-var]  # the backends' list is a generator
            count = 0
            for item in found:
                if limit is not None and count >= limit:
                    return
                opened = self.sealer.open_tuple(item)
                metadata: Mapping[str, Any] = opened.metadata
                if all(k in metadata and metadata[k] == v for k, v in sealed.items()):
                    count += 1
                    yield opened

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        *,
        records: CheckpointRecords | None = None,
    ) -> RunnableConfig:
        """The checkpoint and its metadata sealed, stored by the inner saver; ``records`` (the put's outbox
        entries, sealed already) go to its ``put`` as they are (see ``WrappedSaver.inner_put``)."""
        configurable = config["configurable"]
        thread_id, ns = configurable["thread_id"], configurable.get("checkpoint_ns", "")
        # Merged here, as the inner saver would, so configurable values are sealed too (it then adds none).
        merged = get_checkpoint_metadata(config, metadata)
        sealed_metadata = self.sealer.seal_metadata(dict(merged), thread_id, ns, checkpoint["id"])
        channels, new_versions = self._stored_channels(checkpoint, new_versions)
        sealed = self.sealer.seal_checkpoint(config, checkpoint, new_versions, channels)
        return self.inner_put(
            config, sealed, cast(CheckpointMetadata, sealed_metadata), new_versions, records
        )

    def _stored_channels(
        self, checkpoint: Checkpoint, new_versions: ChannelVersions
    ) -> tuple[Collection[str] | None, ChannelVersions]:
        """Which channel values to seal (``None``: all) and the versions the inner put writes.

        A backend that ``stores_written_channels_only`` stores the values of ``new_versions`` and finds
        the others by version in the rows that wrote them: sealing those would be wasted. Under
        ``migrate``, a backend that ``inlines_primitive_values`` (PostgreSQL) may hold such a value of
        the plain era only inline in an older checkpoint row, which a read of this one does not look
        at (a sealed value is a blob, never inline): the primitive values the put carries are written
        too, as blob rows at their versions (where one exists already, the backend keeps it).
        """
        if not getattr(self.inner, "stores_written_channels_only", False):
            return None, new_versions
        if self.sealer.mode == "migrate" and getattr(self.inner, "inlines_primitive_values", False):
            versions = checkpoint.get("channel_versions") or {}
            carried = {
                channel: versions[channel]
                for channel, value in (checkpoint.get("channel_values") or {}).items()
                if channel not in new_versions and channel in versions and _is_primitive(value)
            }
            if carried:
                new_versions = {**new_versions, **carried}
        return new_versions.keys(), new_versions

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        configurable = config["configurable"]
        thread_id, ns = configurable["thread_id"], configurable.get("checkpoint_ns", "")
        checkpoint_id = configurable["checkpoint_id"]
        sealed = [
            (
                channel,
                self.sealer.seal_write(
                    value, thread_id, ns, checkpoint_id, task_id, WRITES_IDX_MAP.get(channel, index), channel
                ),
            )
            for index, (channel, value) in enumerate(writes)
        ]
        return self.inner.put_writes(config, sealed, task_id, task_path)


class _DeleteForRuns:
    inner: BaseCheckpointSaver

    def delete_for_runs(self, run_ids: Sequence[str], **kwargs: Any) -> None:
        return self.inner.delete_for_runs(run_ids, **kwargs)


class _Prune:
    inner: BaseCheckpointSaver

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """The inner ``prune``; ``keep_latest`` first refuses threads holding a DeltaChannel snapshot,
        which the backends recognize by its bytes, and which are sealed here: the threads' checkpoints are
        opened and looked at (the backends still check the metadata counters themselves)."""
        if strategy == "keep_latest" and not isinstance(thread_ids, str):
            delta = []
            for thread_id in thread_ids:
                with closing(self.list({"configurable": {"thread_id": thread_id}})) as found:  # type: ignore[attr-defined]
                    if any(
                        is_snapshot_value(value)
                        for item in found
                        for value in (item.checkpoint.get("channel_values") or {}).values()
                    ):
                        delta.append(thread_id)
            refuse_delta_threads(delta)
        return self.inner.prune(thread_ids, strategy=strategy)


class _CopyThread:
    inner: BaseCheckpointSaver
    sealer: Sealer

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread by opening each of its values and sealing it again for the target thread.

        The backends' own ``copy_thread`` copies rows as they are, and a ciphertext bound to the source
        thread does not open under the target. Checkpoints are copied oldest first, with their ids,
        parents, metadata and pending writes (whose ``task_path`` the saver API does not return: copies
        get ``""``). Unlike the backends' copy it is not one transaction: a copy cut short leaves the
        target partly written (delete it and copy again).

        Raises:
            ValueError: If source and target are the same thread id.
            ThreadNotEmptyError: If the target already holds checkpoints (nothing copied).
        """
        source, target = check_copy_ids(source_thread_id, target_thread_id)
        listed = self.inner.list({"configurable": {"thread_id": target}}, limit=1)
        with closing(listed) as found:  # type: ignore[type-var]  # the backends' list is a generator
            if next(found, None) is not None:
                raise ThreadNotEmptyError(target)
        with closing(self.list({"configurable": {"thread_id": source}})) as found:  # type: ignore[attr-defined]
            items = list(found)
        for item in sorted(items, key=lambda i: i.checkpoint["id"]):
            ns = item.config["configurable"].get("checkpoint_ns", "")
            parent = (item.parent_config or {}).get("configurable", {}).get("checkpoint_id")
            config: RunnableConfig = {"configurable": {"thread_id": target, "checkpoint_ns": ns}}
            if parent:
                config["configurable"]["checkpoint_id"] = parent
            values = item.checkpoint.get("channel_values") or {}
            versions = {
                c: v for c, v in (item.checkpoint.get("channel_versions") or {}).items() if c in values
            }
            self.put(config, item.checkpoint, item.metadata, versions)  # type: ignore[attr-defined]
            by_task: dict[str, list[tuple[str, Any]]] = {}
            for task_id, channel, value in item.pending_writes or ():
                by_task.setdefault(task_id, []).append((channel, value))
            written = {
                "configurable": {
                    "thread_id": target,
                    "checkpoint_ns": ns,
                    "checkpoint_id": item.checkpoint["id"],
                }
            }
            for task_id, writes in by_task.items():
                self.put_writes(written, writes, task_id)  # type: ignore[attr-defined]


class _DeltaChannelHistory:
    inner: BaseCheckpointSaver
    sealer: Sealer

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        """The backend's history of the channels (its own queries, ``placed_delta_history``), each write
        opened with the checkpoint, task and index it is bound to, each seed with its channel version."""
        configurable = config["configurable"]
        thread_id, ns = str(configurable["thread_id"]), configurable.get("checkpoint_ns", "")
        result: dict[str, DeltaChannelHistory] = {}
        for channel, placed in self.inner.placed_delta_history(config, channels).items():  # type: ignore[attr-defined]
            writes = [
                (
                    task_id,
                    channel,
                    self.sealer.open_write(value, thread_id, ns, checkpoint_id, task_id, channel)[1],
                )
                for checkpoint_id, task_id, value in placed["writes"]
            ]
            entry = DeltaChannelHistory(writes=writes)
            if "seed" in placed:
                version, value = placed["seed"]
                entry["seed"] = self.sealer.open_value(value, thread_id, ns, channel, version)
            result[channel] = entry
        return result

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        return self.get_delta_channel_history(config=config, channels=channels)


_MIXINS: dict[str, type] = {
    "copy_thread": _CopyThread,
    "delete_for_runs": _DeleteForRuns,
    "prune": _Prune,
    "delta_channel_history": _DeltaChannelHistory,
}


def encrypting(inner: BaseCheckpointSaver, sealer: Sealer) -> EncryptingSaver:
    """``inner`` wrapped in an :class:`EncryptingSaver` with the capabilities it keeps under encryption
    (DeltaChannel history where the backend reads it with places: ``placed_delta_history``)."""
    kept = set(saver_capabilities(inner) & _MIXINS.keys())
    if not hasattr(inner, "placed_delta_history"):
        kept.discard("delta_channel_history")
    return with_capabilities(EncryptingSaver, frozenset(kept), _MIXINS)(inner, sealer)
