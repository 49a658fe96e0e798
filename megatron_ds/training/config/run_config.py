"""The run's settings once parsed: one frozen object.

`parse_args` returns a RunConfig: argparse's Namespace of Megatron's flag names (the code reads them by those
names, and Megatron's saved `args` in a checkpoint are a plain copy, `flags()`), with its typed parts named
(`model`, `batch`, `pipeline`, `plan`, `auto`, `ds_config`). Only the flag-parsing package (this folder) writes
to the Namespace, while it parses; afterwards a write raises. What changes while a run starts or trains is a new
RunConfig the owner takes in place of the old one:
- the process group's facts (rank, world size, local rank, backend): `initialize.initialize_distributed`;
- the tokenizer's padded vocabulary and its end-of-document id: the loop;
- the schedule "auto" chose, its plan and recompute setting: `pipeline.with_choice`.
`tests/training/config/test_run_config.py` fails if a module outside this folder writes to the settings.
"""
import argparse

# The values a run learns after parsing, which a RunConfig may take through replace() without having them
# yet: the process group's (initialize.py), the tokenizer's (data/tokenizer.py) and the loop's.
LEARNED_AT_START = ("local_rank", "distributed_backend", "padded_vocab_size", "eod_token")


class FrozenSettingsError(AttributeError):
    """A write to the parsed settings after parsing: a bug, not bad input (it keeps its traceback)."""


class RunConfig(argparse.Namespace):
    """The parsed flags, frozen; `replace` returns a new one. Typed parts: model (GPTConfig), batch
    (BatchSizeSchedule), pipeline (PipelineSettings), plan (PipelinePlan or None: DeepSpeed's engine plans
    itself), auto (AutoPlan or None: no "auto"), ds_config (the merged ds_config dict DeepSpeed gets)."""

    @classmethod
    def freeze(cls, namespace: argparse.Namespace) -> "RunConfig":
        settings = cls.__new__(cls)
        settings.__dict__.update(vars(namespace))  # not through __setattr__, which refuses
        return settings

    def __setattr__(self, name, value):
        raise FrozenSettingsError(
            f"args.{name}: the run's settings are frozen once parsed; take a new value instead "
            f"(args = args.replace({name}=...)), as training/config/run_config.py says")

    def __delattr__(self, name):
        raise FrozenSettingsError(f"del args.{name}: the run's settings are frozen once parsed")

    def replace(self, **changes) -> "RunConfig":
        unknown = sorted(set(changes) - set(vars(self)) - set(LEARNED_AT_START))
        if unknown:
            raise FrozenSettingsError(f"replace({', '.join(unknown)}): not a setting of this run")
        return RunConfig.freeze(argparse.Namespace(**{**vars(self), **changes}))

    def flags(self) -> argparse.Namespace:
        """A plain, writable copy: Megatron's saved `args`, and tools that build their own settings from it."""
        return argparse.Namespace(**vars(self))

    @property
    def model(self):
        return self.gpt_config

    @property
    def batch(self):
        return self.batch_schedule

    @property
    def pipeline(self):
        return self.pipeline_settings

    @property
    def plan(self):
        return self.pipeline_plan

    @property
    def auto(self):
        return self.auto_plan
