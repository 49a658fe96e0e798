"""A MoE GPT at p=4 on timed layers beside the simulator: iteration time, per-rank memory and the
all-to-all's share of the step under 1f1b, zb-h1, zbv, bitpipe and dualpipev.

1. Costs, measured as bench/layer_costs.py measures them (its flags; defaults below: the model of
   bench/moe.py with 8 layers, every second one MoE, EP 2): a dense layer's and a MoE layer's F, B, W
   on this CPU (one thread), the embedding's and the head + loss's, each layer's activations, and the
   all-to-all of one micro-batch's routed rows over gloo on --expert-model-parallel-size processes.
2. Simulated (schedules.costs.evaluate): each layer its own cost, the MoE layers' all-to-all on the
   critical path of their F and B, kept apart (SimResult.all_to_all: each rank's time in it).
3. Measured: the schedules' real engines on --pp ranks (gloo, one thread each, one launch, the engines
   taking turns iteration by iteration) over L TimedLayers (megatron_ds/testing/timed.py) that sleep
   each layer's measured cost x --time-scale (the sleeps then stand above the machine's jitter; the
   tables divide it back out), the first layer also the embedding's, the last the head + loss's, "uniform"
   cut (DeepSpeed's count-balanced one, as the simulation's). A MoE layer sleeps its all-to-all after its
   forward and before its backward, where the runtime runs it (synchronously), and counts that time.

Columns: iteration = median wall time of train_batch on rank 0 (after a barrier), / --time-scale;
sim. = the simulated makespan; a2a share = time in the all-to-all over the iteration, the most of any
rank (measured: the counted sleeps; simulated: SimResult.all_to_all); activations = the simulated peak
per rank (one micro-batch of one 1F1B stage = the measured layers' bytes / p, the logits counted);
weights = the parameters (fp32) each rank holds: its stages' layers, E/e experts of each MoE layer,
bitpipe's two replicas.

    python -m bench.moe_timed                               # about 3 minutes on 2 cores
    python -m bench.moe_timed --iterations 3 --micro-batches 16   # other flags: bench/layer_costs.py's
"""
from __future__ import annotations

import logging
import statistics
import sys
import time

import torch

from bench import layer_costs
from bench.harness import Machine, alternated, emit, parser, table
from bench.moe_costs import layer_parameters
from bench.schedules import HIDDEN, MBS, SEQ, ds_config  # the timed layers' tensors (their time is slept)
from megatron_ds.testing.launcher import run_ranks
from megatron_ds.testing.timed import TimedLayer

SCHEDULES = ("1f1b", "zb-h1", "zbv", "bitpipe", "dualpipev")
MODEL = ["--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "2",
         "--num-layers", "8", "--vocab-size", "2048", "--swiglu", "--normalization", "rmsnorm",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--expert-model-parallel-size", "2",
         "--moe-aux-loss-coeff", "0.01", "--pp", "4", "--micro-batches", "8"]


def layer_seconds(costs, num_layers: int, pp: int) -> list[tuple]:
    """Per timed layer: ((F, B, W) compute, (F, B) all-to-all) seconds, the embedding's on the first, the
    head + loss's on the last (where the simulation puts them)."""
    mean = [t * pp / num_layers for t in (costs.tf, costs.tb, costs.tw)]  # a dense model's layers: all alike
    compute = [list(t) for t in costs.layers] or [list(mean) for _ in range(num_layers)]
    comm = [tuple(c) for c in costs.all_to_all] or [(0.0, 0.0)] * num_layers
    for i in range(3):
        compute[0][i] += costs.embed[i]
        compute[-1][i] += costs.head[i]
    return [(tuple(c), a) for c, a in zip(compute, comm)]


# -- worker side (one process per pipeline rank) -------------------------------------------------

class CommClock:
    """Seconds this process slept as all-to-all (the timed MoE layers add to it)."""
    seconds = 0.0

    @classmethod
    def sleep(cls, costs, seconds):
        start = time.perf_counter()
        costs.sleep(seconds)
        cls.seconds += time.perf_counter() - start


class _Comm(torch.autograd.Function):
    """x through, a layer's forward all-to-all slept after its forward, its backward one before its backward."""

    @staticmethod
    def forward(ctx, x, costs, f, b):
        ctx.costs, ctx.b = costs, b
        CommClock.sleep(costs, f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CommClock.sleep(ctx.costs, ctx.b)
        return grad, None, None, None


class TimedMoELayer(TimedLayer):
    """A TimedLayer of `scale` (its F, B, W seconds: the costs' tf = tb = tw = 1) and its all-to-all `comm`
    ((F, B) seconds, slept apart and counted)."""

    def __init__(self, hidden, costs, scale, comm):
        super().__init__(hidden, costs, scale)
        self.comm = tuple(comm)

    def forward(self, x):
        y = super().forward(x)
        return _Comm.apply(y, self.costs, *self.comm) if any(self.comm) else y


def build_engine(schedule, opts, costs):
    from deepspeed.pipe import LayerSpec
    from megatron_ds.model import GPTConfig
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.testing.timed import timed_loss

    scale = opts["time_scale"]
    specs = [LayerSpec(TimedMoELayer, HIDDEN, costs, tuple(x * scale for x in compute),
                       tuple(x * scale for x in comm)) for compute, comm in opts["layers"]]
    cfg = ds_config(opts["pp"], {"schedule": schedule}, None, opts["micro_batches"])
    shape = GPTConfig(vocab_size=1, hidden_size=HIDDEN, num_layers=len(specs), num_attention_heads=1,
                      max_position_embeddings=SEQ)
    module = build_pipeline_module(shape, cfg, opts["pp"], layers=specs, loss_fn=timed_loss)
    return initialize_engine(module, cfg, optimizer=torch.optim.SGD(module.parameters(), lr=1e-3))


def worker(opts):
    import deepspeed
    from megatron_ds.testing.timed import TimedCosts

    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.utils.logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    costs = TimedCosts(tf=1.0, tb=1.0, tw=1.0, carry_overshoot=True)  # each layer's scale is its seconds
    engines = {name: build_engine(name, opts, costs) for name in opts["schedules"]}
    g = torch.Generator().manual_seed(0)
    data = [((torch.randn(MBS, SEQ, HIDDEN, generator=g),), torch.randn(MBS, SEQ, HIDDEN, generator=g))
            for _ in range(opts["micro_batches"])]
    slept = {name: [] for name in engines}

    def run(name, engine):
        def one(_):
            CommClock.seconds = 0.0
            engine.train_batch(iter(data))
            slept[name].append(CommClock.seconds)
        return one
    times = alternated({name: run(name, engine) for name, engine in engines.items()},
                       opts["warmup"] + opts["iterations"])
    first = opts["warmup"]
    return {name: {"times": t[first:], "comm": [c / e for c, e in zip(slept[name][first:], t[first:])]}
            for name, t in times.items()}


# -- the parent: costs, simulation, table --------------------------------------------------------

def measure(argv):
    """(layer_costs' args, ModelCosts, its measured layers) of the flags."""
    args = layer_costs.parse_args(argv)
    layers = layer_costs.measure_layers(args)
    ends = layer_costs.measure_ends(args)
    return args, layer_costs.model_costs(args, layers, ends), layers, ends


def rank_weights(schedule, config, flags, vocab: int, untied: bool) -> list[float]:
    """Bytes of the fp32 parameters each rank holds: the layers of its stages (each replica's), the
    embedding with stage 0, the head with the last stage (tied: its weight is the embedding's)."""
    from megatron_ds.schedules.costs import stage_layers
    params = layer_parameters(config, flags)
    table = vocab * config.hidden_size
    out = [0.0] * schedule.pp
    for placed in schedule.placement:
        for stage, held in enumerate(stage_layers(len(flags), schedule.stages)):
            ends = (stage == 0) + untied * (stage == schedule.stages - 1)
            out[placed[stage]] += sum(params[i] for i in held) + table * ends
    return [4.0 * x for x in out]


def simulate_rows(args, costs, layers):
    """{schedule: simulated makespan, a2a share, per-rank activation and weight bytes}."""
    from megatron_ds.pipe.plan.config import pipeline_settings
    from megatron_ds.schedules.costs import evaluate
    unit = sum(layers["bytes"]) / args.pp  # one micro-batch on one 1F1B stage
    config = layer_costs.setup(args)[0]
    out = {}
    for name in SCHEDULES:
        schedule = pipeline_settings({"pipeline": {"schedule": name}}).build_schedule(args.pp, args.micro_batches)
        res = evaluate(schedule, costs)
        out[name] = {"sim": res.makespan, "sim_a2a": max(res.all_to_all) / res.makespan,
                     "activations": [m * unit for m in res.peak_memory],
                     "weights": rank_weights(schedule, config, layers["flags"], args.vocab_size,
                                             config.untie_embeddings_and_output_weights)}
    return out


def markdown(args, costs, layers, rows, opts) -> str:
    mb, ep = 1024 * 1024, layer_costs.setup(args)[0].moe.expert_model_parallel_size
    timed = layers["timed"]
    dense, moe = timed.get("dense"), timed["MoE"]
    comm = next(c for c, f in zip(layers["all_to_all"], layers["flags"]) if f)
    ms = lambda t: "/".join(f"{x * 1e3:.2f}" for x in t)  # noqa: E731
    lines = [f"Measured per micro-batch (F/B/W ms): a dense layer {ms(dense[:3]) if dense else 'none'}, a MoE layer "
             f"{ms(moe[:3])} ({sum(layers['flags'])} of {args.num_layers} layers), its all-to-all F/B {ms(comm)} "
             f"(EP {ep} over gloo); embedding "
             f"{ms(costs.embed)}, head + loss {ms(costs.head)}; activations of one micro-batch: a MoE layer "
             f"{moe[3] / mb:.2f} MB" + (f", a dense one {dense[3] / mb:.2f} MB" if dense else "") + ".", "",
             f"p={args.pp}, m={args.micro_batches}, timed layers x {opts['time_scale']:g}:", ""]
    base = rows["1f1b"]["iteration"]
    lines += table(["schedule", "iteration (ms)", "sim. (ms)", "meas./sim.", "iteration / 1f1b's",
                    "a2a share (meas. / sim.)", "activations per rank, sim. (MB)", "weights per rank (MB)"], "lrrrrrll",
                   [[name, f"{r['iteration'] * 1e3:.1f}", f"{r['sim'] * 1e3:.1f}", f"{r['iteration'] / r['sim']:.3f}",
                     f"{r['iteration'] / base:.3f}", f"{r['a2a']:.1%} / {r['sim_a2a']:.1%}",
                     " ".join(f"{x / mb:.2f}" for x in r["activations"]),
                     " ".join(f"{x / mb:.2f}" for x in r["weights"])] for name, r in rows.items()])
    return "\n".join(lines)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations per engine")
    ap.add_argument("--timed-warmup", type=int, default=1, help="untimed iterations per engine")
    ap.add_argument("--time-scale", type=float, default=4.0, help="the timed layers sleep the measured costs x this")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the launch")
    own, rest = ap.parse_known_args(argv)
    machine = Machine()
    head = (f"# bench/moe_timed.py on {machine.cores} CPU cores, {machine.at_start()}; layer_costs flags: "
            f"{' '.join(MODEL + rest)}")
    print(head, flush=True)
    args, costs, layers, _ = measure(MODEL + rest)
    opts = {"pp": args.pp, "micro_batches": args.micro_batches, "schedules": SCHEDULES, "iterations": own.iterations,
            "warmup": own.timed_warmup, "time_scale": own.time_scale,
            "layers": layer_seconds(costs, args.num_layers, args.pp)}
    measured = run_ranks(args.pp, worker, opts, timeout=own.timeout, quiet=True)
    results = simulate_rows(args, costs, layers)
    for name, row in results.items():
        row["iteration"] = statistics.median(measured[0][name]["times"]) / own.time_scale
        row["a2a_ranks"] = [statistics.median(rank[name]["comm"]) for rank in measured]
        row["a2a"] = max(row["a2a_ranks"])
    emit("\n" + markdown(args, costs, layers, results, opts) + f"\n\n# {machine.at_end()}", own.perf_file,
         "bench.moe_timed", argv, printed_before=head + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
