"""What each rank of a context-parallel launch computes (tests/model/context_parallel/test_attention.py): CP attention
of every --cp-comm-type against full attention of the whole sequence on one process, which every rank also does
itself (attention alone: in fp64, the exact values; the layer: at CP 1 in fp32). Returns per case the largest differences and the largest reference values: the output, the
gradients of q, k, v (attention alone) or of the input and the weights summed over the CP ranks (the layer)."""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.gpt_config import GPTConfig
from megatron_ds.model.attention import CausalSelfAttention
from megatron_ds.model.context_parallel import ContextLayout, set_context_parallel_group
from megatron_ds.model.context_parallel.attend import context_parallel_attention
from megatron_ds.model.documents import Documents
from megatron_ds.model.kv_cache import KVSlot, SegmentKVCache

B, D = 2, 8
EOD = 0
COMM_TYPES = ("p2p", "allgather", "a2a")


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


def attention_case(group, comm, heads, kv_heads, packed, k):
    """Attention alone: {what: (max diff, max reference value)} over this rank's positions."""
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
        local = [t[:, :, mine].clone().requires_grad_() for t in (q, *kv)]
        with cache.segment(("mb", 0), start, start + n, s) as segment, _documents(tokens):
            out = context_parallel_attention(*local, group, comm, segment.spans, extend=_extender(segment, slot))
        units.append((start, n, mine, local, out))
        start += n
    for start, n, mine, _, out in reversed(units):
        with cache.segment(("mb", 0), start, start + n, s), _documents(tokens):
            out.backward(dy[:, :, mine])
    cache.free(("mb", 0))
    mine = torch.cat([u[2] for u in units])
    got = [torch.cat([u[4].detach() for u in units], 2)] + [torch.cat([u[3][i].grad for u in units], 2)
                                                              for i in range(3)]
    want = [y.detach()] + [t.grad for t in ref]
    return {what: _diff(a, b[:, :, mine]) for what, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def _extender(segment, slot):
    def extend(k, v, share):
        return segment.extend(slot, k, v, share)
    return extend


LAYERS = {
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", rope_theta=100.0,
                  num_key_value_heads=2, add_bias_linear=False, ffn_hidden_size=48),
    "bloom": dict(position_embedding_type="alibi"),
}


def layer_config(family, cp, comm, **kw):
    return GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, max_position_embeddings=256,
                     seed=3, context_parallel_size=cp, cp_comm_type=comm, **LAYERS[family], **kw)


def layer_case(group, comm, family, recompute, packed):
    """CausalSelfAttention at CP C against the same layer at CP 1 on the whole sequence: output, input gradient and
    the weight gradients summed over the CP ranks."""
    layout = ContextLayout.of(group)
    s = length(layout.size)
    extra = dict(recompute_granularity="selective") if recompute else {}
    if packed:
        extra.update(eod_token=EOD, reset_attention_mask=True, reset_position_ids=True)
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(B, s, 32, generator=g), torch.randn(B, s, 32, generator=g)
    tokens = packed_tokens(s, 13) if packed else None

    def documents():
        if tokens is None:
            return contextlib.nullcontext()
        positions = torch.arange(s).expand_as(tokens)  # the restarted positions, as Packing makes them
        starts = torch.ones_like(tokens, dtype=torch.bool)
        starts[:, 1:] = tokens[:, :-1] == EOD
        positions = positions - torch.where(starts, positions, 0).cummax(1).values
        return Documents(tokens, EOD, positions if family == "llama" else None).opened()

    ref_layer = CausalSelfAttention(layer_config(family, 1, comm, **extra))
    ref_x = x.clone().requires_grad_()
    with documents():
        y = ref_layer(ref_x)
        y.backward(dy)
    layer = CausalSelfAttention(layer_config(family, layout.size, comm, **extra))
    local_x = layout.shard(x).requires_grad_()
    with documents():
        local_y = layer(local_x)
        local_y.backward(layout.shard(dy))
    out = {"out": _diff(local_y.detach(), layout.shard(y.detach())), "dx": _diff(local_x.grad, layout.shard(ref_x.grad))}
    for (name, p), (_, ref_p) in zip(layer.named_parameters(), ref_layer.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        out["d" + name] = _diff(grad, ref_p.grad)
    return out


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
    try:
        context_parallel_attention(*(torch.zeros(1, world + 1, 2, D) for _ in range(3)), group, "a2a",
                                   ((0, 2 * world),))
        results["a2a refusal"] = ""
    except ValueError as e:
        results["a2a refusal"] = str(e)
    return results
