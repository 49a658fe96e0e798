"""Megatron-core's --pipeline-model-parallel-layout and --decoder-first/last-pipeline-num-layers: the grammar,
the bounds over the pipeline's layers, and one line (exit 2 at parse time) for each layout that cannot cut."""
import pytest

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.plan.layout import LayoutError, first_last_layout, layout_bounds, parse
from megatron_ds.pipe.plan.partition import cost_bounds
from tests.gpt_harness import tiny_config


def test_the_grammar_unrolls_repeats_and_ignores_commas():
    assert parse("Et*3|(tt|)*2,t|tL") == ["Ettt", "tt", "tt", "t", "tL"]
    assert parse("E(t|)*3tL") == ["Et", "t", "t", "tL"]
    assert parse("Et*12L") == ["E" + "t" * 12 + "L"]


@pytest.mark.parametrize("text, words", [
    ("Et*3|m|L", "'m' (Megatron's multi-token-prediction layer)"),
    ("Ex|L", "'x' is no layer"),
    ("E(t|L", "'(' without its ')'"),
    ("Et)|L", "unbalanced ')'"),
    ("Et*|L", "'*' needs a count"),
])
def test_a_bad_string_is_one_line(text, words):
    with pytest.raises(LayoutError, match=None) as info:
        parse(text)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_bounds_over_embedding_layers_norm_and_head():
    # [embedding, 6 layers, final norm, head]: L takes the norm and the head
    assert layout_bounds("Et*5|tL", 6, 2) == [0, 6, 9]
    assert layout_bounds("Et|t*3|t*2|L", 6, 4) == [0, 2, 5, 7, 9]
    assert layout_bounds("Et*5|tL", 6, 2, vocab_parallel=True) == [0, 6, 8]  # the head sits beside the stages


def test_a_layout_equals_the_same_cut_given_as_costs():
    config = tiny_config(6)
    costs = "costs:[0.5, 1, 1, 1, 1, 1, 1, 0, 4]"
    assert cost_bounds(costs, config, [[0, 1]]) == cost_bounds("layout:Et*5|tL", config, [[0, 1]]) == [0, 6, 9]
    v = [[0, 1, 1, 0]]  # zbv's placement: the rank of each stage (rank 0 holds stages 0 and 3)
    assert cost_bounds(costs, config, v) == cost_bounds("layout:Et|t*3|t*2|L", config, v)


@pytest.mark.parametrize("text, stages, words", [
    ("Et*5|tL", 4, "has 2 stages; the schedule cuts the model into 4"),
    ("Et*4|tL", 2, "places 5 transformer layers; the model has 6"),
    ("tEt*4|tL", 2, "the embedding (E) comes once, first in the first stage"),
    ("Et*5|Lt", 2, "the loss (L) comes once, last in the last stage"),
    ("Et*6||L", 3, "stage 1 holds no layer"),
])
def test_a_layout_that_cannot_cut_this_model_says_why(text, stages, words):
    with pytest.raises(LayoutError) as info:
        layout_bounds(text, 6, stages)
    assert words in str(info.value)


def test_first_and_last_stage_counts_are_a_layout():
    assert first_last_layout(3, 1, 8, 4) == "Ettt|tt|tt|tL"
    assert first_last_layout(None, 2, 8, 3) == "Ettt|ttt|ttL"
    with pytest.raises(LayoutError, match="leave 5 of --num-layers 8 to the 2 other stages"):
        first_last_layout(2, 1, 8, 4)


def test_the_ds_config_key_is_checked_when_read():
    assert pipeline_settings({"pipeline": {"schedule": "1f1b", "partition_method": "layout:Et*5|tL"}})
    with pytest.raises(ConfigError, match='"pipeline.partition_method": layout .*\'q\' is no layer'):
        pipeline_settings({"pipeline": {"schedule": "1f1b", "partition_method": "layout:Eq|L"}})
