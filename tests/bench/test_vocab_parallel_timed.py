"""bench.vocab_parallel_timed at toy size (p=2): the timed vocabulary passes sleep their simulated
cost, and the table holds finite, positive measured and simulated figures for every schedule and
placement. Structure only - the timings of a loaded test machine prove nothing."""
import math

import pytest

from bench.vocab_parallel_timed import PLACEMENTS, analyse, claims, embed_costs, markdown, vocab_op_seconds, worker
from megatron_ds.schedules.kinds import Kind
from megatron_ds.schedules.timeline import load_iteration, steps
from megatron_ds.testing.launcher import run_ranks

OPTS = {"pp": 2, "layers": 4, "head": 3.0, "layer_ms": 5.0, "micro_batches": 4, "schedules": ["1f1b", "zbv"],
        "iterations": 1, "warmup": 0}


def test_vocab_pass_costs_are_the_simulators():
    # p=4, head 3 layers, embedding 0.75 layers (F 0.25, backward 0.5), one layer 10 ms
    cost = {k: vocab_op_seconds(k, 3.0, embed_costs(3.0), 4, 0.010) for k in (Kind.S, Kind.T, Kind.EF, Kind.EW)}
    assert cost == pytest.approx({Kind.S: 0.015, Kind.T: 0.0075, Kind.EF: 0.000625, Kind.EW: 0.00125})


@pytest.mark.timeout(600)
def test_measured_table_and_timed_passes(tmp_path):
    results = run_ranks(OPTS["pp"], worker, OPTS, str(tmp_path), timeout=540)[0]
    table = analyse(results, OPTS)
    assert list(table) == OPTS["schedules"]
    for rows in table.values():
        for placement in PLACEMENTS:
            row = rows[placement]
            for key in ("iteration", "sim", "meas_sim", "traced"):
                assert math.isfinite(row[key]) and row[key] > 0, (placement, key, row[key])
            assert 0 <= row["bubble"] < 1
        assert rows["ratio"]["simulated"] > 1  # the head's 3 layers unbalance naive placement
    text = markdown(table, OPTS)
    assert "p=2, m=4, L=4 layers (2 per rank), head + loss = 3 layers" in text
    assert [line.split("|")[1].strip() for line in text.splitlines()[4:]] == OPTS["schedules"]
    assert [line.split(":")[0] for line in claims(table)] == OPTS["schedules"]
    # every S pass on every rank lasts its simulated cost: 1/p of the head's F + B (a sleep may end up
    # to 10 ms early in all, paying back lateness: timed.MAX_CARRY)
    s_seconds = vocab_op_seconds(Kind.S, 3.0, embed_costs(3.0), 2, 0.005)
    trace_dir = results["1f1b|vocab"]["trace_dir"]
    for trace in load_iteration(trace_dir, steps(trace_dir)[-1]):
        s_ops = [end - start for op, start, end in trace.compute_ops() if op.kind is Kind.S]
        assert len(s_ops) == OPTS["micro_batches"]
        assert sum(s_ops) >= len(s_ops) * s_seconds - 0.010, s_ops
