"""Segment-wise causal attention through the K/V cache equals full causal attention (fp32):
forward outputs, input gradients and weight gradients, for k in {1, 2, 4} segments split
evenly or FLOP-balanced, with activation-checkpoint recomputation and with deferred W;
and so for the LLaMA layers (RoPE at the segment's positions, grouped K/V heads, which the
cache holds as they are), the Qwen3 layers (each query and key head normalised before RoPE: the cache
holds the normalised keys) and the BLOOM layers (ALiBi offsets)."""
import contextlib

import pytest
import torch
import torch.utils.checkpoint as tc

from megatron_ds.model import GPTConfig, TransformerLayer, WeightGradStore
from megatron_ds.model.attention import CausalSelfAttention
from megatron_ds.model.kv_cache import KVSlot, SegmentKVCache
from megatron_ds.schedules.seq_split import balanced_segment_lengths, even_segment_lengths

B, S, H = 2, 64, 32
ATOL = 1e-5


FAMILIES = {
    "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", rope_theta=100.0,
                  num_key_value_heads=2, add_bias_linear=False, ffn_hidden_size=48),
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
    "qwen3": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope", rope_theta=100.0,
                  num_key_value_heads=2, add_bias_linear=False, ffn_hidden_size=48, qk_layernorm=True),
}


def config(**kw):
    return GPTConfig(vocab_size=64, hidden_size=H, num_layers=2, num_attention_heads=4,
                     max_position_embeddings=S, seed=3, **kw)


def lengths_for(k, method):
    cfg = config()
    if method == "even":
        return even_segment_lengths(S, k)
    return balanced_segment_lengths(S, k, cfg.hidden_size, cfg.ffn_hidden_size)


def two_layers(**kw):
    cfg = config(**kw)  # each layer draws its weights from its own seed
    return torch.nn.Sequential(TransformerLayer(cfg, 1), TransformerLayer(cfg, 2))


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def full_run(module, x, grad_out):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(grad_out)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def segmented_run(module, x, grad_out, lengths, checkpoint=None, defer=False, cache=None, key=("mb", 0)):
    """Forward segments 0..k-1, then backward k-1..0, each segment its own graph (as the runtime does)."""
    cache = cache or SegmentKVCache()
    units = forward_segments(module, x, lengths, cache, key, checkpoint)
    return backward_segments(module, units, grad_out, cache, key, defer)


def forward_segments(module, x, lengths, cache, key, checkpoint=None):
    units, start = [], 0
    for n in lengths:
        xs = x[:, start:start + n].clone().requires_grad_()
        with cache.segment(key, start, start + n, S):
            ys = tc.checkpoint(module, xs, use_reentrant=checkpoint == "reentrant") if checkpoint else module(xs)
        units.append((start, n, xs, ys))
        start += n
    return units


def backward_segments(module, units, grad_out, cache, key, defer=False):
    """The backward of forward_segments' units, last first: (output, input gradient, weight gradients)."""
    queues = []
    for start, n, xs, ys in reversed(units):
        with cache.segment(key, start, start + n, S):  # open for recomputation
            queue = []
            with WeightGradStore.deferring(queue) if defer else contextlib.nullcontext():
                ys.backward(grad_out[:, start:start + n])
            queues.append(queue)
    if defer:
        # every K/V gradient reached its segment in B: input gradients are final before any W
        x_grad = torch.cat([xs.grad for _, _, xs, _ in units], dim=1)
        for queue in queues:
            WeightGradStore.drain(queue)
    cache.free(key)
    assert key not in cache.keys()
    y = torch.cat([ys.detach() for *_, ys in units], dim=1)
    x_grad_final = torch.cat([xs.grad for _, _, xs, _ in units], dim=1)
    if defer:
        assert torch.equal(x_grad, x_grad_final)
    return y, x_grad_final, {n: p.grad.clone() for n, p in module.named_parameters()}


def assert_close(a, b, what):
    diff = (a - b).abs().max().item()
    assert diff <= ATOL, f"{what}: max abs diff {diff:.3g}"


def compare(module_factory, lengths, **kw):
    x, g = inputs()
    ref = full_run(module_factory(), x, g)
    got = segmented_run(module_factory(), x, g, lengths, **kw)
    assert_close(got[0], ref[0], "output")
    assert_close(got[1], ref[1], "input gradient")
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        assert_close(got[2][name], ref[2][name], f"gradient of {name}")


@pytest.mark.parametrize("method", ["even", "balanced"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_segment_attention_equals_full_causal_attention(k, method):
    lengths = lengths_for(k, method)
    assert sum(lengths) == S and len(lengths) == k

    def attention():
        torch.manual_seed(0)
        return CausalSelfAttention(config())
    compare(attention, lengths)


def test_balanced_split_is_uneven_here():
    assert len(set(lengths_for(4, "balanced"))) > 1  # the tests above then cover unequal segments


@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_transformer_layers_with_recompute(checkpoint):
    compare(two_layers, lengths_for(4, "balanced"), checkpoint=checkpoint)


def test_deferred_weight_gradients_keep_kv_gradients_in_b():
    compare(two_layers, [24, 8, 32], defer=True)


@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
@pytest.mark.parametrize("lengths", [[32, 32], [24, 8, 32], [16, 16, 8, 24]])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_layers_segmented_equal_full(family, lengths, checkpoint):
    compare(lambda: two_layers(**FAMILIES[family]), lengths, checkpoint=checkpoint, defer=checkpoint is None)


def test_cache_holds_grouped_kv_heads():
    layers = two_layers(**FAMILIES["llama"])
    cache, x = SegmentKVCache(), inputs()[0]
    for start in (0, 32):
        with cache.segment(("mb", 0), start, start + 32, S):
            layers(x[:, start:start + 32])
    shapes = {tuple(t.shape) for t in cache.kv_tensors()}
    assert shapes == {(2, B, 2, S, H // 4)}  # keys and values of 2 K/V heads, not the 4 query heads repeated


def test_without_an_open_segment_attention_is_plain_causal_sdpa():
    torch.manual_seed(0)
    attn = CausalSelfAttention(config())
    x, _ = inputs()
    q, k, v = attn.c_attn(x).split(H, dim=2)
    q, k, v = (t.view(B, S, 4, H // 4).transpose(1, 2) for t in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, H)
    assert torch.equal(attn(x), attn.c_proj(y))


def test_backward_out_of_order_is_refused():
    torch.manual_seed(0)
    attn = CausalSelfAttention(config())
    cache, outs, start = SegmentKVCache(), [], 0
    x, g = inputs()
    for n in (32, 32):
        with cache.segment(("mb", 0), start, start + n, S):
            outs.append(attn(x[:, start:start + n].clone().requires_grad_()))
        start += n
    with pytest.raises(RuntimeError, match="last segment first"):
        outs[0].backward(g[:, :32])


def test_forward_out_of_order_is_refused():
    torch.manual_seed(0)
    attn = CausalSelfAttention(config())
    cache = SegmentKVCache()
    x, _ = inputs()
    with pytest.raises(RuntimeError, match="in order"), cache.segment(("mb", 0), 32, S, S):
        attn(x[:, 32:])


def test_cpu_causal_mask_is_one_strided_row_and_exact_at_kernel_block_sizes():
    """Queries last first make the bottom-right causal mask row[i + j]: lq + lk - 1 values per segment
    shape instead of lq x lk; checked against a dense mask over several of the CPU kernel's blocks."""
    b, heads, d, lq, lk = 1, 2, 16, 300, 1100
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, d, generator=g) for n in (lq, lk, lk))
    cache, slot = SegmentKVCache(), KVSlot()
    for start, end in ((0, lk - lq), (lk - lq, lk)):
        with cache.segment(("mb", 0), start, end, lk) as seg:
            keys, values = seg.extend(slot, k[:, :, start:end], v[:, :, start:end])
    got = torch.nn.functional.scaled_dot_product_attention(seg.queries(q), keys, values,
                                                           attn_mask=seg.causal_mask(q, keys))
    assert [t.untyped_storage().nbytes() for t in cache.mask_tensors()] == [(lq + lk - 1) * 4]
    dense = torch.zeros(lq, lk).masked_fill_(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), float("-inf"))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert_close(seg.outputs(got.transpose(1, 2)).transpose(1, 2), want, "attention with the strided mask")


def test_kv_buffers_are_written_in_place_and_owed_gradients_wait_for_the_backward():
    """A cache for compiled layers (not growing): the micro-batch's K/V buffer is laid out once at its full
    length and each segment writes its positions in place (no copy of earlier ones); the owed-gradient buffer
    gets memory only when the first backward opens; a second micro-batch of the chunk gets its buffers when
    its segment opens."""
    cache, slot, k = SegmentKVCache(growing=False), KVSlot(), torch.randn(1, 2, 48, 8, requires_grad=True)
    pointers, outs = [], []
    for start, end in ((0, 24), (24, 32), (32, 48)):
        with cache.segment(("mb", 0), start, end, 48) as seg:
            outs.append(seg.extend(slot, k[:, :, start:end], k[:, :, start:end])[0])
        pointers.append({t.untyped_storage().data_ptr() for t in cache.kv_tensors()})
    assert len(pointers[0]) == 1 and pointers[0] == pointers[1] == pointers[2]
    assert torch.equal(next(cache.kv_tensors()), torch.stack([k.detach()] * 2))
    assert slot.buffers is None  # nothing held once the segment closes
    entry = cache._entries[("mb", 0)][slot]
    assert entry.owed.nbytes() == 0
    with cache.segment(("mb", 0), 32, 48, 48):
        assert entry.owed.nbytes() == 2 * 48 * 2 * 8 * 4
        outs[2].sum().backward()
    assert torch.equal(k.grad[:, :, 32:], torch.ones(1, 2, 16, 8))
    with cache.segment(("mb", 1), 0, 24, 48):  # laid out before any layer runs
        assert [tuple(t.shape) for t in slot.buffers] == [(2, 1, 2, 48, 8)] * 2


def test_eager_kv_buffers_hold_the_positions_in_flight_only():
    """Eager (growing), a micro-batch's K/V buffer holds positions [0, stop) of its last segment run forward,
    and shrinks to each segment's stop as its backward opens (the owed gradients with it); the keys and values
    written survive every resize, and the gradients equal one unsegmented pass."""
    cache, slot = SegmentKVCache(), KVSlot()
    k, v = torch.randn(1, 2, 48, 8, requires_grad=True), torch.randn(1, 2, 48, 8, requires_grad=True)
    position = 2 * 2 * 8 * 4  # keys and values of one position: 2 heads x 8, fp32
    outs, held = [], []
    for start, end in ((0, 24), (24, 32), (32, 48)):
        with cache.segment(("mb", 0), start, end, 48) as seg:
            keys, values = seg.extend(slot, k[:, :, start:end], v[:, :, start:end])
            outs.append((keys * values).sum())
        held.append(cache._entries[("mb", 0)][slot].kv.nbytes())
    assert held == [24 * position, 32 * position, 48 * position]
    assert torch.equal(next(cache.kv_tensors()), torch.stack([k.detach(), v.detach()]))
    entry, owed = cache._entries[("mb", 0)][slot], []
    for (start, end), out in zip(((32, 48), (24, 32), (0, 24)), reversed(outs)):
        with cache.segment(("mb", 0), start, end, 48):
            assert entry.kv.nbytes() == entry.owed.nbytes() == end * position
            out.backward()
            owed.append(entry.owed.nbytes())
    assert owed == [48 * position, 32 * position, 24 * position]
    k_ref, v_ref = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    sum((k_ref[:, :, :end] * v_ref[:, :, :end]).sum() for end in (24, 32, 48)).backward()
    assert torch.equal(k.grad, k_ref.grad) and torch.equal(v.grad, v_ref.grad)


def test_static_cache_gives_each_micro_batch_the_same_buffers_every_iteration():
    """A static cache (CUDA graphs: the buffers are the compiled layers' static inputs) keeps freed buffers
    and hands out the first free ones: with two micro-batches in flight each gets its own, the next
    iteration gives each the same memory again (and zeroes its owed gradients again: the results equal
    full attention every time), and every tensor over them is marked a static input. An ordinary cache
    keeps nothing once a micro-batch is freed."""
    lengths, (x, g) = [16, 16, 32], inputs()
    layers = two_layers(**FAMILIES["llama"])
    ref = full_run(layers, x, g)
    cache, pointers = SegmentKVCache(static=True), []
    for _ in range(2):
        layers.zero_grad(set_to_none=True)
        units = {mb: forward_segments(layers, x, lengths, cache, ("chunk", mb)) for mb in (0, 1)}
        pointers.append({mb: sorted(t.untyped_storage().data_ptr() for t in entries_tensors(cache, mb))
                         for mb in (0, 1)})
        for mb in (0, 1):
            got = backward_segments(layers, units[mb], g, cache, ("chunk", mb))
            assert_close(got[0], ref[0], "output")
            assert_close(got[1], ref[1], "input gradient")
        for name in ref[2]:  # two micro-batches' weight gradients
            assert_close(got[2][name], 2 * ref[2][name], f"gradient of {name}")
    assert pointers[1] == pointers[0]
    assert not set(pointers[0][0]) & set(pointers[0][1])
    assert sum(len(entries) for entries in cache._pool.values()) == 2 * len(layers)
    with cache.segment(("chunk", 2), 0, 16, S) as seg:
        assert len(seg.filled) == len(layers)
        assert all(t._dynamo_static_input_type == "unguarded" for slot in seg.filled for t in slot.buffers)
    ordinary = SegmentKVCache()
    segmented_run(layers, x, g, lengths, cache=ordinary, key=("chunk", 0))
    assert ordinary._pool == {} and ordinary.keys() == []


def entries_tensors(cache, mb):
    return [entry._tensor(entry.kv) for entry in cache._entries[("chunk", mb)].values()]


def test_compiled_layers_run_a_segment_as_one_graph():
    """Compiled (regional, per layer), a segment's pass through the cache is inside the layer's graph:
    after the chunk's first segment (run eagerly: the cache learns the layers there) every layer runs
    each segment as one compiled graph, nothing breaks or compiles again, and every micro-batch
    equals full attention."""
    from torch._dynamo.utils import counters
    from torch.profiler import profile
    from megatron_ds.model.compile import compile_layers
    lengths, (x, g) = [16, 16, 32], inputs()
    ref = full_run(two_layers(**FAMILIES["llama"]), x, g)
    layers, cache = two_layers(**FAMILIES["llama"]), SegmentKVCache()
    compile_layers(list(layers), defer_weight_grads=False)
    compiled, breaks = [], sum(counters["graph_break"].values())
    for mb in range(3):
        layers.zero_grad(set_to_none=True)
        graphs = counters["stats"]["unique_graphs"]
        with profile() as prof:
            got = segmented_run(layers, x, g, lengths, cache=cache, key=("chunk", mb))
        compiled.append(sum(e.name == "CompiledFunction" for e in prof.events()))
        assert_close(got[0], ref[0], "output")
        assert_close(got[1], ref[1], "input gradient")
        for name in ref[2]:
            assert_close(got[2][name], ref[2][name], f"gradient of {name}")
    assert compiled[1:] == [len(layers) * len(lengths)] * 2, compiled
    assert counters["stats"]["unique_graphs"] == graphs  # the third micro-batch compiled nothing
    assert sum(counters["graph_break"].values()) == breaks
    assert cache.keys() == []
