"""What a Hugging Face causal LM costs through --hf-model's path (pipe/hf/): a LLaMA-shaped transformers model cut
into pipeline stages, against our own GPT of the same shape under the same schedule, and on our engine against
DeepSpeed's own engine running the same cut.

One launch of p gloo ranks (one thread each) builds every contestant side by side in each process and times
their train_batch alternated step by step (bench/harness.alternated: a barrier before each, the order reversed
every other step), so that the load of a shared machine hits them alike:
- "hf 1f1b", "hf zbv": the transformers LlamaForCausalLM (untied, no biases, RMSNorm, SwiGLU, RoPE, grouped-query
  attention) cut by pipe/hf (its decoder layers running our attention) on our engine under 1f1b and zbv;
- "gpt 1f1b", "gpt zbv": our GPT built from the same sizes with our flags (rmsnorm, swiglu, rope, untied, no bias
  linears, the same K/V heads); weights need not match;
- "hf deepspeed": the same cut under DeepSpeed's own PipelineEngine (a ds_config without "schedule"), its 1F1B.
`--profile` adds where the time goes, on this process (no launch), each part timed alternated with its
counterpart: the whole model's forward + backward of one micro-batch, hf against gpt (ms and aten operators);
one attention call, ours (pipe/hf/attention.py: the mask from the position ids, K/V grouped) against bare
SDPA (K/V grouped, enable_gqa); the loss, hf's causal_lm_loss against the GPT's; and a chunk of two
decoder layers under zbv's backward split through autograd (pipe/foreign/autograd_split.py: the plan made per B
op, B to the inputs, W as one autograd call per batch of weight groups that do not reach each other) against
its plain backward.
Every contestant trains on the same token batches with fp32 AdamW, ZeRO-1. The rows give each one's median
iteration and, for the three comparisons, the paired ratio (the median over steps of the two's ratio in that
step: drifts of the load cancel) against its goal: hf / gpt at most 1.10 under each schedule, hf on our 1f1b at
most 3 % dearer than DeepSpeed's engine (1.03). Each rank's CPU time per iteration is given too (what waiting for a core on a
loaded machine does not inflate).

    python -m bench.hf_cost                               # p=2, a few minutes on 2 loaded cores
    python -m bench.hf_cost --hidden 512 --layers 8 --seq 256
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.harness import Machine, add_output_args, alternated, emit, medians, paired_ratio, table
from megatron_ds.testing.launcher import run_ranks

CONTESTANTS = ("hf 1f1b", "gpt 1f1b", "hf zbv", "gpt zbv", "hf deepspeed")
# (numerator, denominator, the ratio's goal): the paired ratio must not exceed it (the last: at most 3 % dearer)
GOALS = (("hf 1f1b", "gpt 1f1b", 1.10), ("hf zbv", "gpt zbv", 1.10), ("hf 1f1b", "hf deepspeed", 1.03))


def hf_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       max_position_embeddings=args.seq, tie_word_embeddings=False, attention_bias=False,
                       mlp_bias=False, rms_norm_eps=1e-5, attention_dropout=0.0, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def gpt_config(args):
    from megatron_ds.model import GPTConfig
    return GPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                     num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, ffn_hidden_size=args.ffn,
                     max_position_embeddings=args.seq, normalization="rmsnorm", swiglu=True,
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False,
                     hidden_dropout=0.0, attention_dropout=0.0)


def ds_config(args, schedule=None):
    config = {"train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": args.gas,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
    if schedule:
        config["pipeline"] = {"schedule": schedule}
    return config


def optimizer(module):
    import torch
    return torch.optim.AdamW(module.parameters(), lr=1e-4)


def build(name, args):
    """The engine of contestant `name` (CONTESTANTS)."""
    import torch
    from megatron_ds.pipe.plan.config import pipeline_settings
    torch.manual_seed(1234)
    family, schedule = name.split()
    config = ds_config(args, None if schedule == "deepspeed" else schedule)
    if family == "hf":
        from megatron_ds.pipe.hf.engine import build_engine
        return build_engine(hf_config(args), config, pipeline_settings(config), args.pp, 1, optimizer,
                            seq_length=args.seq)[0]
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    module = build_pipeline_module(gpt_config(args), config, args.pp, seq_length=args.seq)
    return initialize_engine(module, config, optimizer=optimizer(module))


def batches(args, step, family):
    """The step's micro-batches: the same tokens for every contestant; (ids, positions) and labels."""
    import torch
    from megatron_ds.model import position_ids_like
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(args.gas):
        tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        out.append(((x, position_ids_like(x)), y) if family == "gpt" else (x, y))
    return iter(out)


def rank_main(args):
    import deepspeed
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    engines = {name: build(name, args) for name in args.contestants}
    cpu = {name: [] for name in engines}

    def prepare(name, step):  # off the clock
        return name, batches(args, step, name.split()[0])

    def run(prepared):
        name, data = prepared
        start = time.process_time()
        engines[name].train_batch(data)
        cpu[name].append(time.process_time() - start)

    times = alternated({name: run for name in engines}, args.warmup + args.iterations, prepare=prepare)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {n: c[args.warmup:] for n, c in cpu.items()})
    return {"times": {n: t[args.warmup:] for n, t in times.items()}, "cpu": gathered,
            "classes": {n: type(e).__name__ for n, e in engines.items()}}


def rows(result):
    """The contestants' rows and the comparisons' rows (cells as text), from rank 0's result."""
    times, cpu = result["times"], result["cpu"]
    med = medians(times)
    contestants = [[name, result["classes"][name], f"{med[name] * 1e3:.1f}",
                    " / ".join(f"{statistics.median(rank[name]) * 1e3:.0f}" for rank in cpu) + " ms"]
                   for name in times]
    comparisons = []
    for a, b, goal in GOALS:
        if a in times and b in times:
            ratio = paired_ratio(times[a], times[b])
            cpu_ratio = (sum(statistics.median(rank[a]) for rank in cpu)
                         / sum(statistics.median(rank[b]) for rank in cpu))
            met = ratio <= goal
            bound = f"<= {goal:.2f}"
            comparisons.append([f"{a} / {b}", f"{ratio:.3f}", f"{med[a] / med[b]:.3f}", f"{cpu_ratio:.3f}",
                                bound, "yes" if met else "no"])
    return contestants, comparisons


def report(result, args):
    lines = [f"p={args.pp}, dp=1, m={args.gas}, micro-batch {args.mbs} x {args.seq} tokens; LLaMA shape: {args.layers} "
             f"layers, hidden {args.hidden}, FFN {args.ffn} (SwiGLU), {args.heads} heads / {args.kv_heads} K/V heads, "
             f"vocabulary {args.vocab} (untied); fp32 AdamW, ZeRO-1, gloo, 1 thread a rank; medians of "
             f"{args.iterations} iterations after {args.warmup} warm-up, the contestants alternated step by step", ""]
    contestants, comparisons = rows(result)
    lines += table(["contestant", "engine", "iteration (ms)", "CPU per iteration, ranks"], "llrl", contestants)
    lines += [""] + table(["ratio", "paired", "of medians", "CPU", "goal", "met"], "lrrrll", comparisons)
    return "\n".join(lines)


def _alternate(parts, repeats):
    """{name: median seconds of `parts[name]()`}, the parts alternated `repeats` times after one warm-up each."""
    for f in parts.values():
        f()
    times = alternated({name: lambda _, f=f: f() for name, f in parts.items()}, repeats)
    return medians(times)


def _aten_ops(f):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        f()
    return sum(k.count for k in prof.key_averages() if k.key.startswith("aten::"))


def profile_parts(args, repeats=15):
    """[(part, hf or ours ms, counterpart ms, ratio, note)] of --profile (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from megatron_ds.model import GPTModel, gpt_loss, position_ids_like
    from megatron_ds.pipe.foreign.autograd_split import Split
    from megatron_ds.pipe.hf import attention
    from megatron_ds.pipe.hf.cut import Parts, load, sequential, use_our_attention
    from megatron_ds.pipe.hf.layers import HFTransformerLayer, causal_lm_loss
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = load(hf_config(args))
    parts = Parts(model)
    layers = parts.layer_list()
    use_our_attention(model)
    hf, gpt = sequential(layers), GPTModel(gpt_config(args))
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1))
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = position_ids_like(ids)
    whole = {"hf": lambda: causal_lm_loss(hf(ids), labels).backward(),
             "gpt": lambda: gpt_loss(gpt(ids, positions), labels).backward()}
    rows = []
    t = _alternate(whole, repeats)
    rows.append(("model forward + backward, one micro-batch", t["hf"], t["gpt"],
                 f"aten operators {_aten_ops(whole['hf'])} / {_aten_ops(whole['gpt'])}"))
    head_dim, groups = args.hidden // args.heads, args.heads // args.kv_heads
    q = torch.randn(args.mbs, args.heads, args.seq, head_dim, requires_grad=True)
    k, v = (torch.randn(args.mbs, args.kv_heads, args.seq, head_dim, requires_grad=True) for _ in range(2))
    module = parts.layers[0].self_attn
    call = {"ours": lambda: attention.attention(module, q, k, v, None, position_ids=positions)[0].sum().backward(),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
            .transpose(1, 2).contiguous().sum().backward()}
    t = _alternate(call, repeats)
    rows.append(("attention call forward + backward", t["ours"], t["sdpa"], f"{groups} query heads per K/V head"))
    logits = torch.randn(args.mbs, args.seq, args.vocab, requires_grad=True)
    loss = {"hf": lambda: causal_lm_loss(logits, labels).backward(), "gpt": lambda: gpt_loss(logits, labels).backward()}
    t = _alternate(loss, repeats)
    rows.append(("loss forward + backward", t["hf"], t["gpt"], f"{args.mbs * args.seq} tokens x {args.vocab}"))
    chunk = [HFTransformerLayer(layer, parts.rotary) for layer in parts.layers[:2]]
    params = [p for c in chunk for p in c.parameters()]
    plan = []

    def forward():
        x = torch.randn(args.mbs, args.seq, args.hidden, requires_grad=True)
        out = (x, positions)
        for c in chunk:
            out = c(out)
        return x, out[0]

    def split():
        x, out = forward()
        start = time.perf_counter()
        s = Split([out], [torch.ones_like(out)], [x], params)
        plan.append((time.perf_counter() - start, len(s.groups), len(s.batches)))
        w = s.backward_input()
        if w is not None:
            w()

    def plain():
        x, out = forward()
        torch.autograd.backward([out], [torch.ones_like(out)])
    t = _alternate({"split": split, "plain": plain}, repeats)
    made = statistics.median(p for p, _, _ in plan)
    rows.append(("2 decoder layers: F, then B and W through autograd / F then one backward", t["split"], t["plain"],
                 f"the plan {made * 1e3:.2f} ms a B op, {plan[-1][1]} weight groups in {plan[-1][2]} autograd calls"))
    return rows


def profile_table(rows):
    return table(["part", "hf / ours (ms)", "gpt / counterpart (ms)", "ratio", "note"], "lrrrl",
                 [[part, f"{a * 1e3:.2f}", f"{b * 1e3:.2f}", f"{a / b:.3f}", note] for part, a, b, note in rows])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--gas", type=int, default=4, help="micro-batches per iteration")
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--contestants", nargs="*", default=list(CONTESTANTS), choices=CONTESTANTS)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--profile", action="store_true", help="also time the parts on this process (see above)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    machine = Machine()
    header = machine.at_start() + "\n\n"
    print(header, end="", flush=True)
    results = run_ranks(args.pp, rank_main, args, timeout=args.timeout, quiet=True)
    text = report(results[0], args)
    if args.profile:
        text += "\n\nWhere the time goes (one process, one thread, each part alternated with its counterpart):\n\n"
        text += "\n".join(profile_table(profile_parts(args)))
    return emit(f"{text}\n\n{machine.before_after()}; {machine.at_end()}", args.perf_file,
                "bench.hf_cost", argv, printed_before=header)


if __name__ == "__main__":
    main()
