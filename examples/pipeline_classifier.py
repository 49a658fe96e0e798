"""Your own DeepSpeed pipeline model under our schedules: a small conv classifier trained under zbv.

Nothing here is GPT: a deepspeed.pipe.PipelineModule of conv, norm, pooling and linear layers (LayerSpecs and
built modules), DeepSpeed's own data loading (training_data) and its ds_config optimizer. The one change from a
DeepSpeed script is `megatron_ds.initialize` in place of `deepspeed.initialize`; the ds_config's "pipeline"
section names the schedule (leave it out and DeepSpeed's own engine runs, unchanged). The data are synthetic:
each class is a random template image plus noise, so the loss falls within a few dozen steps.

    deepspeed --num_gpus 2 examples/pipeline_classifier.py --deepspeed_config examples/ds_config_zbv_classifier.json

(on a machine without GPUs: `python -m deepspeed.launcher.runner --num_gpus 2 ...`; the ranks use gloo).
"""
import argparse

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

import megatron_ds

CLASSES, SIZE = 10, 16


class Images(torch.utils.data.Dataset):
    """Synthetic labelled images: a fixed random template per class, plus noise."""

    def __init__(self, count, seed=1):
        templates = torch.randn(CLASSES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (count,), generator=g)
        self.images = templates[self.labels] + 0.8 * torch.randn(count, 3, SIZE, SIZE, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def layers():
    """Eight pipeline layers; uniform partitioning gives zbv's 4 virtual stages (2 ranks) two each."""
    return [LayerSpec(torch.nn.Conv2d, 3, 16, 3, padding=1), torch.nn.GroupNorm(4, 16),
            torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            LayerSpec(torch.nn.Conv2d, 16, 32, 3, padding=1), torch.nn.Sequential(torch.nn.GroupNorm(4, 32),
                                                                                 torch.nn.ReLU()),
            torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten()),
            LayerSpec(torch.nn.Linear, 32 * 4, CLASSES)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(1234)  # every rank builds the same initial layers

    net = PipelineModule(layers=layers(), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method="uniform")
    engine, _, _, _ = megatron_ds.initialize(args=args, model=net, model_parameters=net.parameters(),
                                             training_data=Images(4096))
    if engine.global_rank == 0:
        print(f"engine {type(engine).__name__}, schedule {engine.plan.settings.schedule}, "
              f"chunks of rank 0: {engine.module.chunks}", flush=True)
    for step in range(1, args.steps + 1):
        loss = engine.train_batch()  # DeepSpeed's loader over training_data feeds the ranks that hold stage 0
        if engine.global_rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step} loss {float(loss):.4f}", flush=True)
    held_out = iter(torch.utils.data.DataLoader(Images(4096, seed=2), batch_size=engine.micro_batch_size))
    loss = engine.eval_batch(held_out)
    if engine.global_rank == 0:
        print(f"eval loss {float(loss):.4f}", flush=True)


if __name__ == "__main__":
    main()
