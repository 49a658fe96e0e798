"""A context-parallel step's time on gloo beside the simulated one, and the share of the ring's transfers hidden.

The LLaMA-style GPT of bench/cp_memory.py at CP 2 (PP 1, two gloo ranks, one thread each, p2p ring), m
micro-batches a step under 1f1b. Each step's ring is timed from inside (model/context_parallel/ring.py's names
wrapped): every wait for a posted K/V block (forward and backward) and for a gradient block, and every block's
attention compute. Two modes, their steps alternated (bench/harness.alternated) so that the shared machine's load
hits both alike:
- overlapped: the ring as it runs, each K/V block in flight while the rank attends the block in hand, and each
  backward step's gradient block while the next step's block is attended; its waits are the transfer the compute
  left exposed;
- serial: every transfer (K/V and gradient) waited for as soon as it is posted, before any compute; its waits are
  the whole transfer time.
K/V hidden = 1 - (overlapped K/V wait) / (serial K/V wait), per step (the medians); "all hidden" counts the
gradient blocks' waits too (what the ring model's `hidden` counts: the last gradient block of each backward
follows the last step's compute in both modes).

Simulated (schedules/context_parallel.ring_times, schedules/simulate.py), per rank: the serial mode's compute (its
step less all its ring waits) as the ops' compute, and the ring's exposed time from the measured rates:
`bandwidth` = a K/V block's bytes over its median serial transfer, `flops` = the attention FLOPs of a rank's blocks
(rank_attention_flops) over their measured compute. The ring couples the CP ranks: every ring step ends when both
have attended their block and the block has arrived, so the group steps at its slowest rank's pace and the faster
rank's waits are that rank's lead, not the link's time. The cost model gives every rank of a ring the same
compute and the same link, so the group's simulated step is the slowest rank's simulated makespan (the largest
of the ranks', each from its own compute and transfer rates; the slowest rank barely waits for its peer, so its
serial waits are closest to the link's time), and the group's measured step is its slowest rank's overlapped
median: meas/sim = the one over the other (goal within 5 %). The per-rank rows show each rank's own makespan
beside it; the faster rank's is no prediction of anything (its step is its peer's). The machine has 2 cores
shared by several engineers: the load average is in the output.

    python -m bench.cp_time --seq-length 4096 --perf-file docs/perf/context_parallel_time_cpu.md
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.cp_memory import model_config, model_text
from bench.harness import Machine, add_output_args, alternated, emit, table
from bench.options import add_model_args
from megatron_ds.testing.launcher import run_ranks

CP = 2
FP32 = 4


class RingClock:
    """Seconds spent in ring.py per step: K/V waits, gradient waits, block compute (forward, backward)."""
    KINDS = ("kv_wait", "grad_wait", "block_f", "block_b")

    def __init__(self):
        self.serial = False
        self.reset()

    def reset(self):
        self.spent = dict.fromkeys(self.KINDS, 0.0)
        self.waits = {"kv_wait": 0, "grad_wait": 0}

    def install(self, ring):
        """Wrap ring's _exchange, _wait and block functions (this process only)."""
        exchange, wait, forward, backward = ring._exchange, ring._wait, ring.block_forward, ring.block_backward
        clock = self

        class Posted(list):
            kind = "kv_wait"

        def timed_wait(works):
            if not works:  # waited for when posted (serial): counted then
                return
            begin = time.perf_counter()
            wait(works)
            kind = getattr(works, "kind", "kv_wait")
            clock.spent[kind] += time.perf_counter() - begin
            clock.waits[kind] += 1

        def timed_exchange(t, plan, tag):
            received, works = exchange(t, plan, tag)
            works = Posted(works)
            works.kind = "kv_wait" if tag == ring._KV_TAG else "grad_wait"
            if clock.serial:
                timed_wait(works)  # the whole transfer before any compute
                works = Posted()
            return received, works

        def timer(fn, kind):
            def timed(*args, **kwargs):
                begin = time.perf_counter()
                out = fn(*args, **kwargs)
                clock.spent[kind] += time.perf_counter() - begin
                return out
            return timed

        ring._exchange, ring._wait = timed_exchange, timed_wait
        ring.block_forward, ring.block_backward = timer(forward, "block_f"), timer(backward, "block_b")


def rank_main(args):
    """One CP rank (run_ranks gives it the launcher's environment and one thread): its timings and ring waits."""
    import deepspeed
    import torch.distributed as dist
    from megatron_ds.model import position_ids_like
    from megatron_ds.model.context_parallel import ring
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    deepspeed.init_distributed(dist_backend="gloo")
    config = model_config(args, CP)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.gas,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9, "pipeline": {"schedule": "1f1b"},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    module = build_pipeline_module(config, ds_config, 1, seq_length=args.seq_length)
    engine = initialize_engine(module, ds_config, model_parameters=list(module.parameters()))
    clock = RingClock()
    clock.install(ring)

    def batches(step):
        g = torch.Generator().manual_seed(step)
        out = []
        for _ in range(args.gas):
            tokens = torch.randint(0, config.vocab_size, (1, args.seq_length + 1), generator=g)
            x = tokens[:, :-1].contiguous()
            out.append(((x, position_ids_like(x)), tokens[:, 1:].contiguous()))
        return out

    rings = {"overlapped": [], "serial": []}

    def step(name):
        def run(data):
            clock.serial = name == "serial"
            clock.reset()
            engine.train_batch(iter(data))
            rings[name].append(dict(clock.spent))
        return run

    engine.train_batch(iter(batches(0)))  # warm-up: optimizer state, allocator
    times = alternated({name: step(name) for name in rings}, args.iterations, start=1,
                       prepare=lambda name, s: batches(s))
    dist.barrier()  # no rank tears gloo down while another's last messages are in flight
    dist.destroy_process_group()
    return dict(times=times, rings=rings, waits=dict(clock.waits))


def launch(args) -> list[dict]:
    """Every CP rank's result, rank order (a hang fails the bench after an hour instead of holding the machine)."""
    return run_ranks(CP, rank_main, args, timeout=3600)


def median_of(rings: list, key: str) -> float:
    return statistics.median(r[key] for r in rings)


def simulated(config, seq: int, m: int, compute: float, kv_transfer: float, block_f: float) -> dict:
    """The simulator's step (pure Python): `compute` seconds of a step's ops (all micro-batches), the ring's K/V
    transfer `kv_transfer` seconds a block, `block_f` seconds of a layer's forward block compute (one
    micro-batch, every step of the ring) on a rank. Returns the rates fed in, the ring's modelled hidden share, the
    exposed seconds and the simulated step."""
    from megatron_ds.schedules import build_schedule, simulate
    from megatron_ds.schedules.context_parallel import messages, rank_attention_flops, ring_times
    from megatron_ds.schedules.costs import ModelCosts
    block_bytes = messages(config, seq, CP, "p2p", dtype_bytes=FP32).forward[0].size
    bandwidth = block_bytes / kv_transfer
    flops = rank_attention_flops(config, seq, CP, 0) / block_f
    ring = ring_times(config, seq, CP, "p2p", dtype_bytes=FP32, flops=flops, bandwidth=bandwidth)
    layers = config.num_layers
    share = compute / m / 3  # PP 1: the ops run one after another, however F, B and W divide a micro-batch
    costs = ModelCosts(share, share, share, context=tuple(layers * e for e in ring.exposed))
    schedule = build_schedule("1f1b", 1, m)
    makespan = simulate(schedule, *costs.per_stage(schedule)).makespan
    return dict(bandwidth=bandwidth, flops=flops, hidden=ring.hidden, exposed=m * layers * sum(ring.exposed),
                step=makespan)


GOAL = 0.05


def group_step(measured: list, simulated: list) -> dict:
    """The CP group's step, measured (its slowest rank's overlapped median) against simulated (the largest of the
    ranks' simulated makespans: the slowest rank's), and the line saying so (pure arithmetic)."""
    slow = max(range(len(simulated)), key=simulated.__getitem__)
    step, sim = max(measured), simulated[slow]
    off = step / sim - 1
    line = (f"CP group step: measured {step:.3f} s (the slowest rank's), simulated {sim:.3f} s (rank {slow}'s "
            f"makespan, the largest): {off:+.1%} (goal within {GOAL:.0%}: {'met' if abs(off) <= GOAL else 'NOT met'})")
    return dict(measured=step, simulated=sim, rank=slow, off=off, line=line)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, gas=2, seq_length=4096, hidden_size=128, num_attention_heads=4, num_layers=2,
                   vocab_size=512)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=352)
    parser.add_argument("--iterations", type=int, default=6, help="timed steps of each mode (alternated)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    machine = Machine()
    header = (f"CP {CP} x PP 1 (2 gloo ranks, 1 thread each), 1f1b, m={args.gas}, mbs 1, seq {args.seq_length}, "
              f"{model_text(args)}; fp32, p2p ring; {args.iterations} steps each mode after one warm-up; "
              f"{machine.at_start()}\n\n")
    print(header, end="", flush=True)
    ranks = launch(args)
    config = model_config(args, CP)
    rows, hidden_rows, sims, steps = [], [], [], []
    for r, res in enumerate(ranks):
        over, serial = res["rings"]["overlapped"], res["rings"]["serial"]
        t_over, t_serial = (statistics.median(res["times"][k]) for k in ("overlapped", "serial"))
        waits_serial = [s["kv_wait"] + s["grad_wait"] for s in serial]
        compute = statistics.median(t - w for t, w in zip(res["times"]["serial"], waits_serial))
        kv_blocks = args.gas * args.num_layers * 2 * (CP - 1)  # forward and backward, each layer and micro-batch
        per_block = median_of(serial, "kv_wait") / kv_blocks
        block_f = median_of(over, "block_f") / (args.gas * args.num_layers * CP)  # a ring step's block compute
        sim = simulated(config, args.seq_length, args.gas, compute, per_block, block_f * CP)
        sims.append(sim)
        steps.append(t_over)
        hidden = 1 - median_of(over, "kv_wait") / median_of(serial, "kv_wait")
        whole = 1 - ((median_of(over, "kv_wait") + median_of(over, "grad_wait"))
                     / (median_of(serial, "kv_wait") + median_of(serial, "grad_wait")))
        rows.append([str(r), f"{t_over:.3f}", f"{t_serial:.3f}", f"{compute:.3f}", f"{sim['step']:.3f}",
                     f"{sim['bandwidth'] / 1e9:.2f}", f"{sim['flops'] / 1e9:.1f}"])
        hidden_rows.append([str(r), f"{median_of(serial, 'kv_wait') * 1e3:.1f}", f"{median_of(over, 'kv_wait') * 1e3:.1f}",
                            f"{hidden:.1%}", f"{whole:.1%}", f"{sim['hidden']:.1%}", f"{median_of(over, 'grad_wait') * 1e3:.1f}",
                            f"{median_of(over, 'block_f') * 1e3:.0f} / {median_of(over, 'block_b') * 1e3:.0f}"])
    group = group_step(steps, [sim["step"] for sim in sims])
    lines = table(["rank", "step s (overlapped)", "step s (serial)", "compute s", "own makespan s (simulated)",
                   "K/V GB/s", "attention GFLOP/s"], "rrrrrrr", rows)
    lines += ["", group["line"], "", *table(["rank", "K/V wait ms serial", "K/V wait ms overlapped", "K/V hidden",
                                             "all hidden (with grads)", "all hidden (ring model)", "grad wait ms",
                                             "block compute ms F / B"], "rrrrrrrr", hidden_rows),
              "", machine.at_end()]
    text = emit("\n".join(lines), args.perf_file, "bench.cp_time", argv, printed_before=header)
    return ranks, sims, group, text


if __name__ == "__main__":
    main()
