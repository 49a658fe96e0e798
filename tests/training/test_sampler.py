"""Megatron's pretraining sampler: each data-parallel rank's slice, and resuming at a sample."""
from megatron_ds.training.batch_schedule import BatchSizeSchedule
from megatron_ds.data.samplers import PretrainingSampler


def test_dp_slices_are_disjoint_and_in_order():
    per_rank = [list(PretrainingSampler(40, 0, 2, r, 3)) for r in range(3)]
    assert per_rank[0][:2] == [[0, 1], [6, 7]] and per_rank[2][:2] == [[4, 5], [10, 11]]
    seen = sorted(i for batches in per_rank for b in batches for i in b)
    assert seen == list(range(36))  # 6 full micro-steps of 2 x 3; the incomplete tail is dropped


def test_resume_continues_the_stream():
    whole = list(PretrainingSampler(64, 0, 2, 1, 2))
    resumed = list(PretrainingSampler(64, 24, 2, 1, 2))
    assert resumed == whole[6:]  # 24 samples = 6 micro-steps of 2 x 2


def test_ramp_depends_only_on_consumed_samples():
    sched = BatchSizeSchedule(8, [2, 2, 16])
    sizes, consumed = [], 0
    for _ in range(sched.iterations_for(36)):
        sizes.append(sched.global_batch_size(consumed))
        consumed += sizes[-1]
    assert sizes == [2, 2, 2, 4, 4, 6, 8, 8] and consumed == sched.samples_after(8) == 36
    assert BatchSizeSchedule(8).iterations_for(36) == 4 and BatchSizeSchedule(8, [8, 8, 100]).global_batch_size(0) == 8
