"""What each rank of a context-parallel launch computes (tests/model/context_parallel/test_attention.py): CP attention
of every --cp-comm-type against full attention of the whole sequence on one process, which every rank also does
itself (attention alone: in fp64, the exact values; the layer: at CP 1 in fp32). Returns per case the largest differences and the largest reference values: the output, the
gradients of q, k, v (attention alone) or of the input and the weights summed over the CP ranks (the layer)."""
import contextlib
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from megatron_ds.gpt_config import GPTConfig
from megatron_ds.model import TransformerLayer, WeightGradStore
from megatron_ds.model.attention import CausalSelfAttention
from megatron_ds.model.context_parallel import ContextLayout, set_context_parallel_group
from megatron_ds.model.context_parallel.attend import context_parallel_attention
from megatron_ds.model.context_parallel.blocks import dropout_keep
from megatron_ds.model.context_parallel import ring
from megatron_ds.model.context_parallel.ring import chunk_spans
from megatron_ds.model import documents as documents_module
from megatron_ds.model.documents import Documents
from megatron_ds.model.kv_cache import KVSlot, SegmentKVCache
from megatron_ds.model.tensor_parallel import initialize_model_parallel
from megatron_ds.model.tensor_parallel.comm import CommCounter
from megatron_ds.pipe.parallel.context_parallel import levels
from megatron_ds.rope_scaling import RopeScaling

B, D = 2, 8
EOD = 0
COMM_TYPES = ("p2p", "allgather", "a2a")
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)  # its attention factor scales cos, sin
HIERARCHY = (2, 2)  # a2a+p2p at CP 4: the all-to-all over ranks {0, 1} and {2, 3}, the ring over {0, 2} and {1, 3}


def length(world):
    return 16 * world  # chunks of 8 tokens: document borders fall inside them


def segment_lengths(world, k):
    """Uneven segments, each a multiple of 2 x CP."""
    unit = 2 * world
    return {1: [8 * unit], 2: [3 * unit, 5 * unit], 4: [unit, 2 * unit, 2 * unit, 3 * unit]}[k]


def packed_tokens(s, seed):
    """(B, s) tokens with EODs inside chunks, a one-token document, and documents spanning several chunks."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (B, s), generator=g)
    tokens[0, [5, 6, 17, s - 9]] = EOD
    tokens[1, [2, s // 2 + 3]] = EOD
    return tokens


def reference_mask(s, tokens):
    """(B or 1, 1, s, s): causal, and within documents when `tokens` (built here from the EODs, not by Documents)."""
    pos = torch.arange(s)
    allowed = (pos <= pos[:, None]).unsqueeze(0)
    if tokens is not None:
        starts = torch.ones_like(tokens, dtype=torch.bool)
        starts[:, 1:] = tokens[:, :-1] == EOD
        ids = starts.cumsum(1)
        allowed = allowed & (ids[:, :, None] == ids[:, None, :])
    return allowed.unsqueeze(1)


def _diff(got, want):
    return (got.double() - want).abs().max().item(), want.abs().max().item()


def _documents(tokens):
    return Documents(tokens, EOD).opened() if tokens is not None else contextlib.nullcontext()


def attention_case(group, comm, heads, kv_heads, packed, k, dtype=torch.float32):
    """Attention alone: {what: (max diff, max reference value)} over this rank's positions; q, k, v in `dtype`."""
    layout = ContextLayout.of(group)
    s = length(layout.size)
    g = torch.Generator().manual_seed(7)
    q, dy = (torch.randn(B, heads, s, D, generator=g) for _ in range(2))
    kv = [torch.randn(B, kv_heads, s, D, generator=g) for _ in range(2)]
    tokens = packed_tokens(s, 11) if packed else None
    # the reference in fp64: the exact values both fp32 computations round (fp32 SDPA itself is ~5e-7 off them)
    ref = [t.double().requires_grad_() for t in (q, *kv)]
    y = F.scaled_dot_product_attention(*ref, attn_mask=reference_mask(s, tokens), enable_gqa=heads != kv_heads)
    y.backward(dy.double())

    cache, slot, units, start = SegmentKVCache(), KVSlot(), [], 0
    for n in segment_lengths(layout.size, k):
        mine = layout.positions(n, start)
        local = [t[:, :, mine].to(dtype).requires_grad_() for t in (q, *kv)]
        with cache.segment(("mb", 0), start, start + n, s) as segment, _documents(tokens):
            out = context_parallel_attention(*local, group, comm, segment.spans, extend=_extender(segment, slot))
        units.append((start, n, mine, local, out))
        start += n
    for start, n, mine, _, out in reversed(units):
        with cache.segment(("mb", 0), start, start + n, s), _documents(tokens):
            out.backward(dy[:, :, mine].to(dtype))
    cache.free(("mb", 0))
    mine = torch.cat([u[2] for u in units])
    got = [torch.cat([u[4].detach() for u in units], 2)] + [torch.cat([u[3][i].grad for u in units], 2)
                                                              for i in range(3)]
    want = [y.detach()] + [t.grad for t in ref]
    return {what: _diff(a, b[:, :, mine]) for what, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def dropout_case(group, k, p=0.25):
    """p2p's attention dropout, attention alone (GQA, causal), the sequence whole or as k segments, each op with a
    seed of its own: against full attention in fp64 whose (s x s) dropout mask is assembled from the same blocks'
    masks (blocks.dropout_keep of the op's seed and the global spans of every rank's query and key tiles): the ring
    applies each block's mask alike forward and backward and merges the dropped blocks exactly. Also the fraction
    of the mask's visible elements dropped."""
    layout = ContextLayout.of(group)
    s, heads, kv_heads = length(layout.size), 8, 4
    g = torch.Generator().manual_seed(31)
    q, dy = (torch.randn(B, heads, s, D, generator=g) for _ in range(2))
    kv = [torch.randn(B, kv_heads, s, D, generator=g) for _ in range(2)]
    keep = torch.zeros(B, heads, s, s, dtype=torch.float64)
    cache, slot, units, start, spans = SegmentKVCache(), KVSlot(), [], 0, []
    for j, n in enumerate(segment_lengths(layout.size, k)):
        seed, mine = 1000 + j, layout.positions(n, start)
        spans.append((start, start + n))
        for r, r_key in itertools.product(range(layout.size), repeat=2):
            for qs in ring.tiles(chunk_spans(layout, n, start, r)):
                for ks in ring.tiles([span for a, b in spans for span in chunk_spans(layout, b - a, a, r_key)]):
                    keep[:, :, qs.start:qs.stop, ks.start:ks.stop] = dropout_keep(
                        seed, qs, ks, (B, heads, qs.length, ks.length), p).double()
        local = [t[:, :, mine].clone().requires_grad_() for t in (q, *kv)]
        with cache.segment(("mb", 0), start, start + n, s) as segment:
            out = context_parallel_attention(*local, group, "p2p", segment.spans, extend=_extender(segment, slot),
                                             dropout=p, seed=seed)
        units.append((start, n, mine, local, out))
        start += n
    for start, n, mine, _, out in reversed(units):
        with cache.segment(("mb", 0), start, start + n, s):
            out.backward(dy[:, :, mine])
    cache.free(("mb", 0))

    ref = [t.double().requires_grad_() for t in (q, *kv)]
    rq, rk, rv = ref[0], *(t.repeat_interleave(heads // kv_heads, dim=1) for t in ref[1:])
    scores = (rq @ rk.transpose(-1, -2)) * D ** -0.5
    causal = reference_mask(s, None)
    y = (scores.masked_fill(~causal, float("-inf")).softmax(-1) * keep) @ rv
    y.backward(dy.double())
    mine = torch.cat([u[2] for u in units])
    got = [torch.cat([u[4].detach() for u in units], 2)] + [torch.cat([u[3][i].grad for u in units], 2)
                                                              for i in range(3)]
    want = [y.detach()] + [t.grad for t in ref]
    out = {what: _diff(a, b[:, :, mine]) for what, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    return out, (keep[causal.expand_as(keep)] == 0).double().mean().item()


def recompute_dropout_case(group, comm, p=0.25):
    """CausalSelfAttention with attention dropout at CP C, from the same RNG state with and without selective
    recompute: the recomputed core draws the same dropout masks (outputs and gradients equal), and they drop."""
    layout = ContextLayout.of(group)
    s = length(layout.size)
    g = torch.Generator().manual_seed(41)
    x, dy = torch.randn(B, s, 32, generator=g), torch.randn(B, s, 32, generator=g)
    runs = []
    for extra in ({}, dict(recompute_granularity="selective"), {}):
        layer = CausalSelfAttention(layer_config("llama8", layout.size, comm, attention_dropout=p, **extra))
        torch.manual_seed(100 + layout.rank)
        local_x = layout.shard(x).requires_grad_()
        y = layer(local_x)
        y.backward(layout.shard(dy))
        runs.append([y.detach(), local_x.grad] + [p.grad for p in layer.parameters()])
    layer.eval()
    undropped = layer(layout.shard(x)).detach()
    out = {f"recomputed {i}": _diff(a, b) for i, (a, b) in enumerate(zip(runs[1], runs[0]))}
    out["rerun"] = _diff(runs[2][0], runs[0][0])
    return out, ((runs[0][0] - undropped).abs().max() / undropped.abs().max()).item()


def _extender(segment, slot):
    def extend(k, v, share):
        return segment.extend(slot, k, v, share)
    return extend


LAYERS = {
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", rope_theta=100.0,
                  num_key_value_heads=2, add_bias_linear=False, ffn_hidden_size=48),
    "bloom": dict(position_embedding_type="alibi"),
    # 8 query heads over 4 K/V heads: a2a shares them out at CP 4 too
    "llama8": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", rope_theta=100.0,
                   num_attention_heads=8, num_key_value_heads=4, add_bias_linear=False, ffn_hidden_size=48),
}


def layer_config(family, cp, comm, **kw):
    shape = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=256,
                 seed=3)
    shape.update(LAYERS[family])
    if comm == "a2a+p2p" and cp > 1:
        kw["hierarchical_context_parallel_sizes"] = HIERARCHY
    return GPTConfig(context_parallel_size=cp, cp_comm_type=comm, **shape, **kw)


def restarted_positions(tokens):
    """The documents' restarted positions, as Packing makes them."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == EOD
    return positions - torch.where(starts, positions, 0).cummax(1).values


def layer_case(group, comm, family, recompute, packed, scaling=None):
    """CausalSelfAttention at CP C against the same layer at CP 1 on the whole sequence: output, input gradient and
    the weight gradients summed over the CP ranks. `scaling`: RoPE scaling's dict (rope_scaling.py), or None."""
    layout = ContextLayout.of(group)
    s = length(layout.size)
    extra = dict(recompute_granularity="selective") if recompute else {}
    if scaling is not None:
        extra["rope_scaling"] = RopeScaling.from_dict(scaling)
    if packed:
        extra.update(eod_token=EOD, reset_attention_mask=True, reset_position_ids=True)
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(B, s, 32, generator=g), torch.randn(B, s, 32, generator=g)
    tokens = packed_tokens(s, 13) if packed else None

    def documents():
        if tokens is None:
            return contextlib.nullcontext()
        return Documents(tokens, EOD, restarted_positions(tokens) if family == "llama" else None).opened()

    ref_layer = CausalSelfAttention(layer_config(family, 1, comm, **extra))
    ref_x = x.clone().requires_grad_()
    with documents():
        y = ref_layer(ref_x)
        y.backward(dy)
    layer = CausalSelfAttention(layer_config(family, layout.size, comm, **extra))
    local_x = layout.shard(x).requires_grad_()
    with documents():
        with CommCounter.counting() as forward:
            local_y = layer(local_x)
        with CommCounter.counting() as backward:
            local_y.backward(layout.shard(dy))
    if not recompute and not packed:
        COUNTS[(comm, family)] = forward.summary(), backward.summary()
    out = {"out": _diff(local_y.detach(), layout.shard(y.detach())), "dx": _diff(local_x.grad, layout.shard(ref_x.grad))}
    for (name, p), (_, ref_p) in zip(layer.named_parameters(), ref_layer.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        out["d" + name] = _diff(grad, ref_p.grad)
    return out


def shared_storage_case(group, comm, packed):
    """What two CP layers (one op's, RoPE, 8 query and 4 K/V heads) keep of their output projection's input and of
    their RoPE tables, as storages: (how many saved tensors view each layer's c_proj input, the distinct storages
    of the saved tables (b or 1, 1, local tokens, head size) of either layer, of both)."""
    layout = ContextLayout.of(group)
    s = length(layout.size)
    extra = dict(eod_token=EOD, reset_attention_mask=True, reset_position_ids=True) if packed else {}
    config = layer_config("llama8", layout.size, comm, **extra)
    layers = [CausalSelfAttention(config), CausalSelfAttention(config)]
    tokens = packed_tokens(s, 13) if packed else None
    documents = Documents(tokens, EOD, restarted_positions(tokens)).opened() if packed else contextlib.nullcontext()
    inputs, saved, layer_of = [], [], [0]

    def keep(t):
        saved.append((layer_of[0], t))
        return t
    for layer in layers:
        layer.c_proj.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    x = torch.randn(B, s // layout.size, 32, generator=torch.Generator().manual_seed(7), requires_grad=True)
    with documents, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        for i, layer in enumerate(layers):
            layer_of[0] = i
            x = layer(x)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    keepers = [sum(ptr(t) == ptr(y) for _, t in saved) for y in inputs]
    head = config.head_dim
    tables = [{ptr(t) for i, t in saved if i == layer and t.dim() == 4 and t.shape[1:] == (1, s // layout.size, head)}
              for layer in (0, 1)]
    return keepers, [len(t) for t in tables], len(tables[0] | tables[1])


def segmented_layers_case(group, comm, k, checkpoint, packed, defer, selective=False):
    """Two LLaMA-style TransformerLayers run as the Seq1F1B runtime runs them, each segment laid out over the CP
    ranks on its own, forward segments in order then backward last first (under activation checkpointing, and with
    the weight gradients deferred to after every B, or under selective recompute), against the layers at CP 1 on the
    whole sequence. Also the
    shapes of the cached K/V after the last forward: what each comm type keeps per rank."""
    layout = ContextLayout.of(group)
    s = length(layout.size)
    extra = dict(eod_token=EOD, reset_attention_mask=True, reset_position_ids=True) if packed else {}
    if selective:
        extra["recompute_granularity"] = "selective"
    tokens = packed_tokens(s, 17) if packed else None
    g = torch.Generator().manual_seed(9)
    x, dy = torch.randn(B, s, 32, generator=g), torch.randn(B, s, 32, generator=g)

    def documents():
        return Documents(tokens, EOD, restarted_positions(tokens)).opened() if packed else contextlib.nullcontext()

    def layers(cp):
        config = layer_config("llama8", cp, comm, **extra)
        return torch.nn.Sequential(TransformerLayer(config, 1), TransformerLayer(config, 2))

    ref = layers(1)
    ref_x = x.clone().requires_grad_()
    with documents():
        y = ref(ref_x)
        y.backward(dy)
    model, cache, key, units, start = layers(layout.size), SegmentKVCache(), ("mb", 0), [], 0
    for n in segment_lengths(layout.size, k):
        mine = layout.positions(n, start)
        xs = x[:, mine].clone().requires_grad_()
        with cache.segment(key, start, start + n, s), documents():
            ys = torch.utils.checkpoint.checkpoint(model, xs, use_reentrant=False) if checkpoint else model(xs)
        units.append((start, n, mine, xs, ys))
        start += n
    kv_shapes = sorted({tuple(t.shape) for t in cache.kv_tensors()})
    queues = []
    for start, n, mine, xs, ys in reversed(units):
        queue = []
        with cache.segment(key, start, start + n, s), documents(), \
                WeightGradStore.deferring(queue) if defer else contextlib.nullcontext():
            ys.backward(dy[:, mine])
        queues.append(queue)
    for queue in queues:
        WeightGradStore.drain(queue)
    cache.free(key)
    mine = torch.cat([u[2] for u in units])
    out = {"out": _diff(torch.cat([u[4].detach() for u in units], 1), y.detach()[:, mine]),
           "dx": _diff(torch.cat([u[3].grad for u in units], 1), ref_x.grad[:, mine])}
    for (name, p), (_, ref_p) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        out["d" + name] = _diff(grad, ref_p.grad)
    return out, kv_shapes


def hierarchical_cases(group):
    """--cp-comm-type a2a+p2p at CP 4 = 2 x 2 (its groups made as pipe/parallel/context_parallel.py makes them):
    attention alone (MHA and GQA, causal and packed documents, whole and as 2 and 4 Seq1F1B segments), the layer
    (LLaMA, BLOOM's ALiBi, 8 heads over 4 K/V; selective recompute, documents), two layers as Seq1F1B segments, the
    K/V each rank caches, bf16, selective recompute's dropout, and the refusal of K/V heads that do not divide by A.
    Keys start with "a2a+p2p"."""
    ranks = list(range(dist.get_world_size()))
    subgroups = [(sub, dist.new_group(ranks=sub)) for sub in levels(ranks, HIERARCHY)]
    mine = tuple(g for sub, g in subgroups if dist.get_rank() in sub)
    set_context_parallel_group(group, len(ranks), mine, HIERARCHY)
    comm, results = "a2a+p2p", {}
    try:
        for name, heads, kv_heads in (("mha", 4, 4), ("gqa", 8, 4)):
            for packed in (False, True):
                for k in (1, 2, 4):
                    results[(comm, "attention", name, packed, k)] = attention_case(group, comm, heads, kv_heads,
                                                                                  packed, k)
        for family in LAYERS:
            for recompute in (False, True):
                for packed in (False, True):
                    results[(comm, "layer", family, recompute, packed)] = layer_case(group, comm, family, recompute,
                                                                                    packed)
        for k in (2, 4):
            for variant in ((False, False, False), (True, False, False), (False, True, True),
                            (False, True, False, True)):
                results[(comm, "segmented", k, *variant)], results[("kv", comm, k)] = \
                    segmented_layers_case(group, comm, k, *variant)
        results[("bf16", comm)] = attention_case(group, comm, 8, 4, True, 2, torch.bfloat16)
        results[("recompute dropout", comm)], results[("dropout effect", comm)] = recompute_dropout_case(group, comm)
        try:
            context_parallel_attention(*(torch.zeros(1, 3, 4, D) for _ in range(3)), group, comm, ((0, 16),))
            results["a2a+p2p refusal"] = ""
        except ValueError as e:
            results["a2a+p2p refusal"] = str(e)
    finally:
        set_context_parallel_group(group, len(ranks))
    results["comm"] = dict(COUNTS)
    return results


def tensor_and_context_parallel_cases():
    """TP 2 x CP 2 on 4 ranks (Megatron's order, TP fastest: the CP group is the data axis of a TP 2 layout), with
    and without sequence parallelism: CausalSelfAttention against the same TP layer at CP 1 on the whole sequence
    (weight gradients: the TP rank's slice, summed over its CP group)."""
    state = initialize_model_parallel(1, 2)
    tp_group, cp_group = state.get_tensor_model_parallel_group(), state.get_data_parallel_group()
    set_context_parallel_group(cp_group, 2)
    layout, tp_rank = ContextLayout.of(cp_group), state.get_tensor_model_parallel_rank()
    s = length(2)
    g = torch.Generator().manual_seed(21)
    x, dy = torch.randn(B, s, 32, generator=g), torch.randn(B, s, 32, generator=g)
    results = {}
    for comm in COMM_TYPES:
        for family in ("llama", "bloom"):
            for sp in (False, True):
                if family == "llama" and comm == "a2a":
                    continue  # 1 K/V head per TP rank
                tp = dict(tensor_model_parallel_size=2, sequence_parallel=sp)

                def cut(t, cp_layout):
                    t = cp_layout.shard(t)
                    return (t.chunk(2, 1)[tp_rank] if sp else t).clone()

                ref_layer = CausalSelfAttention(layer_config(family, 1, comm, **tp))
                ref_x = cut(x, ContextLayout(1, 0)).requires_grad_()
                y = ref_layer(ref_x)
                y.backward(cut(dy, ContextLayout(1, 0)))
                layer = CausalSelfAttention(layer_config(family, 2, comm, **tp))
                local_x = cut(x, layout).requires_grad_()
                local_y = layer(local_x)
                local_y.backward(cut(dy, layout))
                if sp:  # the layer's output and input gradient are the TP rank's share of the CP rank's tokens
                    want_y, want_dx = (_unsplit(t, tp_group) for t in (y.detach(), ref_x.grad))
                    got_y, got_dx = (_unsplit(t, tp_group) for t in (local_y.detach(), local_x.grad))
                    want_y, want_dx = layout.shard(want_y), layout.shard(want_dx)
                else:
                    want_y, want_dx, got_y, got_dx = layout.shard(y.detach()), layout.shard(ref_x.grad), \
                        local_y.detach(), local_x.grad
                out = {"out": _diff(got_y, want_y), "dx": _diff(got_dx, want_dx)}
                for (name, p), (_, ref_p) in zip(layer.named_parameters(), ref_layer.named_parameters()):
                    grad = p.grad.clone()
                    dist.all_reduce(grad, group=cp_group)
                    out["d" + name] = _diff(grad, ref_p.grad)
                results[("tp x cp", comm, family, sp)] = out
    return results


def _unsplit(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, 1)


COUNTS = {}  # (comm type, family) -> the layer's ({op: (count, bytes)} forward, backward)


def compiled_layers_case(group, comm):
    """Two LLaMA-style TransformerLayers compiled (compile_layers, aot_eager: dynamo's graphs without inductor's
    code generation) at CP C against the eager layers at CP 1; the graph breaks that are not by design, and the
    seconds spent compiling (> 0: the layers did compile)."""
    from megatron_ds.model.compile import compile_layers, compile_seconds, unplanned_graph_breaks  # lazy: dynamo
    layout = ContextLayout.of(group)
    s = length(layout.size)
    g = torch.Generator().manual_seed(23)
    x, dy = torch.randn(B, s, 32, generator=g), torch.randn(B, s, 32, generator=g)

    def layers(cp):
        config = layer_config("llama8", cp, comm)
        return torch.nn.Sequential(TransformerLayer(config, 1), TransformerLayer(config, 2))

    ref, model = layers(1), layers(layout.size)
    ref_x = x.clone().requires_grad_()
    y = ref(ref_x)
    y.backward(dy)
    compile_layers(list(model), defer_weight_grads=False, backend="aot_eager")
    local_x = layout.shard(x).requires_grad_()
    local_y = model(local_x)
    local_y.backward(layout.shard(dy))
    out = {"out": _diff(local_y.detach(), layout.shard(y.detach())), "dx": _diff(local_x.grad, layout.shard(ref_x.grad))}
    for (name, p), (_, ref_p) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        out["d" + name] = _diff(grad, ref_p.grad)
    return out, (unplanned_graph_breaks(), compile_seconds())


def run_all(world):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    group = dist.group.WORLD
    set_context_parallel_group(group, world)
    results = {}
    for comm in COMM_TYPES:
        for name, heads, kv_heads in (("mha", 4, 4), ("gqa", 8, 4)):
            for packed in (False, True):
                for k in (1, 2, 4):
                    results[("attention", comm, name, packed, k)] = attention_case(group, comm, heads, kv_heads,
                                                                                  packed, k)
        for family in LAYERS:
            for recompute in (False, True):
                for packed in (False, True):
                    if family == "llama" and comm == "a2a" and world > 2:
                        continue  # 2 K/V heads do not divide among 4 ranks (the refusal is a case of its own)
                    results[("layer", comm, family, recompute, packed)] = layer_case(group, comm, family, recompute,
                                                                                     packed)
        for k in (2, 4):
            for variant in ((False, False, False), (True, False, False), (False, True, True), (False, True, False, True)):
                results[("segmented", comm, k, *variant)], results[("kv", comm, k)] = \
                    segmented_layers_case(group, comm, k, *variant)
        for packed in (False, True):
            if comm != "a2a" or world == 2:  # LLaMA's 2 K/V heads (above)
                results[("layer", comm, "llama yarn", False, packed)] = layer_case(group, comm, "llama", False,
                                                                                   packed, YARN)
            results[("shared", comm, packed)] = shared_storage_case(group, comm, packed)
    try:
        context_parallel_attention(*(torch.zeros(1, world + 1, 2, D) for _ in range(3)), group, "a2a",
                                   ((0, 2 * world),))
        results["a2a refusal"] = ""
    except ValueError as e:
        results["a2a refusal"] = str(e)
    for k in (1, 2):
        results[("dropout", k)], results[("dropped", k)] = dropout_case(group, k)
    tile, ring.TILE = ring.TILE, 3  # chunks of 8 tokens in tiles of 3, 3 and 2
    try:
        results[("attention", "p2p tiled", "gqa", True, 2)] = attention_case(group, "p2p", 8, 4, True, 2)
        results[("dropout", "tiled")] = dropout_case(group, 2)[0]
    finally:
        ring.TILE = tile
    for comm in COMM_TYPES:  # bf16 in and out (p2p and the gradient sums accumulate in fp32)
        results[("bf16", comm)] = attention_case(group, comm, 8, 4, True, 2, torch.bfloat16)
    side, documents_module.DENSE_SIDE = documents_module.DENSE_SIDE, 4  # documents attended group by group
    try:
        for comm in ("allgather", "a2a"):
            results[("attention", comm + " grouped", "gqa", True, 2)] = attention_case(group, comm, 8, 4, True, 2)
    finally:
        documents_module.DENSE_SIDE = side
    for comm in COMM_TYPES:
        results[("recompute dropout", comm)], results[("dropout effect", comm)] = recompute_dropout_case(group, comm)
    results["comm"] = dict(COUNTS)
    if world == 2:  # last: compiling changes how later caches lay out their buffers. One comm type: each is the
        # same call out of the graph (outside_graph), and compiling costs seconds
        results[("compiled", "p2p")], results["graph breaks"] = compiled_layers_case(group, "p2p")
    if world == 4:
        results.update(hierarchical_cases(group))
        results.update(tensor_and_context_parallel_cases())
    return results
