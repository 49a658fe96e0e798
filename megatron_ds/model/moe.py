"""The mixture-of-experts MLP: a router, the routed expert MLPs, an optional shared expert.

Tokens (flattened to T x H) go to their top-k experts; each expert runs its tokens through its own
MLP (GELU or SwiGLU as the dense MLP, deferrable linears, so the B/W split defers the experts' weight
GEMMs too; with `grouped_gemm` the experts' GEMMs run grouped where the device has the kernel, grouped_linear.py),
the outputs come back weighted by the router's probabilities and summed per token; the
shared expert, if any, adds its output for every token.

The router's losses never reach the pipeline's loss: a micro-batch's loss lives on the last stage, the
router on its own. `RouterLosses` passes the layer's output through unchanged in the forward and, in
the backward, adds the losses' gradients to the router's scores (Megatron's MoEAuxLossAutoScaler), so
each token's share enters the gradient exactly once, in the backward of the op that routed it, under
every schedule. The gradient scale is the runtime's scale of a micro-batch's loss (`set_grad_scale`).
The same backward records the loss values for the log and the expert counts for the bias update: it
runs once per routed chunk, where a forward may run twice (activation checkpointing recomputes it).

Under Seq1F1B a micro-batch's sequence runs as segments, each routing its own tokens, while the balancing
losses weigh the score sums by the whole micro-batch's counts: the segments share one MicroBatchCounts, and
their backward passes, which all come after the micro-batch's last forward on this stage (the schedule's
dependencies), read it whole. The segment losses so add up to the unsplit micro-batch's exactly.
"""
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_ds.gpt_config import GPTConfig
from .compile import outside_graph
from .context_parallel import context_parallel_group
from .grouped_linear import grouped_linear, grouped_mm_fits
from .kv_cache import SegmentKVCache
from .linear import linear
from .moe_dispatch import expert_parallel_group, group_name, local_experts, run_experts_across
from .moe_router import Router, aux_loss_weights, loss_inputs
from .tensor_parallel import Dropout, tensor_parallel_group


class RouterLossLog:
    """The router losses of this process's backward passes since the last `take`, summed over layers and
    micro-batches: {"load_balancing_loss": float tensor, "z_loss": ...} and the experts' load per layer."""
    sums = {}
    loads = {}  # layer index -> tokens per expert (E,)

    @classmethod
    def add(cls, name, value):
        cls.sums[name] = cls.sums.get(name, 0.0) + value.detach()

    @classmethod
    def add_load(cls, layer_idx, routed):
        cls.loads[layer_idx] = cls.loads.get(layer_idx, 0.0) + routed

    @classmethod
    def take(cls):
        sums, loads = cls.sums, cls.loads
        cls.sums, cls.loads = {}, {}
        return sums, loads


class RouterLosses(torch.autograd.Function):
    """out -> out; backward also gives d(losses)/d(score sums) and d(losses)/d(z sum), scaled as the
    micro-batch's loss is."""
    grad_scale = 1.0

    @staticmethod
    def forward(ctx, out, score_sums, z_sum, layer, inputs, totals, offset):
        ctx.layer, ctx.inputs, ctx.totals, ctx.offset = layer, inputs, totals, offset
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        layer, inputs, totals, m = ctx.layer, ctx.inputs, ctx.totals, ctx.layer.config
        scale = RouterLosses.grad_scale
        grad_scores = grad_z = None
        if inputs.score_sums is not None:  # every segment of the micro-batch has run forward by now
            weights = aux_loss_weights(totals.counts(), totals.tokens(), inputs.sequences, m)
            grad_scores = weights * scale
            RouterLossLog.add("load_balancing_loss", (weights * inputs.score_sums.detach()).sum())
        if inputs.z_sum is not None:
            z_weight = m.z_loss_coeff / totals.tokens()
            grad_z = torch.full_like(inputs.z_sum, z_weight * scale)
            RouterLossLog.add("z_loss", inputs.z_sum.detach() * z_weight)
        if ctx.offset == 0:
            totals.release()
        RouterLossLog.add_load(layer.layer_idx, inputs.routed)
        if layer.router.tokens_per_expert is not None:
            layer.router.tokens_per_expert.add_(inputs.routed)
        return grad_out, grad_scores, grad_z, None, None, None, None


class MicroBatchCounts:
    """The load-balancing counts and tokens of a micro-batch's chunks, by the chunk's first position: one
    chunk, or a Seq1F1B micro-batch's segments (a recomputed segment puts the same values again)."""

    def __init__(self, inputs=None):
        self.parts = {}
        self.release = lambda: None  # called by the backward of the chunk at position 0: nothing runs after it
        if inputs is not None:
            self.put(0, inputs)

    def put(self, offset, inputs):
        self.parts[offset] = (inputs.counts, inputs.tokens)

    def counts(self):
        return sum(counts for counts, _ in self.parts.values())

    def tokens(self):
        return sum(tokens for _, tokens in self.parts.values())


def whole_sequence(inputs, group):
    """A sequence shard's loss inputs with the counts and the token count of the whole sequence (summed over
    the tensor-parallel ranks that hold its shards, or the context-parallel ones); the score sums stay the
    shard's: each rank's gradient is its tokens' share, and the router's gradient is summed over those ranks
    (sequence_parallel; under context parallelism the runtime scales it by CP before DeepSpeed's mean over
    DP x CP, pipe/moe/moe.router_grad_scale)."""
    counts = inputs.counts
    if counts is not None:
        counts = counts.clone()
        torch.distributed.all_reduce(counts, group=group)
    return dataclasses.replace(inputs, counts=counts, tokens=inputs.tokens * torch.distributed.get_world_size(group))


def set_grad_scale(scale: float):
    """The factor the runtime multiplies a micro-batch's loss by before its backward (1 / micro-batches)."""
    RouterLosses.grad_scale = scale


def mlp_activation(x, swiglu):
    """Between an MLP's two linears (the dense MLP's and each expert's): silu(gate) * up of SwiGLU's
    [gate; up], or GELU (tanh approximation)."""
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(x, approximate="tanh")


class ExpertMLP(nn.Module):
    """One expert: fc1 (SwiGLU: [gate; up]) and fc2, whole on every rank that holds the expert."""

    def __init__(self, hidden_size, ffn_hidden_size, swiglu, bias, init_method, output_init_method):
        super().__init__()
        self.swiglu = swiglu
        self.fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size if swiglu else ffn_hidden_size, bias=bias)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)
        with torch.no_grad():
            for layer, init in ((self.fc1, init_method), (self.fc2, output_init_method)):
                init(layer.weight)
                if bias:
                    layer.bias.zero_()

    def forward(self, x):
        return linear(mlp_activation(linear(x, self.fc1.weight, self.fc1.bias), self.swiglu), self.fc2.weight,
                      self.fc2.bias)


def expert_loop(experts, rows, counts):
    """Each expert on its rows in turn (rows sorted by expert, counts[i] of them for experts[i]): the exact path."""
    return torch.cat([expert(r) for expert, r in zip(experts, rows.split(counts))])


def grouped_experts(experts, rows, counts):
    """expert_loop's result by grouped GEMMs (grouped_linear.py); by expert_loop itself where the kernel cannot
    run these shapes (grouped_mm_fits) or no rows came."""
    fc1, fc2 = [e.fc1 for e in experts], [e.fc2 for e in experts]
    if not (rows.shape[0] and all(grouped_mm_fits(rows.device, rows.dtype, [lin.weight for lin in fc])
                                  for fc in (fc1, fc2))):
        return expert_loop(experts, rows, counts)
    hidden = grouped_linear(rows, counts, [lin.weight for lin in fc1], _biases(fc1))
    return grouped_linear(mlp_activation(hidden, experts[0].swiglu), counts, [lin.weight for lin in fc2], _biases(fc2))


def _biases(linears):
    return None if linears[0].bias is None else [lin.bias for lin in linears]


# eager between a compiled layer's graphs: the counts are data (a graph would be specialised on them), and the
# kernel's traced (fake tensor) form takes bf16 only
@outside_graph
def _grouped_experts_eager(experts, rows, counts):
    return grouped_experts(experts, rows, counts.tolist())


def expert_of(key: str, prefix: str = ""):
    """The global index of the expert a state-dict key under `prefix` (a MoE layer's) names; None for another key."""
    head = prefix + "experts."
    return int(key[len(head):].split(".", 1)[0]) if key.startswith(head) else None


def expert_parallel_size(module) -> int:
    """The EP size of a module's MoE layers (1 without any)."""
    return max((m.config.expert_model_parallel_size for m in module.modules() if isinstance(m, MoE)), default=1)


class MoE(nn.Module):
    """Router + experts (+ shared expert) in place of a transformer layer's MLP. `layer_idx` is the
    global pipeline index (it names the layer in the load log)."""

    def __init__(self, config: GPTConfig, init_method, output_init_method, layer_idx: int, shared_expert=None):
        super().__init__()
        m = self.config = config.moe
        self.layer_idx = layer_idx
        self.router = Router(config.hidden_size, m, init_method)
        self.ep_group = expert_parallel_group(m)
        self.local_experts = local_experts(m, self.ep_group)
        experts = {}
        for i in range(m.num_experts):  # every expert drawn in order, so the weights do not depend on the split
            expert = ExpertMLP(config.hidden_size, m.ffn_hidden_size, config.swiglu, config.add_bias_linear,
                               init_method, output_init_method)
            if i in self.local_experts:
                experts[str(i)] = expert
        self.experts = nn.ModuleDict(experts)
        self.shared_expert = shared_expert
        self._segments = {}  # Seq1F1B: micro-batch key -> MicroBatchCounts of its segments run forward
        self.drop = Dropout(config.hidden_dropout, partitioned=config.sequence_parallel)
        self.shard_group = tensor_parallel_group(config) if config.sequence_parallel else None
        self.context_group = context_parallel_group(config)  # the ranks holding the sequence's other chunks
        for p in [*self.router.parameters(), *self.experts.parameters()]:
            p.sequence_parallel = config.sequence_parallel  # a sequence shard's tokens: summed over the TP group
        if self.ep_group is not None:  # DeepSpeed's marks of an expert parameter: reduced over its EDP group
            for p in self.experts.parameters():
                p.allreduce, p.group_name = False, group_name(m.expert_model_parallel_size)
            # a layer's state dict as saved holds every expert (pipe/moe/moe_checkpoint.py): this rank keeps its own
            self.register_load_state_dict_pre_hook(self._other_experts_dropped)

    def forward(self, x):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        logits, probs, experts, kept = self.router(x2d)
        out = self.drop(self._experts(x2d, probs, experts, kept).view(shape))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.training:  # a checkpointed layer's first forward too (no autograd): its segment's counts count
            inputs = loss_inputs(logits, experts, kept, self.config, batch=shape[0])
            if self.shard_group is not None:  # sequence parallelism: the balancing counts are the whole sequence's
                inputs = whole_sequence(inputs, self.shard_group)
            if self.context_group is not None:  # context parallelism: so are they, over the CP ranks' chunks
                inputs = whole_sequence(inputs, self.context_group)
            totals, offset = self._micro_batch(inputs)
            if torch.is_grad_enabled():
                out = RouterLosses.apply(out, inputs.score_sums, inputs.z_sum, self, inputs, totals, offset)
        return out

    def _micro_batch(self, inputs):
        """(The MicroBatchCounts this chunk of tokens belongs to, the chunk's first position): its own, or
        under Seq1F1B the one its micro-batch's segments share (made by its first forward, dropped by its
        last backward: segment 0's)."""
        segment = SegmentKVCache.current()
        if segment is None:
            return MicroBatchCounts(inputs), 0
        if segment.offset == 0 and not segment.backward:
            self._segments[segment.key] = MicroBatchCounts()
        totals = self._segments[segment.key]
        totals.put(segment.offset, inputs)
        totals.release = lambda: self._segments.pop(segment.key, None)
        return totals, segment.offset

    def _other_experts_dropped(self, module, state, prefix, *rest):
        for key in [k for k in state if expert_of(k, prefix) is not None]:
            if expert_of(key, prefix) not in self.local_experts:
                del state[key]

    def _experts(self, x2d, probs, experts, kept):
        """Each kept (token, expert) assignment through its expert, weighted, summed per token."""
        k = experts.shape[1]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        order = order[kept.flatten()[order]]  # dropped assignments (over capacity) go nowhere
        counts = torch.bincount(flat[order], minlength=self.config.num_experts)
        tokens = order // k
        if self.ep_group is None:
            outputs = self._run_local(counts, x2d[tokens])
        else:
            outputs = run_experts_across(x2d[tokens], counts, self._run_local, self.local_experts, self.ep_group)
        weighted = outputs * probs.flatten()[order].unsqueeze(-1).to(x2d.dtype)
        return torch.zeros_like(x2d).index_add(0, tokens, weighted)

    def _run_local(self, counts, rows):
        """This rank's experts on their rows (sorted by expert, counts[i] for its i-th: a tensor). Every expert
        runs, on no rows too: its gradient is then zeros, never None (the data-parallel reduction of ZeRO expects
        the same gradients on every rank, whatever each rank routed)."""
        experts = [self.experts[str(i)] for i in self.local_experts]
        if self.config.grouped_gemm:
            return _grouped_experts_eager(experts, rows, counts)
        return expert_loop(experts, rows, counts.tolist())
