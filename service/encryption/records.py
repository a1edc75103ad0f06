"""Sealing the service's own records: outbox messages and long-term memory (store) values.

* An outbox row's ``message`` becomes ``{ENVELOPE_TYPE: "<base64 envelope>"}``, bound to the row's
  (namespace, key); :class:`EncryptingOutbox` seals what is recorded and opens what is claimed.
* A store item's value becomes the same one-key object, bound to the item's (namespace, key);
  :class:`EncryptingStore` seals puts and opens what gets and searches return. A search filter on value
  fields is applied here, after opening (the database cannot compare ciphertext), with LangGraph's own
  comparison (``InMemoryStore``'s); the offset and limit then count matches.

A process with ``--encryption off`` shares its database with sealing ones during a rollout: its outbox
never claims a sealed row (``claims_sealed`` stays false: the row waits for a process with the key ring),
and :class:`PlainStore` refuses a sealed item (``EncryptedValueRefused``) rather than return its envelope
as a value.

The tenant is the namespace's (``("tenants", tenant, ...)`` in tenant mode).
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from langgraph.store.base import BaseStore, GetOp, Item, Op, PutOp, Result, SearchOp
from langgraph.store.memory import _compare_values

from reducing_saver.service.encryption.envelope import IntegrityError, key_id_of
from reducing_saver.service.encryption.saver import ENVELOPE_TYPE, Sealer
from reducing_saver.service.storage import EncryptedValueRefused, StoredDataError
from reducing_saver.service.storage.outbox import OutboxEntry

logger = logging.getLogger("reducing_saver.service")

#: Items a filtered search reads per page while it filters after opening.
_SEARCH_PAGE = 500

_ItemT = TypeVar("_ItemT", bound=Item)


def _tenant(sealer: Sealer, namespace: Sequence[str]) -> str:
    return namespace[1] if sealer.tenant_mode and len(namespace) > 1 and namespace[0] == "tenants" else ""


def is_sealed_record(value: Any) -> bool:
    """Whether an outbox message or store value is an envelope."""
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(ENVELOPE_TYPE), str)


def record_key_id(value: Any) -> str | None:
    """The key id of a sealed record (``None`` for a plain one)."""
    if not is_sealed_record(value):
        return None
    try:
        return key_id_of(base64.b64decode(value[ENVELOPE_TYPE]))
    except (binascii.Error, ValueError):
        return None


def seal_record(sealer: Sealer, kind: str, value: Any, namespace: Sequence[str], key: str) -> dict[str, str]:
    """``value`` (JSON data) sealed, bound to ``kind`` (``"outbox"`` or ``"store"``), namespace and key."""
    context = [kind, list(namespace), key]
    envelope = sealer.cipher.seal(json.dumps(value).encode(), _tenant(sealer, namespace), context)
    return {ENVELOPE_TYPE: base64.b64encode(envelope).decode()}


def open_record(sealer: Sealer, kind: str, value: Any, namespace: Sequence[str], key: str) -> Any:
    """The JSON data of a sealed record; a plain one as it is (``migrate``) or refused (``required``).

    Raises:
        IntegrityError, UnknownKeyError, PlainTextRefused: Naming the record.
    """
    where = f"{kind} item {key!r} in namespace {tuple(namespace)!r}"
    if not is_sealed_record(value):
        return sealer.plain(value, where)
    try:
        envelope = base64.b64decode(value[ENVELOPE_TYPE], validate=True)
    except (binascii.Error, ValueError):
        raise IntegrityError(f"{where}: integrity check failed: the stored ciphertext is malformed") from None
    context = [kind, list(namespace), key]
    return json.loads(sealer.cipher.open(envelope, _tenant(sealer, namespace), context, where))


# -- the outbox ------------------------------------------------------------------------------------


def seal_entries(sealer: Sealer | None, entries: Iterable[OutboxEntry]) -> list[OutboxEntry]:
    """Outbox entries with their messages sealed and their fingerprints keyed (:func:`keyed_fingerprint`);
    unchanged without a sealer, or when already sealed."""
    if sealer is None:
        return list(entries)
    return [
        entry
        if is_sealed_record(entry.message)
        else dataclasses.replace(
            entry,
            message=seal_record(sealer, "outbox", entry.message, entry.namespace, entry.key),
            fingerprint=keyed_fingerprint(sealer, entry.namespace, entry.fingerprint),
        )
        for entry in entries
    ]


def keyed_fingerprint(sealer: Sealer | None, namespace: Sequence[str], fingerprint: str | None) -> str | None:
    """An outbox message's fingerprint as its row keeps it: keyed per tenant under encryption (a plain
    digest of a short message could be guessed by trying texts), as it is without."""
    if sealer is None or fingerprint is None:
        return fingerprint
    return sealer.cipher.fingerprint(bytes.fromhex(fingerprint), _tenant(sealer, namespace))


class EncryptingOutbox:
    """An outbox whose rows hold sealed messages: :meth:`record` seals, :meth:`claim` opens.

    Everything else is the inner outbox's (statuses, leases and dead letters read no message).
    """

    def __init__(self, inner: Any, sealer: Sealer) -> None:
        self.inner = inner
        self.sealer = sealer
        inner.claims_sealed = True  # this process opens them

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("inner", "sealer"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def record(self, entries: Iterable[OutboxEntry]) -> int:
        return self.inner.record(seal_entries(self.sealer, entries))

    def forget(self, entries: Iterable[OutboxEntry]) -> int:
        return self.inner.forget(entries)  # a deletion holds no message: nothing to seal

    def claim(self, worker_id: str, limit: int, lease_seconds: float) -> list[OutboxEntry]:
        """The inner claim, messages opened. A row that cannot be opened (changed, moved, plain under
        ``required``, an unknown key) becomes a dead letter whose error says why; the others go on."""
        opened = []
        for entry in self.inner.claim(worker_id, limit, lease_seconds):
            if entry.message is None:  # a deletion (``forget``): no message
                opened.append(entry)
                continue
            try:
                message = open_record(self.sealer, "outbox", entry.message, entry.namespace, entry.key)
            except StoredDataError as exc:
                logger.error("outbox row %r of thread %r: %s", entry.key, entry.thread_id, exc)
                self.inner.fail(worker_id, entry.ident, str(exc), dead=True)
                continue
            opened.append(dataclasses.replace(entry, message=message))
        return opened


# -- the store -------------------------------------------------------------------------------------


class _StoreWrapper(BaseStore):
    """What a store wrapper takes from the store it wraps: BaseStore's TTL attributes (class attributes
    there, which ``__getattr__`` never reaches) and every other attribute."""

    inner: BaseStore

    @property
    def supports_ttl(self) -> bool:  # type: ignore[override]
        return self.inner.supports_ttl

    @property
    def ttl_config(self) -> Any:  # type: ignore[override]
        return self.inner.ttl_config

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("inner", "sealer"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class EncryptingStore(_StoreWrapper):
    """A store whose item values are sealed; namespaces and keys stay plain (they are the address).

    Semantic search is not offered under encryption (the settings refuse ``store_index``): its vectors
    would be computed from, and reveal, the plain text.
    """

    def __init__(self, inner: BaseStore, sealer: Sealer) -> None:
        self.inner = inner
        self.sealer = sealer

    def _open_item(self, item: _ItemT) -> _ItemT:
        opened = copy.copy(item)  # an Item or a SearchItem (its score kept)
        opened.value = open_record(self.sealer, "store", item.value, item.namespace, item.key)
        return opened

    def _search(self, op: SearchOp) -> list[Item]:
        """A search filtering on value fields: pages of the namespace prefix, opened, then compared."""
        conditions = op.filter or {}
        found: list[Item] = []
        offset = 0
        while True:
            page_op = SearchOp(op.namespace_prefix, None, _SEARCH_PAGE, offset, op.query, op.refresh_ttl)
            page = _search_result(self.inner.batch([page_op])[0])
            for item in page:
                opened = self._open_item(item)
                if all(_compare_values(opened.value.get(k), v) for k, v in conditions.items()):
                    found.append(opened)
            if len(page) < _SEARCH_PAGE or len(found) >= op.offset + op.limit:
                return found[op.offset : op.offset + op.limit]
            offset += _SEARCH_PAGE

    def _sealed_op(self, op: Op) -> Op:
        if isinstance(op, PutOp) and op.value is not None:
            sealed = seal_record(self.sealer, "store", op.value, op.namespace, op.key)
            return PutOp(op.namespace, op.key, sealed, False, op.ttl)
        return op

    def _opened_result(self, op: Op, result: Result) -> Result:
        if isinstance(op, GetOp):
            item = _get_result(result)
            return None if item is None else self._open_item(item)
        if isinstance(op, SearchOp):
            return [self._open_item(item) for item in _search_result(result)]
        return result

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        if any(isinstance(op, SearchOp) and op.filter for op in ops):
            # One at a time, in order, so a filtered search sees the batch's earlier puts.
            return [
                self._search(op)
                if isinstance(op, SearchOp) and op.filter
                else self._opened_result(op, self.inner.batch([self._sealed_op(op)])[0])
                for op in ops
            ]
        results = self.inner.batch([self._sealed_op(op) for op in ops])
        return [self._opened_result(op, result) for op, result in zip(ops, results, strict=True)]

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        raise NotImplementedError("the service calls its store synchronously, in worker threads")


class PlainStore(_StoreWrapper):
    """The store of a process without encryption: values pass as they are, but a sealed one (written by
    a process with ``--encryption migrate`` or ``required`` on the same database) is refused, naming the
    item, never returned as if its envelope were the value. A filtered search cannot match sealed values
    in the database: only what it returns is checked."""

    def __init__(self, inner: BaseStore) -> None:
        self.inner = inner

    @staticmethod
    def _checked(item: Item | None) -> Item | None:
        if item is not None and is_sealed_record(item.value):
            raise EncryptedValueRefused(f"store item {item.key!r} in namespace {tuple(item.namespace)!r}")
        return item

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        results = self.inner.batch(ops)
        for op, result in zip(ops, results, strict=True):
            if isinstance(op, GetOp):
                self._checked(_get_result(result))
            elif isinstance(op, SearchOp):
                for item in _search_result(result):
                    self._checked(item)
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        raise NotImplementedError("the service calls its store synchronously, in worker threads")


def _get_result(result: Result) -> Item | None:
    """A ``GetOp``'s result (``BaseStore.batch`` types each result as any op's)."""
    if result is None or isinstance(result, Item):
        return result
    raise TypeError(f"a store answered a get with a {type(result).__name__}, not an Item or None")


def _search_result(result: Result) -> list[Item]:
    """A ``SearchOp``'s result (``BaseStore.batch`` types each result as any op's): its items."""
    if not isinstance(result, list):
        raise TypeError(f"a store answered a search with a {type(result).__name__}, not a list")
    items = [item for item in result if isinstance(item, Item)]
    if len(items) != len(result):
        raise TypeError("a store answered a search with a list holding something other than Items")
    return items


def sealed_store(store: BaseStore, sealer: Sealer | None) -> BaseStore:
    """``store``, wrapped in an :class:`EncryptingStore` when a sealer is given, else in a
    :class:`PlainStore` (which refuses values sealed by another process)."""
    return PlainStore(store) if sealer is None else EncryptingStore(store, sealer)


def sealed_outbox(outbox: Any, sealer: Sealer | None) -> Any:
    """``outbox``, wrapped in an :class:`EncryptingOutbox` that claims sealed rows when a sealer is given;
    without one, as it is: its claims leave sealed rows to a process with the key ring."""
    return outbox if sealer is None else EncryptingOutbox(outbox, sealer)
