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
  the whole transfer time, and the wait for the peer's post.

Simulated, the CP group's step (`coupled_step`): RingClock also marks, per rank and step, where each ring starts,
where each ring step takes its block, each wait and where the ring returns (`timeline`), which cuts a serial step
into the compute outside the rings (before, between, after them) and each ring step's compute (its time less its
waits). For each serial step both ranks' sequences run side by side, coupled at every ring step by
schedules/context_parallel.coupled_ring (a step's transfers leave when both ranks have posted, so a rank waits
for its slower peer's post and for the bytes), at one link: a K/V block's and a gradient block's transfer are the
shorter of the two ranks' serial waits for the same exchange (the later poster waits for the transfer alone),
averaged over the step's exchanges; the step ends with the group's collectives (gradients, loss) after the last
rings. The group's simulated step is the median over the serial steps (both ranks' blocks of a step index ran at
the same time, so their noise is paired), against the measured group step, its slowest rank's overlapped median
(goal within 5 %). It needs no schedule: at PP 1 the ops run back to back on each rank, in the order the measured
timeline already has, and the ring is the only thing coupling the ranks, which schedules/simulate.py does not
model; the simulator still gives the old number beside it.

The old number, each rank uncoupled (`simulated`: schedules/context_parallel.ring_times and
schedules/simulate.py): a rank's serial compute (its step less all its ring waits) as the ops' compute, the ring's
exposed time from its own rates (`bandwidth` = a K/V block's bytes over its median serial transfer, `flops` = the
attention FLOPs of a rank's blocks (rank_attention_flops) over their measured compute), every rank of the ring
alike; the largest of the ranks' makespans is what it says of the group, and misses each step's coupling.

Columns. First table, per rank: the measured median step of each mode; "compute s", the serial step less its ring
waits; "own makespan s (uncoupled)", the old simulation; the K/V rate and attention rate it used. Then the group
line, the old number beside it, and the link the coupled simulation used. Second table, per rank: the K/V waits of
each mode; "K/V hidden" 1 - overlapped / serial K/V wait; "all hidden (with grads)" the same with the gradient
blocks' waits (what the ring model's `hidden` counts: the last gradient block of each backward follows the last
step's compute in both modes); "all hidden (ring model)" ring_times' share at the rank's own rates; "all hidden
(coupled)" the coupled simulation's (its exposed transfer over the transfer); "ring waits ms overlapped /
coupled", all the rank's ring waits measured in the overlapped mode and simulated (exposed transfer plus the wait
for its peer); the block compute summed, forward / backward. A faster rank's waits are its lead over its peer, not
the link: its measured "hidden" shares can be low or negative. The machine has 2 cores shared by several
engineers: the load average is in the output.

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
    """What ring.py spends, per training step: seconds summed by kind (`spent`: K/V waits, gradient waits, block
    compute forward and backward), waits counted (`waits`), and the step's marks in order (`marks`, for
    `timeline`): ("enter", t, "F" or "B") as a ring starts, ("step", t) as each ring step takes its block,
    ("wait", begin, end, kind) for each wait, ("exit", t) as the ring returns."""
    KINDS = ("kv_wait", "grad_wait", "block_f", "block_b")

    def __init__(self):
        self.serial = False
        self.reset()

    def reset(self):
        self.spent = dict.fromkeys(self.KINDS, 0.0)
        self.waits = {"kv_wait": 0, "grad_wait": 0}
        self.marks = []

    def install(self, ring):
        """Wrap ring's _exchange, _wait, block functions, RingPlan.blocks and _Ring's two passes (this process)."""
        exchange, wait, forward, backward = ring._exchange, ring._wait, ring.block_forward, ring.block_backward
        blocks, ring_f, ring_b = ring.RingPlan.blocks, ring._Ring.forward, ring._Ring.backward
        clock, now = self, time.perf_counter

        class Posted(list):
            kind = "kv_wait"

        def timed_wait(works):
            if not works:  # waited for when posted (serial): counted then
                return
            begin = now()
            wait(works)
            end = now()
            kind = getattr(works, "kind", "kv_wait")
            clock.spent[kind] += end - begin
            clock.waits[kind] += 1
            clock.marks.append(("wait", begin, end, kind))

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
                begin = now()
                out = fn(*args, **kwargs)
                clock.spent[kind] += now() - begin
                return out
            return timed

        def marked_blocks(plan, src, q):  # called once a ring step, as it takes its block
            clock.marks.append(("step", now()))
            return blocks(plan, src, q)

        def marked(fn, kind):
            def run(*args):
                clock.marks.append(("enter", now(), kind))
                out = fn(*args)
                clock.marks.append(("exit", now()))
                return out
            return staticmethod(run)

        ring._exchange, ring._wait = timed_exchange, timed_wait
        ring.block_forward, ring.block_backward = timer(forward, "block_f"), timer(backward, "block_b")
        ring.RingPlan.blocks = marked_blocks
        ring._Ring.forward, ring._Ring.backward = marked(ring_f, "F"), marked(ring_b, "B")


def timeline(marks: list, begin: float, end: float) -> dict:
    """One rank's training step [begin, end) cut at its rings (pure arithmetic on RingClock's marks): `outside`,
    the seconds before, between and after the rings (one more than the rings); `rings`, each ring's ("F" or "B",
    [its steps' compute]): a step runs from the ring's start (the first) or its block's taking to the next one's
    (the ring's return, the last), less the waits within it; `kv` and `grad`, each wait's seconds in order."""
    outside, rings, kv, grad = [], [], [], []
    edge, ring = begin, None
    for mark in marks:
        what, at = mark[0], mark[1]
        if what == "enter":
            if ring is not None:
                raise ValueError("a ring entered inside another")
            outside.append(at - edge)
            ring = dict(kind=mark[2], bounds=[at], waited=[0.0], steps=0)
        elif what == "step":
            if ring["steps"]:  # the first step starts with the ring
                ring["bounds"].append(at)
                ring["waited"].append(0.0)
            ring["steps"] += 1
        elif what == "wait":
            (kv if mark[3] == "kv_wait" else grad).append(mark[2] - at)
            if ring is not None:
                ring["waited"][-1] += mark[2] - at
        elif what == "exit":
            bounds = ring["bounds"] + [at]
            rings.append((ring["kind"], [b - a - w for a, b, w in zip(bounds, bounds[1:], ring["waited"])]))
            edge, ring = at, None
    outside.append(end - edge)
    return dict(outside=outside, rings=rings, kv=kv, grad=grad)


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
    timelines = {name: [] for name in rings}

    def step(name):
        def run(data):
            clock.serial = name == "serial"
            clock.reset()
            begin = time.perf_counter()
            engine.train_batch(iter(data))
            timelines[name].append(timeline(clock.marks, begin, time.perf_counter()))
            rings[name].append(dict(clock.spent))
        return run

    engine.train_batch(iter(batches(0)))  # warm-up: optimizer state, allocator
    times = alternated({name: step(name) for name in rings}, args.iterations, start=1,
                       prepare=lambda name, s: batches(s))
    dist.barrier()  # no rank tears gloo down while another's last messages are in flight
    dist.destroy_process_group()
    return dict(times=times, rings=rings, waits=dict(clock.waits), timelines=timelines)


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


def coupled_step(steps: list) -> dict:
    """The CP group's step from one serial step of every rank (`timeline`s of the same step index, measured at the
    same time), the ranks coupled at every ring step (pure arithmetic): each rank runs its own non-ring compute and
    enters each ring when done with it; schedules/context_parallel.coupled_ring steps the ring through with the
    ranks' own block computes and one link: a K/V (gradient) block's transfer is the mean over the step's exchanges
    of the shorter of the two ranks' serial waits for it (a serial wait is the transfer plus the wait for the peer's
    post, and the later poster waits for the transfer alone). After the last ring the step ends with collectives
    over the group (the gradients', the loss's): the group leaves when its latest rank has done its rest, the
    shorter of the ranks' serial tails (which hold the wait for the later rank). Returns the step, the transfer
    times and each rank's exposed transfer, wait for its peer (`lag`) and transfer in the rings, in seconds."""
    from megatron_ds.schedules.context_parallel import coupled_ring
    size = len(steps)
    shapes = {tuple((kind, len(c)) for kind, c in s["rings"]) for s in steps}
    counts = {(len(s["kv"]), len(s["grad"])) for s in steps}
    if len(shapes) != 1 or len(counts) != 1:
        raise ValueError(f"the ranks' steps ran different rings or exchanges: {shapes} {counts}")

    def paired(key):
        waits = list(zip(*(s[key] for s in steps)))
        return sum(min(w) for w in waits) / len(waits) if waits else 0.0

    kv, grad = paired("kv"), paired("grad")
    now, exposed, lag, transfer = [0.0] * size, [0.0] * size, [0.0] * size, 0.0
    for i, (kind, _) in enumerate(steps[0]["rings"]):
        now = [now[r] + steps[r]["outside"][i] for r in range(size)]
        ring = coupled_ring([s["rings"][i][1] for s in steps], kv, grad, backward=kind == "B", starts=now)
        now, transfer = list(ring.ends), transfer + ring.transfer
        exposed = [a + b for a, b in zip(exposed, ring.exposed)]
        lag = [a + b for a, b in zip(lag, ring.lag)]
    step = max(now) + min(s["outside"][-1] for s in steps)
    return dict(step=step, kv=kv, grad=grad, exposed=exposed, lag=lag, transfer=transfer)


GOAL = 0.05


def group_step(measured: list, coupled: list, makespans: list) -> dict:
    """The CP group's step, measured (its slowest rank's overlapped median) against simulated (the median over the
    serial steps of `coupled_step`'s), and the old simulated step beside it (the largest of the ranks' own
    makespans); the lines saying so (pure arithmetic)."""
    step, sim = max(measured), statistics.median(coupled)
    off = step / sim - 1
    slow = max(range(len(makespans)), key=makespans.__getitem__)
    old = makespans[slow]
    lines = [f"CP group step: measured {step:.3f} s (the slowest rank's), simulated {sim:.3f} s (the ranks' serial "
             f"block computes coupled at every ring step, median of {len(coupled)} steps): {off:+.1%} (goal within "
             f"{GOAL:.0%}: {'met' if abs(off) <= GOAL else 'NOT met'})",
             f"the ranks uncoupled (each rank's own makespan, the largest: rank {slow}'s): {old:.3f} s, measured "
             f"{step / old - 1:+.1%}"]
    return dict(measured=step, simulated=sim, off=off, rank=slow, old=old, old_off=step / old - 1,
                line="\n".join(lines))


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
    coupled = [coupled_step(list(paired)) for paired in zip(*(res["timelines"]["serial"] for res in ranks))]
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
        ring_waits = statistics.median(o["kv_wait"] + o["grad_wait"] for o in over)
        sim_waits = statistics.median(c["exposed"][r] + c["lag"][r] for c in coupled)
        sim_hidden = statistics.median(1 - c["exposed"][r] / c["transfer"] for c in coupled)
        rows.append([str(r), f"{t_over:.3f}", f"{t_serial:.3f}", f"{compute:.3f}", f"{sim['step']:.3f}",
                     f"{sim['bandwidth'] / 1e9:.2f}", f"{sim['flops'] / 1e9:.1f}"])
        hidden_rows.append([str(r), f"{median_of(serial, 'kv_wait') * 1e3:.1f}",
                            f"{median_of(over, 'kv_wait') * 1e3:.1f}", f"{hidden:.1%}", f"{whole:.1%}",
                            f"{sim['hidden']:.1%}", f"{sim_hidden:.1%}", f"{ring_waits * 1e3:.0f} / {sim_waits * 1e3:.0f}",
                            f"{median_of(over, 'block_f') * 1e3:.0f} / {median_of(over, 'block_b') * 1e3:.0f}"])
    group = group_step(steps, [c["step"] for c in coupled], [sim["step"] for sim in sims])
    link = (f"the link (shorter of the paired serial waits, median of the steps): a K/V block "
            f"{statistics.median(c['kv'] for c in coupled) * 1e3:.1f} ms, a gradient block "
            f"{statistics.median(c['grad'] for c in coupled) * 1e3:.1f} ms")
    lines = table(["rank", "step s (overlapped)", "step s (serial)", "compute s", "own makespan s (uncoupled)",
                   "K/V GB/s", "attention GFLOP/s"], "rrrrrrr", rows)
    lines += ["", group["line"], link, "",
              *table(["rank", "K/V wait ms serial", "K/V wait ms overlapped", "K/V hidden", "all hidden (with grads)",
                      "all hidden (ring model)", "all hidden (coupled)", "ring waits ms overlapped / coupled",
                      "block compute ms F / B"], "rrrrrrrrr", hidden_rows),
              "", machine.at_end()]
    text = emit("\n".join(lines), args.perf_file, "bench.cp_time", argv, printed_before=header)
    return ranks, sims, coupled, group, text


if __name__ == "__main__":
    main()
