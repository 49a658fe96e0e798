"""Vocabulary parallelism measured: naive placement against vocabulary-parallel on timed layers, each
beside the simulator's prediction for it.

The model is bench/vocab_parallel.py's at p ranks (default p=4, L=16 layers: 4 per rank, the
issue's 4 layers per stage; head = 3 layers): L TimedLayers (megatron_ds/testing/timed.py) that
sleep one layer's cost each (F = B = W = --layer-ms), an output layer with its loss costing c layers
(F, B and W alike) and an embedding costing c/4 (F c/12, its backward c/6, all weight gradient).
- naive: L/S layers per virtual stage ("uniform"); the first layer also sleeps the embedding's cost,
  the last one the head's (TimedLayer's `scale`): DeepSpeed's "type:transformer" cut;
- vocab: the same layers under ds_config "pipeline.vocab_parallel": true. Each rank's EF, S, T and EW
  passes run the engine's own code (pipe/vocab/vocab_passes.py) on a real slice of a small vocabulary
  (VOCAB_ROWS rows), then sleep the simulator's cost of the pass (schedules/kinds.py's traits: S the head's
  F + B over p, T its W over p, EF the embedding's F over p, EW its B + W over p), counted from the
  last message the pass waited for. The bench hands the engine these TimedVocabPasses in place of
  its VocabPasses (engine.vocab), nothing else changes.
Every engine is built in one launch of p ranks (gloo, one thread each) and the engines take turns
iteration by iteration, so machine noise hits all alike.

Columns: iteration = median wall time of train_batch on rank 0 (after a barrier); sim = the makespan
bench.vocab_parallel.run simulates for the same costs; meas/sim = iteration / sim; vp/naive =
throughput with vocabulary parallelism over naive placement's (naive iteration / vocab iteration),
measured and simulated; the claims lines under the table give the two bounds, and the same figures
for each engine's fastest iteration (sleeps only run late: the least disturbed by the machine's other
work); traced = median compute makespan of the traced iterations (pipe/trace.py;
first op start to last op end over all ranks) and bubble its measured bubble ratio.

    python -m bench.vocab_parallel_timed                       # p=4, L=16, c=3, m=8: about 3 minutes
    python -m bench.vocab_parallel_timed --schedules 1f1b zbv zb-h1 --micro-batches 16
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import sys
import time

from bench.harness import Machine, alternated, emit, parser, table
from bench.schedules import HIDDEN, MBS, SEQ, ds_config
from bench.vocab_parallel import EMBED_SHARE, SCHEDULES, run as simulate_placements
from megatron_ds.files import write_atomic
from megatron_ds.testing.launcher import run_ranks

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
VOCAB_ROWS = 256            # rows of the real vocabulary slices' matrices (their time is slept, not computed)
PLACEMENTS = ("naive", "vocab")


def embed_costs(head: float) -> tuple:
    """The embedding's (F, B, W) in layers, as bench/vocab_parallel.py models it."""
    return EMBED_SHARE * head / 3, 0.0, 2 * EMBED_SHARE * head / 3


def vocab_op_seconds(kind, head: float, embed: tuple, pp: int, layer_s: float) -> float:
    """A slice's pass of `kind`: its share of the whole layer's (F, B, W), as the simulator charges it."""
    layer = {"head": (head,) * 3, "embed": embed}[kind.traits.vocab]
    return sum(c * x for c, x in zip(kind.traits.cost, layer)) / pp * layer_s


# -- worker side (one process per pipeline rank) -------------------------------------------------

def timed_vocab_passes(engine, costs, seconds):
    """The engine's VocabPasses (imported here: the launching process needs no torch), each pass then
    sleeping `seconds[kind]` counted from the last message it waited for (costs: the TimedCosts whose
    lateness the sleeps share)."""
    from megatron_ds.pipe.vocab.vocab_passes import VocabPasses
    from megatron_ds.schedules.kinds import Kind

    class TimedVocabPasses(VocabPasses):
        resume = 0.0

        def _fetch(self, message_key, keep=False):
            tensor = super()._fetch(message_key, keep)
            self.resume = time.perf_counter()
            return tensor

        def _timed(self, kind, run, op):
            self.resume = time.perf_counter()
            run(op)
            costs.sleep_until(self.resume + seconds[kind])

        def embedding_forward(self, op):
            self._timed(Kind.EF, super().embedding_forward, op)

        def s_pass(self, op):
            self._timed(Kind.S, super().s_pass, op)

        def t_pass(self, op):
            self._timed(Kind.T, super().t_pass, op)

        def embedding_weight_grad(self, op):
            self._timed(Kind.EW, super().embedding_weight_grad, op)

    return TimedVocabPasses(engine)


def build_engine(schedule, placement, opts, costs):
    import torch
    from deepspeed.pipe import LayerSpec
    from megatron_ds.model import GPTConfig
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.schedules.kinds import VOCAB
    from megatron_ds.testing.timed import TimedLayer, timed_loss

    p, layers, head = opts["pp"], opts["layers"], opts["head"]
    embed = embed_costs(head)
    scales = [[1.0, 1.0, 1.0] for _ in range(layers)]
    if placement == "naive":  # the embedding's cost on the first layer, the head's on the last
        scales[0] = [1.0 + x for x in embed]
        scales[-1] = [1.0 + head] * 3
    specs = [LayerSpec(TimedLayer, HIDDEN, costs, tuple(s)) for s in scales]
    section = dict(SCHEDULES[schedule], schedule=schedule, vocab_parallel=placement == "vocab")
    cfg = ds_config(opts["pp"], section, None, opts["micro_batches"])
    shape = GPTConfig(vocab_size=VOCAB_ROWS, hidden_size=HIDDEN, num_layers=layers, num_attention_heads=1,
                      max_position_embeddings=SEQ)
    module = build_pipeline_module(shape, cfg, p, layers=specs, loss_fn=timed_loss)
    engine = initialize_engine(module, cfg, optimizer=torch.optim.SGD(module.parameters(), lr=1e-3))
    if placement == "vocab":
        seconds = {k: vocab_op_seconds(k, head, embed, p, opts["layer_ms"] / 1e3) for k in VOCAB}
        engine.vocab = timed_vocab_passes(engine, costs, seconds)  # the engine's passes, timed
    return engine


def batches(placement, m, seed):
    """Naive: float inputs and targets (the timed loss); vocab: tokens, positions and labels (the slices)."""
    import torch
    from megatron_ds.model import position_ids_like
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        if placement == "naive":
            out.append(((torch.randn(MBS, SEQ, HIDDEN, generator=g),), torch.randn(MBS, SEQ, HIDDEN, generator=g)))
        else:
            tokens = torch.randint(0, VOCAB_ROWS, (MBS, SEQ + 1), generator=g)
            x = tokens[:, :-1].contiguous()
            out.append(((x, position_ids_like(x)), tokens[:, 1:].contiguous()))
    return out


def worker(opts, out_root):
    import deepspeed
    import torch
    from megatron_ds.testing.timed import TimedCosts

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    layer_s = opts["layer_ms"] / 1e3
    costs = TimedCosts(tf=layer_s, tb=layer_s, tw=layer_s, carry_overshoot=True)
    cells = [(s, pl) for s in opts["schedules"] for pl in PLACEMENTS]
    engines = {cell: build_engine(*cell, opts, costs) for cell in cells}
    data = {pl: batches(pl, opts["micro_batches"], 0) for pl in PLACEMENTS}
    dirs = {cell: os.path.join(out_root, f"{cell[0]}_{cell[1]}") for cell in cells}
    losses = {cell: [] for cell in cells}

    def trace_timed(cell, step):  # off the clock: the warm-up untraced
        engines[cell].tracer.trace_dir = dirs[cell] if step >= opts["warmup"] else None
        return step

    def run(cell):
        return lambda step: losses[cell].append(float(engines[cell].train_batch(iter(data[cell[1]]))))
    times = alternated({cell: run(cell) for cell in cells}, opts["warmup"] + opts["iterations"], prepare=trace_timed)
    first = opts["warmup"]
    return {f"{s}|{pl}": {"times": times[(s, pl)][first:], "losses": losses[(s, pl)][first:],
                          "trace_dir": dirs[(s, pl)]} for s, pl in cells}


# -- analysis --------------------------------------------------------------------------------------

def analyse(results, opts):
    """{schedule: {placement: row}} with measured, traced and simulated figures (seconds)."""
    from megatron_ds.schedules.timeline import load_iteration, measure, steps
    layer_s = opts["layer_ms"] / 1e3
    table = {}
    for schedule in opts["schedules"]:
        sim = simulate_placements(schedule, opts["pp"], opts["micro_batches"], opts["head"], opts["layers"])
        rows = table[schedule] = {}
        for placement in PLACEMENTS:
            r = results[f"{schedule}|{placement}"]
            traced = [measure(load_iteration(r["trace_dir"], step)) for step in steps(r["trace_dir"])]
            it = statistics.median(r["times"])
            s = sim[placement].makespan * layer_s
            rows[placement] = {"iteration": it, "times": r["times"], "losses": r["losses"], "sim": s,
                               "meas_sim": it / s, "best_sim": min(r["times"]) / s,
                               "traced": statistics.median(t.makespan for t in traced),
                               "bubble": statistics.median(t.bubble_ratio for t in traced)}
        n, v = rows["naive"], rows["vocab"]
        rows["ratio"] = {"measured": n["iteration"] / v["iteration"], "simulated": n["sim"] / v["sim"],
                         "best": min(n["times"]) / min(v["times"]),
                         "ideal": sim["ideal"].makespan * layer_s}
    return table


def markdown(results, opts):
    p, L, c = opts["pp"], opts["layers"], opts["head"]
    lines = [f"**p={p}, m={opts['micro_batches']}, L={L} layers ({L // p} per rank), head + loss = {c:g} layers "
             f"(F, B, W alike), embedding = {c * EMBED_SHARE:g} layers; one layer's F = B = W = "
             f"{opts['layer_ms']:g} ms** (iteration times in ms)", ""]
    cells = []
    for name, rows in results.items():
        n, v, r = rows["naive"], rows["vocab"], rows["ratio"]
        cells.append([name, f"{n['iteration'] * 1e3:.0f}", f"{n['sim'] * 1e3:.0f}", f"{n['meas_sim']:.3f}",
                      f"{v['iteration'] * 1e3:.0f}", f"{v['sim'] * 1e3:.0f}", f"{v['meas_sim']:.3f}",
                      f"{r['measured']:.3f}", f"{r['simulated']:.3f}", f"{n['traced'] * 1e3:.0f} / {n['bubble']:.3f}",
                      f"{v['traced'] * 1e3:.0f} / {v['bubble']:.3f}"])
    lines += table(["schedule", "naive", "naive sim.", "naive meas/sim", "vocab", "vocab sim.", "vocab meas/sim",
                    "vp/naive measured", "vp/naive simulated", "naive traced / bubble", "vocab traced / bubble"],
                   "l" + "r" * 10, cells)
    return "\n".join(lines)


CLAIM_RATIO, CLAIM_SIM = 1.25, 1.05  # the bars: vp/naive at least this, measured / simulated within this


def claims(table):
    """One line per schedule: the two bounds (CLAIM_RATIO, CLAIM_SIM), measured in this run."""
    lines = []
    for name, rows in table.items():
        ratio = rows["ratio"]["measured"]
        off = max(abs(rows[pl]["meas_sim"] - 1) for pl in PLACEMENTS)
        lines.append(f"{name}: vp/naive = {ratio:.3f} ({'>=' if ratio >= CLAIM_RATIO else 'NOT >='} {CLAIM_RATIO}; "
                     f"simulated {rows['ratio']['simulated']:.3f}); measured/simulated naive "
                     f"{rows['naive']['meas_sim']:.3f}, vocab {rows['vocab']['meas_sim']:.3f} "
                     f"({'within' if off <= CLAIM_SIM - 1 else 'NOT within'} {CLAIM_SIM}); least disturbed "
                     f"iterations: vp/naive {rows['ratio']['best']:.3f}, measured/simulated naive "
                     f"{rows['naive']['best_sim']:.3f}, vocab {rows['vocab']['best_sim']:.3f}")
    return lines


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16, help="transformer layers L (L/p per rank)")
    ap.add_argument("--head", type=float, default=3.0, help="head + loss cost c, in layers")
    ap.add_argument("--micro-batches", type=int, default=None, help="default: 2p")
    ap.add_argument("--layer-ms", type=float, default=25.0, help="one layer's F (= B = W), milliseconds")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"], choices=list(SCHEDULES))
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations per engine")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_vocab_parallel_timed"),
                    help="traces and results.json go here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the launch")
    args = ap.parse_args(argv)
    opts = {"pp": args.pp, "layers": args.layers, "head": args.head, "layer_ms": args.layer_ms,
            "micro_batches": args.micro_batches or 2 * args.pp, "schedules": args.schedules,
            "iterations": args.iterations, "warmup": args.warmup}
    machine = Machine()
    head = (f"# bench/vocab_parallel_timed.py on {machine.cores} CPU cores, {machine.at_start()}; median of "
            f"{args.iterations} iterations (+{args.warmup} warm-up) per engine, engines taking turns")
    print(head, flush=True)
    for schedule in opts["schedules"]:  # traces of an earlier run would join this one's
        for placement in PLACEMENTS:
            shutil.rmtree(os.path.join(args.out, f"{schedule}_{placement}"), ignore_errors=True)
    results = run_ranks(args.pp, worker, opts, args.out, timeout=args.timeout, quiet=True)[0]
    rows = analyse(results, opts)
    emit(f"\n{markdown(rows, opts)}\n\n" + "\n".join(claims(rows)) + f"\n\n# {machine.at_end()}", args.perf_file,
         "bench.vocab_parallel_timed", argv, printed_before=head + "\n")
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "results.json"), json.dumps({"opts": opts, "table": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
