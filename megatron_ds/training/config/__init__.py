"""The run's flags (Megatron-DeepSpeed's names) and its ds_config, checked before any process group starts.

Read order: arguments.py (parse_args: the flags, the ds_config merge, every check) -> the flag groups it
calls (model_args.py, moe_args.py, document_args.py, parallel_args.py, observability.py) -> fork_flags.py
(the research forks' and Megatron-LM's flags as aliases) -> pipeline.py (the pipeline plan made at parse
time). Torch-free: `pretrain_gpt.py --help` and a bad flag cost no torch import."""
