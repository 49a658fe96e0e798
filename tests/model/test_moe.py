"""The MoE layer on one process: routing as Hugging Face's Mixtral, Qwen3-MoE and DeepSeek-V3 route, the
router losses' gradients as Megatron's formulas give them, capacity, the expert bias."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.gpt_config import GPTConfig
from megatron_ds.model.gpt import GPTModel
from megatron_ds.model.moe import MoE, RouterLossLog, set_grad_scale
from megatron_ds.model.moe_router import capacity_kept, route
from megatron_ds.moe_config import MoEConfig

H, E = 16, 8


def gpt_config(**moe):
    moe = {"num_experts": E, **moe}
    return GPTConfig(vocab_size=64, hidden_size=H, num_layers=2, num_attention_heads=2, max_position_embeddings=16,
                     swiglu=True, normalization="rmsnorm", position_embedding_type="rope", add_bias_linear=False,
                     ffn_hidden_size=24, moe=MoEConfig(**moe))


def moe_layer(**moe):
    torch.manual_seed(0)
    config = gpt_config(**moe)
    init = lambda w: w.normal_(0.0, 0.3)  # router logits large enough to make the choice matter
    return MoE(config, init, init, layer_idx=1)


def hf_block(kind, layer, **config):
    """Hugging Face's sparse MoE block with `layer`'s router and expert weights."""
    transformers = pytest.importorskip("transformers")
    cfg_class, module = {"mixtral": ("MixtralConfig", "mixtral"), "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe"),
                         "deepseek_v3": ("DeepseekV3Config", "deepseek_v3")}[kind]
    import importlib
    cfg = getattr(transformers, cfg_class)(hidden_size=H, intermediate_size=layer.config.ffn_hidden_size,
                                           moe_intermediate_size=layer.config.ffn_hidden_size,
                                           num_experts_per_tok=layer.config.router_topk, **config)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    block = {"mixtral": lambda: modeling.MixtralSparseMoeBlock(cfg), "qwen3_moe": lambda: modeling.Qwen3MoeSparseMoeBlock(cfg),
             "deepseek_v3": lambda: modeling.DeepseekV3MoE(cfg)}[kind]()
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        for i in range(E):
            block.experts.gate_up_proj[i].copy_(layer.experts[str(i)].fc1.weight)
            block.experts.down_proj[i].copy_(layer.experts[str(i)].fc2.weight)
    return block


@pytest.mark.parametrize("kind, moe, hf", [
    ("mixtral", {}, dict(num_local_experts=E)),
    ("qwen3_moe", {"pre_softmax": True}, dict(num_experts=E, norm_topk_prob=False)),
    ("qwen3_moe", {}, dict(num_experts=E, norm_topk_prob=True)),
])
def test_softmax_routing_equals_hugging_face(kind, moe, hf):
    layer = moe_layer(**moe)
    block = hf_block(kind, layer, **hf)
    x = torch.randn(3, 5, H, requires_grad=True)
    ours, theirs = layer(x), block(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ours)
    g_ours, = torch.autograd.grad(ours, x, grad)
    g_theirs, = torch.autograd.grad(theirs, x, grad)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-6)


def test_sigmoid_group_limited_biased_routing_equals_deepseek_v3():
    m = dict(score_function="sigmoid", enable_expert_bias=True, num_groups=4, group_topk=2, router_topk=4,
             topk_scaling_factor=2.5)
    layer = moe_layer(**m)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.randn(E) * 0.3)
    block = hf_block("deepseek_v3", layer, n_routed_experts=E, n_shared_experts=0, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, norm_topk_prob=True)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(layer.router.expert_bias)
    x = torch.randn(4, 6, H)
    logits = F.linear(x.view(-1, H), layer.router.weight)
    probs, experts = route(logits, layer.config, layer.router.expert_bias)
    _, hf_weights, hf_experts = block.gate(x)
    order, hf_order = experts.argsort(-1), hf_experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), hf_experts.gather(1, hf_order))
    torch.testing.assert_close(probs.gather(1, order), hf_weights.gather(1, hf_order))
    assert not torch.equal(route(logits, layer.config)[1].sort(-1).values, experts.sort(-1).values), \
        "the bias changed no choice: the test would not see it ignored"
    torch.testing.assert_close(layer(x), block.experts(x.view(-1, H), hf_experts, hf_weights).view_as(x),
                               rtol=1e-5, atol=1e-6)


def megatron_losses(logits, m: MoEConfig, batch):
    """The router losses written out as Megatron-core's formulas (moe_utils), for the comparison."""
    T = logits.shape[0]
    scores = torch.softmax(logits.float(), -1) if m.score_function == "softmax" else \
        torch.sigmoid(logits.float()) / torch.sigmoid(logits.float()).sum(-1, keepdim=True)
    routing = torch.zeros_like(scores).scatter(1, scores.topk(m.router_topk, -1).indices, 1.0)
    if m.load_balancing_type == "seq_aux_loss":
        S = T // batch
        counts = routing.view(batch, S, E).sum(1) / (S * m.router_topk / E)
        aux = (counts * scores.view(batch, S, E).sum(1)).sum(1).mean() * m.aux_loss_coeff / S
    else:
        aux = (scores.sum(0) * routing.sum(0)).sum() * E * m.aux_loss_coeff / (m.router_topk * T * T)
    z = torch.logsumexp(logits.float(), -1).square().mean() * m.z_loss_coeff
    return aux, z


@pytest.mark.parametrize("moe", [
    dict(aux_loss_coeff=0.1, z_loss_coeff=0.01),
    dict(aux_loss_coeff=0.1, load_balancing_type="seq_aux_loss"),
    dict(aux_loss_coeff=0.05, z_loss_coeff=0.02, score_function="sigmoid", enable_expert_bias=True),
])
def test_router_losses_enter_the_gradient_as_megatrons_formulas(moe):
    """The losses' gradients, added in the layer's backward (scaled as the LM loss is), equal adding
    Megatron's aux and z losses to the loss; the logged values equal theirs."""
    torch.manual_seed(1)
    config = gpt_config(shared_expert_intermediate_size=8, **moe)
    model = GPTModel(config)
    tokens = torch.randint(0, 64, (3, 8))
    logits_seen = []
    hooks = [layer.mlp.router.register_forward_hook(lambda mod, inp, out: logits_seen.append(out[0]))
             for layer in model.layers]

    def grads(explicit):
        model.zero_grad()
        logits_seen.clear()
        RouterLossLog.take()
        set_grad_scale(0.0 if explicit else 0.5)
        lm = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        losses = [megatron_losses(lg, config.moe, batch=3) for lg in logits_seen]
        total = lm + sum(a + z for a, z in losses) if explicit else lm
        (0.5 * total).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, losses

    try:
        ours, _ = grads(explicit=False)
        logged, _ = RouterLossLog.take()
        theirs, losses = grads(explicit=True)
    finally:
        set_grad_scale(1.0)
        for h in hooks:
            h.remove()
    router = "layers.0.mlp.router.weight"
    assert ours[router].abs().sum() > 0
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(logged["load_balancing_loss"], sum(a for a, _ in losses).detach())
    if config.moe.z_loss_coeff:
        torch.testing.assert_close(logged["z_loss"], sum(z for _, z in losses).detach())


def test_without_loss_coefficients_the_gradient_is_the_lm_losss():
    torch.manual_seed(2)
    model = GPTModel(gpt_config())
    tokens = torch.randint(0, 64, (2, 8))
    RouterLossLog.take()
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    sums, loads = RouterLossLog.take()
    assert sums == {} and sorted(loads) == [1, 2] and loads[1].sum() == 2 * 8 * 2


def test_capacity_drops_the_lowest_probabilities_of_each_full_expert():
    m = MoEConfig(num_experts=4, router_topk=2, capacity_factor=0.75)
    torch.manual_seed(3)
    logits = torch.randn(12, 4) * 2
    probs, experts = route(logits, m)
    kept = capacity_kept(probs, experts, m, 4)
    capacity = math.ceil(12 * 2 / 4 * 0.75)
    for e in range(4):
        mine = [(probs[t, j].item(), t) for t in range(12) for j in range(2) if experts[t, j] == e]
        expect = {t for _, t in sorted(mine, reverse=True)[:capacity]}
        got = {t for t in range(12) for j in range(2) if experts[t, j] == e and kept[t, j]}
        assert got == expect, e
    assert (~kept).any(), "nothing dropped: the factor is too large for the test"


def test_dropped_assignments_add_nothing():
    layer = moe_layer(capacity_factor=0.5)
    x = torch.randn(2, 6, H)
    x2d = x.view(-1, H)
    logits, probs, experts, kept = layer.router(x2d)
    out = torch.zeros_like(x2d)
    for t in range(x2d.shape[0]):
        for j in range(2):
            if kept[t, j]:
                out[t] += probs[t, j] * layer.experts[str(experts[t, j].item())](x2d[t:t + 1])[0]
    torch.testing.assert_close(layer(x).view(-1, H), out, rtol=1e-5, atol=1e-6)


def test_expert_bias_moves_against_the_load():
    layer = moe_layer(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
    x = torch.randn(4, 8, H, requires_grad=True)
    layer(x).sum().backward()
    counts = layer.router.tokens_per_expert.clone()
    assert counts.sum() == 4 * 8 * 2
    layer.router.update_expert_bias()
    torch.testing.assert_close(layer.router.expert_bias, 0.01 * torch.sign(counts.mean() - counts))
    assert layer.router.tokens_per_expert.sum() == 0
    with torch.no_grad():
        layer(x)
    assert layer.router.tokens_per_expert.sum() == 0, "evaluation counted tokens"


def test_moe_layer_pattern_and_shared_expert():
    config = gpt_config(layer_freq=(0, 1), shared_expert_intermediate_size=8)
    model = GPTModel(config)
    assert type(model.layers[0].mlp).__name__ == "MLP" and isinstance(model.layers[1].mlp, MoE)
    assert model.layers[1].mlp.shared_expert.c_fc.weight.shape == (16, H)


def test_an_expert_without_tokens_gets_a_zero_gradient():
    """Not None: ZeRO's data-parallel reduction needs the same gradients on every rank."""
    layer = moe_layer(router_topk=1)
    x = torch.randn(1, 2, H)  # two tokens: six of the eight experts get none
    unused = set(range(E)) - set(layer.router(x.view(-1, H))[2].flatten().tolist())
    layer(x).sum().backward()
    for e in unused:
        weight = layer.experts[str(e)].fc1.weight
        assert weight.grad is not None and torch.equal(weight.grad, torch.zeros_like(weight))
    assert all(p.grad is not None for p in layer.parameters())
