"""The linear layers of a MoE layer's experts as grouped GEMMs, the weight GEMM deferrable as linear.py's.

Expert i multiplies its rows x_i by its own weight W_i. The loop (moe.py) runs one small GEMM per expert, which
on a GPU is one launch per expert, each too small to fill the device when the experts are many. torch's grouped
matmul (torch._grouped_mm) runs them all as one kernel over the rows sorted by expert, cut at cumulative
offsets: the forward x_i W_i^T, the input gradient g_i W_i and the weight gradient g_i^T x_i (the groups ragged
along the shared dimension). On CPU in fp32 each of the three is the loop's GEMM bit for bit
(tests/model/test_grouped_linear.py). With biases the forward adds them after the GEMM, where the loop's
addmm adds them inside it: equal to about one rounding.

The experts keep their own nn.Linear parameters, so names, checkpoints, expert parallelism, ZeRO and the
Hugging Face mapping do not change, and each call stacks the local weights into one (E, out, in) tensor: in the
forward, and again in the backward rather than keeping the stack for it (which would hold a copy of the experts'
weights per micro-batch in flight). Each stack reads and writes every local expert weight: on an H200 in bf16 the
four stacks of a forward and backward took 2.9 ms of a Mixtral layer's 18 ms of grouped experts at 4096 tokens
(docs/perf/moe_cpu.md). Stored 3-D weights are the later GPU step. The weight gradients still land in each
expert's own .grad.

Whether the kernel runs is decided once per device, dtype and shape (`grouped_mm_fits`), never at run time:
the caller runs the loop instead, with the same result.
"""
import itertools

import torch

from .linear import WeightGradStore, accumulate_grad, bias_grad


def grouped_linear(x, counts, weights, biases=None):
    """F.linear of each group of rows with its own weight: x (T, in) sorted by group, counts[i] rows of group i
    (a list of ints), weights[i] (out, in) and biases[i] (out,). The weight gradients are deferrable: inside a
    B op (linear.WeightGradStore) the one grouped weight GEMM is queued for the W op."""
    params = (*weights, *(biases or ()))
    return _GroupedLinear.apply(x, list(counts), biases is not None, *params)


class _GroupedLinear(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, counts, has_bias, *params):
        weights, x = params[:len(counts)], _dense(x)
        ctx.counts, ctx.has_bias = counts, has_bias
        ctx.save_for_backward(x, *weights)
        offsets = _offsets(counts, x.device)
        # the (E, out, in) stack seen as (E, in, out): each group's operand is the loop's weight.t(), same layout
        out = torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)
        if has_bias:
            rows = torch.tensor(counts, device=x.device)
            out = out + torch.stack(params[len(counts):]).repeat_interleave(rows, dim=0, output_size=x.shape[0])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        counts, groups = ctx.counts, len(ctx.counts)
        grad_out, offsets = _dense(grad_out), _offsets(counts, x.device)
        needs_weight = ctx.needs_input_grad[3:3 + groups]
        grad_x = torch._grouped_mm(grad_out, torch.stack(weights), offs=offsets) if ctx.needs_input_grad[0] else None
        # each group's own sum, in the loop's order (a scatter-add's would not be)
        grad_biases = [bias_grad(g) if needed else None
                       for g, needed in zip(grad_out.split(counts), ctx.needs_input_grad[3 + groups:])]
        grad_weights = [None] * groups
        if any(needs_weight):
            grad_weights = _weight_grads(weights, needs_weight, grad_out, x, counts, offsets)
        return grad_x, None, None, *grad_weights, *grad_biases


def _weight_grads(weights, needed, grad_out, x, counts, offsets):
    """Each group's g_i^T x_i as one grouped GEMM: returned now, or queued for the W op inside a B op (then None
    each). A deferred one adds to .grad as autograd adds the returned one: a split backward is bit-identical."""
    def compute():
        with torch.no_grad():  # a W op may run with autograd on
            grads = torch._grouped_mm(grad_out.t(), x, offs=offsets)
            empty = [i for i, n in enumerate(counts) if n == 0]
            if empty:  # a group without rows: zeros, as the loop's GEMM over no rows, whatever the kernel leaves there
                grads[empty] = 0
        # one view each (not unbind's, which refuse the in-place additions of later micro-batches)
        return [grads[i] for i in range(len(counts))]
    queue = WeightGradStore._queue
    if queue is None:
        return [g if n else None for g, n in zip(compute(), needed)]

    def deferred():
        for weight, grad, n in zip(weights, compute(), needed):
            if n:
                accumulate_grad(weight, grad)
    queue.append(deferred)
    return [None] * len(weights)


def _offsets(counts, device):
    """The groups' cumulative ends, as the kernel takes them."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)


def _dense(t):
    """t, if row-major and 16-byte aligned (what the kernel reads), else a fresh copy of it."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


_FITS = {}  # (device, dtype, groups, out, in) -> whether the grouped kernel runs these GEMMs


def grouped_mm_fits(device, dtype, weights) -> bool:
    """Whether grouped_linear can run rows of `dtype` on `device` against these weights, decided once per shape.
    On CUDA, bf16 on compute capability 9.0 and newer: elsewhere torch's _grouped_mm falls back to a loop of
    GEMMs after a host synchronisation, no better than ours. On CPU (torch's loop in C++) wherever it runs:
    there it is a check of the path, not a speed-up. Then the kernel must run the three GEMMs on a few rows,
    an empty group among them: torch refuses strides that are not multiples of 16 bytes (fp32 rows of 2 values,
    say), dtypes it has no kernel for and devices without one."""
    device = torch.device(device)
    key = (device, dtype, len(weights), *weights[0].shape)
    if key not in _FITS:
        same = all(w.dtype == dtype and w.device == device and w.shape == weights[0].shape for w in weights)
        _FITS[key] = same and _device_has_kernel(device, dtype) and _runs(*key)
    return _FITS[key]


def _device_has_kernel(device, dtype):
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def _runs(device, dtype, groups, out_features, in_features):
    """The three grouped GEMMs on ones, one row per group but the first (none), against the loop's values."""
    counts = [0] + [1] * (groups - 1) if groups > 1 else [1]
    rows = sum(counts)
    x = torch.ones(rows, in_features, dtype=dtype, device=device)
    weights = torch.ones(groups, out_features, in_features, dtype=dtype, device=device)
    grad = torch.ones(rows, out_features, dtype=dtype, device=device)
    offsets = _offsets(counts, device)
    try:
        with torch.no_grad():
            outputs = (torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets),
                       torch._grouped_mm(grad, weights, offs=offsets),
                       torch._grouped_mm(grad.t(), x, offs=offsets)[1:])
    except (RuntimeError, NotImplementedError):
        return False
    expected = (x @ weights[0].t(), grad @ weights[0], (grad[:1].t() @ x[:1]).expand(groups - 1, -1, -1))
    return all(o.shape == e.shape and torch.equal(o, e) for o, e in zip(outputs, expected))
