"""Pretrain a GPT with DeepSpeed's pipeline engine and ZeRO-1 (Megatron-DeepSpeed flags).

    torchrun --nproc_per_node 4 pretrain_gpt.py --pipeline-model-parallel-size 2 ... \\
        --deepspeed --deepspeed_config ds_configs/ds_config_1f1b_stock.json

Also runs under `deepspeed --num_gpus N` and `srun` (see slurm/). `--help` lists every flag.
"""
import sys

from megatron_ds.training.loop import entry_point

if __name__ == "__main__":
    sys.exit(entry_point())
