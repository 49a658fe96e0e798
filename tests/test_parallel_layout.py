"""The layout's and the batch's arithmetic, each rule in one place (parallel_layout.py), as its callers see it."""
import pytest

from megatron_ds.parallel_layout import (ParallelConfigError, accumulation_steps, data_parallel_size,
                                         global_batch_size, micro_batch_size)
from megatron_ds.pipe.plan.config import ConfigError
from megatron_ds.pipe.plan.plan import micro_batches_per_step


def test_data_parallel_size_is_world_over_tp_times_pp():
    assert data_parallel_size(8, 2) == 4
    assert data_parallel_size(8, 2, 2) == 2
    assert data_parallel_size(1, 1) == 1
    assert data_parallel_size(16, 2, 2, 2) == 2  # context parallelism: world / (TP x CP x PP)


@pytest.mark.parametrize("world, pp, tp, cp, message", [
    (4, 3, 1, 1, "--pipeline-model-parallel-size 3 must divide the world size 4 (the number of processes the "
                 "launcher started)"),
    (4, 0, 1, 1, "--pipeline-model-parallel-size 0 must divide the world size 4"),
    (4, 2, 0, 1, "--tensor-model-parallel-size 0 and --pipeline-model-parallel-size 2 must be at least 1"),
    (6, 2, 2, 1, "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4 must divide the world size 6 "
                 "(the data-parallel size is world / (TP x PP))"),
    (12, 2, 1, 4, "--tensor-model-parallel-size 1 x --context-parallel-size 4 x --pipeline-model-parallel-size 2 = 8 "
                  "must divide the world size 12 (the data-parallel size is world / (TP x CP x PP))"),
    (4, 2, 1, 0, "--tensor-model-parallel-size 1, --context-parallel-size 0 and --pipeline-model-parallel-size 2 "
                 "must be at least 1"),
])
def test_a_layout_that_does_not_divide_the_world_is_one_message(world, pp, tp, cp, message):
    with pytest.raises(ParallelConfigError) as err:
        data_parallel_size(world, pp, tp, cp)
    assert message in str(err.value)


def test_the_batch_is_micro_times_steps_times_data_parallel():
    assert global_batch_size(2, 3, 4) == 24
    assert accumulation_steps(24, 2, 4) == 3 and micro_batch_size(24, 3, 4) == 2
    assert accumulation_steps(25, 2, 4) is None and micro_batch_size(25, 3, 4) is None


def test_a_plan_from_a_ds_config_alone_takes_any_two_batch_keys():
    assert micro_batches_per_step({"train_batch_size": 12, "gradient_accumulation_steps": 3}, 2) == (2, 3)
    assert micro_batches_per_step({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, 2) == (3, 2)
    assert micro_batches_per_step({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2) == (3, 5)
    with pytest.raises(ConfigError, match="needs two of train_batch_size"):
        micro_batches_per_step({"train_batch_size": 12}, 2)
    with pytest.raises(ConfigError, match="train_batch_size 10 is not a multiple of gradient_accumulation_steps 3 x "
                                          "the data-parallel size 1"):
        micro_batches_per_step({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 1)


def test_layout_problem_is_the_one_rule_of_the_context_parallel_layout():
    from megatron_ds.parallel_layout import context_unit, layout_problem
    assert layout_problem(8, 2) == "" and context_unit(2) == 4
    assert "--seq-length (6) must be divisible by 2 x --context-parallel-size (4)" in layout_problem(6, 2)
    # under sequence parallelism a rank's tokens are cut TP ways again; without it TP changes nothing
    assert context_unit(2, 2, True) == 8 and context_unit(2, 2, False) == 4
    assert layout_problem(12, 2, "--seq-length", 2, False) == ""
    assert ("must be divisible by 2 x --context-parallel-size x --tensor-model-parallel-size (--sequence-parallel) "
            "(8)") in layout_problem(12, 2, "--seq-length", 2, True)
