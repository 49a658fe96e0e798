""""auto_recompute" at parse time: the run's GPTConfig takes the recompute setting "auto" starts under (the least
under which a start-up schedule fits the budget), and what would fix the recompute otherwise is refused with one
line: the recompute flags, --checkpoint-activations, a mixture of experts, a schedule other than "auto"."""
import json

import pytest

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.training.config.arguments import ArgumentsError, parse_args

# 4 layers, pipeline 2, micro-batch 2, 4 micro-batches, seq 16: as tests/training/test_auto_recompute_loop.py
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", __file__,
        "--merge-file", __file__, "--micro-batch-size", "2", "--global-batch-size", "8",
        "--pipeline-model-parallel-size", "2"]
pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def parse(*extra, budget=1.497, **pipeline):
    with open("ds.json", "w") as fh:
        json.dump({"zero_optimization": {"stage": 1}, "pipeline": {
            "schedule": "auto", "memory_budget": budget, "auto_recompute": True, **pipeline}}, fh)
    return parse_args(BASE + list(extra) + ["--deepspeed_config", "ds.json"], env={"WORLD_SIZE": "2", "RANK": "0"})


@pytest.mark.parametrize("budget,start,recompute", [
    (4, "zb-h1", (None, None, None)),  # fits without recompute
    (1.497, "seq1f1b", ("full", "uniform", 1)),  # only Seq1F1B k=2 with every layer recomputed
])
def test_the_run_starts_under_the_least_recompute_that_fits(budget, start, recompute):
    args = parse(budget=budget)
    config = args.gpt_config
    assert args.pipeline_plan.settings.schedule == start
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == recompute
    assert args.auto_plan.recompute == dict(zip(("granularity", "method", "num_layers"), recompute))
    assert args.checkpoint_activations == (recompute[0] == "full")


@pytest.mark.parametrize("extra,words", [
    (["--recompute-granularity", "selective"], ["--recompute-granularity", "auto_recompute"]),
    (["--recompute-activations"], ["--recompute-granularity", "auto_recompute"]),
    (["--checkpoint-activations"], ["--checkpoint-activations", "auto_recompute"]),
    (["--num-experts", "4"], ["auto_recompute", "mixture of experts"]),
])
def test_what_fixes_the_recompute_is_refused(extra, words):
    with pytest.raises(ArgumentsError) as err:
        parse(*extra)
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value), str(err.value)


def test_the_key_is_auto_s_and_a_bool():
    with pytest.raises(ConfigError, match='apply to "schedule": "auto" only'):
        pipeline_settings({"pipeline": {"schedule": "1f1b", "auto_recompute": True}})
    with pytest.raises(ConfigError, match="must be true or false"):
        pipeline_settings({"pipeline": {"schedule": "auto", "memory_budget": 2, "auto_recompute": "yes"}})


def test_a_decision_s_recompute_is_the_rebuild_s_and_the_resume_s():
    """What the rebuild after the decision and a resume from its auto_schedule.json build: the chosen schedule's
    ds_config (the "auto" keys dropped) and the chosen setting in the run's GPTConfig."""
    from megatron_ds.pipe.auto import chosen_ds_config
    from megatron_ds.training.config.pipeline import with_choice
    args = parse()
    decision = {"choice": {"section": {"schedule": "bitpipe"},
                           "recompute": {"granularity": "selective", "method": None, "num_layers": None}}}
    args = with_choice(args, chosen_ds_config(args.ds_config, decision), decision)
    assert args.ds_config["pipeline"] == {"schedule": "bitpipe"} and args.auto_plan is None
    assert args.pipeline_plan.schedule.name == "bitpipe"
    assert (args.gpt_config.recompute_granularity, args.checkpoint_activations) == ("selective", False)
