"""bench.vocab_parallel_gpt at toy size (p=2): a real GPT with and without vocabulary parallelism
trains the same losses under every schedule, and the table holds finite, positive times."""
import math

import pytest

from bench.vocab_parallel_gpt import analyse, markdown, worker
from megatron_ds.testing.launcher import run_ranks

OPTS = {"pp": 2, "gas": 4, "mbs": 2, "seq": 16, "hidden": 32, "layers": 4, "heads": 4, "vocab": 512,
        "schedules": ["1f1b", "zbv"], "iterations": 2, "warmup": 0}


@pytest.mark.timeout(600)
def test_vocab_parallel_trains_the_naive_runs_losses():
    table = analyse(run_ranks(OPTS["pp"], worker, OPTS, timeout=540)[0], OPTS)
    assert list(table) == OPTS["schedules"]
    for rows in table.values():
        naive, vocab = rows["naive"], rows["vocab"]
        assert len(naive["losses"]) == len(vocab["losses"]) == 2
        assert vocab["losses"] == pytest.approx(naive["losses"], abs=1e-5)
        assert naive["losses"][0] == pytest.approx(math.log(OPTS["vocab"]), abs=0.5)  # random init, random tokens
        assert all(math.isfinite(t) and t > 0 for t in naive["times"] + vocab["times"])
        assert math.isfinite(rows["ratio"]) and rows["ratio"] > 0
    text = markdown(table, OPTS)
    assert "vocabulary 512 (head + loss = " in text
    assert [line.split("|")[1].strip() for line in text.splitlines()[4:]] == OPTS["schedules"]
