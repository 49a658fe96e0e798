"""The smallest micro-batch counts (1 .. p, as a batch-size ramp-up starts) under every schedule: a count the
schedule builds trains exactly as the single-process reference (loss, first-step gradients, weights after
2 steps, eval loss); a count it does not build is a ScheduleError, which start-up turns into one line
(training/config/arguments._check_schedule_over_rampup). BitPipe at m <= p/2 leaves its up replica idle: it hung."""
import pytest

from megatron_ds.pipe.plan.config import pipeline_settings
from megatron_ds.schedules import ScheduleError
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import assert_matches_reference, engine_rank_runs, reference_run, tiny_config

STEPS = 2
SECTIONS = [{"schedule": "gpipe"}, {"schedule": "1f1b"}, {"schedule": "interleaved", "virtual_stages": 2},
            {"schedule": "zb-h1"}, {"schedule": "zb-h2"}, {"schedule": "zbv"}, {"schedule": "zbv-half"},
            {"schedule": "zbv-min"}, {"schedule": "dualpipev"}, {"schedule": "bitpipe"},
            {"schedule": "1f1b", "vocab_parallel": True}, {"schedule": "bitpipe", "vocab_parallel": True}]
# Seq1F1B cuts a longer sequence, and trains at a lower lr (tests/pipe/test_seq1f1b.py says why)
SEQ1F1B = [{"schedule": "seq1f1b", "seq_splits": 2}, {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True},
           {"schedule": "seq1f1b", "seq_splits": 2, "virtual_stages": 2}]
SEQ, LR = 64, 1e-3


def runnable(sections, pp, m):
    """The sections whose schedule builds for (pp, m); the others must refuse it with a ScheduleError."""
    out = []
    for section in sections:
        try:
            pipeline_settings({"pipeline": section}).build_schedule(pp, m)
        except ScheduleError:
            continue
        out.append(section)
    return out


def check(pp, m, layers, sections, **kw):
    ref = reference_run(tiny_config(layers, kw.get("seq", 16)), 1, m, STEPS, **({"lr": kw["lr"]} if "lr" in kw else {}))
    per_rank = run_ranks(pp, engine_rank_runs, pp, m, STEPS, sections, num_layers=layers, timeout=300, **kw)
    for i, section in enumerate(sections):
        try:
            assert_matches_reference([r[i] for r in per_rank], ref)
        except AssertionError as exc:
            raise AssertionError(f"{section} at pp={pp}, m={m}: {exc}") from None


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 1), (4, 2), (4, 3)])
def test_every_schedule_trains_few_micro_batches(pp, m):
    sections = runnable(SECTIONS, pp, m)
    assert {"schedule": "bitpipe"} in sections  # BitPipe takes any count (docs/TRAINING.md: batch-size ramp-up)
    check(pp, m, 2 * pp, sections)


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 1), (4, 2)])
def test_seq1f1b_trains_few_micro_batches(pp, m):
    sections = runnable(SEQ1F1B, pp, m)
    assert sections
    check(pp, m, 2 * pp, sections, seq=SEQ, lr=LR)
