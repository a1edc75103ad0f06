"""Storage you can see: what a thread holds now, per kind, and what a plain saver would hold for it.

Each backend measures its own rows (``storage/<backend>/usage.py``) and hands back one
:class:`ThreadStorage` per thread; this module holds what they share: the figures, which threads a
measurement covers (:class:`Selection`), how a thread's tenant is read from its stored id, and the plain
estimate, whose formula docs/storage.md ("The plain estimate") derives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: Label of the threads of no tenant (single-tenant mode).
NO_TENANT = ""


@dataclass(frozen=True)
class Selection:
    """Which threads a measurement covers: one stored thread id, a tenant's threads, or every thread.

    Attributes:
        thread: A stored thread id (``tenant:thread`` in tenant mode), or ``None``.
        tenant: Every thread of this tenant (tenant mode), or ``None``.
        tenant_mode: Stored thread ids are ``tenant:thread``; outbox rows and store items name the agent's
            thread under the namespace ``("tenants", tenant, ...)``.
    """

    thread: str | None = None
    tenant: str | None = None
    tenant_mode: bool = False

    @property
    def thread_prefix(self) -> str:
        """The stored thread ids' common prefix (``""``: any)."""
        return f"{self.tenant}:" if self.tenant is not None else ""

    def agent_thread(self) -> str | None:
        """The agent's id of :attr:`thread` (what outbox rows and store items name)."""
        if self.thread is None:
            return None
        return split_thread(self.thread, self.tenant_mode)[1]

    def thread_tenant(self) -> str | None:
        """The tenant whose namespaces hold the outbox rows and store items of the selection."""
        if not self.tenant_mode:
            return None
        if self.thread is not None:
            return split_thread(self.thread, True)[0]
        return self.tenant


def split_thread(stored: str, tenant_mode: bool) -> tuple[str, str]:
    """``(tenant, agent thread id)`` of a stored thread id (tenant :data:`NO_TENANT` without tenants)."""
    if tenant_mode and ":" in stored:
        tenant, _, thread = stored.partition(":")
        return tenant, thread
    return NO_TENANT, stored


def stored_thread(tenant: str | None, agent_thread: str, tenant_mode: bool) -> str:
    """The stored thread id of an agent's thread id under ``tenant``."""
    return f"{tenant}:{agent_thread}" if tenant_mode else agent_thread


def tenant_of_namespace(namespace: Iterable[str], tenant_mode: bool) -> str | None:
    """The tenant of a memory namespace ``("tenants", tenant, ...)``; ``NO_TENANT`` without tenants;
    ``None`` for a namespace outside every tenant's subtree in tenant mode."""
    if not tenant_mode:
        return NO_TENANT
    labels = list(namespace)
    return labels[1] if len(labels) >= 2 and labels[0] == "tenants" else None


@dataclass
class Head:
    """The head checkpoint of one namespace, as the plain estimate needs it.

    Attributes:
        copies: How many copies of the messages a plain saver of this backend would have written;
            ``None``: one per message (``k + c``).
        window_bytes: Bytes of the messages value of the head (``w``).
        window_messages: Messages in it (``k``), ``None`` when unreadable.
        checkpoints_had: Checkpoints the namespace has had, deleted ones included (head step + 2), or
            ``None`` when the head has no step.
    """

    copies: int | None = None
    window_bytes: int = 0
    window_messages: int | None = None
    checkpoints_had: int | None = None


def checkpoints_had(step: Any) -> int | None:
    """Checkpoints a namespace whose head has ``step`` has had: steps start at -1."""
    return step + 2 if isinstance(step, int) and not isinstance(step, bool) else None


@dataclass
class ThreadStorage:
    """What one thread holds now, in bytes per kind, and what a plain saver would hold.

    Attributes:
        thread_id: The stored thread id (``tenant:thread`` in tenant mode).
        tenant: Its tenant (``""`` without tenants).
        checkpoints: Checkpoints kept (every namespace).
        checkpoint_bytes: Checkpoint rows (SQLite: the whole state, messages included).
        blob_bytes: Channel value rows (PostgreSQL, memory; SQLite has none).
        write_bytes: Pending write rows.
        outbox_bytes: Outbox rows of messages cut from the thread.
        store_bytes: Store items the default extractor made of those messages (their value names the
            thread).
        messages_bytes: The part of checkpoint and blob bytes that is the messages channel.
        cut_messages: Messages cut from the thread (``c`` of the estimate).
        plain_estimate: Bytes a plain ``add_messages`` saver would hold in the checkpoint tables.
        delta_channels: The thread's DeltaChannels: the channels its checkpoints' metadata counts since
            their last snapshot (``counters_since_delta_snapshot``), sorted.
    """

    thread_id: str
    tenant: str = NO_TENANT
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    blob_bytes: int = 0
    write_bytes: int = 0
    outbox_bytes: int = 0
    store_bytes: int = 0
    messages_bytes: int = 0
    cut_messages: int = 0
    plain_estimate: int = 0
    delta_channels: list[str] = field(default_factory=list)
    heads: dict[str, Head] = field(default_factory=dict, repr=False)

    @property
    def saver_bytes(self) -> int:
        """Bytes in the checkpoint tables (what ``plain_estimate`` compares with)."""
        return self.checkpoint_bytes + self.blob_bytes + self.write_bytes

    @property
    def total_bytes(self) -> int:
        """Every byte the thread holds: checkpoint tables, outbox and store."""
        return self.saver_bytes + self.outbox_bytes + self.store_bytes

    @property
    def saved_ratio(self) -> float | None:
        """``plain_estimate / total_bytes`` (how many times smaller the thread is); ``None`` when empty."""
        return self.plain_estimate / self.total_bytes if self.total_bytes else None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["heads"]
        return {
            **data,
            "saver_bytes": self.saver_bytes,
            "total_bytes": self.total_bytes,
            "saved_ratio": self.saved_ratio,
        }


def plain_messages(head: Head, cut: int) -> int:
    """``H * (n + 1) / 2`` with ``H = w + c * w / k`` (see the module docstring)."""
    history: float = head.window_bytes
    if cut and head.window_messages:
        history += cut * head.window_bytes / head.window_messages
    copies = head.copies if head.copies is not None else (head.window_messages or 0) + cut
    return round(history * (copies + 1) / 2)


def finish(thread: ThreadStorage) -> ThreadStorage:
    """Fill in ``plain_estimate`` from the heads, the cut count and the bytes held now."""
    plain = sum(
        plain_messages(head, thread.cut_messages if ns == "" else 0) for ns, head in thread.heads.items()
    )
    other = max(thread.saver_bytes - thread.messages_bytes, 0)
    had = [head.checkpoints_had for head in thread.heads.values()]
    if thread.checkpoints and had and all(count is not None for count in had):
        other = round(other * max(sum(had) / thread.checkpoints, 1.0))  # type: ignore[arg-type]
    thread.plain_estimate = plain + other
    return thread


def assemble(
    threads: Mapping[str, ThreadStorage],
    outbox: Mapping[tuple[str | None, str], tuple[int, int]],
    store: Mapping[tuple[str | None, str], tuple[int, int]],
    tenant_mode: bool,
) -> list[ThreadStorage]:
    """The measured threads with their outbox and store figures, estimates filled in, largest first.

    Args:
        threads: Stored thread id -> its checkpoint-table figures and heads.
        outbox: ``(tenant, agent thread id)`` -> ``(rows, bytes)``.
        store: ``(tenant, agent thread id)`` -> ``(items, bytes)``.
        tenant_mode: How stored ids map to ``(tenant, agent thread id)``.
    """
    for stored, thread in threads.items():
        key = split_thread(stored, tenant_mode)
        rows, thread.outbox_bytes = outbox.get(key, (0, 0))
        items, thread.store_bytes = store.get(key, (0, 0))
        thread.tenant = key[0]
        thread.cut_messages = max(rows, items)
        finish(thread)
    return sorted(threads.values(), key=lambda t: (-t.total_bytes, t.thread_id))


def summarize(threads: list[ThreadStorage], top: int) -> dict[str, Any]:
    """Totals over ``threads`` and the ``top`` largest of them (``threads`` come largest first)."""
    totals = {
        name: sum(getattr(t, name) for t in threads)
        for name in (
            "checkpoints",
            "checkpoint_bytes",
            "blob_bytes",
            "write_bytes",
            "outbox_bytes",
            "store_bytes",
            "saver_bytes",
            "total_bytes",
            "plain_estimate",
        )
    }
    total = totals["total_bytes"]
    return {
        "threads": len(threads),
        **totals,
        "saved_ratio": totals["plain_estimate"] / total if total else None,
        "largest": [t.as_dict() for t in threads[:top]],
    }


__all__ = [
    "NO_TENANT",
    "Head",
    "Selection",
    "ThreadStorage",
    "assemble",
    "checkpoints_had",
    "finish",
    "plain_messages",
    "split_thread",
    "stored_thread",
    "summarize",
    "tenant_of_namespace",
]
