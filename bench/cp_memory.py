"""Peak activation memory per rank under context parallelism, on CPU, beside the simulator's prediction.

A small LLaMA-style GPT (RoPE, GQA, SwiGLU, RMSNorm, untied head) at a long sequence on PP 2, three runs:
1F1B at CP 1 (2 ranks), 1F1B at CP 2 and Seq1F1B k segments at CP 2 (4 ranks: PP 2 x CP 2, p2p ring). Each run
is its own fresh gloo processes, one iteration of warm-up, the second measured the way bench/seq1f1b_memory.py
measures: the peak of the bytes autograd's saved tensors hold (parameters excluded; Seq1F1B's K/V cache counted
at its buffers' full length), per pipeline stage the largest over its CP ranks. Beside it, what
schedules/context_parallel.ContextRun.simulate predicts for the same shapes and schedule (fp32: 4 bytes a value,
the busiest rank's peak: the layers' kept activations, the logits on the loss stage, one layer's ring buffers in
flight; and without those blocks, which no saved-tensor count sees). Goals: CP 2 1F1B at most 0.55 of CP 1's, Seq1F1B at CP 2 at most 0.30 of 1F1B at CP 1 on the peak rank,
the simulator within 10 % of each.

    python -m bench.cp_memory --seq-length 8192 --perf-file docs/perf/context_parallel_memory_cpu.md
"""
from __future__ import annotations

import argparse
import os
import resource

import torch

from bench.harness import Machine, add_output_args, emit, table
from bench.options import add_model_args
from megatron_ds.testing.launcher import run_ranks

MB = 2 ** 20
FP32 = 4
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False, layernorm_epsilon=1e-6)


def model_config(args, cp: int):
    from megatron_ds.model import GPTConfig
    return GPTConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     num_attention_heads=args.num_attention_heads, num_key_value_heads=args.kv_heads,
                     ffn_hidden_size=args.ffn_hidden_size, max_position_embeddings=args.seq_length,
                     context_parallel_size=cp, cp_comm_type="p2p", **LLAMA)


def rank_main(args, cp, pipeline):
    """One rank (run_ranks gives it the launcher's environment and one thread): its stage and memory numbers."""
    import deepspeed
    from megatron_ds.model import position_ids_like
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.testing.saved_memory import PeakRSS, SavedMemory
    deepspeed.init_distributed(dist_backend="gloo")
    config = model_config(args, cp)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.gas,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9, "pipeline": pipeline,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    module = build_pipeline_module(config, ds_config, args.pp, seq_length=args.seq_length)
    engine = initialize_engine(module, ds_config, model_parameters=list(module.parameters()))
    g = torch.Generator().manual_seed(0)

    def batches():  # every CP rank reads the whole sample; the engine cuts it to the rank's two chunks
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
    return dict(stage=module.stage_id, saved=meter.peak, kv=meter.at_peak["kv"], left=meter.now,
                rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_growth=rss.growth,
                lengths=list(module.plan.segment_lengths or ()))


def run(args, cp: int, pipeline: dict) -> list[dict]:
    """Per pipeline stage: the largest saved peak over its CP ranks (and that rank's other numbers)."""
    # fresh interpreters in which tensors of 64 KiB and more get their own mappings, returned to the system when
    # freed: the RSS follows the live tensors instead of glibc's heap high-water mark
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    results = run_ranks(args.pp * cp, rank_main, args, cp, pipeline, timeout=3600,
                        startup_env={"MALLOC_MMAP_THRESHOLD_": threshold})
    return [max((r for r in results if r["stage"] == s), key=lambda r: r["saved"]) for s in range(args.pp)]


def predicted(config, seq: int, cp: int, pp: int, m: int, k: int = 1, lengths=None, in_flight: bool = True) -> float:
    """The simulator's busiest rank's peak activation bytes (fp32) for this run (pure Python). `in_flight=False`:
    without the ring's K/V blocks in flight while a layer attends, which are no saved tensors (the measurement
    here counts saved tensors only; the RSS columns see them)."""
    import dataclasses

    from megatron_ds.schedules import build_schedule
    from megatron_ds.schedules.context_parallel import ContextRun
    if k > 1:
        schedule = build_schedule("seq1f1b", pp, m, seq_splits=k, segment_lengths=tuple(lengths))
    else:
        schedule = build_schedule("1f1b", pp, m)
    run = ContextRun(config, seq, cp, "p2p", dtype_bytes=FP32)
    if not in_flight:  # the same layers with nothing in flight: ContextRun memoises each span's layer
        for start, n in run._spans(list(lengths) if k > 1 else [seq]):
            held, ring = run.layer(start, n, k > 1)
            run._memo[(start, n, k > 1)] = (dataclasses.replace(held, in_flight=(0.0, 0.0)), ring)
    return run.simulate(schedule)[1]


RUNS = [("1f1b", 1, 1), ("1f1b", 2, 1), ("seq1f1b", 2, None)]  # (schedule, CP, k: None = --splits)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, pp=2, gas=4, seq_length=8192, hidden_size=128, num_attention_heads=4, num_layers=4,
                   vocab_size=512)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=352)
    parser.add_argument("--splits", type=int, default=4, help="Seq1F1B's segments")
    parser.add_argument("--method", choices=["balanced", "even"], default="even")
    add_output_args(parser)
    args = parser.parse_args(argv)
    machine = Machine()
    header = (f"PP {args.pp}, m={args.gas}, mbs 1, seq {args.seq_length}, LLaMA-style: hidden {args.hidden_size}, "
              f"{args.num_attention_heads} heads ({args.kv_heads} K/V), ffn {args.ffn_hidden_size}, "
              f"{args.num_layers} layers, vocab {args.vocab_size}; fp32 on CPU (gloo), p2p ring; "
              f"{machine.at_start()}\n\n")
    print(header, end="", flush=True)
    rows, measured, results = [], {}, {}
    for name, cp, k in RUNS:
        k = args.splits if k is None else k
        pipeline = ({"schedule": "seq1f1b", "seq_splits": k, "seq_split_method": args.method} if k > 1
                    else {"schedule": name})
        stages = run(args, cp, pipeline)
        shape = (model_config(args, cp), args.seq_length, cp, args.pp, args.gas, k, stages[0]["lengths"])
        sim, kept = predicted(*shape), predicted(*shape, in_flight=False)
        peak = max(s["saved"] for s in stages)
        results[(name, cp)] = dict(stages=stages, peak=peak, predicted=sim, kept=kept)
        measured[(name, cp)] = peak
        base = measured[("1f1b", 1)]
        label = f"{name}" + (f" k={k} {stages[0]['lengths']}" if k > 1 else "")
        rows.append([label, str(cp), " / ".join(f"{s['saved'] / MB:.1f}" for s in stages),
                     f"{peak / MB:.1f}", f"{peak / base:.3f}", f"{sim / MB:.1f}", f"{peak / sim - 1:+.1%}",
                     f"{kept / MB:.1f}", f"{peak / kept - 1:+.1%}",
                     " / ".join(f"{s['kv'] / MB:.1f}" for s in stages),
                     " / ".join(f"{s['rss_growth'] / MB:.0f}" for s in stages)])
        print(f"  {label} CP {cp}: {peak / MB:.1f} MB peak", flush=True)
    lines = table(["schedule", "CP", "saved MB per stage", "peak MB", "/ 1f1b CP1", "simulated MB",
                   "measured vs sim",
                   "sim w/o in-flight MB", "measured vs it", "K/V cache MB", "iter RSS MB"], "llrrrrrrrrr", rows)
    cp2 = measured[("1f1b", 2)] / measured[("1f1b", 1)]
    seq = measured[("seq1f1b", 2)] / measured[("1f1b", 1)]
    lines += ["", f"goals: 1f1b CP2 / CP1 = {cp2:.3f} (goal <= 0.55: {'met' if cp2 <= 0.55 else 'NOT met'}); "
              f"seq1f1b k={args.splits} CP2 / 1f1b CP1 = {seq:.3f} (goal <= 0.30: {'met' if seq <= 0.30 else 'NOT met'})",
              "", machine.at_end()]
    text = emit("\n".join(lines), args.perf_file, "bench.cp_memory", argv, printed_before=header)
    return results, text


if __name__ == "__main__":
    main()
