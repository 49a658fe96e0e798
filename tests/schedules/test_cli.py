import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_ds.schedules import CATALOG, Schedule, build_schedule
from megatron_ds.schedules.cli import main
from megatron_ds.testing.launcher import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_export_contract(tmp_path):
    out = tmp_path / "zbv.json"
    assert main(["export", "--schedule", "zbv", "--pp", "4", "--micro-batches", "8", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {k: d[k] for k in ("schedule", "pp", "micro_batches", "replicas", "stages", "seq_splits")} == {
        "schedule": "zbv", "pp": 4, "micro_batches": 8, "replicas": 1, "stages": 8, "seq_splits": 1}
    assert d["placement"] == [[0, 1, 2, 3, 3, 2, 1, 0]]
    assert d["ranks"][0][0] == {"op": "F", "replica": 0, "stage": 0, "mb": 0, "seq": 0}
    assert Schedule.from_json(out.read_text()) == build_schedule("zbv", 4, 8)


def test_export_seq_and_virtual(capsys):
    assert main(["export", "--schedule", "seq1f1b", "--pp", "2", "--micro-batches", "2",
                 "--seq-splits", "2", "--virtual-stages", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["seq_splits"] == 2 and d["stages"] == 4


def test_show_prints_timeline_and_summary(capsys):
    assert main(["show", "--schedule", "1f1b", "--pp", "4", "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    timeline = [line for line in out.splitlines() if line[:4] == "rank" and line[4].isdigit()]
    assert [line.split()[0] for line in timeline] == ["rank0", "rank1", "rank2", "rank3"]
    assert timeline[3].count("|BW") == 8
    assert "makespan 33.000, bubble ratio 0.273" in out
    assert "peak activation memory 4.000" in out


def test_compare_table(capsys):
    assert main(["compare", "--pp", "4", "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert set(rows) == set(CATALOG)
    assert "25.50" in rows["zbv"] and "33.00" in rows["1f1b"] and "27.00" in rows["zb-h1"]


def test_compare_reports_refused_settings(capsys):
    assert main(["compare", "--pp", "3", "--micro-batches", "6"]) == 0
    out = capsys.readouterr().out
    assert "n/a: bitpipe needs an even pipeline size (pp=3)" in out


def test_bad_setting_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "megatron_ds.schedules", "export", "--schedule",
                           "bitpipe", "--pp", "3", "--micro-batches", "6"],
                          cwd=ROOT, capture_output=True, text=True, env=child_env(ROOT))
    assert proc.returncode == 2
    assert proc.stderr == "error: bitpipe needs an even pipeline size (pp=3)\n"
    assert proc.stdout == ""


def test_visualize_tool(tmp_path):
    png, svg = tmp_path / "s.png", tmp_path / "s.svg"
    proc = subprocess.run([sys.executable, "tools/visualize_schedule.py", "--schedule", "zb-h1",
                           "--pp", "4", "--micro-batches", "8", "--out", str(png), "--out", str(svg)],
                          cwd=ROOT, capture_output=True, text=True, env=child_env(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 1000 and svg.stat().st_size > 1000
    assert "makespan 27.000" in proc.stdout


def test_visualize_tool_refuses(tmp_path):
    proc = subprocess.run([sys.executable, "tools/visualize_schedule.py", "--schedule", "interleaved",
                           "--pp", "4", "--micro-batches", "9", "--virtual-stages", "2",
                           "--out", str(tmp_path / "x.png")], cwd=ROOT, capture_output=True, text=True, env=child_env(ROOT))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: interleaved with virtual_stages=2 needs micro_batches")


def test_vocab_parallel_export_show_compare(tmp_path, capsys):
    out = tmp_path / "vp.json"
    args = ["--schedule", "1f1b", "--pp", "2", "--micro-batches", "4", "--vocab-parallel"]
    assert main(["export", *args, "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["vocab_parallel"] is True and {o["op"] for o in d["ranks"][1]} == {"EF", "F", "S", "T", "BW", "EW"}
    assert Schedule.from_json(out.read_text()) == build_schedule("1f1b", 2, 4, vocab_parallel=True)
    assert main(["show", *args, "--head-cost", "2,2,2", "--head-memory", "4"]) == 0
    shown = capsys.readouterr().out
    assert "|S" in shown and "peak activation memory" in shown
    if importlib.util.find_spec("matplotlib"):
        assert main(["show", *args, "--plot", str(tmp_path / "vp.svg")]) == 0
        svg = (tmp_path / "vp.svg").read_text()
        assert f"timeline drawn to {tmp_path / 'vp.svg'}" in capsys.readouterr().out
        assert "<!-- EW -->" in svg and "<!-- S -->" in svg  # the legend names the vocabulary passes
    assert main(["compare", "--pp", "2", "--micro-batches", "4", "--head-cost", "2,2,2", "--vocab-parallel"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    naive = next(r for r in rows if r[:1] == ["1f1b"] and r[1] != "+vocab")
    vocab = next(r for r in rows if r[:2] == ["1f1b", "+vocab"])
    assert float(vocab[2]) < float(naive[1])   # the head's cost spread over both ranks: a shorter iteration
