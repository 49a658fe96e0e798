"""Our engine's overhead: the same small GPT under DeepSpeed's stock TrainSchedule and
under ScheduleEngine with "1f1b", in one launch, iterations alternating so machine
noise hits both alike. Prints the median time per iteration and their ratio.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m bench.engine_overhead --pp 2
"""
import deepspeed
import torch
import torch.distributed as dist

from bench.gpt_cpu import bench_ds_config, gpt_config, model_opts, random_batches
from bench.harness import Report, alternated, medians, parser, table
from megatron_ds.pipe.build import build_pipeline_module, initialize_engine


def make_engine(config, pipeline, opts):
    ds_config = bench_ds_config(opts, pipeline, gradient_clipping=1.0)
    module = build_pipeline_module(config, ds_config, opts["pp"], seq_length=opts["seq"])
    return initialize_engine(module, ds_config, model_parameters=[p for p in module.parameters()])


def main(argv=None):
    ap = parser(__doc__, pp=2, gas=8, micro_batch_size=4, seq_length=128, hidden_size=256, num_layers=4,
                num_attention_heads=4, vocab_size=1024)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    opts = model_opts(args)
    config = gpt_config(opts)
    engines = {"deepspeed TrainSchedule": make_engine(config, None, opts),
               "megatron_ds 1f1b": make_engine(config, {"schedule": "1f1b"}, opts)}
    batches = random_batches(config, opts)
    times = alternated({name: lambda step, e=engine: e.train_batch(batches(step)) for name, engine in engines.items()},
                       args.iterations, swap=False)
    if dist.get_rank() == 0:
        warm = medians(times, 2)  # the first iterations exchange shapes, warm caches
        out = Report(args.perf_file, "bench.engine_overhead", argv)
        out("", f"pp={args.pp} dp={dist.get_world_size() // args.pp} m={args.gas} mbs={args.micro_batch_size} "
            f"seq={args.seq_length} hidden={args.hidden_size} layers={args.num_layers}, "
            f"median of iterations 3..{args.iterations}")
        out(*table(["engine", "ms/iteration", "ratio"], "lrr", [
            [name, f"{med * 1e3:.1f}", f"{med / warm['deepspeed TrainSchedule']:.3f}"] for name, med in warm.items()]))
        out.save()


if __name__ == "__main__":
    main()
