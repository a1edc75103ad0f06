"""``reducing-saver report``: the table of the largest threads and the PNG chart, on SQLite and PostgreSQL,
after a real chat graph wrote through the service."""

from __future__ import annotations

import sys

import pytest

from reducing_saver.service.cli import main
from reducing_saver.service.storage import open_backend
from reducing_saver.service.storage.report import NO_MATPLOTLIB, human_bytes
from reducing_saver.service.storage.usage import Selection
from tests.service.storage.test_usage import KEYS, converse, running

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/rs.sqlite"
    return request.getfixturevalue("fresh_pg")


def test_report_prints_the_largest_threads_and_writes_a_png(database: str, tmp_path, capsys) -> None:
    with running(database) as run, run.saver() as saver:
        converse(saver, "long", 14, seed=1)
        converse(saver, "middle", 6, seed=2)
        converse(saver, "short", 1, seed=3)
        run.delivered(14 * 2 - 6)
    png = tmp_path / "chart.png"
    capsys.readouterr()
    assert main(["report", "--database", database, "--top", "2", "--png", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "thread",
        "tenant",
        "checkpoints",
        "bytes",
        "now",
        "plain",
        "estimate",
        "saved",
        "delta",
        "channels",
    ]
    backend = open_backend(database, create=False)
    try:
        threads = backend.storage(Selection(), messages_key="messages")
    finally:
        backend.close()
    assert [t.thread_id for t in threads] == ["long", "middle", "short"]
    for line, thread in zip(lines[1:3], threads[:2], strict=True):
        cells = line.split()
        assert cells[:3] == [thread.thread_id, "-", str(thread.checkpoints)]
        assert " ".join(cells[3:5]) == human_bytes(thread.total_bytes)
        assert " ".join(cells[5:7]) == human_bytes(thread.plain_estimate)
        assert cells[7] == f"{thread.plain_estimate / thread.total_bytes:.1f}x"
    assert lines[3].startswith("3 thread(s): ")
    assert not any("short" in line.split()[:1] for line in lines)  # --top 2
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 300 and height > 100


def test_report_names_each_threads_tenant(tmp_path, capsys, monkeypatch) -> None:
    database = f"sqlite:///{tmp_path}/rs.sqlite"
    api_keys = ",".join(f"{tenant}={key}" for tenant, key in KEYS.items())
    with running(database, api_keys=api_keys) as run, run.saver(KEYS["a"]) as a, run.saver(KEYS["b"]) as b:
        converse(a, "same", 5, seed=1)
        converse(b, "same", 2, seed=2)
    monkeypatch.setenv("REDUCING_SAVER_API_KEYS", api_keys)
    capsys.readouterr()
    assert main(["report", "--database", database]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:3]]
    assert rows == [["same", "a"], ["same", "b"]]


def test_report_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch) -> None:
    database = f"sqlite:///{tmp_path}/rs.sqlite"
    with running(database):
        pass
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(["report", "--database", database, "--png", str(tmp_path / "x.png")]) == 1
    assert capsys.readouterr().err.strip() == f"reducing-saver: {NO_MATPLOTLIB}"
    assert not (tmp_path / "x.png").exists()


def test_report_refuses_bad_arguments(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--database", f"sqlite:///{tmp_path}/rs.sqlite", "--top", "0"])
    assert exit_info.value.code == 2 and "--top" in capsys.readouterr().err
    assert main(["report", "--database", "memory://"]) == 2
    assert main(["report", "--database", f"sqlite:///{tmp_path}/missing.sqlite"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing.sqlite").exists()


@pytest.mark.parametrize("count", [1, 2, 12])
def test_the_charts_legend_covers_no_bar(count: int, tmp_path, monkeypatch) -> None:
    """With one thread the two bars fill the plot: a legend inside it hid them."""
    import matplotlib.figure

    from reducing_saver.service.storage.report import chart
    from reducing_saver.service.storage.usage import ThreadStorage

    seen: list[tuple] = []
    save = matplotlib.figure.Figure.savefig

    def savefig(figure, *args, **kwargs):
        save(figure, *args, **kwargs)
        renderer = figure.canvas.get_renderer()  # the Agg canvas, while the figure is still open
        legends = [
            legend for legend in (*figure.legends, *(axes.get_legend() for axes in figure.axes)) if legend
        ]
        bars = [patch.get_window_extent(renderer) for axes in figure.axes for patch in axes.patches]
        seen.append((figure.bbox, [legend.get_window_extent(renderer) for legend in legends], bars))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    threads = [
        ThreadStorage(
            f"thread-{n}", checkpoints=3, checkpoint_bytes=10_000 * (n + 1), plain_estimate=90_000 * (n + 1)
        )
        for n in range(count)
    ]
    chart(threads, str(tmp_path / "chart.png"))
    ((picture, legends, bars),) = seen
    assert len(legends) == 1 and len(bars) == 2 * count
    legend = legends[0]
    assert [bar for bar in bars if bar.overlaps(legend)] == []
    # And the legend is inside the picture.
    assert picture.contains(legend.x0, legend.y0) and picture.contains(legend.x1, legend.y1)
