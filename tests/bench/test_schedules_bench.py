"""bench.schedules end to end at toy size: the engines (in one launch, --one-launch), the traces, the
analysis, the tables and the pictures; and the merge of per-engine launches (the default). Structure
only - the timings of a loaded test machine prove nothing."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINES = ["1f1b", "zbv", "seq1f1b k=2"]


@pytest.mark.timeout(900)
def test_schedules_bench_runs_every_engine_and_writes_tables_and_pictures(tmp_path):
    cmd = [sys.executable, "-m", "bench.schedules", "--pp", "2", "--tf-ms", "4", "--one-launch",
           "--iterations", "1", "--warmup", "0", "--engines", *ENGINES, "--out", str(tmp_path / "out"),
           "--pictures", str(tmp_path / "pics"), "--picture-setting", "p2_m4_1-1-1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert sorted(results["tables"]) == ["p2_m2_1-1-0.5", "p2_m2_1-1-1", "p2_m4_1-1-0.5", "p2_m4_1-1-1"]
    for table in results["tables"].values():
        assert list(table["rows"]) == ["DS 1F1B (stock)", *ENGINES]
        for row in table["rows"].values():
            assert row["iteration"] > 0 and row["sim"] > 0 and 0 <= row["bubble"] < 1
        assert table["rows"]["DS 1F1B (stock)"]["vs_stock"] == 1.0
    # the simulated makespan of 1f1b at p=2, m=4, TF=TB=TW=4 ms: (m + p - 1) * 3 TF
    assert results["tables"]["p2_m4_1-1-1"]["rows"]["1f1b"]["sim"] == pytest.approx(0.06)
    summary = proc.stdout[proc.stdout.index("**iteration / DS 1F1B's**"):]
    for name in ENGINES:
        assert re.search(rf"\| {re.escape(name)} (\| [0-9.]+ ){{4}}\|", summary), name
    assert len(list((tmp_path / "pics").glob("p2_m4_1-1-1_*.png"))) == 1 + len(ENGINES)


def test_per_engine_launches_merge_into_one_result():
    from bench.schedules import merge
    results = {"na": {}, "settings": {}, "init_s": {}}
    rows = {"a": {"times": [1.0]}, "b": {"times": [2.0]}}
    for name in ("a", "b", "c"):
        merge(results, {"na": {"c": "refused"} if name == "c" else {}, "init_s": {name: 0.5},
                        "settings": {} if name == "c" else {"p2_m2_1-1-1": {"p": 2, "m": 2, "ratio": "1:1:1",
                                                                           "rows": {name: rows[name]}}}})
    assert results == {"na": {"c": "refused"}, "init_s": {"a": 0.5, "b": 0.5, "c": 0.5},
                       "settings": {"p2_m2_1-1-1": {"p": 2, "m": 2, "ratio": "1:1:1", "rows": rows}}}
