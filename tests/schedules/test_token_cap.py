"""Seq1F1B capped at 1F1B's token count per rank: every rank's peak tokens in flight <= (p - r)
micro-batches for the balanced split, the lists stay valid, and the simulated makespan does not grow."""
import pytest

from megatron_ds.schedules import build_schedule, simulate
from megatron_ds.schedules.kinds import Kind
from megatron_ds.schedules.seq_split import balanced_segment_lengths, segment_costs
from megatron_ds.schedules.token_cap import cap_tokens


def peak_tokens(ops, lengths):
    held = top = 0
    for op in ops:
        held += lengths[op.seq] if op.kind is Kind.F else -lengths[op.seq] if op.kind in (Kind.B, Kind.BW) else 0
        top = max(top, held)
    return top


@pytest.mark.parametrize("pp,m,k,hidden,split", [(4, 8, 4, 256, False), (8, 16, 4, 256, False), (4, 8, 2, 256, False),
                                                 (4, 8, 4, 256, True), (8, 32, 4, 1024, False)])
def test_capped_seq1f1b_holds_no_more_tokens_than_1f1b(pp, m, k, hidden, split):
    lengths = balanced_segment_lengths(2048, k, hidden)
    costs = segment_costs(lengths, hidden)
    plain = build_schedule("seq1f1b", pp, m, seq_splits=k, split_backward=split)
    capped = cap_tokens(build_schedule("seq1f1b", pp, m, seq_splits=k, split_backward=split), lengths)
    assert peak_tokens(plain.ranks[-1], lengths) > 2048  # the balanced split's long first segment
    assert [peak_tokens(ops, lengths) <= (pp - r) * 2048 for r, ops in enumerate(capped.ranks)] == [True] * pp
    assert [sorted(map(str, ops)) for ops in capped.ranks] == [sorted(map(str, ops)) for ops in plain.ranks]
    for tb in (1.0, 2.0):
        before = simulate(plain, 1.0, tb, tb, seq_costs=costs).makespan
        assert simulate(capped, 1.0, tb, tb, seq_costs=costs).makespan <= before + 1e-9


def test_even_segments_leave_the_order_alone():
    plain = build_schedule("seq1f1b", 4, 8, seq_splits=4)
    assert cap_tokens(build_schedule("seq1f1b", 4, 8, seq_splits=4), [512] * 4).ranks == plain.ranks


def test_generator_caps_and_the_cli_exports_the_engines_order(capsys):
    """The cap lives in the seq1f1b generator: build_schedule with segment_lengths, the CLI export
    with --seq-length/--hidden-size and the engine's plan (pipe/plan/plan.py) give one op order."""
    from types import SimpleNamespace

    from megatron_ds.pipe.plan.plan import PipelinePlan
    from megatron_ds.schedules import Schedule
    from megatron_ds.schedules.cli import main

    lengths = balanced_segment_lengths(2048, 4, 256)
    built = build_schedule("seq1f1b", 4, 8, seq_splits=4, segment_lengths=lengths)
    assert built.ranks == cap_tokens(build_schedule("seq1f1b", 4, 8, seq_splits=4), lengths).ranks
    assert built.ranks != build_schedule("seq1f1b", 4, 8, seq_splits=4).ranks
    assert built.segment_lengths == lengths
    assert main(["export", "--schedule", "seq1f1b", "--pp", "4", "--micro-batches", "8", "--seq-splits", "4",
                 "--seq-length", "2048", "--hidden-size", "256"]) == 0
    exported = Schedule.from_json(capsys.readouterr().out)
    assert exported.segment_lengths == lengths and exported.ranks == built.ranks
    config = SimpleNamespace(num_layers=4, hidden_size=256, ffn_hidden_size=1024, max_position_embeddings=2048)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 1},
          "pipeline": {"schedule": "seq1f1b", "seq_splits": 4}}
    plan = PipelinePlan.from_config(config, ds, 4, 1)
    assert plan.segment_lengths == tuple(lengths) and plan.schedule.ranks == built.ranks
    assert main(["show", "--schedule", "seq1f1b", "--pp", "4", "--micro-batches", "8", "--seq-splits", "4",
                 "--seq-length", "2048", "--hidden-size", "256"]) == 0
    assert "makespan" in capsys.readouterr().out


def test_segment_lengths_refused_where_they_do_not_apply():
    from megatron_ds.schedules import ScheduleError
    with pytest.raises(ScheduleError, match="1f1b does not take segment_lengths"):
        build_schedule("1f1b", 4, 8, segment_lengths=[4, 4])
    with pytest.raises(ScheduleError, match="give seq_splits=4 positive token counts"):
        build_schedule("seq1f1b", 4, 8, seq_splits=4, segment_lengths=[512, 512])
