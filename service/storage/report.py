"""``reducing-saver report``: the largest threads' storage as a table, and as a PNG bar chart."""

from __future__ import annotations

from collections.abc import Sequence

from reducing_saver.service.storage.usage import ThreadStorage

#: What ``report --png`` needs, and how to get it.
NO_MATPLOTLIB = (
    "--png needs matplotlib, which is not installed: install the report extra (pip install -e '.[server,report]' "
    "in the checkout) or pip install matplotlib"
)
COLUMNS = ("thread", "tenant", "checkpoints", "bytes now", "plain estimate", "saved", "delta channels")


def human_bytes(size: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def ratio(thread: ThreadStorage) -> str:
    """``plain estimate / bytes now`` as ``"4.2x"`` (``"-"`` for an empty thread)."""
    return "-" if thread.saved_ratio is None else f"{thread.saved_ratio:.1f}x"


def agent_thread(thread: ThreadStorage) -> str:
    """The thread id as its agent names it (without ``tenant:``)."""
    return thread.thread_id.removeprefix(f"{thread.tenant}:") if thread.tenant else thread.thread_id


def rows(threads: Sequence[ThreadStorage], top: int) -> list[tuple[str, ...]]:
    """The table's rows: the ``top`` largest threads (``threads`` come largest first)."""
    return [
        (
            agent_thread(t),
            t.tenant or "-",
            str(t.checkpoints),
            human_bytes(t.total_bytes),
            human_bytes(t.plain_estimate),
            ratio(t),
            # Stored as written, never windowed: rebuilt from their writes (docs/storage.md).
            ", ".join(t.delta_channels) or "-",
        )
        for t in threads[:top]
    ]


def table(threads: Sequence[ThreadStorage], top: int) -> str:
    """The rows under a header, columns aligned, and a line of totals over every thread."""
    body = rows(threads, top)
    total = sum(t.total_bytes for t in threads)
    plain = sum(t.plain_estimate for t in threads)
    widths = [max(len(cell) for cell in column) for column in zip(COLUMNS, *body, strict=False)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (COLUMNS, *body)
    ]
    saved = f"{plain / total:.1f}x" if total else "-"
    now, plain_text = human_bytes(total), human_bytes(plain)
    lines.append(f"{len(threads)} thread(s): {now} now, {plain_text} with a plain saver ({saved})")
    return "\n".join(lines)


def chart(threads: Sequence[ThreadStorage], path: str) -> None:
    """A horizontal bar chart: per thread (``tenant:thread`` with tenants), the bytes it holds now beside
    the plain estimate."""
    import matplotlib
    from matplotlib.ticker import FuncFormatter

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    names = [t.thread_id if len(t.thread_id) <= 32 else t.thread_id[:31] + "…" for t in threads]
    # Constrained layout keeps the legend, outside the plot below it, on the picture: with one thread the
    # two bars fill the plot, and any legend inside it would hide them.
    figure, axes = plt.subplots(figsize=(9, 1.8 + 0.45 * max(len(threads), 1)), layout="constrained")
    positions = range(len(threads))
    axes.barh(
        [p + 0.2 for p in positions],
        [t.plain_estimate for t in threads],
        height=0.4,
        label="plain add_messages (estimate)",
        color="#c44e52",
    )
    axes.barh(
        [p - 0.2 for p in positions],
        [t.total_bytes for t in threads],
        height=0.4,
        label="reducing-saver now",
        color="#4c72b0",
    )
    axes.set_yticks(list(positions), names)
    axes.invert_yaxis()
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(value)))
    axes.set_xlabel("bytes")
    axes.set_title("Storage of the largest threads: now against a plain saver")
    figure.legend(loc="outside lower center", ncols=2, frameon=False)
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
