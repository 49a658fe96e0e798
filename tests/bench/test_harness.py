"""bench/harness.py, what the benches share: the alternated timing loop, the paired ratio, the table, the
docs/perf file with its command; and `python -m bench`, the list of benches."""
import os
import subprocess
import sys

from bench import harness
from bench.__main__ import benches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_alternated_swaps_the_order_and_prepares_off_the_clock():
    calls, prepared = [], []

    def run(name):
        return lambda x: calls.append((name, x))
    times = harness.alternated({"a": run("a"), "b": run("b")}, 3, start=10,
                               prepare=lambda name, step: prepared.append(name) or step * 2)
    assert calls == [("a", 20), ("b", 20), ("b", 22), ("a", 22), ("a", 24), ("b", 24)]
    assert prepared == [name for name, _ in calls]
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3} and min(times["a"] + times["b"]) >= 0
    calls.clear()
    harness.alternated({"a": run("a"), "b": run("b")}, 2, swap=False)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_paired_ratio_and_medians():
    assert harness.paired_ratio([2.0, 3.0, 10.0], [1.0, 2.0, 2.0]) == 2.0  # median of 2, 1.5, 5
    assert harness.medians({"a": [9.0, 1.0, 3.0, 2.0]}, warmup=1) == {"a": 2.0}


def test_table_is_markdown():
    assert harness.table(["schedule", "ms"], "lr", [["1f1b", "1.0"], "| zbv | n/a |"]) == [
        "| schedule | ms |", "|---|---:|", "| 1f1b | 1.0 |", "| zbv | n/a |"]
    assert harness.row(["zbv", 2, "0.5"]) == "| zbv | 2 | 0.5 |"


def test_best_of_keeps_each_clocks_fewest_and_sets_up_off_the_clock():
    ticks = iter([0, 10, 20, 23, 30, 37])  # a fake clock: calls take 10, 3 and 7
    made = []
    best, out = harness.best_of(lambda: "x", 3, clocks=(lambda: next(ticks),))
    assert (best, out) == (3, "x")
    ticks = iter([0, 5, 100, 101])
    cpu, wall, out = harness.best_of(lambda x: x * 2, 2, lambda: made.append(1) or len(made),
                                     (lambda: 0, lambda: next(ticks)))
    assert (cpu, wall, out, made) == (0, 1, 4, [1, 1])


def test_rounds_reverse_every_other_round():
    assert list(harness.rounds(["a", "b"], 3)) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def test_parser_has_the_model_flags_asked_for_and_the_perf_file():
    args = harness.parser("What it asks.\n\nMore.", pp=2, seq_length=64).parse_args(["--pp", "4"])
    assert (args.pp, args.seq_length, args.perf_file) == (4, 64, None)
    assert harness.parser("What it asks.").description == "What it asks."


def test_report_prints_as_it_goes_and_saves_with_the_command(tmp_path, capsys):
    path = tmp_path / "perf.md"
    out = harness.Report(str(path), "bench.partitions", ["--pp", "2"])
    out("first", "")
    assert capsys.readouterr().out == "first\n\n" and not path.exists()
    out("| a |")
    assert out.save() == "first\n\n| a |"
    assert path.read_text() == "Made by `python -m bench.partitions --pp 2`:\n\nfirst\n\n| a |\n"
    assert harness.Report(None, "bench.partitions").save() == ""


def test_the_machine_lines():
    machine = harness.Machine()
    assert machine.at_start().startswith("load average ") and machine.at_start().endswith(" at start")
    assert machine.before_after().endswith(f" after, on {os.cpu_count()} cores")
    assert machine.at_end().startswith("done in ")


def test_the_perf_file_holds_the_command_that_made_it(tmp_path, capsys):
    path = tmp_path / "perf.md"
    harness.emit("| a |", str(path), "bench.moe_overlap", ["--shares", "0.3", "--note", "two words"],
                 printed_before="# header\n")
    assert capsys.readouterr().out == "| a |\n"
    assert path.read_text() == ("Made by `python -m bench.moe_overlap --shares 0.3 --note 'two words'`:\n\n"
                                "# header\n| a |\n")


def test_python_m_bench_lists_every_bench_with_its_purpose():
    proc = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")}
    names = {name for name, _, _ in benches()}
    assert listed == names and {"moe_overlap", "harness", "schedules"} <= names
    line = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["foreign_cost"])
    assert "What megatron_ds.initialize costs on a user's own PipelineModule" in line
    runnable = dict((name, run) for name, _, run in benches())
    assert runnable["moe_overlap"] and not runnable["harness"] and not runnable["options"]


def test_every_perf_file_says_the_command_that_made_it_at_its_top():
    import re
    perf = os.path.join(ROOT, "docs", "perf")
    silent = [name for name in sorted(os.listdir(perf)) if name.endswith(".md") and not re.search(
        r"`(python -m bench\.|python bench/|bash bench/)", "\n".join(open(os.path.join(perf, name)).read().split("\n")[:6]))]
    assert not silent, f"docs/perf files without the command that made them in their first lines: {silent}"
