"""MoEConfig's rules (torch-free): one message per impossible setting, named by Megatron-core's flag."""
import pytest

from megatron_ds.gpt_config import GPTConfig
from megatron_ds.moe_config import MoEConfig, compact_layer_freq, layer_pattern, moe_problem, parse_layer_freq


@pytest.mark.parametrize("text, layers, pattern", [
    ("1", 4, [1, 1, 1, 1]), ("2", 5, [1, 0, 1, 0, 1]), ("[0,1,1]", 3, [0, 1, 1]),
    ("([0]*1+[1]*3)", 4, [0, 1, 1, 1]), ("[1]*2+[0]*2", 4, [1, 1, 0, 0]), ("0,1,1", 3, [0, 1, 1]),
])
def test_layer_freq_as_megatron_writes_it(text, layers, pattern):
    assert layer_pattern(parse_layer_freq(text), layers) == pattern


@pytest.mark.parametrize("text", ["__import__('os')", "[0, x]", "[0.5]", "abc"])
def test_layer_freq_runs_nothing(text):
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_layer_freq(text)


@pytest.mark.parametrize("options, flag", [
    (dict(num_experts=8, router_topk=9), "--moe-router-topk (9) must be between 1 and --num-experts (8)"),
    (dict(num_experts=8, expert_model_parallel_size=3), "--expert-model-parallel-size (3) must divide"),
    (dict(num_experts=8, num_groups=3, group_topk=1), "--moe-router-num-groups (3) must divide"),
    (dict(num_experts=8, num_groups=4), "go together"),
    (dict(num_experts=8, router_topk=3, num_groups=4, group_topk=2), "must be a multiple of --moe-router-group-topk"),
    (dict(num_experts=8, capacity_factor=0.0), "--moe-expert-capacity-factor must be positive"),
    (dict(num_experts=8, enable_expert_bias=True), "add --moe-router-score-function sigmoid"),
    (dict(num_experts=8, pre_softmax=True, score_function="sigmoid"), "--moe-router-pre-softmax"),
    (dict(num_experts=8, layer_freq=(0, 0, 0, 0)), "leaves no layer with experts"),
    (dict(num_experts=8, layer_freq=(0, 1)), "one 0 or 1 per layer (4)"),
    (dict(num_experts=8, load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type 'sinkhorn'"),
    (dict(num_experts=8, shared_expert_intermediate_size=9), "--moe-shared-expert-intermediate-size (9)"),
])
def test_impossible_settings_name_their_flag(options, flag):
    assert flag in moe_problem(MoEConfig(**options), num_layers=4, tensor_parallel=2)


def test_gpt_config_checks_moe_and_resolves_its_ffn_size():
    base = dict(vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=16,
                ffn_hidden_size=48)
    assert GPTConfig(**base, moe=MoEConfig(num_experts=4)).moe.ffn_hidden_size == 48
    assert GPTConfig(**base, moe=MoEConfig(num_experts=4, ffn_hidden_size=8)).moe.ffn_hidden_size == 8
    with pytest.raises(ValueError, match="--moe-router-topk"):
        GPTConfig(**base, moe=MoEConfig(num_experts=4, router_topk=5))
    assert not GPTConfig(**base).is_moe_layer(1)
    c = GPTConfig(**base, moe=MoEConfig(num_experts=4, layer_freq=(2,)))
    assert [c.is_moe_layer(i) for i in range(1, 5)] == [True, False, True, False]


def test_a_moe_model_on_llamas_layout_is_mixtral_or_with_qk_norms_qwen3_moe():
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=16,
                normalization="rmsnorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False)
    assert GPTConfig(**base).family == "llama" and GPTConfig(**base, qk_layernorm=True).family == "qwen3"
    assert GPTConfig(**base, moe=MoEConfig(num_experts=4)).family == "mixtral"
    sparse = MoEConfig(num_experts=4, layer_freq=(0, 1), pre_softmax=True, aux_loss_coeff=0.01, z_loss_coeff=0.1)
    assert GPTConfig(**base, moe=sparse).family is None  # Mixtral: every layer, renormalised top-k
    assert GPTConfig(**base, moe=sparse, qk_layernorm=True).family == "qwen3_moe"
    assert GPTConfig(**{**base, "add_bias_linear": True}, moe=MoEConfig(num_experts=4)).family is None
    assert GPTConfig(**base, moe=MoEConfig(num_experts=4, shared_expert_intermediate_size=8)).family is None
    assert GPTConfig(**base, moe=MoEConfig(num_experts=4, score_function="sigmoid")).family is None


def test_compact_layer_freq_is_the_shortest_flag_value():
    assert compact_layer_freq([1, 1, 1, 1]) == (1,) and compact_layer_freq([1, 0, 1, 0]) == (2,)
    assert compact_layer_freq([1, 0, 0]) == (3,) and compact_layer_freq([1]) == (1,)
    assert compact_layer_freq([0, 1, 0, 1]) == (0, 1, 0, 1) and compact_layer_freq([1, 1, 0]) == (1, 1, 0)
    for pattern in ([1, 0, 1, 0], [0, 1, 1], [1, 1, 1]):
        assert layer_pattern(compact_layer_freq(pattern), len(pattern)) == pattern
