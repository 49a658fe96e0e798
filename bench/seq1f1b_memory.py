"""Peak activation memory per pipeline rank: 1F1B against Seq1F1B (k segments), on CPU.

Each configuration runs in its own p fresh processes (gloo), one training iteration on a
long sequence. Per rank it reports
- saved: the peak of the bytes held by autograd's saved tensors (torch's saved_tensors_hooks,
  each storage counted once, parameters excluded), plus the segment K/V cache buffers ("K/V":
  the bytes the cache holds, read from it at every save: each micro-batch's buffer at full length) and
  the bottom-right causal masks' storage ("masks"; on CPU one row of lq + lk - 1 values per
  segment shape, shared by all layers and micro-batches; on CUDA the flash kernels align the
  causal mask bottom-right themselves); "w/o masks" is the ratio without them;
- RSS: the process's peak RSS (ru_maxrss), and the iteration's peak above the RSS it
  started from (VmHWM reset through /proc/self/clear_refs);
with the ratio to 1F1B's on the same rank. Theory: rank r holds p-r micro-batches under
1F1B and p-r-1+k segments under Seq1F1B, (p-r-1+k)/(k(p-r)) of 1F1B's activations
(rank 0, p=4, k=4: 7/16 = 0.44); "tokens" is that ratio for the actual segment lengths
(a balanced split makes the first segments longer), read off the op order the engine runs
(capped at 1F1B's token count per rank: without the cap the last rank held 1.18 at k=4).

    python -m bench.seq1f1b_memory --pp 4 --seq-length 2048
"""
import argparse
import os
import resource

import torch

from bench.options import add_model_args
from megatron_ds.testing.launcher import run_ranks

MB = 2 ** 20


def rank_main(args, pipeline):
    """One pipeline rank (run_ranks gives it the launcher's environment and one thread): its memory numbers."""
    import deepspeed
    from megatron_ds.model import GPTConfig, position_ids_like
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.testing.saved_memory import PeakRSS, SavedMemory
    deepspeed.init_distributed(dist_backend="gloo")
    config = GPTConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_attention_heads=args.num_attention_heads, max_position_embeddings=args.seq_length)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.gas,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9, "pipeline": pipeline,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    module = build_pipeline_module(config, ds_config, args.pp, seq_length=args.seq_length)
    engine = initialize_engine(module, ds_config, model_parameters=list(module.parameters()))
    g = torch.Generator().manual_seed(0)

    def batches():
        for _ in range(args.gas):
            tokens = torch.randint(0, config.vocab_size, (1, args.seq_length + 1), generator=g)
            x = tokens[:, :-1].contiguous()
            yield (x, position_ids_like(x)), tokens[:, 1:].contiguous()

    engine.train_batch(batches())  # warm-up: optimizer state, p2p buffers, allocator
    meter = SavedMemory(exclude=list(module.parameters()), cache=getattr(engine, "_kv", None))
    with PeakRSS() as rss, meter.recording():
        engine.train_batch(batches())
    torch.distributed.barrier()  # no rank tears gloo down while another's last messages are in flight
    torch.distributed.destroy_process_group()
    return dict(saved=meter.peak, kv=meter.at_peak["kv"], mask=meter.at_peak["mask"], left=meter.now,
                rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_growth=rss.growth,
                lengths=module.plan.segment_lengths)


def run(args, pipeline):
    """Every rank's numbers, rank order: fresh interpreters (run_ranks' startup_env), in which tensors of 64 KiB
    and more get their own mappings, returned to the system when freed, so the RSS follows the live tensors
    instead of glibc's heap high-water mark."""
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    return run_ranks(args.pp, rank_main, args, pipeline, timeout=3600,
                     startup_env={"MALLOC_MMAP_THRESHOLD_": threshold})


def tokens_in_flight_ratio(pp, m, k, lengths, rank):
    """Peak tokens whose activations rank `rank` holds, Seq1F1B over 1F1B, from the op orders the
    engine runs (Seq1F1B capped at 1F1B's tokens, schedules/token_cap.py)."""
    from megatron_ds.schedules import build_schedule
    from megatron_ds.schedules.token_cap import cap_tokens

    def peak(schedule, size):
        held = top = 0
        for op in schedule.ranks[rank]:
            held += size(op.seq) if op.kind == "F" else -size(op.seq) if op.kind in ("B", "BW") else 0
            top = max(top, held)
        return top
    seq = sum(lengths)
    return (peak(cap_tokens(build_schedule("seq1f1b", pp, m, seq_splits=k), lengths), lambda q: lengths[q])
            / peak(build_schedule("1f1b", pp, m), lambda q: seq))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, pp=4, gas=8, seq_length=2048, hidden_size=256, num_attention_heads=4, num_layers=4,
                   vocab_size=512)
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--method", choices=["balanced", "even"], default="balanced")
    args = parser.parse_args()
    p = args.pp
    configs = [("1f1b", {"schedule": "1f1b"}, 1)] + [
        (f"seq1f1b k={k}", {"schedule": "seq1f1b", "seq_splits": k, "seq_split_method": args.method}, k)
        for k in args.splits]
    results = {name: run(args, pipeline) for name, pipeline, _ in configs}
    print(f"\npp={p} m={args.gas} mbs=1 seq={args.seq_length} hidden={args.hidden_size} heads={args.num_attention_heads} "
          f"layers={args.num_layers} vocab={args.vocab_size}, fp32 on CPU, second iteration measured")
    for name, _, k in configs[1:]:
        print(f"  {name} {args.method} segments: {results[name][0]['lengths']}")
    print(f"\n{'schedule':<14}{'rank':>4}{'saved MB':>10}{'K/V':>6}{'masks':>7}{'ratio':>7}{'w/o masks':>10}"
          f"{'theory':>8}{'tokens':>8}{'peak RSS MB':>13}{'ratio':>7}{'iter RSS MB':>13}{'ratio':>7}")
    base = results["1f1b"]
    for name, _, k in configs:
        for r, res in enumerate(results[name]):
            b = base[r]
            theory = (p - r - 1 + k) / (k * (p - r))
            tokens = tokens_in_flight_ratio(p, args.gas, k, res["lengths"], r) if k > 1 else 1.0
            print(f"{name:<14}{r:>4}{res['saved'] / MB:>10.1f}{res['kv'] / MB:>6.1f}{res['mask'] / MB:>7.1f}"
                  f"{res['saved'] / b['saved']:>7.2f}{(res['saved'] - res['mask']) / b['saved']:>10.2f}"
                  f"{theory:>8.2f}{tokens:>8.2f}"
                  f"{res['rss_peak'] / MB:>13.1f}{res['rss_peak'] / b['rss_peak']:>7.2f}"
                  f"{res['rss_growth'] / MB:>13.1f}{res['rss_growth'] / max(b['rss_growth'], 1):>7.2f}")
            if res["left"]:
                print(f"  (rank {r}: {res['left'] / MB:.1f} MB of saved tensors outlived the iteration)")


if __name__ == "__main__":
    main()
