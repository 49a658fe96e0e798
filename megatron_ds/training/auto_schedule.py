"""The training side of `"schedule": "auto"`: take the engine's decision, switch to it, save it
with the checkpoints, and resume on it without timing again.

The engine (pipe/auto.py) reports its decision once, through its `on_auto_decision` hook (an
AutoDecision); the loop then logs it and, when the chosen schedule places the chunks otherwise,
rebuilds the engine through a checkpoint (`switch_engine`).

Every checkpoint saved once the run has decided holds the decision:
SAVE/global_stepN/auto_schedule.json, handed to the checkpoint writer (training/checkpoint/save_load.py
writes it on rank 0, temp file and rename, before the manifest and `latest` name the step). A file
beside DeepSpeed's, not DeepSpeed's client state: the choice fixes how the module is cut into
chunks, so it is needed before the module is built, and the client state comes back from
engine.load_checkpoint only after; the file is also read without torch, and `cat` shows what a
run chose.

    {"format": 1, "iteration": 4, "decided_at": 2, "key": {...}, "decision": {...}}

On --load with an "auto" ds_config the decision is reused when everything it was made for is
unchanged (`WHAT`: pp, the micro-batch count, the layer count, the budget, the sizes and precision
that set the measured op times, the mixture-of-experts flags, expert parallelism included, the device,
and the candidates this code offers): the run builds
the chosen schedule directly (pipe/auto.chosen_ds_config; a searched zb-search schedule by a switch
of the plan after the build) and times nothing. Otherwise it times again and says why in one line:
something differs, "remeasure": true, --finetune, or a universal checkpoint (another layout). A
checkpoint saved before the timed iterations ended holds no decision: the run times as a new one.
"""
import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from megatron_ds.data.dist_utils import print_rank_0
from megatron_ds.files import read_json
from megatron_ds.pipe.auto import candidate_labels, chosen_ds_config
from megatron_ds.pipe.parallel.context_parallel import context_parallel_size, samples_batch
from megatron_ds.schedules import auto
from megatron_ds.schedules.flops import vocab_size

from .checkpoint.save_load import LoadPlan, read_latest_tag, restore
from .config.moe_args import moe_flags
from .config.pipeline import with_choice
from .faults import timeouts
from .initialize import get_rng_state, set_rng_state
from .model_setup import model_config, setup_hf_model, setup_model_and_optimizer

NAME = "auto_schedule.json"
FORMAT = 1
# what a decision depends on: its key in the record -> how the message names it
WHAT = {
    "pp": "pipeline stages", "micro_batches": "micro-batches per step", "num_layers": "--num-layers",
    "budget": '"memory_budget" (micro-batches of one stage\'s activations)', "micro_batch_size": "--micro-batch-size",
    "seq_length": "--seq-length", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "tp": "--tensor-model-parallel-size",
    "sequence_parallel": "--sequence-parallel", "recompute": "activation checkpointing interval",
    "dtype": "precision", "device": "device", "candidates": "candidate schedules",
    "cuts": "Seq1F1B segment lengths", "vocab_size": "padded vocabulary",
    "vocab_parallel": '"vocab_parallel"', "moe": "the mixture-of-experts flags", "auto_recompute": '"auto_recompute"',
}
UNSAVED = {"vocab_parallel": False, "moe": "none", "auto_recompute": False}  # what a record saved before the key existed meant


def run_key(plan, auto_plan, config, ds_config: dict, device: str, recompute: int = 0) -> dict:
    """What the decision of an "auto" run with this (unswitched) PipelinePlan and AutoPlan depends on."""
    dtype = next((k for k in ("bf16", "fp16") if (ds_config.get(k) or {}).get("enabled")), "fp32")
    vocab_parallel = plan.settings.vocab_parallel
    return {"pp": plan.pp, "micro_batches": plan.micro_batches, "num_layers": auto_plan.num_layers,
            "budget": auto_plan.budget, "micro_batch_size": plan.micro_batch_size, "seq_length": plan.seq_length,
            "hidden_size": plan.hidden_size, "ffn_hidden_size": getattr(config, "ffn_hidden_size", None),
            "num_attention_heads": getattr(config, "num_attention_heads", None),
            "tp": getattr(config, "tensor_model_parallel_size", 1),
            "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
            "recompute": recompute,
            "dtype": dtype, "device": device,
            "candidates": candidate_labels(plan.pp, plan.micro_batches, auto_plan.num_layers, auto_plan.cuts,
                                           vocab_parallel, getattr(config, "moe", None)),
            "cuts": [list(c.lengths) for c in auto_plan.cuts], "vocab_size": vocab_size(config),
            "vocab_parallel": vocab_parallel, "auto_recompute": plan.settings.auto_recompute,
            "moe": " ".join(moe_flags(getattr(config, "moe", None))) or "none"}  # experts, sizes and EP set the times


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _then_now(name, then, now) -> str:
    if name == "candidates" and isinstance(then, list):
        new, gone = sorted(set(now) - set(then)), sorted(set(then) - set(now))
        return (f"{WHAT[name]} differ" + (f" (now also {', '.join(new)})" if new else "")
                + (f" (no longer {', '.join(gone)})" if gone else ""))
    return f"{WHAT[name]} {then if then is not None else 'unknown'} then, {now} now"


def differences(saved: dict, key: dict) -> list:
    """What of `key` (this run) differs from `saved` (the run that decided), as message parts."""
    then = {**UNSAVED, **saved}
    return [_then_now(name, then.get(name), key[name]) for name in WHAT if not _same(then.get(name), key[name])]


def read_record(step_dir: str):
    """The step's record; None when it has none; ValueError when it cannot be used."""
    path = os.path.join(step_dir, NAME)
    if not os.path.isfile(path):
        return None
    record = read_json(path)  # UnreadableFile, a ValueError
    if not isinstance(record, dict) or record.get("format") != FORMAT or not all(
            k in record for k in ("iteration", "decided_at", "key", "decision")):
        raise ValueError(f"{path} is not a format-{FORMAT} auto schedule record")
    return record


def resume_choice(step_dir: str, key: dict, *, remeasure=False, universal=False, finetune=False):
    """(the record whose decision this run builds, or None to time again; the line to log)."""
    if universal:
        return None, "auto schedule: timing again: a universal checkpoint loads under another layout"
    if finetune:
        return None, "auto schedule: timing again: --finetune starts a new run from the checkpoint's weights"
    try:
        record = read_record(step_dir)
    except ValueError as exc:
        return None, f"auto schedule: timing again: {exc}"
    if record is None:
        return None, (f"auto schedule: timing again: checkpoint {os.path.basename(step_dir)} holds no decision "
                      "(saved before the timed iterations ended)")
    label, n = record["decision"]["choice"]["label"], record["iteration"]
    if remeasure:
        return None, (f'auto schedule: timing again ("remeasure": true); the checkpoint of iteration {n} '
                      f"had chosen {label}")
    diffs = differences(record["key"], key)
    if diffs:
        return None, f"auto schedule: timing again: the checkpoint of iteration {n} chose {label} for another run: " \
                     + "; ".join(diffs)
    choice, budget = record["decision"]["choice"], record["decision"]["budget"]
    return record, (f"auto schedule: {label} from the checkpoint of iteration {n} (decided at iteration "
                    f"{record['decided_at']}); simulated makespan {choice['makespan'] * 1e3:.1f} ms, peak memory "
                    f"{choice['memory']:g} of budget {budget:g}; \"remeasure\": true times again")


class AutoSchedule:
    """The decision an "auto" run holds (the trainer owns one): the engine reports it through its hook,
    the checkpoints save it, the loop takes it (a log line, TensorBoard, a rebuild when needed)."""

    def __init__(self, key: dict, record=None):
        self.key = key
        self.decision = record["decision"] if record else None
        self.decided_at = record["decided_at"] if record else None
        self.reported = None  # the engine's AutoDecision, until the loop takes it

    def resume_search(self, engine) -> None:
        """After the build: a resumed searched choice runs on zb-h1's placement, which the ds_config built:
        switch its op order."""
        if self.decision is not None and self.decision["choice"].get("search"):
            choice = self.decision["choice"]
            engine.use_plan(engine.plan.switch(choice["section"], auto.schedule_maker(choice)))

    def report(self, report) -> None:
        """The engine's hook (given to it at build time: model_setup.setup_model_and_optimizer)."""
        self.reported = report

    def _settle(self, iteration: int) -> None:
        """A reported decision counts from the iteration that ended when it came."""
        if self.reported is not None and self.reported.decision is not self.decision:
            self.decision, self.decided_at = self.reported.decision, iteration

    def checkpoint_files(self, iteration: int) -> list:
        """[(file name, content)] for the checkpoint of `iteration`: the record, or None before the decision
        (the writer then removes a stale one from a reused tag folder)."""
        self._settle(iteration)
        record = None if self.decision is None else {
            "format": FORMAT, "iteration": iteration, "decided_at": self.decided_at, "key": self.key,
            "decision": self.decision}
        return [(NAME, record)]

    def take(self, iteration: int, tb):
        """The reported decision (pipe/auto.AutoDecision), logged to TensorBoard; its owner rebuilds the
        engine (rebuild) when it places the chunks otherwise (`report.rebuild`)."""
        self._settle(iteration)
        report, self.reported = self.reported, None
        if tb.writer is not None:
            tb.writer.add_text("auto-schedule", auto.describe(report.decision), iteration)
        return report


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def prepare(args):
    """Before the model is built: (the run's settings, None) unless "schedule": "auto"; else its AutoSchedule,
    and when --load holds a decision still valid, the settings of the chosen schedule (config/pipeline.with_choice)."""
    settings = args.pipeline_settings
    if not settings.auto:
        return args, None
    key = run_key(args.pipeline_plan, args.auto_plan, model_config(args), args.ds_config, device_name(),
                  args.activation_checkpoint_interval)
    if not args.load:
        return args, AutoSchedule(key)
    box = [(None, None)]
    if dist.get_rank() == 0:  # one reading for all: every rank must build the same schedule
        tag = read_latest_tag(args.load, args.universal_checkpoint)
        if tag is not None:
            box[0] = resume_choice(os.path.join(args.load, tag), key, remeasure=settings.remeasure,
                                   universal=args.universal_checkpoint, finetune=args.finetune)
    dist.broadcast_object_list(box, src=0)
    record, line = box[0]
    if line:
        print_rank_0(line)
    if record is not None:
        args = with_choice(args, chosen_ds_config(args.ds_config, record["decision"]), record["decision"])
    return args, AutoSchedule(key, record)


# -- switching through a checkpoint ---------------------------------------------------------------
# When the chosen schedule places the chunks differently (pipe/auto.py swaps in place otherwise): the
# engine saves a DeepSpeed checkpoint to a temporary folder, the caller builds the module, optimizer and
# engine of the chosen schedule, and the checkpoint loads into it as a resume under another layout does
# (training/checkpoint/save_load.py: weights, lr schedule and step counters as saved, the ZeRO-1 optimizer
# state re-cut parameter by parameter), so training goes on with the same numbers. The RNG states are
# put back after the build (building a module draws from them). The folder must be visible to every
# rank: under --save when there is one, else the system's temporary folder (one node).

SWITCH_TAG = "auto_switch"


def shared_folder(save_dir=None):
    """A new empty folder every rank gets the same path of (rank 0 makes it, broadcasts the path)."""
    box = [None]
    if dist.get_rank() == 0:
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix=".auto-switch-", dir=save_dir or None)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def switch_engine(engine, decision: dict, build, save_dir=None):
    """`build(ds_config)` -> the new engine; returns it, with the old engine's whole training state."""
    folder = shared_folder(save_dir)
    try:
        engine.save_checkpoint(folder, tag=SWITCH_TAG, client_state={}, save_latest=False)
        dist.barrier()
        rng = get_rng_state()
        # DeepSpeed's copy counts each context-parallel rank as a replica: the build counts samples
        ds_config = chosen_ds_config(samples_batch(engine.config, context_parallel_size(engine.module)), decision)
        del engine  # the caller's reference goes when it takes the new one
        new = build(ds_config)
        set_rng_state(rng)
        restore(new, folder, SWITCH_TAG, LoadPlan("by_name", True, "auto switch"))
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if dist.get_rank() == 0:
        why = "another chunk placement" + (f" or recompute setting: recompute {decision['choice']['recompute_label']}"
                                           if "recompute" in decision["choice"] else "")
        print(f"auto schedule: switched from {decision['start']} to {decision['choice']['label']} "
              f"through a checkpoint ({why})", flush=True)
    return new


def rebuild(args, engine, decision: dict, hf_model=None):
    """switch_engine for the pretraining loop: (the run's settings under the choice, the new engine, its lr
    schedule), for the loop's Trainer to take; `hf_model`: --hf-model's transformers model, cut again."""
    built = {}

    def build(ds_config):
        built["args"] = with_choice(args, ds_config, decision)
        if hf_model is not None:
            new, built["lr_scheduler"], _ = setup_hf_model(built["args"], model=hf_model)
        else:
            new, built["lr_scheduler"] = setup_model_and_optimizer(built["args"])
        return new

    engine = switch_engine(engine, decision, build, args.save)
    timeouts.label_groups(engine.grid, engine.module)
    return built["args"], engine, built["lr_scheduler"]
