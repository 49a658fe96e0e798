"""What every rank of the shared tensor-parallel launch computes: one entry per case.

Each case builds the dense layer and the parallel one from the same full weights, runs
both on the same data and reports the largest differences (forward output, input
gradient, gathered weight gradients) and whether the deferred-W gradients equal the
fused ones bit for bit. The tests assert on these numbers.
"""
import contextlib
import importlib.util
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.model import GPTConfig, GPTModel
from megatron_ds.model.layers import gpt_loss, loss_function
from megatron_ds.model.linear import Linear, WeightGradStore
from megatron_ds.model.tensor_parallel import (ColumnParallelLinear, ParallelState, RowParallelLinear,
                                               initialize_model_parallel,
                                               VocabParallelEmbedding, gather_from_region, gather_from_sequence,
                                               get_rng_tracker, model_parallel_manual_seed,
                                               reduce_scatter_to_sequence, scatter_to_region, scatter_to_sequence,
                                               shard, unshard, vocab_parallel_cross_entropy, vocab_parallel_loss)
from megatron_ds.model.tensor_parallel.comm import rank as tp_rank
from megatron_ds.model.tensor_parallel.comm import world_size as tp_size

B, S = 2, 8  # S splits over 4 sequence-parallel ranks


def _data(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _init(seed, std=0.3):
    return lambda w: w.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def _gather(local, group, dim, sections=None):
    pieces = [torch.empty_like(local) for _ in range(tp_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return unshard(pieces, dim, sections)


def _diff(a, b):
    """Largest difference, relative to the reference's largest magnitude when that exceeds 1 (a sum split
    over ranks rounds differently: a few ulps of the values, not of 1)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


def _dense_linear(in_f, out_f, weight_init, bias):
    layer = Linear(in_f, out_f)
    with torch.no_grad():
        weight_init(layer.weight)
        layer.bias.copy_(bias)
    return layer


def _seq_shard(t, group):
    return t.chunk(tp_size(group), 1)[tp_rank(group)]


def _backward(loss, deferred, weight):
    """loss.backward(), or as a B op and then its W op; True when B left the weight gradient to W."""
    if not deferred:
        loss.backward()
        return True
    queue = []
    with WeightGradStore.deferring(queue):
        loss.backward()
    left_to_w = len(queue) == 1 and weight.grad is None
    WeightGradStore.drain(queue)
    return left_to_w


def column_case(group, sp, deferred):
    """Fused QKV with grouped K/V heads: 2*TP query heads, TP K/V heads, head size 4."""
    tp, r = tp_size(group), tp_rank(group)
    nh, nkv, d, h = 2 * tp, tp, 4, 16
    sections = [nh * d, nkv * d, nkv * d]
    out_f = sum(sections)
    bias = _data(out_f, seed=3)
    dense = _dense_linear(h, out_f, _init(11), bias)
    layer = ColumnParallelLinear(h, out_f, init_method=_init(11), group=group, sections=sections, sequence_parallel=sp)
    with torch.no_grad():
        layer.bias.copy_(shard(bias, r, tp, 0, sections))
    x, gy = _data(B, S, h, seed=1), _data(B, S, out_f, seed=2)
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    (yd * gy).sum().backward()
    xp = (_seq_shard(x, group) if sp else x).clone().requires_grad_()
    y = layer(xp)
    left_to_w = _backward((y * shard(gy, r, tp, -1, sections)).sum(), deferred, layer.weight)
    return dict(
        init=_diff(_gather(layer.weight.detach(), group, 0, sections), dense.weight.detach()),
        out=_diff(y, shard(yd, r, tp, -1, sections)),
        grad_x=_diff(xp.grad, _seq_shard(xd.grad, group) if sp else xd.grad),
        grad_w=_diff(_gather(layer.weight.grad, group, 0, sections), dense.weight.grad),
        grad_b=_diff(_gather(layer.bias.grad, group, 0, sections), dense.bias.grad),
        deferred_to_w=left_to_w,
        local_grads=(layer.weight.grad.clone(), layer.bias.grad.clone(), xp.grad.clone()))


def row_case(group, sp, deferred):
    tp, r = tp_size(group), tp_rank(group)
    in_f, out_f = 8 * tp, 12
    bias = _data(out_f, seed=4)
    dense = _dense_linear(in_f, out_f, _init(12), bias)
    layer = RowParallelLinear(in_f, out_f, init_method=_init(12), group=group, sequence_parallel=sp)
    with torch.no_grad():
        layer.bias.copy_(bias)
    x, gy = _data(B, S, in_f, seed=5), _data(B, S, out_f, seed=6)
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    (yd * gy).sum().backward()
    xp = shard(x, r, tp, -1).clone().requires_grad_()
    y = layer(xp)
    left_to_w = _backward((y * (_seq_shard(gy, group) if sp else gy)).sum(), deferred, layer.weight)
    grad_b = layer.bias.grad.clone()
    if sp:  # each rank's bias gradient covers its tokens: the sum over the group is the gradient
        dist.all_reduce(grad_b, group=group)
    return dict(
        init=_diff(_gather(layer.weight.detach(), group, 1), dense.weight.detach()),
        out=_diff(y, _seq_shard(yd, group) if sp else yd),
        grad_x=_diff(xp.grad, shard(xd.grad, r, tp, -1)),
        grad_w=_diff(_gather(layer.weight.grad, group, 1), dense.weight.grad),
        grad_b=_diff(grad_b, dense.bias.grad),
        deferred_to_w=left_to_w,
        local_grads=(layer.weight.grad.clone(), layer.bias.grad.clone(), xp.grad.clone()))


def _gqa(qkv, nh, nkv, d):
    """Causal attention on a fused [q | k | v] projection with nh query and nkv key/value heads."""
    b, s = qkv.shape[:2]
    q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    q = q.view(b, s, nh, d).transpose(1, 2)
    k, v = (t.view(b, s, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, nh * d)


def _swiglu(fc1_out):
    gate, up = fc1_out.chunk(2, dim=-1)
    return F.silu(gate) * up


def block_case(group, sp, deferred):
    """Attention with grouped K/V heads, then a SwiGLU MLP: each rank keeps its query heads with their
    K/V groups, and matching slices of gate and up; compared with the same block unsplit."""
    tp = tp_size(group)
    nh, nkv, d, f = 2 * tp, tp, 4, 8 * tp
    h = nh * d
    qkv_sections, fc1_sections = [nh * d, nkv * d, nkv * d], [f, f]
    zeros = torch.zeros
    dense = dict(qkv=_dense_linear(h, sum(qkv_sections), _init(21), zeros(sum(qkv_sections))),
                 proj=_dense_linear(h, h, _init(22), zeros(h)),
                 fc1=_dense_linear(h, 2 * f, _init(23), zeros(2 * f)),
                 fc2=_dense_linear(f, h, _init(24), zeros(h)))
    kw = dict(group=group, sequence_parallel=sp)
    par = dict(qkv=ColumnParallelLinear(h, sum(qkv_sections), init_method=_init(21), sections=qkv_sections, **kw),
               proj=RowParallelLinear(h, h, init_method=_init(22), **kw),
               fc1=ColumnParallelLinear(h, 2 * f, init_method=_init(23), sections=fc1_sections, **kw),
               fc2=RowParallelLinear(f, h, init_method=_init(24), **kw))

    def block(m, x, heads, kv_heads):
        x = x + m["proj"](_gqa(m["qkv"](x), heads, kv_heads, d))
        return x + m["fc2"](_swiglu(m["fc1"](x)))

    x, gy = _data(B, S, h, seed=7), _data(B, S, h, seed=8)
    xd = x.clone().requires_grad_()
    yd = block(dense, xd, nh, nkv)
    (yd * gy).sum().backward()
    xp = (_seq_shard(x, group) if sp else x).clone().requires_grad_()
    y = block(par, xp, nh // tp, nkv // tp)
    _backward((y * (_seq_shard(gy, group) if sp else gy)).sum(), deferred, par["qkv"].weight)
    if sp:  # the row-parallel biases saw only this rank's tokens
        for name in ("proj", "fc2"):
            dist.all_reduce(par[name].bias.grad, group=group)
    sections = dict(qkv=(0, qkv_sections), proj=(1, None), fc1=(0, fc1_sections), fc2=(1, None))
    grad_w = max(_diff(_gather(par[n].weight.grad, group, dim, sec), dense[n].weight.grad)
                 for n, (dim, sec) in sections.items())
    grad_b = max(_diff(_gather(par[n].bias.grad, group, 0, sections[n][1]) if sections[n][0] == 0
                       else par[n].bias.grad, dense[n].bias.grad) for n in sections)
    return dict(out=_diff(y, _seq_shard(yd, group) if sp else yd),
                grad_x=_diff(xp.grad, _seq_shard(xd.grad, group) if sp else xd.grad),
                grad_w=grad_w, grad_b=grad_b)


def embedding_case(group, sp):
    tp = tp_size(group)
    vocab, h = 8 * tp, 6
    dense = torch.nn.Embedding(vocab, h)
    with torch.no_grad():
        _init(31)(dense.weight)
    layer = VocabParallelEmbedding(vocab, h, init_method=_init(31), group=group, sequence_parallel=sp)
    tokens = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(9))
    tokens[0, :] = torch.arange(S) * (vocab // S)  # touch every rank's slice
    gy = _data(B, S, h, seed=10)
    yd = dense(tokens)
    (yd * gy).sum().backward()
    y = layer(tokens)
    (y * (_seq_shard(gy, group) if sp else gy)).sum().backward()
    return dict(init=_diff(_gather(layer.weight.detach(), group, 0), dense.weight.detach()),
                out=_diff(y, _seq_shard(yd, group) if sp else yd),
                grad_w=_diff(_gather(layer.weight.grad, group, 0), dense.weight.grad),
                rows=layer.weight.shape[0], start=layer.vocab_start)


def cross_entropy_case(group):
    tp, r = tp_size(group), tp_rank(group)
    vocab = 16 * tp
    logits = _data(B, S, vocab, seed=13) * 3
    target = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(14))
    weights = _data(B, S, seed=15)
    ld = logits.clone().requires_grad_()
    loss_d = F.cross_entropy(ld.flatten(0, 1), target.flatten(), reduction="none").view(B, S)
    (loss_d * weights).sum().backward()
    lp = shard(logits, r, tp, -1).requires_grad_()
    loss = vocab_parallel_cross_entropy(lp, target, group)
    (loss * weights).sum().backward()
    mean = vocab_parallel_loss(shard(logits, r, tp, -1), target, group)
    segment = vocab_parallel_loss(shard(logits, r, tp, -1)[:, :S // 2], (target[:, :S // 2], B * S), group)
    bf16 = vocab_parallel_cross_entropy(shard(logits, r, tp, -1).bfloat16(), target, group)
    bf16_dense = F.cross_entropy(logits.bfloat16().float().flatten(0, 1), target.flatten(), reduction="none")
    return dict(loss=_diff(loss, loss_d), grad=_diff(lp.grad, shard(ld.grad, r, tp, -1)),
                mean=_diff(mean, gpt_loss(logits, target)),
                segment=_diff(segment, gpt_loss(logits[:, :S // 2], (target[:, :S // 2], B * S))),
                bf16=_diff(bf16, bf16_dense.view(B, S)), dtypes=(loss.dtype, bf16.dtype))


def chunked_loss_case(group, sp, deferred):
    """The chunked head + loss (model/chunked_loss.py) on this rank's vocabulary rows equals the dense
    head + gpt_loss: loss, input gradient, gathered weight gradient (B then W when deferred); and a
    Seq1F1B segment's (labels, num_tokens) loss."""
    from megatron_ds.model.layers import chunked_head_loss, head_input
    tp, r = tp_size(group), tp_rank(group)
    h, vocab = 12, 16 * tp
    hidden = _data(B, S, h, seed=21)
    weight = _data(vocab, h, seed=22)
    target = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(23))
    xd, wd = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_d = gpt_loss(F.linear(xd, wd), target)
    loss_d.backward()
    x = (_seq_shard(hidden, group) if sp else hidden).clone().requires_grad_()
    w = shard(weight, r, tp, 0).clone().requires_grad_()
    loss = chunked_head_loss((head_input(x, group, sp), w), target, chunk=5, group=group)
    left_to_w = _backward(loss, deferred, w)
    segment = chunked_head_loss((head_input(x, group, sp)[:, :S // 2], w), (target[:, :S // 2], B * S), chunk=3,
                                group=group)
    return dict(loss=_diff(loss, loss_d), grad_x=_diff(x.grad, _seq_shard(xd.grad, group) if sp else xd.grad),
                grad_w=_diff(_gather(w.grad, group, 0), wd.grad), left_to_w=left_to_w,
                segment=_diff(segment, gpt_loss(F.linear(hidden[:, :S // 2], weight), (target[:, :S // 2], B * S))))


def mappings_case(group):
    """The sequence-parallel and the last-dimension mappings, forward and backward."""
    tp, r = tp_size(group), tp_rank(group)
    x, gy = _data(B, S, 4 * tp, seed=16), _data(B, S, 4 * tp, seed=17)
    out = {}
    xs = x.clone().requires_grad_()  # split then gather (the replicated consumer's backward only splits)
    y = gather_from_sequence(scatter_to_sequence(xs, group), group, tensor_parallel_output_grad=False)
    y.backward(gy)
    out["split_gather"] = (torch.equal(y, x), torch.equal(xs.grad, gy))
    xr = (x + r).requires_grad_()  # each rank a different tensor: reduce-scatter then gather is the sum
    y = gather_from_sequence(reduce_scatter_to_sequence(xr, group), group)
    y.backward(gy)
    total = sum(x + i for i in range(tp))
    out["reduce_scatter_gather"] = (_diff(y, total), _diff(xr.grad, tp * gy))
    xl = x.clone().requires_grad_()
    y = gather_from_region(scatter_to_region(xl, group), group)
    y.backward(gy)
    out["last_dim"] = (torch.equal(y, x), torch.equal(xl.grad, gy))
    return out


def rng_case(group):
    model_parallel_manual_seed(1234, tp_rank(group))
    tracker = get_rng_tracker()
    replicated = F.dropout(torch.ones(64), 0.5)
    saved = tracker.get_states()
    with tracker.fork():
        partitioned = F.dropout(torch.ones(64), 0.5)
    after = F.dropout(torch.ones(64), 0.5)
    tracker.set_states(saved)
    with tracker.fork():
        replayed = F.dropout(torch.ones(64), 0.5)
    torch.manual_seed(1234)
    F.dropout(torch.ones(64), 0.5)
    unforked = F.dropout(torch.ones(64), 0.5)
    return dict(replicated=_gather(replicated, group, 0), partitioned=_gather(partitioned, group, 0),
                after=torch.equal(after, unforked), replayed=torch.equal(replayed, partitioned))


def comm_count_case(group):
    spec = importlib.util.spec_from_file_location(
        "tensor_parallel_comm", os.path.join(os.path.dirname(__file__), *[os.pardir] * 3, "bench",
                                             "tensor_parallel_comm.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    b, s, h = 2, 8, 32
    return {sp: (bench.count_layer(tp_size(group), sp, b, s, h, heads=4 * tp_size(group)),
                 bench.megatron_formula(tp_size(group), sp, b, s, h)) for sp in (False, True)}


LAYOUTS = [(2, 2, 1), (1, 2, 2), (1, 4, 1)]  # (pp, tp, dp)


def groups_case(pp, tp):
    """Our mpu beside DeepSpeed's PipelineParallelGrid on the same topology: ranks of every group."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    state = ParallelState(pp, tp)
    grid = PipelineParallelGrid(topology=state.topology)
    ranks = dist.get_process_group_ranks
    ours = dict(tensor=ranks(state.get_tensor_model_parallel_group()), pipe=ranks(state.get_pipe_parallel_group()),
                data=ranks(state.get_data_parallel_group()), model=ranks(state.get_model_parallel_group()),
                rank=(state.get_tensor_model_parallel_rank(), state.get_pipe_parallel_rank(),
                      state.get_data_parallel_rank(), state.get_model_parallel_rank()),
                size=(state.get_tensor_model_parallel_world_size(), state.get_pipe_parallel_world_size(),
                      state.get_data_parallel_world_size(), state.get_model_parallel_world_size()))
    theirs = dict(tensor=ranks(grid.get_slice_parallel_group()), pipe=ranks(grid.get_pipe_parallel_group()),
                  data=ranks(grid.get_data_parallel_group()), model=ranks(grid.get_model_parallel_group()),
                  rank=(grid.get_tensor_model_parallel_rank(), grid.get_pipe_parallel_rank(),
                        grid.get_data_parallel_rank(), grid.get_model_parallel_rank()),
                  size=(grid.get_tensor_model_parallel_world_size(), grid.get_pipe_parallel_world_size(),
                        grid.get_data_parallel_world_size(), grid.get_model_parallel_world_size()))
    return ours, theirs


FAMILIES = {"gpt2": {},
            "llama": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
                          untie_embeddings_and_output_weights=True, add_bias_linear=False),
            "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
            "qwen3": dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
                          untie_embeddings_and_output_weights=True, add_bias_linear=False, qk_layernorm=True)}
FAMILIES["qwen3-kv16"] = dict(FAMILIES["qwen3"], kv_channels=16)  # heads of 16: q, k, v and c_proj's input not h wide


def _full_grads(model, group):
    """Every parameter's gradient as the dense model has it: slices gathered, partial sums summed."""
    out = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            g = p.grad
            if isinstance(module, ColumnParallelLinear):
                g = _gather(g, group, 0, module.sections)
            elif isinstance(module, RowParallelLinear) and pname == "weight":
                g = _gather(g, group, 1)
            elif isinstance(module, VocabParallelEmbedding):
                g = _gather(g, group, 0)
            elif getattr(p, "sequence_parallel", False) or getattr(p, "tensor_parallel_partial", False):
                # norms and row biases on a sequence shard; per-head norms on this rank's heads
                g = g.clone()
                dist.all_reduce(g, group=group)
            out[f"{mname}.{pname}"] = g
    return out


def model_case(group, family, sp):
    """The whole GPT split over the TP group (heads 2*TP, K/V heads TP for llama) against the dense GPT:
    logits, loss (vocab-parallel) and every gradient; the B/W split (deferred W) with sequence parallelism."""
    tp = tp_size(group)
    kw = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=2 * tp, max_position_embeddings=S,
              **FAMILIES[family])
    if family in ("llama", "qwen3", "qwen3-kv16"):
        kw["num_key_value_heads"] = tp
    dense = GPTModel(GPTConfig(**kw))
    config = GPTConfig(**kw, tensor_model_parallel_size=tp, sequence_parallel=sp)
    model = GPTModel(config)
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(18))
    labels = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(19))
    logits_d = dense(tokens)
    loss_d = gpt_loss(logits_d, labels)
    loss_d.backward()
    logits = model(tokens)
    loss = loss_function(config)(logits, labels)
    queue = []
    with WeightGradStore.deferring(queue) if sp else contextlib.nullcontext():
        loss.backward()
    queued = len(queue)
    WeightGradStore.drain(queue)
    grads, grads_d = _full_grads(model, group), {n: p.grad for n, p in dense.named_parameters()}
    return dict(logits=_diff(_gather(logits.detach(), group, -1), logits_d), loss=_diff(loss, loss_d),
                grads=max(_diff(grads[n], grads_d[n]) for n in grads_d), names=grads.keys() == grads_d.keys(),
                queued=queued)


def run_all(world):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    group = initialize_model_parallel(1, world).tensor_parallel_group_or_none()
    out = {}
    for family in FAMILIES:
        for sp in (False, True):
            out["model", family, sp] = model_case(group, family, sp)
    for sp in (False, True):
        for deferred in (False, True):
            out["column", sp, deferred] = column_case(group, sp, deferred)
            out["row", sp, deferred] = row_case(group, sp, deferred)
        out["block", sp] = block_case(group, sp, deferred=sp)
        out["embedding", sp] = embedding_case(group, sp)
    out["cross_entropy"] = cross_entropy_case(group)
    for sp in (False, True):
        for deferred in (False, True):
            out["chunked_loss", sp, deferred] = chunked_loss_case(group, sp, deferred)
    out["mappings"] = mappings_case(group)
    out["rng"] = rng_case(group)
    out["comm_count"] = comm_count_case(group)
    if world == 4:
        out["groups"] = {layout: groups_case(layout[0], layout[1]) for layout in LAYOUTS}
    return out
