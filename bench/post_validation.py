"""Optimizer post-validation: time per iteration with "pipeline.post_validation" off and on.

A pipeline of timed layers (megatron_ds.testing.timed: they sleep set times in forward, input-gradient
and weight-gradient backward, so p ranks on a small CPU behave like p devices) with a "ballast"
parameter per layer that only the optimizer works on: the optimizer step is real work (ZeRO-1 flatten, AdamW, copies) of a chosen
size. Under ZB-V and ZB-H2 the ranks finish their last op at different times (rank 0 first); without
post-validation every rank waits for the last one before it may step, with it each rank steps while the
others finish and only then waits. Rank 0 then starts the next iteration sooner by up to
min(optimizer step, finish gap - copy time); under 1F1B rank 0 finishes last and nothing is gained (the
contrast row). "finish gap": last minus first rank to reach the optimizer step (post-validation off).
Both engines of a schedule are built in one launch and run in
alternating blocks of back-to-back iterations (no barrier inside a block, so an early rank may start
its next iteration early); the table gives the median block of each and the median of the blocks'
on/off ratios (each "on" block paired with the "off" block next to it).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m bench.post_validation
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 -m bench.post_validation --schedules zbv
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m bench.post_validation --ballast 30000 --optimizer-ms 40

The last form models the optimizer step's time by a sleep as the layers do (steadier on a busy CPU; the
kept copy then costs next to nothing, as the copies of a small partition do).
"""
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec

from bench.harness import Report, alternated, paired_ratio, parser, table
from megatron_ds.testing.timed import TimedCosts, TimedLayer, timed_loss
from megatron_ds.pipe.build import initialize_engine, topology
from megatron_ds.pipe.plan.config import pipeline_settings
from megatron_ds.pipe.module import ChunkedPipelineModule
from megatron_ds.pipe.plan.plan import PipelinePlan


class BallastLayer(TimedLayer):
    """megatron_ds.testing.timed's TimedLayer plus `ballast` parameters that only the optimizer works on:
    they get a zero gradient in the first forward of each iteration, so ZeRO reduces and flattens them
    and AdamW steps them (real work of a chosen size) while forward and backward stay timed sleeps."""

    def __init__(self, hidden, ballast, costs):
        super().__init__(hidden, costs)
        self.ballast = torch.nn.Parameter(torch.zeros(ballast))

    def forward(self, x):
        if self.training and self.ballast.grad is None:
            self.ballast.grad = torch.zeros_like(self.ballast)
        return super().forward(x)


def make_engine(schedule, post_validation, args, pp):
    ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch_size,
                 "gradient_accumulation_steps": args.gas, "gradient_clipping": args.clip,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                 "pipeline": {"schedule": schedule, "post_validation": post_validation}}
    plan = PipelinePlan(pipeline_settings(ds_config), pp, args.micro_batch_size, args.gas, args.seq_length,
                        args.hidden)
    layers_per_rank = args.layers_per_rank
    costs = TimedCosts(tf=args.tf, tb=args.tb, tw=args.tw, carry_overshoot=True)
    specs = [LayerSpec(BallastLayer, args.hidden, args.ballast // layers_per_rank, costs)
             for _ in range(layers_per_rank * pp)]
    module = ChunkedPipelineModule(layers=specs, plan=plan, loss_fn=timed_loss, topology=topology(pp),
                                   partition_method="uniform")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    if args.optimizer_ms:  # an optimizer step of a chosen device time, as the layers' ops
        adamw_step = optimizer.step

        def timed_adamw_step(*a, **kw):
            costs.sleep(args.optimizer_ms / 1e3)
            return adamw_step(*a, **kw)

        optimizer.step = timed_adamw_step
    engine = initialize_engine(module, ds_config, optimizer=optimizer)
    engine.optimizer_seconds = []
    original = engine.optimizer._optimizer_step

    def timed_step(group_no):  # the optimizer's own math, for the table
        start = time.perf_counter()
        original(group_no)
        engine.optimizer_seconds.append(time.perf_counter() - start)

    engine.optimizer._optimizer_step = timed_step
    engine.step_reached = []
    take = engine._take_model_step

    def reached(*a, **kw):  # when this rank has finished its last op and starts the step
        engine.step_reached.append(time.perf_counter())
        return take(*a, **kw)

    engine._take_model_step = reached
    return engine


def batches(args):
    g = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_length, args.hidden)
    for _ in range(args.gas):
        yield (torch.randn(shape, generator=g),), torch.randn(shape, generator=g)


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main(argv=None):
    ap = parser(__doc__, gas=8, micro_batch_size=2, seq_length=16)
    ap.add_argument("--schedules", default="zbv,zb-h2,1f1b")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers-per-rank", type=int, default=2)
    ap.add_argument("--tf", type=float, default=0.015, help="seconds per layer and micro-batch")
    ap.add_argument("--tb", type=float, default=0.015)
    ap.add_argument("--tw", type=float, default=0.015)
    ap.add_argument("--ballast", type=int, default=3_000_000, help="optimizer-only parameters per rank")
    ap.add_argument("--optimizer-ms", type=float, default=0.0,
                        help="the optimizer step also sleeps this long (use with a small --ballast)")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block-iterations", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    pp = dist.get_world_size()
    rows = []
    for schedule in args.schedules.split(","):
        engines = {pv: make_engine(schedule, pv, args, pp) for pv in (False, True)}

        def block(pv):
            def run(_):
                for _ in range(args.block_iterations):  # no barrier inside a block: an early rank may go on
                    engines[pv].train_batch(batches(args))
                dist.barrier()  # the block ends when every rank is done
            return run
        times = alternated({pv: block(pv) for pv in engines}, args.blocks + 1,
                           prepare=lambda pv, step: engines[pv].step_reached.clear())
        times = {pv: [t / args.block_iterations for t in ts[1:]] for pv, ts in times.items()}  # block 0 warms up
        reached = gather(engines[False].step_reached)  # every rank's step start, off engine, last block
        gaps = [max(r[i] for r in reached) - min(r[i] for r in reached) for i in range(len(reached[0]))]
        opt_seconds = gather(statistics.median(engines[False].optimizer_seconds[2:] or engines[False].optimizer_seconds))
        counts = gather(engines[True]._post_validation.counts)
        norm = float(engines[False].get_global_grad_norm())
        off, on = (statistics.median(times[pv]) for pv in (False, True))
        paths = " ".join(f"{c['optimistic']}/{c['redone']}/{c['steps']}" for c in counts)
        rows.append([schedule, f"{off * 1e3:.1f}", f"{on * 1e3:.1f}", f"{paired_ratio(times[True], times[False]):.3f}",
                     f"{statistics.median(gaps) * 1e3:.1f}", f"{max(opt_seconds) * 1e3:.1f}", f"{norm:.3g}", paths])
        for engine in engines.values():
            engine.destroy()
    if dist.get_rank() == 0:
        out = Report(args.perf_file, "bench.post_validation", argv)
        out("", f"pp={pp} m={args.gas} layers/rank={args.layers_per_rank} TF=TB=TW per layer "
            f"{args.tf * 1e3:.0f}/{args.tb * 1e3:.0f}/{args.tw * 1e3:.0f} ms, optimizer-only parameters "
            f"per rank {args.ballast:,}, optimizer sleep {args.optimizer_ms:g} ms, clip {args.clip}; "
            f"median of {args.blocks} blocks of {args.block_iterations} iterations")
        out(*table(["schedule", "off ms/it", "on ms/it", "on/off", "finish gap ms", "optimizer ms", "grad norm",
                    "steps early/redone/all (per rank)"], "lrrrrrrl", rows))
        out.save()


if __name__ == "__main__":
    main()
