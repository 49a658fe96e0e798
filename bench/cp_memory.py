"""Peak activation memory per rank under context parallelism, on CPU, beside the simulator's prediction.

A small LLaMA-style GPT (RoPE, GQA, SwiGLU, RMSNorm, untied head) at a long sequence, for each pipeline size of
--pp (default 2 and 4) three runs: 1F1B at CP 1 (PP ranks), 1F1B at CP 2 and Seq1F1B k segments at CP 2 (PP x 2
ranks, p2p ring). Each run is its own fresh gloo processes (run_ranks' startup_env: glibc returns freed tensors
to the system, so the RSS columns follow them), one iteration of warm-up, the second measured the way
bench/seq1f1b_memory.py measures: the peak of the bytes autograd's saved tensors hold ("kept": parameters
excluded; Seq1F1B's K/V cache counted at its buffers' full length), per pipeline stage the largest over its CP
ranks. The ring's blocks, which no saved-tensor count sees, are counted too (testing/saved_memory.RingBuffers:
the K/V blocks, receive buffers and gradient blocks, from their allocation until nothing holds them): their
largest total ("ring"), and the peak of kept and ring bytes together ("with ring").

Beside them what schedules/context_parallel.ContextRun.simulate predicts for the same shapes and schedule (fp32:
4 bytes a value, the busiest rank's peak), compared like with like: its kept activations (the layers' and the
logits on the loss stage, nothing in flight) against the measured kept peak; one layer's ring blocks in flight
(two K/V blocks and three fp32 gradient blocks; one K/V block at CP 2) against the measured ring peak; and its
whole peak, where each op holds the blocks while a layer attends (ContextRun.attention_bytes: in F above the
stage's earlier layers and the last layer's part before its core, in B above what the op has not yet freed),
against the measured joint peak of kept and ring bytes. Goals, each PP: CP 2 1F1B at most 0.55 of CP 1's,
Seq1F1B at CP 2 at most 0.30 of 1F1B at CP 1 on the peak rank (kept bytes), the simulator within 10 % of each.

`--record FILE` writes the measurements (each run's per-stage numbers) as JSON; `--replay FILE` takes them from
such a file instead of running (seconds, not half an hour): the simulator's columns are computed anew, the
header and the run's end line are the recorded ones.

    python -m bench.cp_memory --seq-length 8192 --perf-file docs/perf/context_parallel_memory_cpu.md
"""
from __future__ import annotations

import argparse
import json
import os
import resource

import torch

from bench.harness import Machine, add_output_args, emit, table
from bench.options import add_model_args
from megatron_ds.files import read_json, write_atomic
from megatron_ds.testing.launcher import run_ranks

MB = 2 ** 20
FP32 = 4
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False, layernorm_epsilon=1e-6)


def model_text(args) -> str:
    """The model of `args` as the benches' headers name it."""
    return (f"LLaMA-style: hidden {args.hidden_size}, {args.num_attention_heads} heads ({args.kv_heads} K/V), ffn "
            f"{args.ffn_hidden_size}, {args.num_layers} layers, vocab {args.vocab_size}")


def model_config(args, cp: int):
    from megatron_ds.model import GPTConfig
    return GPTConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                     num_attention_heads=args.num_attention_heads, num_key_value_heads=args.kv_heads,
                     ffn_hidden_size=args.ffn_hidden_size, max_position_embeddings=args.seq_length,
                     context_parallel_size=cp, cp_comm_type="p2p", **LLAMA)


def rank_main(args, pp, cp, pipeline):
    """One rank (run_ranks gives it the launcher's environment and one thread): its stage and memory numbers."""
    import deepspeed
    from megatron_ds.model import position_ids_like
    from megatron_ds.model.context_parallel import ring
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.testing.saved_memory import PeakRSS, RingBuffers, SavedMemory
    deepspeed.init_distributed(dist_backend="gloo")
    config = model_config(args, cp)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.gas,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9, "pipeline": pipeline,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    module = build_pipeline_module(config, ds_config, pp, seq_length=args.seq_length)
    engine = initialize_engine(module, ds_config, model_parameters=list(module.parameters()))
    g = torch.Generator().manual_seed(0)

    def batches():  # every CP rank reads the whole sample; the engine cuts it to the rank's two chunks
        for _ in range(args.gas):
            tokens = torch.randint(0, config.vocab_size, (1, args.seq_length + 1), generator=g)
            x = tokens[:, :-1].contiguous()
            yield (x, position_ids_like(x)), tokens[:, 1:].contiguous()

    engine.train_batch(batches())  # warm-up: optimizer state, p2p buffers, allocator
    buffers = RingBuffers()
    meter = SavedMemory(exclude=list(module.parameters()), cache=getattr(engine, "_kv", None),
                        transient=lambda: buffers.now)
    buffers.meter = meter  # the joint peak sampled at each block's allocation too
    with PeakRSS() as rss, meter.recording(), buffers.installed(ring):
        engine.train_batch(batches())
    torch.distributed.barrier()  # no rank tears gloo down while another's last messages are in flight
    torch.distributed.destroy_process_group()
    return dict(stage=module.stage_id, saved=meter.peak, kv=meter.at_peak["kv"], left=meter.now, ring=buffers.peak,
                with_ring=meter.peak_all,
                rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_growth=rss.growth,
                lengths=list(module.plan.segment_lengths or ()))


def run(args, pp: int, cp: int, pipeline: dict, fresh: bool = True) -> list[dict]:
    """Per pipeline stage: the numbers of its CP rank with the largest kept peak, the largest ring and with-ring
    peaks over its CP ranks. `fresh=False`: ranks forked as run_ranks starts them by default (no allocator
    setting, so the RSS columns mean less; the saved-tensor counts are the same)."""
    # fresh interpreters in which tensors of 64 KiB and more get their own mappings, returned to the system when
    # freed: the RSS follows the live tensors instead of glibc's heap high-water mark
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    results = run_ranks(pp * cp, rank_main, args, pp, cp, pipeline, timeout=3600,
                        startup_env={"MALLOC_MMAP_THRESHOLD_": threshold} if fresh else None)
    stages = []
    for s in range(pp):
        ranks = [r for r in results if r["stage"] == s]
        stages.append(dict(max(ranks, key=lambda r: r["saved"]), ring=max(r["ring"] for r in ranks),
                           with_ring=max(r["with_ring"] for r in ranks)))
    return stages


def predicted(config, seq: int, cp: int, pp: int, m: int, k: int = 1, lengths=None, in_flight: bool = True) -> float:
    """The simulator's busiest rank's peak activation bytes (fp32) for this run (pure Python). `in_flight=False`:
    without the ring's K/V blocks in flight while a layer attends, which are no saved tensors (the measured kept
    peak counts saved tensors only)."""
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


def simulated_ring(config, seq: int, cp: int, k: int = 1, lengths=None) -> float:
    """The simulator's largest in-flight bytes of one layer's ring (fp32): forward's or backward's, of the longest
    K/V cache a segment passes (pure Python)."""
    from megatron_ds.schedules.context_parallel import ContextRun
    run = ContextRun(config, seq, cp, "p2p", dtype_bytes=FP32)
    return max(max(run.layer(a, n, k > 1)[0].in_flight) for a, n in run._spans(list(lengths) if k > 1 else [seq]))


RUNS = [("1f1b", 1, 1), ("1f1b", 2, 1), ("seq1f1b", 2, None)]  # (schedule, CP, k: None = --splits)
GOAL_CP2, GOAL_SEQ, GOAL_SIM = 0.55, 0.30, 0.10


def measure(args, pp: int, fresh: bool = True, recorded: dict | None = None) -> dict:
    """{(schedule, CP): the run's stages (run(), or `recorded`'s: {"schedule/CP": {"k", "stages"}} as `recorded_form`
    writes them), measured peaks (kept, ring, with ring: the largest over the stages) and the simulator's
    (predicted: whole, kept, ring)} at `pp` stages."""
    results = {}
    for name, cp, k in RUNS:
        k = args.splits if k is None else k
        pipeline = ({"schedule": "seq1f1b", "seq_splits": k, "seq_split_method": args.method} if k > 1
                    else {"schedule": name})
        if recorded is not None:
            k, stages = recorded[f"{name}/{cp}"]["k"], recorded[f"{name}/{cp}"]["stages"]
        else:
            stages = run(args, pp, cp, pipeline, fresh)
        shape = (model_config(args, cp), args.seq_length, cp, pp, args.gas, k, stages[0]["lengths"])
        results[(name, cp)] = dict(
            k=k, stages=stages, peak=max(s["saved"] for s in stages), ring=max(s["ring"] for s in stages),
            with_ring=max(s["with_ring"] for s in stages), predicted=predicted(*shape),
            kept=predicted(*shape, in_flight=False), ring_sim=simulated_ring(shape[0], args.seq_length, cp, k,
                                                                             stages[0]["lengths"]))
        print(f"  PP {pp} {name} k={k} CP {cp}: {results[(name, cp)]['peak'] / MB:.1f} MB peak", flush=True)
    return results


def recorded_form(results: dict) -> dict:
    """measure()'s results as JSON holds them: per "schedule/CP" the run's k and stages."""
    return {f"{name}/{cp}": {"k": res["k"], "stages": res["stages"]} for (name, cp), res in results.items()}


def report(pp: int, results: dict) -> tuple[list, str]:
    """(table rows, the goals line) of one PP's measure() results (pure arithmetic)."""
    base = results[("1f1b", 1)]["peak"]
    rows, off_kept, off_all = [], [], []
    for (name, cp), res in results.items():
        stages, peak, k = res["stages"], res["peak"], res["k"]
        off_kept.append(peak / res["kept"] - 1)
        off_all.append(res["with_ring"] / res["predicted"] - 1)
        label = f"{name}" + (f" k={k} {stages[0]['lengths']}" if k > 1 else "")
        rows.append([str(pp), label, str(cp), " / ".join(f"{s['saved'] / MB:.1f}" for s in stages),
                     f"{peak / MB:.1f}", f"{peak / base:.3f}", f"{res['kept'] / MB:.1f}", f"{off_kept[-1]:+.1%}",
                     f"{res['ring'] / MB:.1f} / {res['ring_sim'] / MB:.1f}", f"{res['with_ring'] / MB:.1f}",
                     f"{res['predicted'] / MB:.1f}", f"{off_all[-1]:+.1%}",
                     " / ".join(f"{s['kv'] / MB:.1f}" for s in stages),
                     " / ".join(f"{s['rss_growth'] / MB:.0f}" for s in stages)])
    k = results[("seq1f1b", 2)]["k"]
    cp2 = results[("1f1b", 2)]["peak"] / base
    seq = results[("seq1f1b", 2)]["peak"] / base
    theory = (pp - 1 + k) / (k * pp) / 2  # rank 0 under Seq1F1B at CP 2 over 1F1B at CP 1 (bench/seq1f1b_memory)
    worst_kept, worst_all = max(map(abs, off_kept)), max(map(abs, off_all))

    def verdict(ok):
        return "met" if ok else "NOT met"
    goals = (f"PP {pp} goals: 1f1b CP2 / CP1 = {cp2:.3f} (<= {GOAL_CP2}: {verdict(cp2 <= GOAL_CP2)}); "
             f"seq1f1b k={k} CP2 / 1f1b CP1 = {seq:.3f} (<= {GOAL_SEQ}: {verdict(seq <= GOAL_SEQ)}; rank 0's theory "
             f"({pp}-1+{k})/({k}x{pp})/2 = {theory:.3f}); simulator off by at most {worst_kept:.1%} kept, "
             f"{worst_all:.1%} with the ring (within {GOAL_SIM:.0%}: "
             f"{verdict(worst_kept <= GOAL_SIM)}, {verdict(worst_all <= GOAL_SIM)})")
    return rows, goals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, gas=4, seq_length=8192, hidden_size=128, num_attention_heads=4, num_layers=4,
                   vocab_size=512)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes, each its three runs")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=352)
    parser.add_argument("--splits", type=int, default=4, help="Seq1F1B's segments")
    parser.add_argument("--method", choices=["balanced", "even"], default="even")
    parser.add_argument("--record", metavar="FILE", help="also write the measurements to FILE (JSON)")
    parser.add_argument("--replay", metavar="FILE", help="take the measurements from FILE (--record's) instead of "
                        "running; the simulator's columns computed anew")
    add_output_args(parser)
    args = parser.parse_args(argv)
    machine = Machine()
    replayed = read_json(args.replay, "--replay") if args.replay else None
    header = (f"PP {' and '.join(map(str, args.pp))}, m={args.gas}, mbs 1, seq {args.seq_length}, {model_text(args)}; "
              f"fp32 on CPU (gloo), p2p ring; {machine.at_start()}\n\n") if replayed is None else replayed["header"]
    print(header, end="", flush=True)
    results, rows, goals = {}, [], []
    for pp in args.pp:
        results[pp] = measure(args, pp, recorded=replayed["runs"][str(pp)] if replayed else None)
        more, line = report(pp, results[pp])
        rows += more
        goals.append(line)
    end = machine.at_end() if replayed is None else replayed["end"]
    if args.record:
        write_atomic(args.record, json.dumps({"header": header, "end": end, "runs": {
            str(pp): recorded_form(res) for pp, res in results.items()}}, indent=1))
    lines = table(["PP", "schedule", "CP", "kept MB per stage", "kept peak MB", "/ 1f1b CP1", "sim kept MB",
                   "kept vs sim", "ring MB meas / sim", "with ring MB", "sim MB", "with ring vs sim", "K/V cache MB",
                   "iter RSS MB"], "rlrrrrrrrrrrrr", rows)
    lines += ["", *goals, "", end + (f" (measurements replayed from {args.replay})" if replayed else "")]
    text = emit("\n".join(lines), args.perf_file, "bench.cp_memory", argv, printed_before=header)
    return results, text


if __name__ == "__main__":
    main()
