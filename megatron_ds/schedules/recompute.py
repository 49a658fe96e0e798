"""Activation recompute as the simulator sees it: what a transformer layer keeps for backward under each of
Megatron's recompute settings, and what recomputing costs (pure data, no torch).

Settings (Megatron's flags, GPTConfig's fields): none; "selective" (the attention core attended again in
backward, model/recompute.py); "full" with method "uniform" (the layers of each virtual stage in groups of N,
each group recomputed from its input) or "block" (the first N layers of each virtual stage recomputed one by
one, the others kept). `checkpoint_groups` is the one rule for which layers a chunk checkpoints; the pipeline
module runs it (pipe/plan/recompute.py).

`layer_memory` counts, in bytes per micro-batch, what our layer's autograd keeps (model/layers.py as torch runs
it; tests/model/test_recompute.py checks it against autograd's saved tensors): the norms' inputs and statistics,
the linears' inputs, the activation function's, the dropout masks, and the attention core's own. The core is
the one part that depends on the kernel. Fused (flash or memory-efficient, every attention on CUDA, and on CPU
attention without dropout or ALiBi) it keeps q, k, v, its output (the output projection's input too) and the
softmax statistics (4 bytes per query and head); unfused (torch's math path: attention dropout or ALiBi on CPU)
copies of q, k, v and (s x s) per head: the probabilities, and with dropout its mask and the dropped
probabilities. Selective recompute frees the core's own tensors and keeps its inputs q, k, v instead, which the
unfused core had copied: its saving is large on the unfused path (the s x s part) and the statistics alone on
the fused one, where Korthikanti et al.'s 5as/h term is already gone.

`for_w` is what a split backward's B leaves for W: every linear's input and output gradient. A whole-layer
recomputation rebuilds the linears' inputs in B, so under a B/W split "full" keeps them to W like "none".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from .costs import ModelCosts, stage_layers
from .ir import Op, Schedule
from .kinds import Kind
from .simulate import SimResult, _token_shares as token_shares, simulate

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
STATS = 4  # bytes of a norm's or the softmax's statistic per row: fp32


@dataclass(frozen=True)
class Recompute:
    """Megatron's recompute settings; granularity None: nothing recomputed."""
    granularity: str | None = None
    method: str | None = None  # "full": "uniform" (default) or "block"
    num_layers: int | None = None  # "full": N (default 1)

    @classmethod
    def of(cls, config) -> "Recompute":
        """The settings of a GPTConfig (or anything with its recompute_* fields)."""
        return cls(getattr(config, "recompute_granularity", None), getattr(config, "recompute_method", None),
                   getattr(config, "recompute_num_layers", None))

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    @property
    def n(self) -> int:
        return self.num_layers or 1

    @property
    def label(self) -> str:
        if not self.granularity:
            return "none"
        return f"full {self.method or 'uniform'} {self.n}" if self.full else self.granularity

    def problem(self) -> str | None:
        """What is wrong with the combination (Megatron's rules), else None."""
        if self.granularity not in (None, *GRANULARITIES):
            return f"recompute granularity {self.granularity!r}: one of {', '.join(GRANULARITIES)}"
        if self.method not in (None, *METHODS):
            return f"recompute method {self.method!r}: one of {', '.join(METHODS)}"
        if not self.full and (self.method or self.num_layers is not None):
            return ("--recompute-method and --recompute-num-layers choose the layers a full recompute checkpoints: "
                    "they need --recompute-granularity full")
        if self.num_layers is not None and self.num_layers < 1:
            return f"--recompute-num-layers must be positive, got {self.num_layers}"
        return None


def checkpoint_groups(recompute: Recompute, layers: list[bool]) -> list[tuple[int, int, bool]]:
    """A chunk's pipeline layers (True: a transformer layer) as consecutive (start, stop, checkpointed) runs.
    Only transformer layers are checkpointed (the embedding, final norm and head run as they are), counted from
    the chunk's first: uniform puts them in groups of N, each recomputed as one; block recomputes the first N
    one by one and keeps the rest."""
    groups, count, i = [], 0, 0
    while i < len(layers):
        if not layers[i] or not recompute.full or (recompute.method == "block" and count >= recompute.n):
            groups.append((i, i + 1, False))
            i += 1
            continue
        size = 1 if recompute.method == "block" else recompute.n
        stop = i
        while stop < len(layers) and stop - i < size and layers[stop]:
            stop += 1
        groups.append((i, stop, True))
        count += stop - i
        i = stop
    return _merged(groups)


def _merged(groups):
    """Consecutive runs that are not checkpointed as one (they run as one stretch of layers)."""
    out = []
    for start, stop, checkpointed in groups:
        if out and not checkpointed and not out[-1][2]:
            out[-1] = (out[-1][0], stop, False)
        else:
            out.append((start, stop, checkpointed))
    return out


class ChunkMemory(NamedTuple):
    """Bytes a chunk's layers keep per micro-batch from F to B, from B to W (a split backward), and how far a B
    and a BW rise above the level they start from while they recompute."""
    kept: float
    for_w: float
    rise_b: float
    rise_bw: float


@dataclass(frozen=True)
class LayerMemory:
    """Bytes one transformer layer keeps per micro-batch (see the module's docstring)."""
    kept: float  # from its forward to its backward, nothing recomputed
    core: float  # of which the attention core's own tensors (selective frees them)
    core_inputs: float  # what q, k, v hold that the core did not keep itself (selective keeps them)
    input: float  # the layer's input (a recomputed group keeps its first layer's)
    for_w: float  # what B leaves for W under a split backward
    after_core: float = 0.0  # what it keeps of the part after the core, freed before backward reaches the core
    after_core_w: float = 0.0  # of which a split B keeps for W

    @property
    def selective_saving(self) -> float:
        return self.core - self.core_inputs

    def stage(self, recompute: Recompute, layers: int) -> ChunkMemory:
        """The ChunkMemory of a chunk of `layers` transformer layers. Backward takes the groups last first: when
        a group is recomputed, the groups after it hold only what W needs (a split B) or nothing (BW), the
        groups before it what F kept."""
        if recompute.selective:  # the chunk's last layer recomputes its core first, its part after the core gone
            rise_bw = max(0.0, self.core - self.after_core)
            rise_b = max(0.0, self.core - self.after_core + self.after_core_w)
            return ChunkMemory(layers * (self.kept - self.selective_saving), layers * self.for_w, rise_b, rise_bw)
        groups = checkpoint_groups(recompute, [True] * layers) if recompute.full else [(0, layers, False)]
        stored = [self.input if checkpointed else (stop - start) * self.kept for start, stop, checkpointed in groups]
        rise_b = rise_bw = 0.0
        for i, (start, stop, checkpointed) in enumerate(groups):
            if checkpointed:  # while recomputed: its layers whole, what it stored given up only after
                later = sum(stored[i:])
                rise_b = max(rise_b, (stop - start) * self.kept + (layers - stop) * self.for_w - later)
                rise_bw = max(rise_bw, (stop - start) * self.kept - later)
        return ChunkMemory(sum(stored), layers * self.for_w, rise_b, rise_bw)


def fused_attention(cuda: bool, attention_dropout: float, alibi: bool) -> bool:
    """Whether torch's attention runs a fused kernel (flash or memory-efficient) for a training step: always
    on CUDA; on CPU its flash kernel takes neither dropout nor an additive bias of every head (ALiBi)."""
    return cuda or (not attention_dropout and not alibi)


def layer_memory(config, seq: int, mbs: int, dtype_bytes: int, cuda: bool = False) -> LayerMemory:
    """What one dense transformer layer of `config` (a GPTConfig or the parsed flags; one process: no tensor
    parallelism, no experts) keeps per micro-batch of mbs x seq tokens at `dtype_bytes` per element. A dropout mask is one
    byte per element on CUDA (a boolean), an element of the dtype on CPU (torch's fallback multiplies)."""
    e, tokens = dtype_bytes, seq * mbs
    h, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", 0) or heads
    head = getattr(config, "kv_channels", None) or h // heads  # --kv-channels: heads wider than hidden / heads
    qw, kv = heads * head, kv_heads * head  # the queries' (and the core output's) width, the keys' and values'
    ffn = getattr(config, "ffn_hidden_size", 0) or 4 * h
    swiglu = bool(getattr(config, "swiglu", False))
    rms = getattr(config, "normalization", "layernorm") == "rmsnorm"
    position = getattr(config, "position_embedding_type", "learned_absolute")
    qk_norm = bool(getattr(config, "qk_layernorm", False))
    attention_dropout = getattr(config, "attention_dropout", 0.0)
    mask = 1 if cuda else e
    row = tokens * e  # one element per token

    def norm(width, rows):
        """What a norm keeps beyond its input: LayerNorm its statistics, RMSNorm (torch composes it) one statistic
        and the normalised input, which the weight's gradient multiplies."""
        return rows * STATS + width * row if rms else 2 * rows * STATS
    qkv = (qw + 2 * kv) * row  # c_attn's output: v (and q, k unless rotated or normalised) a view of it
    fresh_qk = (qw + kv) * row if position == "rope" or qk_norm else 0.0  # rotated or normalised q and k
    head_norms = (norm(qw, tokens * heads) + norm(kv, tokens * kv_heads), qkv) if qk_norm else (0.0, 0.0)  # on qkv
    out = qw * row  # the core's output, or the output projection's input
    if fused_attention(cuda, attention_dropout, position == "alibi"):
        core = mbs * heads * seq * STATS  # the softmax statistics: q, k, v and the output are kept anyway
        core_inputs, attention = 0.0, qkv + fresh_qk + out + core
    else:
        scores = mbs * heads * seq * seq
        core = 3 * qw * row + scores * e + (scores * (mask + e) if attention_dropout else 0.0)  # q, k, v copied
        core_inputs = qkv + fresh_qk - head_norms[1]  # what q, k, v hold that nothing else kept
        attention = head_norms[1] + core + out  # the output projection's input: a copy of the core's output
    mlp = (4 * ffn if swiglu else 2 * ffn) * row  # SwiGLU: [gate; up], silu(gate), their product
    dropouts = 2 * h * tokens * mask if getattr(config, "hidden_dropout", 0.0) else 0.0
    norms = 2 * (h * row + norm(h, tokens)) + head_norms[0]  # ln_1's and ln_2's (and q, k's) inputs and statistics
    kept = norms + 2 * h * row + attention + mlp + dropouts  # + c_attn's and c_fc's inputs (the norms' outputs)
    inputs_w = (2 * h + qw + ffn) * row  # c_attn, c_proj, c_fc, the MLP's c_proj
    grads_w = (2 * h + qw + 2 * kv + (2 * ffn if swiglu else ffn)) * row
    fused = fused_attention(cuda, attention_dropout, position == "alibi")
    # after the core: ln_2 and its input, c_fc's input, the MLP, both dropout masks; the output projection's
    # input too where it is a copy (fused, it is the core's own output, freed with the core)
    after_core = h * row + norm(h, tokens) + h * row + mlp + dropouts + (0.0 if fused else out)
    after_core_w = (ffn + 3 * h + (2 * ffn if swiglu else ffn) + (0 if fused else qw)) * row  # inputs, gradients
    return LayerMemory(kept=kept, core=core, core_inputs=core_inputs, input=h * row, for_w=inputs_w + grads_w,
                       after_core=after_core, after_core_w=after_core_w)


def act_size(schedule: Schedule, num_layers: int, memory: LayerMemory, recompute: Recompute):
    """simulate's act_size and transient for `recompute`, in its unit (one micro-batch's activations on one 1F1B
    stage, nothing recomputed: num_layers / pp layers' `kept`): per op (M_B, M_W) of the op's stage and segment,
    and what a B or BW holds while it recomputes."""
    unit = memory.kept * num_layers / schedule.pp
    per_stage = [memory.stage(recompute, len(held)) for held in stage_layers(num_layers, schedule.stages)]
    share = token_shares(schedule)

    def sizes(op: Op) -> tuple[float, float]:
        chunk = per_stage[op.stage]
        return chunk.kept * share[op.seq] / unit, chunk.for_w * share[op.seq] / unit

    def transient(op: Op) -> float:
        chunk = per_stage[op.stage]
        rise = chunk.rise_b if op.kind is Kind.B else chunk.rise_bw if op.kind is Kind.BW else 0.0
        return rise * share[op.seq] / unit
    return sizes, transient


def recomputed_share(recompute: Recompute, layers: int, core_share: float) -> float:
    """The share of a chunk's layer forward that its backward runs again: the attention core's `core_share` of
    every layer (selective), the checkpointed layers' (full)."""
    if recompute.selective:
        return core_share
    if not recompute.full or not layers:
        return 0.0
    groups = checkpoint_groups(recompute, [True] * layers)
    return sum(stop - start for start, stop, checkpointed in groups if checkpointed) / layers


def evaluate(schedule: Schedule, costs: ModelCosts, recompute: Recompute, memory: LayerMemory, num_layers: int,
             core_share: float, **kwargs) -> SimResult:
    """costs.evaluate under `recompute`: each B (or BW) pays again the forward of what its chunk recomputes,
    and the activations are `memory`'s (act_size), in micro-batches of one 1F1B stage's with nothing recomputed;
    `costs.head_memory` in that unit. `core_share`: the attention core's share of a layer's forward time."""
    f, b, w = costs.per_stage(schedule)
    layer_f = dataclasses.replace(costs, embed=(0.0,) * 3, head=(0.0,) * 3).per_stage(schedule)[0]
    held = stage_layers(num_layers, schedule.stages)
    b = [x + lf * recomputed_share(recompute, len(layers), core_share) for x, lf, layers in zip(b, layer_f, held)]
    sizes, transient = act_size(schedule, num_layers, memory, recompute)
    vocab = {"head": costs.head, "embed": costs.embed} if schedule.vocab_parallel else {}
    return simulate(schedule, f, b, w, op_overhead=costs.op_overhead, head_memory=costs.head_memory,
                    act_size=sizes, transient=transient, **vocab, **costs.all_to_all_args(schedule), **kwargs)
