"""Regional torch.compile: each transformer layer its own compiled region (torchtitan's apply_compile),
and the loss another (compile_loss).

Every TransformerLayer, and the final norm, is compiled in place (`nn.Module.compile`: parameter
names, state dicts and checkpoints unchanged) with static shapes; layers share one compiled graph per input shape, as their
code and parameter shapes are the same. The runtime's hooks cannot live inside a graph, so a few calls
stay eager (`outside_graph`), each a graph break by design:

- the deferrable linear layers of a run that splits backward into B and W (`defer_weight_grads`), in a
  pass the runtime did not give carriers (weight_carriers.py): a recomputation under activation
  checkpointing. In a forward op the carriers take each linear's weight GEMM out of the graph's
  backward for the W op, so the layer is one graph forward and one in B; without a split the linears
  are plain F.linear in the graph;
- the tensor-parallel linears (their collectives);
- a Seq1F1B layer whose K/V buffers the open segment did not lay out (a micro-batch of another shape
  than the chunk's first).

A Seq1F1B segment's pass through the K/V cache is in the graph: the runtime prepares the buffers when it
opens the segment, and the layer writes and reads them with tensor operations (kv_cache.py). The
segment's offset is a constant of the graph (its rotary positions): a layer compiles once per segment.
A chunk's first segment runs eagerly (the cache learns its layers' shapes there), so no graph is ever
compiled around the eager lay-out.

Everything else of a layer (norms, the projections' pointwise work, RoPE, SwiGLU/GELU, residuals and
attention) is one graph. Dropout under tensor parallelism draws from the RNG tracker,
which dynamo cannot follow: it breaks the graph there by itself (reported once in the log).
"""
import functools

import torch

# A layer compiles once per input shape: a Seq1F1B run has k segment lengths (and k K/V lengths),
# evaluation and a last partial batch add theirs. Above this many, dynamo would fall back to eager.
RECOMPILE_LIMIT = 64


_OUTSIDE = []  # [(fn, its cell)]: the disabled twins are made when layers are compiled (dynamo's import
# takes seconds, which every eager process, test ranks and tools included, would pay at import)


def outside_graph(fn):
    """`fn` unchanged in eager mode; under torch.compile a call dynamo leaves out of the graph (it runs
    eagerly between two compiled pieces). Eager code pays nothing for it."""
    disabled = []  # [torch.compiler.disable(fn)], filled by compile_layers

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)
    _OUTSIDE.append((fn, disabled))
    return call


def _disable_outside_calls():
    for fn, disabled in _OUTSIDE:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))


class CompileMode:
    """What the compiled layers must leave outside their graphs (read while dynamo traces: a change
    makes it trace again)."""
    linears_outside = False  # deferred weight gradients: a linear without carriers must stay eager
    layers_compiled = False  # compile_layers ran in this process


def compile_layers(modules, defer_weight_grads: bool, backend: str = "inductor", cuda_graphs: bool = False):
    """Compile every module of `modules` (the transformer layers) in place; returns how many. `cuda_graphs`:
    inductor replays each compiled graph as a CUDA graph (mode "reduce-overhead": one launch for a
    graph's kernels, its inputs copied into static buffers); on CPU it changes nothing."""
    CompileMode.linears_outside, CompileMode.layers_compiled = defer_weight_grads, True
    _disable_outside_calls()
    limits = torch._dynamo.config
    limits.recompile_limit = max(limits.recompile_limit, RECOMPILE_LIMIT)
    limits.accumulated_recompile_limit = max(limits.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    count = 0
    for module in modules:
        module.compile(backend=backend, dynamic=False, mode="reduce-overhead" if cuda_graphs else None)
        count += 1
        for inner in module.modules() if defer_weight_grads else ():
            if getattr(inner, "w_slot", None) is not None:
                inner.w_slot.in_graph = True  # the runtime gives it carriers (weight_carriers.py)
    return count


def compile_loss(loss_fn, backend: str = "inductor"):
    """`loss_fn` (the plain cross-entropy, layers.gpt_loss, or the arithmetic of a chunked one,
    chunked_loss.ChunkMath) compiled as a region of its own. Eager, the plain loss passes over a (tokens x vocabulary) tensor about ten times a micro-batch, most in fp32 (the
    upcast, log-softmax, the one-hot gradient nll_loss's backward writes, log-softmax's backward, the
    cast back), and holds the fp32 log-probabilities from forward to backward. Inductor fuses these
    into reductions over the logits as they came and one kernel writing their gradient, and keeps the
    logits themselves (half the bytes in bf16). Never a CUDA graph: its inputs would be copied into
    static buffers, and the logits are the largest tensor of a step."""
    return torch.compile(loss_fn, backend=backend, dynamic=False)


def compile_seconds():
    """Seconds dynamo and inductor have spent so far in this process (forward graphs when traced,
    backward graphs when first run)."""
    times = torch._dynamo.utils.compilation_time_metrics
    return sum(sum(times.get(key, ())) for key in ("_compile.compile_inner", "backward._backward_impl"))


_BY_DESIGN = "torch.compiler.disable"  # the calls outside_graph leaves out


def unplanned_graph_breaks():
    """{reason's first line: count} of the graph breaks dynamo took so far that are not by design."""
    breaks = torch._dynamo.utils.counters["graph_break"]
    return {reason.splitlines()[0]: n for reason, n in breaks.items() if _BY_DESIGN not in reason}


def compile_summary(first_iteration=None, later_iteration=None):
    """One log line (None when nothing compiled): the first iteration's wall time `first_iteration` (s)
    against `later_iteration` (s, the mean of the iterations after it; None: none yet), and the seconds
    dynamo and inductor compiled in this process; then the graph breaks not by design. The compile time
    alone understates what compiling costs a run: the first iteration waits for every rank's compiles."""
    seconds = compile_seconds()
    if not seconds:
        return None
    line = "> compiled regions (torch.compile, per layer and the loss): "
    if first_iteration:
        line += f"the first iteration took {first_iteration:.1f} s"
        line += f" against {later_iteration:.2f} s for the ones after it" if later_iteration else ""
        line += f", {seconds:.1f} s ({seconds / first_iteration:.0%}) of it compiling in this process"
    else:
        line += f"{seconds:.1f} s compiling in this process"
    unplanned = unplanned_graph_breaks()
    if unplanned:
        line += "; graph breaks not removed: " + "; ".join(f"{r} (x{n})" for r, n in sorted(unplanned.items()))
    return line
