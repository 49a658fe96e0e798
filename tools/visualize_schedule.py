"""Draw a pipeline schedule's simulated timeline (PNG and/or SVG) and print its ASCII form.

    python tools/visualize_schedule.py --schedule bitpipe --pp 4 --micro-batches 8 \
        --tf 1 --tb 1 --tw 1 --out bitpipe.png --out bitpipe.svg
    python tools/visualize_schedule.py --from-json schedule.json --out schedule.svg
    python tools/visualize_schedule.py --ds-config ds_configs/ds_config_seq1f1b.json --pp 2 \
        --micro-batches 4 --seq-length 64 --hidden-size 64 --out seq1f1b.png

--ds-config draws a run's own schedule: its "pipeline" section read by the code the run reads it
with (megatron_ds/pipe/plan/config.py; DeepSpeed's own engine is 1F1B), the Seq1F1B segments cut as the
run cuts them (megatron_ds/pipe/plan/plan.segment_lengths) from the model flags given, which are
pretrain_gpt.py's.
"""
from __future__ import annotations

import argparse
import sys

from megatron_ds.schedules import CATALOG, Schedule, ScheduleError, build_schedule, simulate
from megatron_ds.errors import UserError
from megatron_ds.files import UnreadableFile, read_json
from megatron_ds.gpt_config import GPTConfig
from megatron_ds.pipe.plan.config import pipeline_settings
from megatron_ds.pipe.plan.plan import segment_lengths
from megatron_ds.schedules.catalog import KNOBS  # what a ds_config's "pipeline" section sets instead of the flags
from megatron_ds.schedules.render import ascii_timeline, plot_timeline, summary_table


def from_ds_config(args):
    """The schedule a run of ds_config `args.ds_config` runs for --pp and --micro-batches."""
    given = [f"--{k.replace('_', '-')}" for k in KNOBS if getattr(args, k, None)]  # this tool has no --op-costs
    if given:
        raise ScheduleError(f"--ds-config: its \"pipeline\" section sets the schedule's knobs; "
                            f"leave out {', '.join(given)}")
    try:
        ds_config = read_json(args.ds_config, f"--ds-config {args.ds_config}")
    except UnreadableFile as exc:
        raise ScheduleError(str(exc)) from None
    settings = pipeline_settings(ds_config)
    if settings.stock:  # DeepSpeed's TrainSchedule
        return build_schedule("1f1b", args.pp, args.micro_batches)
    if settings.auto:
        raise ScheduleError('--ds-config: "schedule": "auto" picks its schedule after timing the first iterations; '
                            "the run's log names it (draw that one)")
    lengths = None
    if settings.seq_splits > 1:
        if args.seq_length is None or (settings.seq_split_method == "balanced" and args.hidden_size is None):
            raise ScheduleError(f"--ds-config: \"seq_splits\": {settings.seq_splits} cuts the run's sequences: give "
                                "its --seq-length" + (" and --hidden-size" if settings.seq_split_method == "balanced"
                                                      else ""))
        model = GPTConfig(vocab_size=1, hidden_size=args.hidden_size or 1, num_layers=1,
                          num_attention_heads=args.num_attention_heads or 1, max_position_embeddings=args.seq_length,
                          ffn_hidden_size=args.ffn_hidden_size or 0, swiglu=args.swiglu,
                          num_key_value_heads=args.num_key_value_heads or 0)
        lengths = segment_lengths(settings, model, args.seq_length)
    return settings.build_schedule(args.pp, args.micro_batches, segment_lengths=lengths)


def described(schedule):
    """One line: what is drawn."""
    line = (f"schedule {schedule.name}: pp={schedule.pp}, micro_batches={schedule.micro_batches}, "
            f"stages={schedule.stages} ({schedule.stages // schedule.pp} per rank and replica), "
            f"seq_splits={schedule.seq_splits}")
    if schedule.segment_lengths:
        line += f", segment lengths {list(schedule.segment_lengths)}"
    return line + (", vocab_parallel" if schedule.vocab_parallel else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--schedule", choices=list(CATALOG))
    src.add_argument("--from-json", help="a file written by `python -m megatron_ds.schedules export`")
    src.add_argument("--ds-config", help="a run's ds_config: draw the schedule its \"pipeline\" section runs")
    ap.add_argument("--pp", type=int)
    ap.add_argument("--micro-batches", type=int)
    ap.add_argument("--virtual-stages", type=int, help="with --schedule (default 1)")
    ap.add_argument("--seq-splits", type=int, help="with --schedule (default 1)")
    ap.add_argument("--split-backward", action="store_true", help="with --schedule")
    model = ap.add_argument_group("with --ds-config, the run's model flags that cut a Seq1F1B sequence")
    model.add_argument("--seq-length", type=int)
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--ffn-hidden-size", type=int)
    model.add_argument("--num-attention-heads", type=int)
    model.add_argument("--num-key-value-heads", type=int)
    model.add_argument("--swiglu", action="store_true")
    ap.add_argument("--tf", type=float, default=1.0)
    ap.add_argument("--tb", type=float, default=1.0)
    ap.add_argument("--tw", type=float, default=1.0)
    ap.add_argument("--p2p-latency", type=float, default=0.0)
    ap.add_argument("--out", action="append", required=True,
                    help="picture to write, .png or .svg (repeat for both)")
    ap.add_argument("--quiet", action="store_true", help="do not print the ASCII timeline")
    args = ap.parse_args(argv)
    try:
        if args.from_json:
            with open(args.from_json) as fh:
                schedule = Schedule.from_json(fh.read())
        elif args.pp is None or args.micro_batches is None:
            raise ScheduleError(f"{'--ds-config' if args.ds_config else '--schedule'} needs --pp and --micro-batches")
        elif args.ds_config:
            schedule = from_ds_config(args)
        else:
            schedule = build_schedule(args.schedule, args.pp, args.micro_batches,
                                      virtual_stages=args.virtual_stages or 1,
                                      seq_splits=args.seq_splits or 1,
                                      split_backward=args.split_backward)
        for path in args.out:
            if not path.endswith((".png", ".svg")):
                raise ScheduleError(f"--out {path}: the picture must end in .png or .svg")
        result = simulate(schedule, args.tf, args.tb, args.tw, p2p_latency=args.p2p_latency)
    except (UserError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(described(schedule))
    for path in args.out:
        plot_timeline(result, path)
        print(f"wrote {path}")
    if not args.quiet:
        print(ascii_timeline(result))
        print(summary_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
