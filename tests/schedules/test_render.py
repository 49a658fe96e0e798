import xml.etree.ElementTree as ET

import pytest

from megatron_ds.schedules import build_schedule, simulate
from megatron_ds.schedules.render import ascii_timeline, plot_timeline, summary_table


def test_ascii_1f1b_exact():
    res = simulate(build_schedule("1f1b", 2, 2), 1, 1, 0)
    # 3 columns per time unit; labels are cut to the op's width.
    assert ascii_timeline(res, width=18) == (
        "rank0  |F0|F1   |BW   |BW\n"
        "rank1     |F0|BW|F1|BW")
    assert "|BW0--|" in ascii_timeline(res, width=36)


def test_ascii_labels_chunks_and_replicas():
    s = build_schedule("bitpipe", 4, 4)
    text = ascii_timeline(simulate(s, 2, 4, 0))
    rows = text.splitlines()
    assert len(rows) == 4
    # Replica 1 in lower case, second leg primed; every op of rank 0 appears once.
    assert s.op_label(0, s.ranks[0][3]) == "f2'"
    for op in s.ranks[0]:
        assert rows[0].count("|" + s.op_label(0, op) + "-") == 1


def test_seq_labels():
    s = build_schedule("seq1f1b", 2, 1, seq_splits=2)
    assert [s.op_label(0, op) for op in s.ranks[0]] == ["F0.0", "F0.1", "BW0.1", "BW0.0"]


def test_summary_mentions_every_rank():
    res = simulate(build_schedule("zbv", 4, 8))
    table = summary_table(res)
    assert "makespan 25.500, bubble ratio 0.059" in table
    assert len(table.splitlines()) == 1 + 4 + 1


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_plot_files(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    res = simulate(build_schedule("bitpipe", 4, 8))
    path = plot_timeline(res, str(tmp_path / f"t.{suffix}"))
    data = open(path, "rb").read()
    if suffix == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        root = ET.fromstring(data)
        assert root.tag.endswith("svg")
        assert b"replica 1" in data


@pytest.mark.parametrize("name,pp,m", [("1f1b", 1, 2), ("zbv", 2, 4), ("bitpipe", 4, 8), ("zbv", 8, 16)])
def test_the_legend_leaves_the_time_label_readable(name, pp, m, tmp_path, monkeypatch):
    """The key sits under the axis label, inside the picture (it covered "time" on short pictures)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    save, boxes = Figure.savefig, []

    def saving(fig, *args, **kwargs):  # where the label and the key were drawn, as the picture was written
        save(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        boxes.append((fig.axes[0].xaxis.label.get_window_extent(renderer),
                      [key.get_window_extent(renderer) for key in legends], fig.bbox))
    monkeypatch.setattr(Figure, "savefig", saving)
    plot_timeline(simulate(build_schedule(name, pp, m)), str(tmp_path / "t.png"))
    (label, keys, picture), = boxes
    assert len(keys) == 1
    assert not keys[0].overlaps(label) and keys[0].y1 <= label.y0 and keys[0].y0 >= picture.y0
