"""The training layer: flags and ds_config (arguments), the loop (loop), checkpoints, launch and
process groups (initialize), the lr schedule, the batch-size ramp-up and logging.

Kept free of imports so that `pretrain_gpt.py --help` loads no torch."""
