"""Cost-balanced partitions (pipe/plan/partition.py) and --allow-padding-num-layers, without processes:
the FLOP model, the cut under linear, interleaved and V placements, the costs list/file, every
impossible setting refused with one ConfigError before a rank starts."""
import json
from types import SimpleNamespace

import pytest

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.plan.partition import balanced_bounds, chunk_cost_bounds, cost_bounds, layer_flops
from megatron_ds.pipe.plan.plan import PipelinePlan
from megatron_ds.schedules import placement

# LLaMA-style, 1024 wide, GQA 16/4 heads, SwiGLU, GPT-2's 50k vocabulary (padded), 32 layers
LLAMA = SimpleNamespace(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, swiglu=True,
                        ffn_hidden_size=2816, max_position_embeddings=2048, vocab_size=50304, num_layers=32)


def counts(bounds, layers):
    """Transformer layers (global indices 1..layers) in each stage."""
    return [len(set(range(a, b)) & set(range(1, layers + 1))) for a, b in zip(bounds, bounds[1:])]


def rank_loads(weights, bounds, place):
    loads = [0.0] * (1 + max(max(row) for row in place))
    for row in place:
        for s, r in enumerate(row):
            loads[r] += sum(weights[bounds[s]:bounds[s + 1]])
    return loads


def test_layer_flops_gqa_swiglu_and_head():
    f = layer_flops(LLAMA)
    h, s, f_ = 1024, 2048, 2816
    assert f[1] == 2 * h * (h + 2 * 4 * 64) + 2 * h * h + 2 * s * h + 3 * 2 * h * f_
    assert len(f) == 35 and f[-1] == 2 * h * 50304 + 5 * 50304
    assert 3.8 < f[-1] / f[1] < 3.9                        # the head weighs almost 4 layers
    mha = layer_flops(SimpleNamespace(**{**vars(LLAMA), "num_key_value_heads": 16}))
    assert mha[1] - f[1] == 2 * h * 2 * 12 * 64            # 12 more K/V heads
    gelu = layer_flops(SimpleNamespace(**{**vars(LLAMA), "swiglu": False}))
    assert f[1] - gelu[1] == 2 * h * f_                    # SwiGLU's third matrix


@pytest.mark.parametrize("name,place,expect", [
    ("1f1b", placement.linear(4), [9, 9, 9, 5]),           # the head stage holds 4 layers fewer
    ("zbv", placement.v_shape(4), [4, 5, 5, 5, 4, 4, 4, 1]),   # rank 0: 4 + 1 layers and the head
    ("interleaved", placement.interleaved(4, 2), [4, 5, 5, 4, 5, 4, 4, 1]),
    ("bitpipe", placement.bitpipe(4), [4, 5, 5, 5, 4, 4, 4, 1]),
])
def test_flops_cut_lightens_the_head_rank(name, place, expect):
    f = layer_flops(LLAMA)
    bounds = cost_bounds("flops", LLAMA, place)
    assert counts(bounds, 32) == expect
    loads = rank_loads([w / f[1] for w in f], bounds, place)
    # the busiest rank is within one layer of a perfect share
    assert max(loads) <= sum(loads) / len(loads) + len(place), (name, loads)
    if name in ("zbv", "bitpipe"):  # rank 0 holds the embedding and the head stage
        per_rank = [0] * 4
        for s, r in enumerate(place[0]):
            per_rank[r] += expect[s]
        assert per_rank[0] < min(per_rank[1:])


def test_v_cut_at_pp8_is_as_good_as_integer_layers_allow():
    f = layer_flops(LLAMA)
    place = placement.v_shape(8)
    loads = rank_loads([w / f[1] for w in f], cost_bounds("flops", LLAMA, place), place)
    assert max(loads) == pytest.approx(5.0)                # 35.9 layers' work on 8 ranks: 5 at best


def test_costs_list_and_file(tmp_path):
    costs = [0.5] + [1.0] * 6 + [0.1, 4.0]
    cfg = SimpleNamespace(num_layers=6)
    inline = cost_bounds("costs:" + json.dumps(costs), cfg, placement.linear(2))
    assert inline == [0, 6, 9]                             # 5.5 | 5.1: stage 1 holds one layer and the head
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"layer_costs": costs}))     # what bench/layer_costs.py --costs-out writes
    assert cost_bounds(f"costs:{path}", cfg, placement.linear(2)) == inline
    path.write_text(json.dumps(costs))
    # V: rank 0 = embedding + 1 layer | the head stage (the head alone) = 5.5, rank 1 = 3 + 2.1 layers = 5.1
    assert cost_bounds(f"costs:{path}", cfg, placement.v_shape(2)) == [0, 2, 5, 8, 9]


def test_vocabulary_parallel_cut_drops_the_head():
    """Under vocabulary parallelism the same list is given and the head's cost (its last) dropped: every rank
    holds a slice of the head beside its stages, and the list is embedding, layers, final norm."""
    costs = [0.5] + [1.0] * 6 + [0.1, 4.0]
    cfg = SimpleNamespace(num_layers=6)
    assert cost_bounds("costs:" + json.dumps(costs), cfg, placement.linear(2), vocab_parallel=True) == [0, 4, 8]
    assert chunk_cost_bounds("flops", LLAMA, placement.linear(4), vocab_parallel=True) == [0, 9, 17, 25, 34]
    assert chunk_cost_bounds("flops", LLAMA, placement.linear(4))[-1] == 35  # with the head: 35 layers


@pytest.mark.parametrize("method,message", [
    ("costs:[1, 2, 3]", "3 costs for 9 pipeline layers (embedding, 6 transformer layers, final norm, head)"),
    ("costs:[1, 2, ", "the list is not JSON"),
    ("costs:nowhere.json", "no file 'nowhere.json'"),
    ('costs:[1, 1, 1, 1, 1, 1, 1, 1, -1]', "a list of numbers >= 0"),
    ('costs:[0, 0, 0, 0, 0, 0, 0, 0, 0]', "the costs sum to 0"),
])
def test_bad_costs_refused(method, message):
    with pytest.raises(ConfigError) as info:
        cost_bounds(method, SimpleNamespace(num_layers=6), placement.linear(2))
    assert message in str(info.value) and "pipeline.partition_method" in str(info.value)


def test_more_stages_than_layers_refused():
    with pytest.raises(ConfigError, match="16 virtual stages but only 7 pipeline layers"):
        cost_bounds("costs:[1, 1, 1, 1, 1, 1, 1]", SimpleNamespace(num_layers=4), placement.v_shape(8))


def test_unknown_method_refused():
    with pytest.raises(ConfigError, match='"flops", "costs:'):
        pipeline_settings({"pipeline": {"schedule": "zbv", "partition_method": "flop"}})


def test_balanced_bounds_one_stage_per_rank_is_the_linear_optimum():
    weights = [3, 1, 1, 1, 1, 1, 1, 1, 1, 5]
    assert balanced_bounds(weights, placement.linear(3)) == [0, 4, 9, 10]  # 6 | 5 | 5


def _config(layers):
    return SimpleNamespace(num_layers=layers, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                           max_position_embeddings=16, vocab_size=64)


def _plan(schedule, layers, **pipeline):
    config = _config(layers)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1},
          "pipeline": {"schedule": schedule, **pipeline}}
    return PipelinePlan.from_config(config, ds, 2, 1)


def _parts(schedule, layers, **pipeline):
    plan = _plan(schedule, layers, **pipeline)
    return chunk_cost_bounds(plan.settings.partition_method, _config(layers), plan.placement)


def test_the_cost_cut_and_the_padding_rule():
    assert _parts("zbv", 8) is None                   # DeepSpeed's method cuts at build time
    # rank 0: the embedding, then the final norm and the head (1 + 5); rank 1: the 6 layers
    assert _parts("zbv", 6, partition_method="costs:[1, 1, 1, 1, 1, 1, 1, 0, 5]") == [0, 1, 4, 7, 9]
    with pytest.raises(ConfigError) as info:
        _plan("zbv", 6)
    assert ("--num-layers 6 must be a multiple of 4, or give --allow-padding-num-layers "
            '(ds_config "pipeline.allow_padding_num_layers": true)') in str(info.value)
    assert _parts("zbv", 6, allow_padding_num_layers=True) is None
    assert _parts("zbv", 6, partition_method="flops") is not None  # cost cuts are unequal anyway
    with pytest.raises(ConfigError, match="at least one transformer layer per virtual stage"):
        _plan("zbv", 3, allow_padding_num_layers=True)


@pytest.mark.parametrize("schedule, layers, way", [
    ("zbv", 2, "choose a schedule of one virtual stage per rank (1f1b, zb-h1, zb-h2) or a pipeline size of at most 1"),
    ("zbv", 3, "choose a schedule of one virtual stage per rank (1f1b, zb-h1, zb-h2) or a pipeline size of at most 1"),
    ("zbv", 1, "choose a model of more layers"),
    ("1f1b", 1, "choose a pipeline size of at most 1"),
])
def test_too_few_layers_names_the_way_out_first(schedule, layers, way):
    """A model of fewer layers than virtual stages is told what runs it, not to pad (padding gives an empty stage
    no layer): 2 layers under zbv at pipeline 2 (4 stages)."""
    with pytest.raises(ConfigError) as info:
        _plan(schedule, layers)
    assert way in str(info.value) and "allow-padding" not in str(info.value), info.value
    assert f"--num-layers {layers} < " in str(info.value)
    with pytest.raises(ConfigError, match="must be true or false"):
        _plan("zbv", 6, allow_padding_num_layers="yes")
