"""The B/W split inside compiled layers (model/weight_carriers.py): with the runtime's carriers, two
compiled LLaMA layers run forward and backward as one graph each, nothing breaks or compiles again after
the first micro-batch, a B leaves every linear's weight GEMM to its W (no weight gradient yet, one
queued GEMM per linear), and B + W equal the eager layers' fused backward (fp32); a backward outside a
B op computes the carried GEMMs at once. (A pass without carriers, a recomputation under activation
checkpointing, takes the eager linears: tests/pipe/test_compile_engine.py's seq1f1b case.)"""
import contextlib

import pytest
import torch

from megatron_ds.model import GPTConfig, TransformerLayer, WeightGradStore
from megatron_ds.model.compile import compile_layers
from megatron_ds.model.weight_carriers import Carriers

B, S, H = 2, 32, 32
LINEARS_PER_LAYER = 4  # c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
ATOL = 1e-5


def two_layers():
    cfg = GPTConfig(vocab_size=64, hidden_size=H, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    ffn_hidden_size=48, max_position_embeddings=S, normalization="rmsnorm", swiglu=True,
                    position_embedding_type="rope", add_bias_linear=False, seed=5)
    return torch.nn.Sequential(TransformerLayer(cfg, 1), TransformerLayer(cfg, 2))


def batch(mb):
    g = torch.Generator().manual_seed(mb)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def fused_eager(x, g):
    layers = two_layers()
    x = x.clone().requires_grad_()
    layers(x).backward(g)
    return x.grad, {n: p.grad for n, p in layers.named_parameters()}


def is_linear_weight(name):
    return name.endswith("c_attn.weight") or name.endswith("c_proj.weight") or name.endswith("c_fc.weight")


def assert_close(got, ref, what):
    diff = (got - ref).abs().max().item()
    assert diff <= ATOL, f"{what}: max abs diff {diff:.3g}"


@pytest.fixture(scope="module")
def compiled():
    layers = two_layers()
    compile_layers(list(layers), defer_weight_grads=True)
    return layers, Carriers.of(list(layers))


@pytest.mark.parametrize("split", [True, False], ids=["b-then-w", "fused"])
def test_compiled_layers_carry_their_weight_gemms_out_of_the_graph(compiled, split):
    from torch._dynamo.utils import counters
    from torch.profiler import profile
    layers, carriers = compiled
    graphs = []
    for mb in range(3):
        x, g = batch(mb)
        ref_x_grad, ref = fused_eager(x, g)
        layers.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"])
        breaks = sum(counters["graph_break"].values())
        x = x.clone().requires_grad_()
        queue = []
        with profile() as prof:
            with carriers.forward((B, S)):
                y = layers(x)
            with WeightGradStore.deferring(queue) if split else contextlib.nullcontext():
                y.backward(g)
        names = [e.name for e in prof.events()]
        assert (names.count("CompiledFunction"), names.count("CompiledFunctionBackward")) == (2, 2)
        assert sum(counters["graph_break"].values()) == breaks  # not even the eager linears' breaks by design
        grads = {n: p.grad for n, p in layers.named_parameters()}
        if split:  # B: the input and norm gradients, no weight GEMM
            assert len(queue) == len(layers) * LINEARS_PER_LAYER
            assert all(grads[n] is None for n in grads if is_linear_weight(n))
            assert all(grads[n] is not None for n in grads if not is_linear_weight(n))
            WeightGradStore.drain(queue)
            grads = {n: p.grad for n, p in layers.named_parameters()}
        assert_close(x.grad, ref_x_grad, "input gradient")
        for name, ref_grad in ref.items():
            assert_close(grads[name], ref_grad, f"gradient of {name}")
    assert graphs[1] == graphs[2], graphs  # the third micro-batch compiled nothing

