import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_ds.schedules import CATALOG, Schedule, build_schedule
from megatron_ds.schedules.cli import main
from megatron_ds.testing.launcher import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_export_writes_the_json_contract_that_reads_back_equal(tmp_path):
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


def test_compare_lists_every_schedule_with_its_makespan(capsys):
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


def test_visualize_writes_png_and_svg_and_prints_the_makespan(tmp_path):
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


def _visualize(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "visualize_schedule.py"), *args, "--quiet"], cwd=cwd,
                          capture_output=True, text=True, env=child_env(ROOT))


def test_visualize_draws_the_run_of_a_ds_config(tmp_path):
    """--ds-config: the schedule the run of that ds_config runs, its knobs and Seq1F1B cut as the run reads them
    (the quick start drew seq1f1b with k=1 and interleaved with v=1)."""
    from megatron_ds.gpt_config import GPTConfig
    from megatron_ds.pipe.plan.config import pipeline_settings
    from megatron_ds.pipe.plan.segments import segment_lengths
    png = tmp_path / "s.png"
    shape = ["--seq-length", "64", "--hidden-size", "64", "--num-attention-heads", "4", "--num-key-value-heads", "2",
             "--swiglu"]
    run = _visualize("--ds-config", "ds_configs/ds_config_seq1f1b.json", "--pp", "2", "--micro-batches", "4", *shape,
                     "--out", str(png))
    assert run.returncode == 0, run.stderr
    seq1f1b = json.loads((ROOT / "ds_configs" / "ds_config_seq1f1b.json").read_text())
    lengths = segment_lengths(pipeline_settings(seq1f1b), GPTConfig(
        vocab_size=64, hidden_size=64, num_layers=4, num_attention_heads=4, num_key_value_heads=2, swiglu=True,
        max_position_embeddings=64), 64)
    assert run.stdout.splitlines()[0] == ("schedule seq1f1b: pp=2, micro_batches=4, stages=2 (1 per rank and "
                                          f"replica), seq_splits=4, segment lengths {lengths}")
    assert png.stat().st_size > 1000
    run = _visualize("--ds-config", "ds_configs/ds_config_interleaved.json", "--pp", "2", "--micro-batches", "4",
                     "--out", str(png))
    assert run.returncode == 0 and "stages=4 (2 per rank and replica)" in run.stdout, run.stderr
    stock = tmp_path / "stock.json"
    stock.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    run = _visualize("--ds-config", str(stock), "--pp", "2", "--micro-batches", "4", "--out", str(png))
    assert run.returncode == 0 and run.stdout.startswith("schedule 1f1b: pp=2"), run.stderr  # DeepSpeed's TrainSchedule


@pytest.mark.parametrize("config,extra,message", [
    ("ds_config_seq1f1b.json", [],
     '"seq_splits": 4 cuts the run\'s sequences: give its --seq-length and --hidden-size'),
    ("ds_config_auto.json", [], '"schedule": "auto" picks its schedule after timing'),
    ("ds_config_zbv.json", ["--virtual-stages", "2"], "sets the schedule's knobs; leave out --virtual-stages"),
    ("ds_config_bitpipe.json", ["--pp", "3"], "bitpipe needs an even pipeline size (pp=3)"),
])
def test_visualize_ds_config_refusals(tmp_path, config, extra, message):
    pp = [] if "--pp" in extra else ["--pp", "2"]
    run = _visualize("--ds-config", f"ds_configs/{config}", *pp, "--micro-batches", "4", *extra,
                     "--out", str(tmp_path / "x.png"))
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.splitlines()) == 1 and message in run.stderr, run.stderr
