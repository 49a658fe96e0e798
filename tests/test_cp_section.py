"""The ds_config's "context_parallel" section is checked in one place (cp_section.py): the flags' merge at parse
time and megatron_ds.initialize's reading of it refuse a bad section with the same line."""
import argparse

import pytest

from megatron_ds.cp_section import COMM_TYPES, section_problem
from megatron_ds.pipe.foreign.foreign_context import context_settings
from megatron_ds.pipe.plan.config import ConfigError
from megatron_ds.training.config.parallel_args import merge_context_parallel
from megatron_ds.training.errors import ArgumentsError


def flags(size=None, comm=None):
    return argparse.Namespace(deepspeed_config="ds.json", context_parallel_size=size, cp_comm_type=comm,
                              hierarchical_context_parallel_sizes=None)


@pytest.mark.parametrize("section, line", [
    (2, 'ds_config "context_parallel" must be an object of context_parallel_size, cp_comm_type and hierarchical_context_parallel_sizes, got 2'),
    ({"size": 2, "ring": 1}, "ds_config \"context_parallel\" has unknown keys 'ring', 'size': its keys are "
                             "context_parallel_size, cp_comm_type and hierarchical_context_parallel_sizes"),
    ({"context_parallel_size": "2"}, 'ds_config "context_parallel.context_parallel_size" = \'2\': a whole number '
                                     "of ranks, 1 or more"),
    ({"context_parallel_size": 0}, 'ds_config "context_parallel.context_parallel_size" = 0: a whole number of '
                                   "ranks, 1 or more"),
    ({"context_parallel_size": True}, 'ds_config "context_parallel.context_parallel_size" = True: a whole number '
                                      "of ranks, 1 or more"),
    ({"cp_comm_type": "ring"}, 'ds_config "context_parallel.cp_comm_type" = \'ring\': one of p2p, allgather, a2a, '
                               "a2a+p2p"),
])
def test_a_bad_section_is_the_same_line_on_both_paths(section, line):
    ds_config = {"context_parallel": section}
    assert section_problem(ds_config) == line
    with pytest.raises(ConfigError) as foreign:
        context_settings(ds_config)
    with pytest.raises(ArgumentsError) as parsed:
        merge_context_parallel(flags(), ds_config)
    assert str(foreign.value) == line
    assert str(parsed.value) == f"ds.json: {line}"  # the flags name the file they read it from


@pytest.mark.parametrize("comm", [c for c in COMM_TYPES if c != "a2a+p2p"])  # a user's module: not a2a+p2p yet
def test_a_good_section_gives_the_same_values_on_both_paths(comm):
    ds_config = {"context_parallel": {"context_parallel_size": 4, "cp_comm_type": comm}}
    args = flags()
    merge_context_parallel(args, ds_config)
    assert (args.context_parallel_size, args.cp_comm_type) == context_settings(ds_config) == (4, comm)


@pytest.mark.parametrize("ds_config", [{}, {"context_parallel": None}, {"context_parallel": {}}])
def test_no_section_is_one_rank_and_the_flags_or_the_ring(ds_config):
    args = flags(comm="allgather")
    merge_context_parallel(args, ds_config)
    assert (args.context_parallel_size, args.cp_comm_type) == (1, "allgather")
    assert context_settings(ds_config) == (1, None)


@pytest.mark.parametrize("size, comm, line", [
    (0, "p2p", "--context-parallel-size must be a whole number >= 1, got 0"),
    (True, "p2p", "--context-parallel-size must be a whole number >= 1, got True"),
    (2, "ring", "--cp-comm-type 'ring': choose one of p2p, allgather, a2a, a2a+p2p"),
])
def test_the_flags_values_are_one_line_for_the_model_and_the_cost_model(size, comm, line):
    """GPTConfig's check and the schedules' cost model (cp_problem) refuse bad values with cp_section's line."""
    import copy
    from megatron_ds.gpt_config import GPTConfig, config_problem
    from megatron_ds.schedules.context_parallel import cp_problem
    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=32,
                       context_parallel_size=2)
    assert config_problem(config) == ""
    bad = copy.copy(config)  # set after __post_init__, which would raise the line itself
    bad.context_parallel_size, bad.cp_comm_type = size, comm
    assert config_problem(bad) == line
    assert cp_problem(32, size, comm) == line
