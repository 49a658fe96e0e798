"""The ds_config `pipeline` section: DeepSpeed's keys plus the schedule's, checked at start-up.

This module checks JSON types only; which knobs a schedule takes is the catalogue's rule
(megatron_ds.schedules.catalog), asked here so that a wrong knob fails before any process
group starts."""
import json
from dataclasses import dataclass
from typing import Optional

from megatron_ds.errors import UserError
from megatron_ds.schedules import CATALOG, ScheduleError, build_schedule
from megatron_ds.schedules.auto import parse_bytes

# Keys DeepSpeed itself defines in "pipeline" (runtime/config.py, pipe engine).
DEEPSPEED_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                  "pipe_partitioned", "grad_partitioned", "use_reentrant"}
STOCK = "deepspeed"
AUTO = "auto"  # measure, then switch to the fastest schedule that fits "memory_budget" (pipe/auto.py)
AUTO_KEYS = ("memory_budget", "timers_start_iter", "timers_end_iter", "remeasure")


class ConfigError(UserError, ValueError):
    """A ds_config setting that cannot work; the message names the key, the value and the rule."""


@dataclass
class PipelineSettings:
    schedule: str = STOCK
    virtual_stages: int = 1
    seq_splits: int = 1
    seq_split_method: str = "balanced"
    split_backward: bool = False
    post_validation: bool = False
    partition_method: str = "type:transformer"
    allow_padding_num_layers: bool = False
    trace_dir: Optional[str] = None
    memory_budget: object = None   # "auto": micro-batches of one stage's activations, or "24GiB"
    timers_start_iter: int = 1     # "auto" times iterations [start, end) of this process, then switches
    timers_end_iter: int = 4
    remeasure: bool = False        # "auto" on --load: time again, though the checkpoint holds a valid choice
    op_costs: Optional[list] = None  # zbv-half/zbv-min: build the op order for these TF, TB, TW of a layer
    compile_layers: bool = False   # torch.compile each transformer layer (model/compile.py), any engine

    @property
    def stock(self):
        return self.schedule == STOCK

    @property
    def auto(self):
        return self.schedule == AUTO

    def build_schedule(self, pp, micro_batches, segment_lengths=None):
        """This section's schedule for `pp` ranks and `micro_batches` (ScheduleError when impossible);
        Seq1F1B's order capped by the `segment_lengths` of a sequence when given."""
        if self.auto:  # pipe/plan.start_auto resolves "auto" for the run's own micro-batch count
            raise ScheduleError('"auto" chooses its schedule for one micro-batch count, after timing it: a batch-size '
                                "ramp-up is not offered with it")
        return build_schedule(self.schedule, pp, micro_batches, virtual_stages=self.virtual_stages,
                              seq_splits=self.seq_splits, split_backward=self.split_backward,
                              segment_lengths=segment_lengths, op_costs=self.op_costs)


def _int_at_least(section, key, minimum, default=None):
    value = section.get(key, minimum if default is None else default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f'ds_config "pipeline.{key}" = {value!r}: must be an integer >= {minimum}')
    return value


def pipeline_settings(ds_config: dict) -> PipelineSettings:
    section = ds_config.get("pipeline", {}) or {}
    if not isinstance(section, dict):
        raise ConfigError(f'ds_config "pipeline" must be an object, got {section!r}')
    ours = set(PipelineSettings.__dataclass_fields__)
    unknown = sorted(set(section) - ours - DEEPSPEED_KEYS)
    if unknown:
        raise ConfigError(f'ds_config "pipeline" has unknown key(s) {unknown}; known: {sorted(ours | DEEPSPEED_KEYS)}')
    schedule = section.get("schedule", STOCK)
    if schedule not in (STOCK, AUTO, *CATALOG):
        raise ConfigError(f'ds_config "pipeline.schedule" = {schedule!r}: unknown schedule; '
                          f'choose one of {[STOCK, AUTO, *CATALOG]}')
    method = section.get("seq_split_method", "balanced")
    if method not in ("balanced", "even"):
        raise ConfigError(f'ds_config "pipeline.seq_split_method" = {method!r}: must be "balanced" or "even"')
    for key in ("split_backward", "post_validation", "allow_padding_num_layers", "remeasure", "compile_layers"):
        if not isinstance(section.get(key, False), bool):
            raise ConfigError(f'ds_config "pipeline.{key}" = {section[key]!r}: must be true or false')
    settings = PipelineSettings(
        schedule=schedule,
        virtual_stages=_int_at_least(section, "virtual_stages", 1),
        seq_splits=_int_at_least(section, "seq_splits", 1),
        seq_split_method=method,
        split_backward=section.get("split_backward", False),
        post_validation=section.get("post_validation", False),
        partition_method=section.get("partition_method", "type:transformer"),
        allow_padding_num_layers=section.get("allow_padding_num_layers", False),
        trace_dir=section.get("trace_dir"),
        memory_budget=section.get("memory_budget"),
        timers_start_iter=_int_at_least(section, "timers_start_iter", 0, default=1),
        timers_end_iter=_int_at_least(section, "timers_end_iter", 1, default=4),
        remeasure=section.get("remeasure", False),
        op_costs=section.get("op_costs"),
        compile_layers=section.get("compile_layers", False),
    )
    if settings.auto:
        _check_auto(settings, section)
    elif any(key in section for key in AUTO_KEYS):
        raise ConfigError(f'ds_config "pipeline": {", ".join(k for k in AUTO_KEYS if k in section)} apply to '
                          f'"schedule": "auto" only (it is {schedule!r})')
    elif not settings.stock:
        for key in ("virtual_stages", "seq_splits", "split_backward", "op_costs"):  # one at a time: the message names it
            value = getattr(settings, key)
            try:
                CATALOG[schedule].knobs(**{key: value})
            except ScheduleError as exc:
                raise ConfigError(f'ds_config "pipeline.{key}" = {json.dumps(value)}: {exc}') from None
    elif settings.virtual_stages > 1 or settings.seq_splits > 1 or settings.split_backward or settings.op_costs is not None:
        raise ConfigError('ds_config "pipeline": virtual_stages, seq_splits, split_backward and op_costs need a named '
                          '"pipeline.schedule"; DeepSpeed\'s own engine runs plain 1F1B')
    if settings.post_validation and settings.stock:
        raise ConfigError('ds_config "pipeline.post_validation" = true needs a named "pipeline.schedule": '
                          "DeepSpeed's own engine validates before it steps")
    method = settings.partition_method
    if not isinstance(method, str) or (method not in ("uniform", "parameters", "flops")
                                       and not method.startswith(("type:", "costs:"))):
        raise ConfigError(f'ds_config "pipeline.partition_method" = {method!r}: use "uniform", "parameters", '
                          '"type:REGEX", "flops", "costs:[c0, c1, ...]" or "costs:FILE.json"')
    return settings


def sequence_parallel_ds_config(ds_config: dict) -> dict:
    """The ds_config for DeepSpeed's stock engine under --sequence-parallel: activations sent whole.

    DeepSpeed's engine (pipe_partitioned, grad_partitioned: on by default with tensor parallelism) sends
    each TP rank 1/TP of an activation it takes to be equal on the TP ranks, and all-gathers the pieces on
    arrival; sequence shards differ from rank to rank, so each must travel whole. Torch-free: the flags'
    parse-time check calls it too.
    """
    section = dict(ds_config.get("pipeline") or {})
    on = [key for key in ("pipe_partitioned", "grad_partitioned") if section.get(key)]
    if on:
        raise ConfigError(f'ds_config "pipeline" {" and ".join(on)} = true with --sequence-parallel: DeepSpeed\'s '
                          "engine would split each activation over the tensor-parallel ranks, which hold different "
                          "sequence shards; set false or leave out")
    section.update(pipe_partitioned=False, grad_partitioned=False)
    return {**ds_config, "pipeline": section}


def _check_auto(settings, section):
    budget = settings.memory_budget
    if budget is None:
        raise ConfigError('ds_config "pipeline.schedule" = "auto" needs "memory_budget": peak activation memory '
                          'per rank, in micro-batches of one stage\'s activations (e.g. 4) or bytes (e.g. "24GiB")')
    numeric = isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0
    if not numeric and not (isinstance(budget, str) and (parse_bytes(budget) or 0) > 0):
        raise ConfigError(f'ds_config "pipeline.memory_budget" = {json.dumps(budget)}: give a positive number '
                          '(micro-batches of one stage\'s activations) or a size such as "24GiB" or "4096MB"')
    if settings.timers_end_iter <= settings.timers_start_iter:
        raise ConfigError(f'ds_config "pipeline.timers_end_iter" = {settings.timers_end_iter} must be greater than '
                          f'"timers_start_iter" = {settings.timers_start_iter}: "auto" times at least one iteration')
    for key in ("virtual_stages", "seq_splits", "split_backward", "op_costs"):
        if key in section and section[key] != PipelineSettings.__dataclass_fields__[key].default:
            raise ConfigError(f'ds_config "pipeline.{key}" = {json.dumps(section[key])}: "schedule": "auto" '
                              "chooses the schedule and its knobs itself")
