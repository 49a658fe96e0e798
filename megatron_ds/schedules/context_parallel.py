"""Context parallelism's costs per CP rank (pure Python): memory, FLOPs, the messages of the attention's
communication and how much of them the block compute hides, and the ModelCosts a schedule's simulation takes at
a CP size C.

Layout (model/context_parallel/layout.py): a sequence, or each Seq1F1B segment on its own, of n tokens is cut
into 2C chunks, rank r holding chunks r and 2C-1-r: n / C tokens per rank. Everything per token (the linear
layers, norms, the head and its logits) is a shorter sequence's; attention alone spans the ranks.

Memory of one layer and micro-batch (segment) on one rank (`layer_bytes`): the layer's activations at n / C
tokens (recompute.layer_memory with the fused core, which keeps q, k, v, the output and the softmax statistics:
flash on a GPU, and the ring's blocks on any device), plus what the communication keeps from F to B:
- p2p (ring): nothing more; while a layer attends, two K/V blocks in flight forward, two K/V blocks and three of
  their fp32 gradients backward (the one attended into, the one sent on, the one arriving; at C = 2 one K/V
  block beside the three, as the last step receives none: `in_flight`, held only while the op runs);
- allgather: the gathered K/V of the whole sequence (segment), kept for backward; backward holds their
  gradients whole twice (sent and received) while it runs;
- a2a (Ulysses): q, k, v and the core's output in the head layout (the whole sequence, heads / C: as large as
  the local ones), kept beside the local ones.
- a2a+p2p: a2a's head layout kept (as large alike), and while a layer attends the ring's blocks of a ring of P.
The buffers in flight live while a layer attends, which is inside the op, so an op's own memory then
(`ContextRun.attention_bytes`, simulate's `transient`, above the level before the op) is where the layer stands
(`before_core`, `after_core`): in F, the stage's earlier layers kept, the last layer's part before its core
(its first norm, c_attn's input and output, the rotated q and k; allgather's gathered K/V, a2a's q, k, v in the
head layout) and the forward's blocks; in B (BW) the backward's blocks less what the op has freed when its
last layer's attention backward starts (that layer's part after the core, less what a split B keeps for W;
under BW the loss stage's logits, which the head's backward frees first). The last layer's attention is F's
largest moment and the first one backward B's; measured (bench/cp_memory.py) the blocks fit in that room.
Under Seq1F1B each segment's keys and values also go into the micro-batch's K/V cache (model/kv_cache.py), whose
buffers hold the positions in flight, so the cache of earlier segments is 2 x K/V width bytes per held token:
per local token for p2p and a2a (its cache holds the local chunks, or every position at heads / C), per whole
token for allgather (its cache holds the gathered segments, which are then what it keeps). The ring then
passes the local cache, [0, stop) / C tokens of K/V, not the segment's own, and saves views of it: a segment's
layer under p2p keeps neither c_attn's output nor the rotated k (RoPE: q is a tensor of its own). The buffers
grow with each segment's F and shrink as each segment's backward opens, so segment j + 1's cache goes when
segment j's B starts and segment 0's after its B (`ContextRun.cache_change`).

FLOPs (flops.py's counts, a multiply-add 2): the linear layers at n / C tokens; attention under the layout
(`rank_attention_flops`): rank r's chunks [a + r c, a + (r+1) c) and [a + (2C-1-r) c, ...) with c = n / 2C,
causal, 2q(b^2 - a^2) each, which sums to 2q c (4a + 2C c) on every rank: equal ranks, the whole count / C.
Backward: B = the linears' forward + twice the attention's, W = the linears' forward (3x forward in all).

Messages per layer (`messages`, bytes one rank sends; every rank sends alike): p2p forward C - 1 K/V blocks,
backward C - 1 K/V blocks and C gradient blocks in fp32 (each block's gradient sum returns to its owner);
allgather forward one all-gather of K/V, backward one all-to-all of their gradients (each sends its (C - 1) / C);
a2a four all-to-alls each way (q, k, v, output; the output's gradient and q's, k's, v's), (C - 1) / C of a
local tensor each; a2a+p2p (hierarchical, `hierarchy`: the all-to-all over A ranks, the ring over P = C / A) the
a2a's four each way at (A - 1) / A, then the ring's messages over P ranks, each block a rank's K/V cache at
heads / A for its P-layout positions (as many bytes as p2p's at C).

What the block compute hides (`ring_times`): a ring step's transfers at `bandwidth` run while the rank attends
one block pair (its attention / C, every step alike under the layout) at `flops`, so a step hides min(1, compute /
transfer) of them and the rest is on the op's critical path. Forward, each of the first C - 1 steps carries the
next K/V block. Backward (model/context_parallel/ring.py) a step attends into a fresh gradient buffer while the
previous step's gradient block travels: the first step carries the next K/V block, the C - 2 middle ones it and
a gradient block, the last a gradient block only, and the last step's own gradient block (home to its owner)
follows its compute, unhidden. `step_hidden` is the share of what travels under the steps that they hide (forward
one step's min(1, compute / transfer)). allgather and a2a communicate before and after the attention: nothing
hidden; a2a+p2p's all-to-alls so too, its ring over P hiding as p2p's at P (a step: the attention / P).
Defaults: `DEVICE_FLOPS` 400 TFLOP/s, the bf16 rate this project's unsplit step reaches on one H100 and one H200
(393.9 and 398.9 TFLOP/s, docs/perf/gpu_h100.md, gpu_h200.md); `BANDWIDTH` 300 GB/s one way, two thirds of
NVLink 4's 450 GB/s per direction (an assumption, not measured here; across nodes give the
network's, e.g. 50 GB/s for 400 Gb/s InfiniBand).

Ranks that compute at different speeds (`coupled_ring`, which the CPU bench feeds measured block times): each rank
steps through the ring with its own compute per ring step, and a step's transfers (what ring_times' steps carry)
leave once both ends of a link have posted (gloo's send waits for the peer's receive; rank r receives from r - 1
and sends to r + 1), so a step ends at the later of its block's end and its neighbours' latest post plus the
transfer. A rank thus waits for a slower neighbour's post (`lag`) as well as for bytes (`exposed`); it may run one
step ahead of its neighbours, so the ring costs the sum of each step's slowest block where one rank is the slower
at every step, less where the slower one alternates. With every rank alike it is ring_times to the last bit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatron_ds.cp_section import COMM_TYPES, flags_problem

from .auto import LOGIT_BYTES
from .costs import ModelCosts, stage_layers
from .flops import attention_flops, layer_shape, linear_flops_per_token, query_width, vocab_size
from .ir import Op, Schedule, ScheduleError
from .kinds import Kind
from .recompute import LayerMemory, Recompute, layer_memory, recomputed_share
from .seq_split import SEGMENT_MULTIPLE, balanced_segment_lengths, even_segment_lengths
from .simulate import SimResult, _token_shares as token_shares, simulate

DEVICE_FLOPS = 400e12  # bf16 FLOP/s one GPU reaches (module docstring)
BANDWIDTH = 300e9      # bytes/s one way between two CP ranks (module docstring)
GRAD_BYTES = 4         # the ring's K/V gradients travel in fp32 (model/context_parallel/ring.py)


NEEDS_SIZES = ("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the all-to-all over A ranks, "
               "the ring over P groups)")


def hierarchy(config, cp: int) -> tuple[int, int]:
    """a2a+p2p's (A, P) at CP `cp`: A the first of `config`'s hierarchical_context_parallel_sizes (--hierarchical-
    context-parallel-sizes), or where it does not divide `cp` (a compare table's smaller CP sizes) their greatest
    common divisor; P = cp / A."""
    sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
    if not sizes:
        raise ScheduleError(NEEDS_SIZES)
    a = math.gcd(sizes[0], cp)
    return a, cp // a


def cp_problem(seq: int, cp: int, comm: str = "p2p", lengths=None, kv_heads: int | None = None,
               sizes: tuple | None = None) -> str:
    """Why `seq` tokens (cut into segments of `lengths`) cannot run at CP `cp` under `comm` ('' when they can);
    `sizes`: a2a+p2p's hierarchy (A, P) at `cp`."""
    if flags_problem(cp, comm):
        return flags_problem(cp, comm)
    if seq % (2 * cp):
        return (f"--seq-length ({seq}) must be divisible by 2 x --context-parallel-size ({2 * cp}): the sequence is "
                f"cut into 2 x CP equal chunks, rank r holding chunks r and 2CP-1-r")
    bad = [n for n in lengths or () if n % (2 * cp)]
    if bad:
        return (f"the Seq1F1B segment lengths {list(lengths)} must each be divisible by 2 x --context-parallel-size "
                f"({2 * cp}): each segment is cut into 2 x CP chunks on its own")
    if cp > 1 and comm == "a2a" and kv_heads and kv_heads % cp:
        return (f"--cp-comm-type a2a shares the heads out over the context-parallel ranks: the {kv_heads} K/V heads "
                f"must be divisible by --context-parallel-size ({cp}); use --cp-comm-type p2p or allgather")
    if cp > 1 and comm == "a2a+p2p" and sizes is None:
        return NEEDS_SIZES
    if cp > 1 and comm == "a2a+p2p" and kv_heads and kv_heads % sizes[0]:
        return (f"--cp-comm-type a2a+p2p shares the heads out over the first of --hierarchical-context-parallel-sizes: "
                f"the {kv_heads} K/V heads must be divisible by {sizes[0]}")
    return ""


def widths(config) -> tuple[int, int]:
    """(the queries' width heads x head size, the keys' (and values') K/V heads x head size)."""
    shape = layer_shape(config)
    q = query_width(shape["hidden"], shape["heads"], shape["head_dim"])
    heads = shape["heads"] or 1
    return q, (shape["kv_heads"] or heads) * (q // heads)


def chunk_spans(n: int, cp: int, rank: int, start: int = 0) -> list[tuple[int, int]]:
    """The [a, b) positions of the two chunks `rank` holds of n tokens from `start`."""
    c = n // (2 * cp)
    return [(start + i * c, start + (i + 1) * c) for i in (rank, 2 * cp - 1 - rank)]


def rank_attention_flops(config, n: int, cp: int, rank: int, start: int = 0, batch: int = 1) -> float:
    """Forward FLOPs of causal attention of rank `rank`'s queries of the tokens [start, start + n) (all keys
    before them, on every rank)."""
    q = widths(config)[0]
    return batch * sum(attention_flops(a, b, q) for a, b in chunk_spans(n, cp, rank, start))


def rank_forward_flops(config, n: int, cp: int, start: int = 0, batch: int = 1) -> tuple[float, float]:
    """(linear layers', attention's) forward FLOPs of one layer on one rank (every rank alike)."""
    return (linear_flops_per_token(**_linear_shape(config)) * batch * n / cp,
            rank_attention_flops(config, n, cp, 0, start, batch))


def _linear_shape(config) -> dict:
    shape = layer_shape(config)
    return {k: shape[k] for k in ("hidden", "ffn", "heads", "kv_heads", "swiglu", "head_dim")}


@dataclass(frozen=True)
class Message:
    what: str
    count: int
    size: float  # bytes of each


@dataclass(frozen=True)
class Messages:
    """What one rank sends for one layer and micro-batch (segment), forward and backward."""
    forward: tuple = ()
    backward: tuple = ()

    @property
    def forward_bytes(self) -> float:
        return sum(m.count * m.size for m in self.forward)

    @property
    def backward_bytes(self) -> float:
        return sum(m.count * m.size for m in self.backward)


def messages(config, n: int, cp: int, comm: str, batch: int = 1, dtype_bytes: int = 2, start: int = 0) -> Messages:
    """The messages of one layer's attention for the tokens [start, start + n) (module docstring)."""
    if cp == 1:
        return Messages()
    q, kv = widths(config)
    token = 2 * kv * batch * dtype_bytes  # one token's keys and values
    block = (start + n) // cp * token  # the local K/V cache: every segment so far (a2a+p2p: 1 / P at heads / A)
    local = n // cp * batch * dtype_bytes
    if comm == "p2p":
        return _ring_messages(block, cp, dtype_bytes)
    if comm == "allgather":
        return Messages((Message("all-gather K/V", 1, (cp - 1) * local * 2 * kv),),
                        (Message("all-to-all dK/dV", 1, (cp - 1) * local * 2 * kv),))
    if comm == "a2a":
        return _a2a_messages(q, kv, local, cp)
    if comm == "a2a+p2p":
        a, p = hierarchy(config, cp)
        a2a, ring = _a2a_messages(q, kv, local, a), _ring_messages(block, p, dtype_bytes) if p > 1 else Messages()
        return Messages(a2a.forward + ring.forward, a2a.backward + ring.backward)
    raise ScheduleError(f"--cp-comm-type {comm!r}: choose one of {', '.join(COMM_TYPES)}")


def _ring_messages(block: float, ranks: int, dtype_bytes: int) -> Messages:
    """A ring of `ranks`: ranks - 1 K/V blocks forward; backward ranks - 1 of them and `ranks` fp32 gradients."""
    grad = block * GRAD_BYTES / dtype_bytes
    return Messages((Message("K/V block", ranks - 1, block),),
                    (Message("K/V block", ranks - 1, block), Message("dK/dV block (fp32)", ranks, grad)))


def _a2a_messages(q: int, kv: int, local: float, ranks: int) -> Messages:
    """Ulysses over `ranks`: four all-to-alls each way, (ranks - 1) / ranks of a local tensor each."""
    share = (ranks - 1) / ranks * local
    return Messages(tuple(Message(f"all-to-all {w}", 1, share * width) for w, width in (("q", q), ("k", kv), ("v", kv),
                                                                                       ("output", q))),
                    tuple(Message(f"all-to-all d{w}", 1, share * width) for w, width in (("output", q), ("q", q),
                                                                                        ("k", kv), ("v", kv))))


@dataclass(frozen=True)
class Ring:
    """One layer and micro-batch (segment) on one rank, in seconds: compute (F, B, W); the communication's
    transfer time (F, B) and of it what the compute does not hide (`exposed`); `step_hidden`: the share of what
    travels under the ring's steps that their block pairs' attention hides, forward and backward (None: no ring)."""
    compute: tuple
    transfer: tuple = (0.0, 0.0)
    exposed: tuple = (0.0, 0.0)
    step_hidden: tuple | None = None

    @property
    def hidden(self) -> float:
        """The share of the whole transfer (forward and backward) hidden; 1 with nothing to send."""
        total = sum(self.transfer)
        return 1.0 - sum(self.exposed) / total if total else 1.0


def ring_times(config, n: int, cp: int, comm: str, batch: int = 1, dtype_bytes: int = 2, start: int = 0,
               flops: float = DEVICE_FLOPS, bandwidth: float = BANDWIDTH) -> Ring:
    """A layer's times on one rank for the tokens [start, start + n) (module docstring)."""
    lin, att = rank_forward_flops(config, n, cp, start, batch)
    compute = ((lin + att) / flops, (lin + 2 * att) / flops, lin / flops)
    msgs = messages(config, n, cp, comm, batch, dtype_bytes, start)
    transfer = (msgs.forward_bytes / bandwidth, msgs.backward_bytes / bandwidth)
    ranks = cp if comm == "p2p" else hierarchy(config, cp)[1] if comm == "a2a+p2p" else 1
    if ranks == 1:  # no ring: every collective waited for where it is issued
        return Ring(compute, transfer, transfer)
    # the ring's messages come last (messages()); a2a+p2p's all-to-alls before them are waited for where issued,
    # its ring over P hides as p2p's at P
    ring_f, ring_b = Messages(msgs.forward[-1:], msgs.backward[-2:]).forward_bytes, msgs.backward[-2:]
    collective = ((msgs.forward_bytes - ring_f) / bandwidth,
                  (msgs.backward_bytes - sum(m.count * m.size for m in ring_b)) / bandwidth)
    block, grad = (m.size / bandwidth for m in ring_b)
    step_f, step_b = att / ranks / flops, 2 * att / ranks / flops
    # backward's steps carry: the first the next K/V block, the middle ones that and the previous step's gradient
    # block, the last that gradient block only; the last step's own gradient block follows its compute
    under_b = [block] + [block + grad] * (ranks - 2) + [grad]
    left_b = sum(max(0.0, t - step_b) for t in under_b)
    exposed = (collective[0] + (ranks - 1) * max(0.0, block - step_f), collective[1] + left_b + grad)
    return Ring(compute, transfer, exposed, (min(1.0, step_f / block), 1.0 - left_b / sum(under_b)))


@dataclass(frozen=True)
class CoupledRing:
    """Every rank's pass through one layer's ring (forward or backward), in seconds: when each leaves it (`ends`),
    and of each one's time in it besides its own block compute what it waited for bytes after its block and its
    neighbours' posts (`exposed`) and what it waited for a neighbour to post (`lag`: the neighbour's lag behind it);
    `transfer`: the seconds its links carried in each direction (what `exposed` is a part of)."""
    ends: tuple
    exposed: tuple
    lag: tuple
    transfer: float

    @property
    def hidden(self) -> tuple:
        """Each rank's share of the transfer hidden (1 with nothing to send)."""
        return tuple(1.0 - e / self.transfer if self.transfer else 1.0 for e in self.exposed)


def coupled_ring(computes, kv: float, grad: float = 0.0, backward: bool = False, starts=None) -> CoupledRing:
    """One layer's ring attention stepped through (module docstring): `computes[r][t]` rank r's compute in ring step
    t (C ranks, C steps each), `kv` and `grad` the seconds a K/V block and a gradient block take on a link,
    `starts[r]` when rank r enters the ring (default 0 for all)."""
    size = len(computes)
    if any(len(steps) != size for steps in computes):
        raise ScheduleError(f"coupled_ring: each of the {size} ranks needs {size} ring steps' compute, got "
                            f"{[len(steps) for steps in computes]}")
    now = list(starts) if starts is not None else [0.0] * size
    if len(now) != size:
        raise ScheduleError(f"coupled_ring: {len(now)} start times for {size} ranks")
    exposed, lag = [0.0] * size, [0.0] * size
    if size == 1:
        return CoupledRing((now[0] + computes[0][0],), (0.0,), (0.0,), 0.0)
    # what each step's exchange carries on a link (None: the step posts nothing), then backward's last gradient block
    carried = ([kv] + [kv + grad] * (size - 2) + [grad, grad]) if backward else [kv] * (size - 1) + [None]

    def exchange(t, done):
        # a transfer starts once both of its ends have posted (gloo's send waits for the peer's receive): rank r
        # receives from r - 1 and sends to r + 1, and its wait returns when both have arrived
        posted = [max(now[r - 1], now[r], now[(r + 1) % size]) for r in range(size)]
        ends = [max(done[r], posted[r] + carried[t]) for r in range(size)]
        for r in range(size):
            exposed[r] += ends[r] - max(done[r], posted[r])
            lag[r] += max(0.0, posted[r] - done[r])
        return ends

    for t in range(size):
        done = [now[r] + computes[r][t] for r in range(size)]
        # a step's transfers start with it (ring_times' accounting): forward the next K/V block, backward also the
        # previous step's gradient block, which ring.py posts after that step's compute
        now = exchange(t, done) if carried[t] is not None else done
    if backward:  # the own block's gradient sum goes home after the last step's compute
        now = exchange(size, now)
    transfer = (size - 1) * kv + (size * grad if backward else 0.0)
    return CoupledRing(tuple(now), tuple(exposed), tuple(lag), transfer)


@dataclass(frozen=True)
class LayerBytes:
    """One layer and micro-batch (segment) on one rank, bytes: kept from F to B (`kept`: the layer's own at
    n / C tokens, a ring's segment's without c_attn's output and the rotated k, whose copies the cache holds; `comm`: what the communication keeps; `cache`: Seq1F1B's K/V cache), what a split B leaves for
    W, and what the attention holds while F and while B runs (`in_flight`). Where in the layer the attention
    runs: `before_core`, what F holds of the layer (and its communication) when its attention starts; in B,
    `after_core`, what is freed before the attention's backward starts, of which a split B keeps
    `after_core_w` for W."""
    kept: float
    comm: float
    cache: float
    for_w: float
    in_flight: tuple
    before_core: float = 0.0
    after_core: float = 0.0
    after_core_w: float = 0.0

    @property
    def held(self) -> float:
        return self.kept + self.comm + self.cache


def layer_bytes(config, n: int, cp: int, comm: str, batch: int = 1, dtype_bytes: int = 2, start: int = 0,
                segmented: bool = False) -> LayerBytes:
    """The memory of one layer for the tokens [start, start + n) (module docstring); `segmented`: a Seq1F1B
    segment, whose keys and values go into the K/V cache."""
    local = n // cp
    own = layer_memory(config, local, batch, dtype_bytes, cuda=True)
    q, kv = widths(config)
    token = 2 * kv * batch * dtype_bytes
    gathered = cp > 1 and comm == "allgather"
    heads_layout = cp > 1 and comm in ("a2a", "a2a+p2p")  # a2a+p2p: the head layout's tensors, as large alike
    kept_comm = n * token if gathered else (2 * q + 2 * kv) * local * batch * dtype_bytes if heads_layout else 0.0
    cache = local * token if segmented and not gathered else 0.0
    if cp > 1 and comm in ("p2p", "a2a+p2p"):
        block = (start + n) // cp * token  # a2a+p2p: 1 / P of the positions at heads / A, as many bytes
        ring = hierarchy(config, cp)[1] if comm == "a2a+p2p" else cp
        # forward 2 K/V blocks; backward 3 gradient blocks beside 2 K/V blocks (C = 2: beside 1, the last step's)
        in_flight = (2 * block, (2 if ring > 2 else 1) * block + 3 * block * GRAD_BYTES / dtype_bytes)
    else:
        in_flight = (0.0, 2.0 * n * token if gathered else 0.0)
    # the fused core keeps its output and the softmax statistics, made by the attention; before it the layer
    # holds its first norm's input and statistics, c_attn's input and output, the rotated q and k (its part of
    # `kept` less what comes after the core); the gathered K/V, or q, k, v in the head layout, are there too
    out = q * local * batch * dtype_bytes
    comm_before = kept_comm if gathered else (q + 2 * kv) * local * batch * dtype_bytes if heads_layout else 0.0
    before = own.kept - own.after_core - own.core - out + comm_before
    # a segment's ring saves its k and v as views of the K/V cache (which holds copies of them) and a rotated q is
    # a tensor of its own: nothing keeps c_attn's output or the rotated k past the layer's forward
    rotated = getattr(config, "position_embedding_type", None) == "rope" and not getattr(config, "qk_layernorm", False)
    uncached = (q + 3 * kv) * local * batch * dtype_bytes if segmented and cp > 1 and comm == "p2p" and rotated \
        else 0.0
    return LayerBytes(own.kept - uncached, kept_comm, cache, own.for_w, in_flight, before, own.after_core,
                      own.after_core_w)


def cp_layer_memory(config, seq: int, mbs: int, dtype_bytes: int, cp: int = 1, comm: str = "p2p") -> LayerMemory:
    """recompute.LayerMemory of one layer on a CP rank (whole sequence of `seq` tokens): layer_bytes' kept with the
    communication's own; under selective recompute allgather gathers the K/V again in backward (they are part of
    the core that it frees), a2a keeps the head layout's q, k, v (the recomputed core's inputs). The fused core's
    on any device: the ring's blocks keep only the softmax statistics, and the CP model counts no (s x s) tensor."""
    own = layer_memory(config, seq // cp, mbs, dtype_bytes, cuda=True)
    extra = layer_bytes(config, seq, cp, comm, mbs, dtype_bytes).comm
    core = own.core + extra if comm == "allgather" else own.core
    return dataclasses.replace(own, kept=own.kept + extra, core=core)


@dataclass(frozen=True)
class ContextRun:
    """A model at one sequence length and CP size, as the simulator sees it: `config` any object with GPTConfig's
    shape fields (num_layers, hidden_size, num_attention_heads, ...: a GPTConfig, the parsed flags)."""
    config: object
    seq: int
    cp: int = 1
    comm: str = "p2p"
    batch: int = 1
    dtype_bytes: int = 2
    flops: float = DEVICE_FLOPS
    bandwidth: float = BANDWIDTH
    logits: bool = True  # the loss stage holds a micro-batch's logits (False: a chunked or fused loss)
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def problem(self, lengths=None) -> str:
        shape = layer_shape(self.config)
        sizes = hierarchy(self.config, self.cp) if self.comm == "a2a+p2p" and self.cp > 1 and \
            getattr(self.config, "hierarchical_context_parallel_sizes", None) else None
        return cp_problem(self.seq, self.cp, self.comm, lengths, shape["kv_heads"] or shape["heads"], sizes)

    def check(self, lengths=None) -> None:
        problem = self.problem(lengths)
        if problem:
            raise ScheduleError(problem)

    def segment_lengths(self, k: int, method: str = "balanced") -> list[int] | None:
        """Seq1F1B's k segments, each a multiple of 2 x CP (and of SEGMENT_MULTIPLE when balanced); None at k=1."""
        if k == 1:
            return None
        if method == "even":
            lengths = even_segment_lengths(self.seq, k, 2 * self.cp)
        else:
            shape = layer_shape(self.config)
            lengths = balanced_segment_lengths(self.seq, k, shape["hidden"], shape["ffn"],
                                               math.lcm(SEGMENT_MULTIPLE, 2 * self.cp), heads=shape["heads"],
                                               kv_heads=shape["kv_heads"], swiglu=shape["swiglu"],
                                               head_dim=shape["head_dim"])
        self.check(lengths)
        return lengths

    def _spans(self, lengths) -> list[tuple[int, int]]:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        return list(zip(starts, lengths))

    def layer(self, start: int = 0, n: int | None = None, segmented: bool = False) -> tuple[LayerBytes, Ring]:
        n = self.seq if n is None else n
        key = (start, n, segmented)
        if key not in self._memo:
            args = (self.config, n, self.cp, self.comm, self.batch, self.dtype_bytes, start)
            self._memo[key] = (layer_bytes(*args, segmented=segmented),
                               ring_times(*args, flops=self.flops, bandwidth=self.bandwidth))
        return self._memo[key]

    def messages(self) -> Messages:
        return messages(self.config, self.seq, self.cp, self.comm, self.batch, self.dtype_bytes)

    def unit_for(self, pp: int) -> float:
        """Bytes of the simulator's memory unit here: one micro-batch's activations (whole sequence, held from F
        to B) on one 1F1B stage of `pp` ranks."""
        return self.layer()[0].held * self.config.num_layers / pp

    def logits_bytes(self) -> float:
        return LOGIT_BYTES * self.batch * self.seq / self.cp * vocab_size(self.config) if self.logits else 0.0

    def head_times(self) -> tuple:
        """(F, B, W) of the LM head on one rank's tokens: 2hV FLOPs per token each."""
        t = 2.0 * self.config.hidden_size * vocab_size(self.config) * self.batch * self.seq / self.cp / self.flops
        return (t, t, t)

    def model_costs(self, pp: int, lengths=None) -> ModelCosts:
        """ModelCosts in seconds per 1F1B stage of `pp` ranks: the layers' compute at S / C tokens, the exposed
        communication (`context`), the head on the last stage, a micro-batch's logits in the memory unit."""
        lengths = lengths or [self.seq]
        seg = len(lengths) > 1
        rings = [self.layer(a, n, seg)[1] for a, n in self._spans(lengths)]
        per = self.config.num_layers / pp
        tf, tb, tw = (per * sum(r.compute[i] for r in rings) for i in range(3))
        context = tuple(per * sum(r.exposed[i] for r in rings) for i in range(2))
        return ModelCosts(tf, tb, tw, head=self.head_times(), head_memory=self.logits_bytes() / self.unit_for(pp),
                          context=context)

    def seq_costs(self, lengths) -> list[float]:
        """Each segment's relative time (compute and exposed communication), simulate's seq_costs."""
        rings = [self.layer(a, n, True)[1] for a, n in self._spans(lengths)]
        return [sum(r.compute) + sum(r.exposed) for r in rings]

    def simulate(self, schedule: Schedule, recompute: Recompute | None = None, **kwargs) -> tuple[SimResult, float]:
        """(the simulation of `schedule` at this CP under `recompute` (None: nothing recomputed), its busiest rank's
        peak activation memory in bytes: the layers' kept activations, the logits on the loss stage, and what an
        op holds while a layer attends (`attention_bytes`))."""
        lengths = self.lengths_of(schedule)
        costs = self.model_costs(schedule.pp, lengths)
        unit = self.unit_for(schedule.pp)
        held = self.chunks(schedule, lengths, recompute)
        counts = [len(layers) for layers in stage_layers(self.config.num_layers, schedule.stages)]

        def sizes(op: Op) -> tuple:
            chunk = held[op.stage][op.seq][0]
            return (chunk.kept + counts[op.stage] * self.cache_change(held[op.stage], op)) / unit, chunk.for_w / unit

        attention = self.attention_bytes(schedule, lengths, recompute)
        seq_costs = self.seq_costs(lengths) if lengths else None
        vocab = {"head": costs.head, "embed": costs.embed} if schedule.vocab_parallel else {}
        f, b, w = costs.per_stage(schedule)
        if recompute is not None and recompute.granularity:  # each B pays again what its chunk recomputes
            layer_f = dataclasses.replace(costs, embed=(0.0,) * 3, head=(0.0,) * 3).per_stage(schedule)[0]
            core = self.core_share(lengths)
            b = [x + lf * recomputed_share(recompute, n, core) for x, lf, n in zip(b, layer_f, counts)]
        res = simulate(schedule, f, b, w, op_overhead=costs.op_overhead,
                       head_memory=costs.head_memory, act_size=sizes,
                       transient=lambda op: attention(op) / unit, seq_costs=seq_costs, **vocab, **kwargs)
        return res, res.peak_memory_max * unit

    def layer_memory(self, start: int, n: int, segmented: bool) -> LayerMemory:
        """recompute.LayerMemory of one layer for the tokens [start, start + n) (cp_layer_memory), its `kept`
        layer_bytes' (a segment's K/V go to the cache, which is counted apart)."""
        mem = self.layer(start, n, segmented)[0]
        own = cp_layer_memory(self.config, n, self.batch, self.dtype_bytes, self.cp, self.comm)
        return dataclasses.replace(own, kept=mem.kept + mem.comm)

    def lengths_of(self, schedule: Schedule) -> list[int] | None:
        """The segment lengths `schedule` runs (even ones where it names none), None without segments."""
        lengths = schedule.segment_lengths if schedule.seq_splits > 1 else None
        if schedule.seq_splits > 1 and not lengths:
            lengths = even_segment_lengths(self.seq, schedule.seq_splits, 2 * self.cp)
        self.check(lengths)
        return list(lengths) if lengths else None

    def core_share(self, lengths=None) -> float:
        """The attention core's share of a layer's forward on a rank (compute and exposed forward communication):
        what selective recompute runs again."""
        rings = [self.layer(a, n, len(lengths or ()) > 1)[1] for a, n in self._spans(lengths or [self.seq])]
        core = sum(r.compute[0] - r.compute[2] + r.exposed[0] for r in rings)
        return core / sum(r.compute[0] + r.exposed[0] for r in rings)

    @staticmethod
    def cache_change(segments: list, op: Op) -> float:
        """Bytes of one layer's K/V cache that `op` allocates (F) or frees (B, BW) of its micro-batch
        (model/kv_cache.py): F grows the buffers by its segment; B of segment j shrinks them to its stop as it
        opens, freeing segment j + 1's, and segment 0's B frees its own after it."""
        if op.kind is Kind.F:
            return segments[op.seq][1].cache
        if op.kind not in (Kind.B, Kind.BW):
            return 0.0
        later = segments[op.seq + 1][1].cache if op.seq + 1 < len(segments) else 0.0
        return later + (segments[0][1].cache if op.seq == 0 else 0.0)

    def chunks(self, schedule: Schedule, lengths=None, recompute: Recompute | None = None) -> list[list[tuple]]:
        """Per stage of `schedule` and segment: (recompute.ChunkMemory in bytes of the stage's layers under
        `recompute`, the segment's LayerBytes); the K/V cache is kept beside the chunk's own (never recomputed).
        `lengths`: the schedule's own (lengths_of) when not given."""
        recompute = recompute or Recompute()
        lengths = lengths or self.lengths_of(schedule)
        spans = self._spans(lengths or [self.seq])
        seg = len(spans) > 1
        mem = [self.layer(a, n, seg)[0] for a, n in spans]
        own = [self.layer_memory(a, n, seg) for a, n in spans]
        return [[(own[j].stage(recompute, len(layers)), mem[j]) for j in range(len(spans))]
                for layers in stage_layers(self.config.num_layers, schedule.stages)]

    def attention_bytes(self, schedule: Schedule, lengths=None, recompute: Recompute | None = None):
        """simulate's `transient` in bytes (op -> bytes above the level before the op): what the op holds while
        one of its layers attends, the attention's buffers in flight included. F: the stage's earlier layers
        kept (as `recompute` keeps them), the last layer's part before its core, every layer's K/V cache of the
        segment (opened with the op) and the forward's blocks; the last layer's attention is the largest. B and
        BW: the backward's blocks less what the op has freed when the last layer's attention backward starts
        (the next segment's K/V cache, which the op's opening lets go; the layer's part after the core, less what
        a split B keeps for W; under BW the logits of the loss stage, which the head's backward frees first); the
        first attention backward is the largest. Under recompute on top of its rise (recompute.ChunkMemory), the
        recomputed forward's blocks counted too (an upper bound where the rise is another group's). W and the
        vocabulary passes: nothing."""
        recompute = recompute or Recompute()
        lengths = lengths or self.lengths_of(schedule)
        again = bool(recompute.granularity)
        held = self.chunks(schedule, lengths, recompute)
        counts = [len(layers) for layers in stage_layers(self.config.num_layers, schedule.stages)]
        spans = self._spans(lengths or [self.seq])
        own = [self.layer_memory(a, n, len(spans) > 1) for a, n in spans]
        earlier = [[m.stage(recompute, max(0, count - 1)).kept for m in own] for count in counts]
        share = token_shares(schedule)
        logits = self.logits_bytes()

        def bytes_of(op: Op) -> float:
            count = counts[op.stage]
            if not count or op.kind not in (Kind.F, Kind.B, Kind.BW):
                return 0.0
            chunk, mem = held[op.stage][op.seq]
            if op.kind is Kind.F:
                return earlier[op.stage][op.seq] + count * mem.cache + mem.before_core + mem.in_flight[0]
            ring = max(mem.in_flight) if again else mem.in_flight[1]
            opened = count * (held[op.stage][op.seq + 1][1].cache if op.seq + 1 < len(spans) else 0.0)
            if op.kind is Kind.B:
                return chunk.rise_b + max(0.0, ring - opened - (mem.after_core - mem.after_core_w))
            freed = logits * share[op.seq] if op.stage == schedule.loss_stage and not schedule.vocab_parallel else 0.0
            return chunk.rise_bw + max(0.0, ring - opened - mem.after_core - freed)
        return bytes_of
