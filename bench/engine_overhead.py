"""Our engine's overhead: the same small GPT under DeepSpeed's stock TrainSchedule and
under ScheduleEngine with "1f1b", in one launch, iterations alternating so machine
noise hits both alike. Prints the median time per iteration and their ratio.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m bench.engine_overhead --pp 2
"""
import argparse
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist

from bench.options import add_model_args
from megatron_ds.model import GPTConfig, position_ids_like
from megatron_ds.pipe.build import build_pipeline_module, initialize_engine


def make_engine(config, pipeline, args):
    ds_config = {"train_micro_batch_size_per_gpu": args.micro_batch_size,
                 "gradient_accumulation_steps": args.gas, "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    if pipeline:
        ds_config["pipeline"] = pipeline
    module = build_pipeline_module(config, ds_config, args.pp, seq_length=args.seq_length)
    return initialize_engine(module, ds_config, model_parameters=[p for p in module.parameters()])


def batches(config, args, step):
    g = torch.Generator().manual_seed(step)
    for _ in range(args.gas):
        tokens = torch.randint(0, config.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
        x = tokens[:, :-1].contiguous()
        yield (x, position_ids_like(x)), tokens[:, 1:].contiguous()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, pp=2, gas=8, micro_batch_size=4, seq_length=128, hidden_size=256, num_layers=4)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=1024, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_attention_heads=4, max_position_embeddings=args.seq_length)
    engines = {"deepspeed TrainSchedule": make_engine(config, None, args),
               "megatron_ds 1f1b": make_engine(config, {"schedule": "1f1b"}, args)}
    times = {name: [] for name in engines}
    for it in range(args.iterations):
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(batches(config, args, it))
            times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        warm = {name: t[2:] for name, t in times.items()}  # the first iterations exchange shapes, warm caches
        base = statistics.median(warm["deepspeed TrainSchedule"])
        print(f"\npp={args.pp} dp={dist.get_world_size() // args.pp} m={args.gas} mbs={args.micro_batch_size} "
              f"seq={args.seq_length} hidden={args.hidden_size} layers={args.num_layers}, "
              f"median of iterations 3..{args.iterations}")
        print(f"{'engine':<26}{'ms/iteration':>14}{'ratio':>8}")
        for name, t in warm.items():
            med = statistics.median(t)
            print(f"{name:<26}{med * 1e3:>14.1f}{med / base:>8.3f}")


if __name__ == "__main__":
    main()
