"""The ds_config `pipeline` section: DeepSpeed's keys plus the schedule's, checked at start-up.

This module checks JSON types only; which knobs a schedule takes is the catalogue's rule
(megatron_ds.schedules.catalog), asked here so that a wrong knob fails before any process
group starts."""
import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

from megatron_ds.errors import UserError
from megatron_ds.schedules import CATALOG, ScheduleError, build_schedule, from_file
from megatron_ds.schedules.catalog import KNOBS, check_vocab_parallel, takes
from megatron_ds.schedules.auto import parse_bytes

from .ds_keys import unknown_keys_line
from .layout import PREFIX as LAYOUT_PREFIX, LayoutError, is_layout, parse as parse_layout

# Keys DeepSpeed itself defines in "pipeline" (runtime/config.py get_pipeline_config; a test compares).
DEEPSPEED_KEYS = {"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                  "pipe_partitioned", "grad_partitioned", "use_reentrant"}
STOCK = "deepspeed"
AUTO = "auto"  # measure, then switch to the fastest schedule that fits "memory_budget" (pipe/auto.py)
AUTO_KEYS = ("memory_budget", "timers_start_iter", "timers_end_iter", "remeasure", "auto_recompute")


class ConfigError(UserError, ValueError):
    """A ds_config setting that cannot work; the message names the key, the value and the rule."""


@dataclass
class PipelineSettings:
    schedule: str = STOCK
    virtual_stages: int = KNOBS["virtual_stages"]  # the schedule knobs: unset as the catalogue's KNOBS say
    seq_splits: int = KNOBS["seq_splits"]
    seq_split_method: str = "balanced"
    split_backward: bool = KNOBS["split_backward"]
    post_validation: bool = False
    partition_method: str = "type:transformer"
    allow_padding_num_layers: bool = False
    trace_dir: Optional[str] = None
    memory_budget: object = None   # "auto": micro-batches of one stage's activations, or "24GiB"
    timers_start_iter: int = 1     # "auto" times iterations [start, end) of this process, then switches
    timers_end_iter: int = 4
    remeasure: bool = False        # "auto" on --load: time again, though the checkpoint holds a valid choice
    auto_recompute: bool = False   # "auto" chooses the recompute too: none, selective or full (schedules/auto_recompute.py)
    op_costs: Optional[list] = KNOBS["op_costs"]  # zbv-half/zbv-min: the op order for these TF, TB, TW of a layer
    vocab_parallel: bool = False     # embedding and output layer sliced over the pipeline ranks by vocabulary
    compile_layers: Optional[bool] = None  # torch.compile each transformer layer, the final norm and the loss
    # (model/compile.py); None: compiles_layers
    cuda_graphs: bool = False      # the compiled layers replayed as CUDA graphs (inductor's cudagraph trees)
    overlap: bool = False          # the schedule's overlapped order (a file's: it has units), run as units (overlap.py)

    def compiles_layers(self, cuda: bool, splits_ops: bool) -> bool:
        """Whether the layers run compiled: as "compile_layers" says, else the default measured to pay
        (docs/perf/gpu_h200.md): on CUDA where each layer is one graph (no deferred weight gradients, no
        Seq1F1B segments: `splits_ops` false), which compiled in 8-9 s and made the step 7-8 % faster;
        off where the runtime's hooks cut the layer into several graphs (a Seq1F1B k=4 + B/W step was
        1.14-1.58x slower compiled: the host pays each graph's call), and off on CPU. Both hooks now
        leave a layer one graph (the K/V cache runs in it, the deferred weight GEMMs leave it through
        carriers: model/weight_carriers.py), which on CPU costs less host time than eager, but is not
        yet timed on a GPU: off until it is. "cuda_graphs" asks for them compiled on CUDA whatever
        the schedule. Overlapped units run eager (check_overlap)."""
        if self.compile_layers is not None:
            return self.compile_layers
        return cuda and not self.overlap and (self.cuda_graphs or not splits_ops)

    @property
    def stock(self):
        return self.schedule == STOCK

    @property
    def auto(self):
        return self.schedule == AUTO

    @property
    def file(self):
        """The path of a "file:PATH.json" schedule, else None."""
        return self.schedule[len(from_file.PREFIX):] if self.schedule.startswith(from_file.PREFIX) else None

    def build_schedule(self, pp, micro_batches, segment_lengths=None):
        """This section's schedule for `pp` ranks and `micro_batches` (ScheduleError when impossible);
        Seq1F1B's order capped by the `segment_lengths` of a sequence when given."""
        if self.auto:  # pipe/plan/auto_start.start_auto resolves "auto" for the run's own micro-batch count
            raise ScheduleError('"auto" chooses its schedule for one micro-batch count, after timing it: a batch-size '
                                "ramp-up is not offered with it")
        if self.file:
            return from_file.for_run(self.file, pp, micro_batches, segment_lengths)
        return build_schedule(self.schedule, pp, micro_batches, segment_lengths=segment_lengths,
                              vocab_parallel=self.vocab_parallel, overlap=self.overlap, **self.knobs())

    def knobs(self) -> dict:
        """The section's schedule knobs (the catalogue's KNOBS), set or not."""
        return {key: getattr(self, key) for key in KNOBS}


def _int_at_least(section, key, minimum, default=None):
    value = section.get(key, minimum if default is None else default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f'ds_config "pipeline.{key}" = {value!r}: must be an integer >= {minimum}')
    return value


def pipeline_settings(ds_config: dict) -> PipelineSettings:
    section = ds_config.get("pipeline", {}) or {}
    if not isinstance(section, dict):
        raise ConfigError(f'ds_config "pipeline" must be an object, got {section!r}')
    unknown = unknown_keys_line(section, set(PipelineSettings.__dataclass_fields__) | DEEPSPEED_KEYS,
                                'ds_config "pipeline"')
    if unknown:
        raise ConfigError(f"{unknown}; the keys are listed in docs/DESIGN.md (The ds_config)")
    schedule = section.get("schedule", STOCK)
    in_file = isinstance(schedule, str) and schedule.startswith(from_file.PREFIX)
    if schedule not in (STOCK, AUTO, *CATALOG) and not in_file:
        raise ConfigError(f'ds_config "pipeline.schedule" = {schedule!r}: unknown schedule; '
                          f'choose one of {[STOCK, AUTO, *CATALOG]} or "{from_file.PREFIX}PATH.json"')
    method = section.get("seq_split_method", "balanced")
    if method not in ("balanced", "even"):
        raise ConfigError(f'ds_config "pipeline.seq_split_method" = {method!r}: must be "balanced" or "even"')
    for key in ("split_backward", "post_validation", "allow_padding_num_layers", "remeasure", "vocab_parallel",
                "compile_layers", "cuda_graphs", "auto_recompute", "overlap"):
        if key in section and not isinstance(section[key], bool):
            raise ConfigError(f'ds_config "pipeline.{key}" = {section[key]!r}: must be true or false')
    if section.get("cuda_graphs") and section.get("compile_layers") is False:
        raise ConfigError('ds_config "pipeline.cuda_graphs" = true: the graphs are the compiled layers\' '
                          '(torch.compile mode "reduce-overhead"), so it contradicts "compile_layers": false')
    if section.get("cuda_graphs") and schedule == STOCK:
        raise ConfigError('ds_config "pipeline.cuda_graphs" = true: the graphs of an iteration are released when '
                          "our engine starts the next; DeepSpeed's own engine does not, so name a \"schedule\"")
    if in_file:
        return _file_settings(section, schedule, method)
    return _checked(section, schedule, method)


def _checked(section, schedule, method, **fixed) -> PipelineSettings:
    """The settings of a section whose schedule name is known; `fixed`: knobs a schedule file sets."""
    settings = PipelineSettings(
        schedule=schedule,
        virtual_stages=_int_at_least(section, "virtual_stages", 1),
        seq_splits=_int_at_least(section, "seq_splits", 1),
        seq_split_method=method,
        split_backward=section.get("split_backward", KNOBS["split_backward"]),
        post_validation=section.get("post_validation", False),
        partition_method=section.get("partition_method", "type:transformer"),
        allow_padding_num_layers=section.get("allow_padding_num_layers", False),
        trace_dir=section.get("trace_dir"),
        memory_budget=section.get("memory_budget"),
        timers_start_iter=_int_at_least(section, "timers_start_iter", 0, default=1),
        timers_end_iter=_int_at_least(section, "timers_end_iter", 1, default=4),
        remeasure=section.get("remeasure", False),
        auto_recompute=section.get("auto_recompute", False),
        op_costs=section.get("op_costs", KNOBS["op_costs"]),
        vocab_parallel=section.get("vocab_parallel", False),
        compile_layers=section.get("compile_layers"),
        cuda_graphs=section.get("cuda_graphs", False),
        overlap=section.get("overlap", False),
    )
    if fixed:
        settings = dataclasses.replace(settings, **fixed)
    elif settings.auto:
        _check_auto(settings, section)
    elif any(key in section for key in AUTO_KEYS):
        raise ConfigError(f'ds_config "pipeline": {", ".join(k for k in AUTO_KEYS if k in section)} apply to '
                          f'"schedule": "auto" only (it is {schedule!r})')
    elif not settings.stock:
        for key in KNOBS:  # one at a time: the message names it
            value = getattr(settings, key)
            try:
                CATALOG[schedule].knobs(**{key: value})
            except ScheduleError as exc:
                raise ConfigError(f'ds_config "pipeline.{key}" = {json.dumps(value)}: {exc}') from None
    elif any(getattr(settings, key) != unset for key, unset in KNOBS.items()):
        raise ConfigError(f'ds_config "pipeline": {", ".join(KNOBS)} need a named "pipeline.schedule"; '
                          'DeepSpeed\'s own engine runs plain 1F1B')
    if settings.post_validation and settings.stock:
        raise ConfigError('ds_config "pipeline.post_validation" = true needs a named "pipeline.schedule": '
                          "DeepSpeed's own engine validates before it steps")
    if settings.vocab_parallel:
        _check_vocab_parallel(settings)
    if settings.overlap and not settings.file:  # a file's units: _file_settings
        check_overlap(settings)
    method = settings.partition_method
    if not isinstance(method, str) or (method not in ("uniform", "parameters", "flops")
                                       and not method.startswith(("type:", "costs:", "layout:"))):
        raise ConfigError(f'ds_config "pipeline.partition_method" = {method!r}: use "uniform", "parameters", '
                          '"type:REGEX", "flops", "costs:[c0, c1, ...]", "costs:FILE.json" or "layout:Et*3|t*4|..." '
                          "(Megatron's --pipeline-model-parallel-layout)")
    if is_layout(method):
        try:
            parse_layout(method[len(LAYOUT_PREFIX):])  # the grammar now; the stage and layer counts with the schedule
        except LayoutError as exc:
            raise ConfigError(f'ds_config "pipeline.partition_method": {exc}') from None
    return settings


def _file_settings(section, schedule, method) -> PipelineSettings:
    """`"schedule": "file:PATH.json"`: the file read and proven runnable now, at start-up; its knobs come
    from the file (segment counts, chunks), so the section may not set them."""
    where = f'ds_config "pipeline.schedule" = {json.dumps(schedule)}'
    knobs = [key for key in (*KNOBS, *AUTO_KEYS, "overlap") if key in section]
    if knobs:
        raise ConfigError(f"{where}: the file fixes the op order, chunks and segments; remove "
                          f"{', '.join(knobs)} from the section")
    try:
        loaded = from_file.load(schedule[len(from_file.PREFIX):])
    except ScheduleError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    settings = _checked(section, schedule, method, seq_splits=loaded.seq_splits,
                        virtual_stages=max(1, loaded.stages // loaded.pp), overlap=bool(loaded.overlap))
    if loaded.overlap:
        if loaded.seq_splits > 1:  # the two ops of a unit would share the layers' K/V cache slots (model/kv_cache.py)
            raise ConfigError(f"{where}: the file has overlapped units and sequence segments; the engine runs units "
                              "without segments so far")
        check_overlap(settings, f"{where} (its overlapped units)")
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


def _check_vocab_parallel(settings):
    key = 'ds_config "pipeline.vocab_parallel" = true'
    if settings.stock:
        raise ConfigError(f'{key} needs a named "pipeline.schedule" or "auto" (it is {settings.schedule!r}): the '
                          "vocabulary passes are ops the schedule places")
    if settings.auto:  # every candidate carries the passes (schedules/auto.py)
        return
    try:
        if not settings.file:  # a schedule file carries its vocabulary ops or not: the validator reads them
            check_vocab_parallel(CATALOG[settings.schedule], True)
    except ScheduleError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    if not settings.file and settings.schedule not in VOCAB_PARALLEL_ENGINE:  # a catalogue entry not proven yet
        raise ConfigError(f"{key} with \"schedule\": {json.dumps(settings.schedule)}: the engine runs the vocabulary "
                          f"passes under the named schedules {', '.join(VOCAB_PARALLEL_ENGINE)} so far; python -m "
                          "megatron_ds.schedules show/export/compare --vocab-parallel simulate any schedule")


def check_overlap(settings, key='ds_config "pipeline.overlap" = true'):
    """`"overlap": true`, or a schedule file with overlapped units: run as units (pipe/moe/overlap.py)."""
    if not settings.file and settings.schedule not in takes("overlap"):
        raise ConfigError(f"{key} with \"schedule\": {json.dumps(settings.schedule)}: overlapped forward-and-backward "
                          f"units are built for {', '.join(takes('overlap'))} (\"auto\" weighs them itself)")
    if settings.vocab_parallel:
        raise ConfigError(f'{key} with "vocab_parallel": true: the vocabulary passes are not placed around '
                          "overlapped units yet; leave one of them out")
    if settings.compile_layers or settings.cuda_graphs:
        raise ConfigError(f'{key} with "{"cuda_graphs" if settings.cuda_graphs else "compile_layers"}": true: '
                          "overlapped units run their layers eagerly so far; leave one of them out")


# The schedules whose vocabulary-parallel runs equal the single-process reference (tests/pipe/vocab/test_vocab_engine.py).
VOCAB_PARALLEL_ENGINE = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "bitpipe", "seq1f1b", "zbv-half",
                         "zbv-min", "dualpipev")


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
    for key, unset in KNOBS.items():
        if key in section and section[key] != unset:
            raise ConfigError(f'ds_config "pipeline.{key}" = {json.dumps(section[key])}: "schedule": "auto" '
                              "chooses the schedule and its knobs itself")
