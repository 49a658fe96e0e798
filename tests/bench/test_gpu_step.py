"""bench/gpu_step.py at toy size on CPU (structure, not timings: CI keeps it working), and the host work
per iteration it counts (torch.profiler, aten operators dispatched, PP=1): an eager Seq1F1B k=4 step
dispatches about 4x the operators of the eager unsplit step; with compiled layers, final norm and loss it must
stay at most 1.5x: 1.19x (5861 / 4929) with a 2-layer toy model, what is left being the embedding, head and
optimizer, not compiled, which run per segment. The test holds it at 1.25x: it fails if the count grows, or if
any of our steps reads a tensor into Python (.item(), float(t): a host synchronisation on CUDA) more often than
DeepSpeed's engine does. One process."""
from megatron_ds.testing.launcher import run_ranks

ARGS = ["--toy", "--count-ops", "--iterations", "1", "--warmup", "1"]


def run_bench():
    from bench import gpu_step
    eager = gpu_step.main(ARGS + ["--compile", "off", "--cases", "deepspeed,1f1b,seq1f1b-k4,transformers"])
    compiled = gpu_step.main(ARGS + ["--compile", "on", "--cases", "seq1f1b-k4"])
    rows = {**eager["64x2"], **compiled["64x2"]}
    failed = {name: r["error"] for name, r in rows.items() if "error" in r}
    assert not failed, failed
    return {name: dict(ops=r["ops"], ms=r["ms"], losses=r["losses"], syncs=r["syncs"]) for name, r in rows.items()}


def test_toy_bench_runs_and_host_ops_stay_bounded():
    rows = run_ranks(1, run_bench, timeout=1200)[0]
    assert set(rows) == {"deepspeed", "1f1b", "seq1f1b-k4", "transformers", "seq1f1b-k4 compiled"}
    assert all(r["ms"] > 0 and r["ops"] > 0 for r in rows.values())
    # the same model and tokens: our engine (any schedule, compiled or not) and DeepSpeed's agree
    for name in ("1f1b", "seq1f1b-k4", "seq1f1b-k4 compiled"):
        assert max(abs(a - b) for a, b in zip(rows[name]["losses"], rows["deepspeed"]["losses"])) < 1e-5, name
    unsplit, split, compiled = rows["1f1b"]["ops"], rows["seq1f1b-k4"]["ops"], rows["seq1f1b-k4 compiled"]["ops"]
    assert split > 3 * unsplit  # what the segments cost eagerly (3.9x measured)
    assert compiled <= 1.25 * unsplit, (compiled, unsplit, compiled / unsplit)
    # the stock engine's reads: its gradient-norm check and the caller's float(loss); segments add none
    assert rows["deepspeed"]["syncs"] > 0
    for name in ("1f1b", "seq1f1b-k4", "seq1f1b-k4 compiled"):
        assert rows[name]["syncs"] <= rows["deepspeed"]["syncs"], (name, rows[name]["syncs"], rows["deepspeed"]["syncs"])
