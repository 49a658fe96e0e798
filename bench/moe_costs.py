"""A MoE layer's costs for bench/layer_costs.py: which layers have experts, and the all-to-all over gloo.

The MoE flags are pretrain_gpt.py's (training/config/moe_args.py parses and checks them: --num-experts,
--moe-router-topk, --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size, --moe-layer-freq,
--expert-model-parallel-size, ...). bench/layer_costs.py times the first MoE layer and the first dense one
in one process, with every expert local: the router and the experts at the routed token count (each token
through its top-k experts; under expert parallelism an EP rank runs its E/e experts on the rows of all e
peers, about as many rows), with the model's own B/W split.

The all-to-all is timed apart, as communication: --expert-model-parallel-size processes (gloo, one thread
each: megatron_ds/testing/launcher.py) run the dispatch's own code (model/moe_dispatch.run_experts_across)
on one micro-batch's routed rows, each expert the identity: the counts, the rows out and the rows back in
the forward, their reverse in the backward, with the byte counts and the uneven per-peer splits of the
dropless path (every token's top-k experts drawn at random, as a fresh router spreads them). Each time is
what AllToAllTimes (the hook "auto" reads) records inside the forward and the backward, the ranks lined up
by a barrier before every repeat; the median of the repeats, the slowest rank's.
"""
from __future__ import annotations

import dataclasses
import statistics


def moe_config(args):
    """The run's MoEConfig (None: a dense model), the flags read as pretrain_gpt.py reads them."""
    from megatron_ds.training.config.moe_args import moe_config_from_args
    return moe_config_from_args(args)


def moe_layers(args) -> list[int]:
    """A 0/1 per transformer layer: 1 where the flags put experts (all 0 for a dense model)."""
    from megatron_ds.moe_config import layer_pattern
    moe = moe_config(args)
    return [0] * args.num_layers if moe is None else layer_pattern(moe.layer_freq, args.num_layers)


def single_process(config):
    """`config` with every expert on this process (expert parallelism needs its process groups)."""
    if config.moe is None or config.moe.expert_model_parallel_size == 1:
        return config
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_model_parallel_size=1))


def routed_counts(tokens: int, experts: int, topk: int, seed: int):
    """Rows per expert (a tensor of `experts` counts) of `tokens` tokens each sent to `topk` distinct
    experts drawn at random: uneven, as a fresh router's dropless dispatch."""
    import torch
    g = torch.Generator().manual_seed(seed)
    choice = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
    return torch.bincount(choice.flatten(), minlength=experts)


def all_to_all_worker(opts):
    """On each EP rank: (F, B) median seconds in the all-to-all of run_experts_across's forward and backward."""
    import torch
    import torch.distributed as dist
    from megatron_ds.model.moe_dispatch import AllToAllTimes, run_experts_across

    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, opts["dtype"])
    counts = routed_counts(opts["tokens"], opts["experts"], opts["topk"], seed=rank)
    rows = torch.randn(int(counts.sum()), opts["hidden"]).to(dtype).requires_grad_()
    grad = torch.randn(rows.shape).to(dtype)
    per_rank = opts["experts"] // ep
    local = range(rank * per_rank, (rank + 1) * per_rank)
    times = {"F": [], "B": []}
    for i in range(opts["warmup"] + opts["repeats"]):
        dist.barrier()
        AllToAllTimes.intervals = []
        out = run_experts_across(rows, counts, lambda _, x: x, local, None)
        forward, AllToAllTimes.intervals = AllToAllTimes.intervals, []
        dist.barrier()
        AllToAllTimes.intervals = []
        torch.autograd.backward(out, grad)
        backward, AllToAllTimes.intervals = AllToAllTimes.intervals, None
        rows.grad = None
        if i >= opts["warmup"]:
            times["F"].append(sum(e - s for s, e in forward))
            times["B"].append(sum(e - s for s, e in backward))
    dist.destroy_process_group()
    return statistics.median(times["F"]), statistics.median(times["B"])


def measure_all_to_all(args, config) -> tuple[float, float]:
    """(F, B) seconds of one MoE layer's all-to-all on one micro-batch at the flags' expert parallelism,
    over gloo (0, 0 without expert parallelism: no all-to-all runs)."""
    from megatron_ds.testing.launcher import run_ranks
    moe = config.moe
    if moe is None or moe.expert_model_parallel_size == 1:
        return 0.0, 0.0
    opts = {"tokens": args.micro_batch_size * args.seq_length, "experts": moe.num_experts, "topk": moe.router_topk,
            "hidden": args.hidden_size, "dtype": "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
            "repeats": args.repeats, "warmup": args.warmup}
    ranks = run_ranks(moe.expert_model_parallel_size, all_to_all_worker, opts, timeout=600)
    return max(f for f, _ in ranks), max(b for _, b in ranks)


def layer_names(flags: list[int]) -> list[str]:
    """The transformer layers' names in the --costs-out file, MoE ones marked."""
    return [f"transformer {i}{' (MoE)' if f else ''}" for i, f in enumerate(flags, start=1)]


def layer_parameters(config, flags: list[int]) -> list[float]:
    """Parameters one EP rank holds of each transformer layer (its E/e experts of a MoE layer's E)."""
    from megatron_ds.model import TransformerLayer
    ep = config.moe.expert_model_parallel_size if config.moe is not None else 1
    count = {}
    for flag in set(flags):
        layer = TransformerLayer(single_process(config), flags.index(flag) + 1)
        count[flag] = sum(p.numel() / (ep if ".experts." in f".{name}" else 1) for name, p in layer.named_parameters())
    return [count[f] for f in flags]
