"""Megatron's AnnealingLR: warm-up, linear/cosine/constant decay, state_dict round trip."""
import math

import pytest

from megatron_ds.training.learning_rates import AnnealingLR


class FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0}, {"lr": 0.0}]


def make(style, warmup=10, decay=110, gbs=1):
    return AnnealingLR(FakeOptimizer(), max_lr=1.0, min_lr=0.1, warmup_steps=warmup, decay_steps=decay,
                       decay_style=style, global_batch_size=gbs)


def lrs(sched, n):
    return [sched.step() for _ in range(n)]


def test_warmup_then_linear():
    s = make("linear")
    assert s.optimizer.param_groups[0]["lr"] == 0.0  # Megatron: the first step runs at lr(0)
    got = lrs(s, 120)
    assert got[4] == pytest.approx(0.5) and got[9] == pytest.approx(1.0)
    assert got[59] == pytest.approx(0.1 + 0.9 * (1 - 50 / 100))
    assert got[109] == pytest.approx(0.1) and got[119] == 0.1
    assert all(g["lr"] == got[-1] for g in s.optimizer.param_groups)


def test_cosine_and_constant():
    s = make("cosine")
    got = lrs(s, 110)
    assert got[59] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert lrs(make("constant"), 200)[150] == 1.0


def test_counts_samples():
    s = make("linear", warmup=0, decay=100, gbs=10)
    assert lrs(s, 5)[-1] == pytest.approx(0.1 + 0.9 * 0.5)
    s.global_batch_size = 20  # ramp-up changes the increment
    assert s.step() == pytest.approx(0.1 + 0.9 * 0.3)


def test_state_dict_round_trip():
    a = make("cosine")
    lrs(a, 37)
    b = make("cosine")
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 37 and b.get_last_lr() == a.get_last_lr()
    assert lrs(a, 5) == lrs(b, 5)


def test_a_longer_run_resumed_says_once_that_the_lr_stays_at_its_minimum(capsys, monkeypatch):
    saved = make("cosine", decay=110)
    lrs(saved, 120)
    for rank in ("1", "0"):  # one line from rank 0, none from the others
        monkeypatch.setenv("RANK", rank)
        resumed = make("cosine", decay=220)
        resumed.load_state_dict(saved.state_dict())
        assert resumed.step() == 0.1 and resumed.decay_steps == 110
    assert capsys.readouterr().out.splitlines() == [
        "WARNING: lr scheduler decay_steps: the flags say 220, the checkpoint 110; using the checkpoint's: the lr "
        "reaches min_lr 0.1 at sample 110 and stays there for the rest of the run (pass --override-lr-scheduler to "
        "use the flags)"]
