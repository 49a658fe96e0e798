"""Resume a `"schedule": "auto"` run on the schedule it chose, without timing it again.

Every checkpoint saved once the run has decided (pipe/auto.py) holds the decision:
SAVE/global_stepN/auto_schedule.json, written by rank 0 (temp file, rename) before the manifest
and `latest` name the step. A file beside DeepSpeed's, not DeepSpeed's client state: the choice
fixes how the module is cut into chunks, so it is needed before the module is built, and the
client state comes back from engine.load_checkpoint only after; the file is also read without
torch, and `cat` shows what a run chose.

    {"format": 1, "iteration": 4, "decided_at": 2, "key": {...}, "decision": {...}}

On --load with an "auto" ds_config the decision is reused when everything it was made for is
unchanged (`WHAT`: pp, the micro-batch count, the layer count, the budget, the sizes and precision
that set the measured op times, the device, and the candidates this code offers): the run builds
the chosen schedule directly (pipe/auto.chosen_ds_config; a searched zb-search schedule by a switch
of the plan after the build) and times nothing. Otherwise it times again and says why in one line:
something differs, "remeasure": true, --finetune, or a universal checkpoint (another layout). A
checkpoint saved before the timed iterations ended holds no decision: the run times as a new one.
"""
import json
import math
import os

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
    "cuts": "Seq1F1B segment lengths",
}


def run_key(plan, config, ds_config: dict, device: str, recompute: int = 0) -> dict:
    """What the decision of an "auto" run with this (unswitched) PipelinePlan depends on."""
    from megatron_ds.schedules import auto
    dtype = next((k for k in ("bf16", "fp16") if (ds_config.get(k) or {}).get("enabled")), "fp32")
    return {"pp": plan.pp, "micro_batches": plan.micro_batches, "num_layers": plan.auto.num_layers,
            "budget": plan.auto.budget, "micro_batch_size": plan.micro_batch_size, "seq_length": plan.seq_length,
            "hidden_size": plan.hidden_size, "ffn_hidden_size": getattr(config, "ffn_hidden_size", None),
            "num_attention_heads": getattr(config, "num_attention_heads", None),
            "tp": getattr(config, "tensor_model_parallel_size", 1),
            "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
            "recompute": recompute,
            "dtype": dtype, "device": device,
            "candidates": sorted(c.label for c, _ in auto.candidates(plan.pp, plan.micro_batches, plan.auto.num_layers,
                                                                      plan.auto.cuts)),
            "cuts": [list(c.lengths) for c in plan.auto.cuts]}


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
    return [_then_now(name, saved.get(name), key[name]) for name in WHAT if not _same(saved.get(name), key[name])]


def write_record(step_dir: str, record) -> None:
    """Rank 0, before the step's manifest: the record, or none (a reused tag folder keeps no stale one)."""
    path = os.path.join(step_dir, NAME)
    if record is None:
        if os.path.exists(path):
            os.remove(path)
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, **record}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_record(step_dir: str):
    """The step's record; None when it has none; ValueError when it cannot be used."""
    path = os.path.join(step_dir, NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read ({exc})") from None
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


class AutoResume:
    """The decision an "auto" run holds, for its checkpoints (the trainer owns one)."""

    def __init__(self, key: dict, record=None):
        self.key = key
        self.decision = record["decision"] if record else None
        self.decided_at = record["decided_at"] if record else None

    def record(self, engine, iteration: int):
        """The record to save with a checkpoint of `iteration`; takes the engine's new decision first."""
        pending = getattr(engine, "auto_decision", None)
        if pending is not None and pending is not self.decision:
            self.decision, self.decided_at = pending, iteration
        if self.decision is None:
            return None
        return {"iteration": iteration, "decided_at": self.decided_at, "key": self.key, "decision": self.decision}

    def after_build(self, engine) -> None:
        """A searched choice runs on zb-h1's placement, which the ds_config built: switch its op order."""
        from megatron_ds.schedules.auto import schedule_maker
        if self.decision is not None and self.decision["choice"].get("search"):
            choice = self.decision["choice"]
            engine.plan.switch(choice["section"], schedule_maker(choice))


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def prepare(args):
    """Before the model is built: None unless "schedule": "auto"; else its AutoResume, and when --load
    holds a decision still valid, args.ds_config / args.pipeline_settings select the chosen schedule."""
    import torch.distributed as dist
    from megatron_ds.data.dist_utils import print_rank_0
    from megatron_ds.pipe.auto import chosen_ds_config
    from megatron_ds.pipe.config import pipeline_settings
    from megatron_ds.pipe.plan import PipelinePlan
    from .checkpointing import read_latest_tag
    from .model_setup import model_config
    settings = args.pipeline_settings
    if not settings.auto:
        return None
    config = model_config(args)
    plan = PipelinePlan.from_config(config, args.ds_config, args.pipeline_model_parallel_size,
                                    args.data_parallel_size, args.seq_length)
    key = run_key(plan, config, args.ds_config, device_name(), args.activation_checkpoint_interval)
    if not args.load:
        return AutoResume(key)
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
        args.ds_config = chosen_ds_config(args.ds_config, record["decision"])
        args.pipeline_settings = pipeline_settings(args.ds_config)
    return AutoResume(key, record)
