"""megatron_ds: a GPT pretraining stack whose pipeline engine runs any schedule (docs/DESIGN.md).

`megatron_ds.initialize` is deepspeed.initialize with our schedules for a user's own PipelineModule
(user_pipeline.py), and `megatron_ds.seed_layer` the seed_fn that makes a PipelineModule's seed_layers=True work
(pipe/foreign/foreign.py); both are loaded on first use, so that `import megatron_ds` stays free of torch and DeepSpeed.
"""


def __getattr__(name):
    if name == "initialize":
        # lazy: `import megatron_ds` (the flags' parse, the tools' --help) stays free of torch and DeepSpeed
        from .user_pipeline import initialize
        return initialize
    if name == "seed_layer":
        from .pipe.foreign.foreign import seed_layer  # lazy: as initialize
        return seed_layer
    raise AttributeError(f"module 'megatron_ds' has no attribute {name!r}")
