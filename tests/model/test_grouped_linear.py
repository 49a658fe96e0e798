"""Grouped expert GEMMs (model/grouped_linear.py, --moe-grouped-gemm) against the per-expert loop, fp32 on CPU:
outputs, input, weight and bias gradients bit for bit (a bias to about one rounding: the loop adds it inside its
GEMM), empty experts included, with the weight GEMM deferred to the W op as the dense linears defer theirs; a
whole MoE layer, eager and compiled; shapes and dtypes the kernel refuses run the loop. On a CUDA GPU of compute
capability 9.0 or newer, the bf16 kernel against the loop."""
import pytest
import torch
import torch.nn.functional as F

from megatron_ds.gpt_config import GPTConfig
from megatron_ds.model import grouped_linear as grouped
from megatron_ds.model.compile import CompileMode, compile_layers
from megatron_ds.model.linear import WeightGradStore
from megatron_ds.model.moe import ExpertMLP, MoE, RouterLossLog, expert_loop, grouped_experts
from megatron_ds.moe_config import MoEConfig

COUNTS = [3, 0, 7, 1, 0]  # two experts without rows
IN, OUT = 16, 24


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times torch._grouped_mm ran since (the fits probe's calls included)."""
    calls, original = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def params(bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(OUT, IN, generator=g).requires_grad_() for _ in COUNTS]
    biases = [torch.randn(OUT, generator=g).requires_grad_() for _ in COUNTS] if bias else None
    return weights, biases


def loop_linear(x, weights, biases):
    biases = biases or [None] * len(weights)
    return torch.cat([F.linear(r, w, b) for r, w, b in zip(x.split(COUNTS), weights, biases)])


def grads_of(out, grad, tensors):
    out.backward(grad)
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_equals_the_loop(bias):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), IN, generator=g)
    grad = torch.randn(sum(COUNTS), OUT, generator=g)
    results = []
    for fn in (loop_linear, grouped.grouped_linear):
        weights, biases = params(bias)
        xi = x.clone().requires_grad_()
        out = fn(xi, weights, biases) if fn is loop_linear else fn(xi, COUNTS, weights, biases)
        results.append((out.detach(), grads_of(out, grad, [xi, *weights, *(biases or [])])))
    (loop_out, loop_grads), (grouped_out, grouped_grads) = results
    if bias:  # the loop's addmm adds the bias inside the GEMM: about one rounding apart
        torch.testing.assert_close(grouped_out, loop_out, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(grouped_out, loop_out)
    for i, (ours, theirs) in enumerate(zip(grouped_grads, loop_grads)):
        assert torch.equal(ours, theirs), i  # input, every weight's and every bias's gradient, bit for bit
    assert torch.equal(grouped_grads[2], torch.zeros(OUT, IN)), "an expert without rows: zeros, never None"


def test_the_weight_gemm_deferred_to_w_equals_it_at_once():
    """Inside a B op (WeightGradStore) the backward gives the input and bias gradients and queues one grouped
    weight GEMM; the W op's drain then adds to .grad as autograd would: three micro-batches, the last two split
    into B and W, give the gradients of three plain backward passes bit for bit, and .grad takes in-place
    updates after (an optimizer's unscaling, ZeRO's averaging)."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(sum(COUNTS), IN, generator=g) for _ in range(3)]
    grads = [torch.randn(sum(COUNTS), OUT, generator=g) for _ in range(3)]
    at_once, biases_at_once = params(bias=True)
    for x, grad in zip(xs, grads):
        grouped.grouped_linear(x, COUNTS, at_once, biases_at_once).backward(grad)
    for plain_first in (False, True):  # the first micro-batch's W fills .grad, or adds to a plain backward's
        split, biases = params(bias=True)
        if plain_first:
            grouped.grouped_linear(xs[0], COUNTS, split, biases).backward(grads[0])
        for x, grad in zip(xs[1:] if plain_first else xs, grads[1:] if plain_first else grads):
            before = [None if w.grad is None else w.grad.clone() for w in split]
            x = x.clone().requires_grad_()
            queue = []
            with WeightGradStore.deferring(queue):
                grouped.grouped_linear(x, COUNTS, split, biases).backward(grad)
            assert len(queue) == 1 and x.grad is not None
            assert all(w.grad is None if b is None else torch.equal(w.grad, b) for w, b in zip(split, before)), \
                "B computed a weight GEMM"
            WeightGradStore.drain(queue)
        for w, b, a, ab in zip(split, biases, at_once, biases_at_once):
            assert torch.equal(w.grad, a.grad) and torch.equal(b.grad, ab.grad)
            assert not w.grad.requires_grad, "the W op's GEMM was recorded by autograd"
            w.grad.mul_(0.5)


@pytest.mark.parametrize("swiglu, bias", [(False, True), (True, False)])
def test_grouped_experts_equal_the_loop(swiglu, bias, kernel_calls):
    """GELU and SwiGLU experts (ExpertMLP): the rows' and every parameter's gradient."""
    init = lambda w: w.normal_(0.0, 0.3)
    results = []
    for fn in (expert_loop, grouped_experts):
        torch.manual_seed(3)
        experts = [ExpertMLP(IN, 8, swiglu, bias, init, init) for _ in COUNTS]
        rows = torch.randn(sum(COUNTS), IN, generator=torch.Generator().manual_seed(4), requires_grad=True)
        out = fn(experts, rows, COUNTS)
        tensors = [rows, *(p for e in experts for p in e.parameters())]
        results.append((out.detach(), grads_of(out, torch.ones_like(out), tensors)))
    assert kernel_calls, "the grouped kernel never ran"
    (loop_out, loop_grads), (grouped_out, grouped_grads) = results
    tolerance = dict(rtol=1e-6, atol=1e-6) if bias else dict(rtol=0, atol=0)
    torch.testing.assert_close(grouped_out, loop_out, **tolerance)
    for i, (ours, theirs) in enumerate(zip(grouped_grads, loop_grads)):
        torch.testing.assert_close(ours, theirs, **tolerance, msg=lambda m: f"tensor {i}: {m}")


def moe_layer(hidden=16, dtype=torch.float32, **moe):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, hidden_size=hidden, num_layers=2, num_attention_heads=1,
                       max_position_embeddings=16, swiglu=True, normalization="rmsnorm",
                       position_embedding_type="rope", add_bias_linear=False, ffn_hidden_size=24,
                       moe=MoEConfig(num_experts=8, **moe))
    init = lambda w: w.normal_(0.0, 0.3)
    return MoE(config, init, init, layer_idx=1).to(dtype)


def layer_grads(layer, x, deferred=False):
    """(output, the input's and every parameter's gradient); `deferred`: the backward as a B op and a W op."""
    x = x.clone().requires_grad_()
    out = layer(x)
    queue = []
    with WeightGradStore.deferring(queue) if deferred else torch.enable_grad():
        out.backward(torch.ones_like(out))
    WeightGradStore.drain(queue)
    RouterLossLog.take()  # emptied as the runtime empties it after a step (the next test's layer may differ)
    return out.detach(), [x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("deferred", [False, True])
def test_a_moe_layer_with_grouped_gemms_equals_the_loop(deferred, kernel_calls):
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(5))
    loop = layer_grads(moe_layer(), x, deferred)
    assert not kernel_calls
    ours = layer_grads(moe_layer(grouped_gemm=True), x, deferred)
    assert kernel_calls
    assert torch.equal(ours[0], loop[0])
    for i, (a, b) in enumerate(zip(ours[1], loop[1])):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("hidden, dtype", [(6, torch.float32), (16, torch.float64)])
def test_a_shape_or_dtype_the_kernel_refuses_runs_the_loop(hidden, dtype, monkeypatch):
    """fp32 rows of 6 values (24 bytes, not a multiple of 16) and fp64 (no kernel): the loop, never an error."""
    layer = moe_layer(hidden=hidden, dtype=dtype, grouped_gemm=True)
    weights = [layer.experts[str(i)].fc1.weight for i in range(8)]
    assert not grouped.grouped_mm_fits("cpu", dtype, weights)
    x = torch.randn(2, 5, hidden, dtype=dtype, generator=torch.Generator().manual_seed(6))
    loop = layer_grads(moe_layer(hidden=hidden, dtype=dtype), x)
    monkeypatch.setattr(torch, "_grouped_mm", None)  # the probe's verdict is kept: the kernel is never called again
    ours = layer_grads(layer, x)
    assert torch.equal(ours[0], loop[0]) and all(torch.equal(a, b) for a, b in zip(ours[1], loop[1]))


def test_a_compiled_moe_layer_keeps_the_grouped_gemms_out_of_its_graphs(monkeypatch, kernel_calls):
    """compile_layers (aot_eager: dynamo's tracing, no code generation): the grouped experts run eagerly between
    the layer's graphs, with the eager layer's values and the weight GEMM deferred in a B op."""
    monkeypatch.setattr(CompileMode, "linears_outside", False)  # restored after: compile_layers sets them
    monkeypatch.setattr(CompileMode, "layers_compiled", False)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 6, 16, generator=g) for _ in range(2)]
    eager = layer_grads(moe_layer(), xs[1], deferred=True)
    layer = moe_layer(grouped_gemm=True)
    compile_layers([layer], defer_weight_grads=True, backend="aot_eager")
    for x in xs:  # the second routes otherwise: the same graphs
        for p in layer.parameters():
            p.grad = None
        ours = layer_grads(layer, x, deferred=True)
    assert kernel_calls
    torch.testing.assert_close(ours[0], eager[0], rtol=1e-6, atol=1e-7)
    for a, b in zip(ours[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_the_gpu_fits_where_the_kernel_is_and_is_close_to_the_loop(kernel_calls):
    """On compute capability 9.0+ the bf16 kernel runs (one rounding of bf16 apart from the loop's GEMMs); before
    it, and in fp32 everywhere on CUDA, the loop runs."""
    layer = moe_layer(hidden=64, dtype=torch.bfloat16, grouped_gemm=True).cuda()
    weights = [layer.experts[str(i)].fc1.weight for i in range(8)]
    device, hopper = weights[0].device, torch.cuda.get_device_capability() >= (9, 0)
    assert grouped.grouped_mm_fits(device, torch.bfloat16, weights) == hopper
    assert not grouped.grouped_mm_fits(device, torch.float32, [w.float() for w in weights])
    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(8)).to(device, torch.bfloat16)
    loop = layer_grads(moe_layer(hidden=64, dtype=torch.bfloat16).cuda(), x)
    ours = layer_grads(layer, x)
    assert bool(kernel_calls) == hopper
    for i, (a, b) in enumerate(zip([ours[0], *ours[1]], [loop[0], *loop[1]])):
        assert relative_error(a, b) < 1e-2, (i, relative_error(a, b))  # bf16: GEMMs summing in another order
    if hopper:  # experts without rows (the kernel leaves their weight gradient as it finds it on some GPUs)
        weights, biases = [[t.detach().to(device, torch.bfloat16).requires_grad_() for t in ts]
                           for ts in params(bias=True)]
        x = torch.randn(sum(COUNTS), IN, device=device, dtype=torch.bfloat16, requires_grad=True)
        out = grouped.grouped_linear(x, COUNTS, weights, biases)
        grads = grads_of(out, torch.ones_like(out), [x, *weights, *biases])
        loop_out = loop_linear(x.detach(), [w.detach() for w in weights], None)
        assert relative_error(out - torch.cat([b.expand(n, -1) for b, n in zip(biases, COUNTS)]), loop_out) < 1e-2
        assert all(torch.equal(grads[1 + i], torch.zeros_like(weights[i])) for i, n in enumerate(COUNTS) if n == 0)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
