"""python -m megatron_ds.schedules {export,show,compare}: a bad setting exits with code 2
and one line naming the setting and the rule, never a traceback."""
from __future__ import annotations

import argparse
import sys

from megatron_ds.cp_section import COMM_TYPES

from .catalog import CATALOG, build_schedule
from .compare import compare_rows, context_rows, format_context_table, format_table
from .context_parallel import BANDWIDTH, DEVICE_FLOPS
from .costs import ModelCosts, evaluate
from .ir import ScheduleError
from .render import ascii_timeline, plot_timeline, summary_table
from .seq_split import SEGMENT_MULTIPLE, balanced_segment_lengths, even_segment_lengths, segment_costs


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", required=True, choices=list(CATALOG))
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--micro-batches", type=int, required=True)
    p.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved, seq1f1b-I)")
    p.add_argument("--seq-splits", type=int, default=1, help="sequence segments (seq1f1b)")
    p.add_argument("--split-backward", action="store_true", help="split the backward into B and W (seq1f1b)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="tokens per sequence (seq1f1b): the segments' lengths cap the order as the engine does")
    p.add_argument("--seq-split-method", choices=["balanced", "even"], default="balanced",
                   help='with --seq-length: as ds_config "pipeline.seq_split_method"')
    p.add_argument("--hidden-size", type=int, default=None, help="with --seq-length and balanced: the model's")
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x --hidden-size")
    p.add_argument("--op-costs", type=_triple, default=None, metavar="TF,TB,TW",
                   help='zbv-half/zbv-min: the order built for these layer times (ds_config "pipeline.op_costs")')
    p.add_argument("--vocab-parallel", action="store_true",
                   help='every rank runs the vocabulary passes EF, S, T, EW on its 1/p of the vocabulary '
                        '(ds_config "pipeline.vocab_parallel")')
    p.add_argument("--overlap", action="store_true",
                   help="the overlapped order: forwards and backwards of other micro-batches as overlapped units, "
                        "each one's all-to-all hidden behind the other's compute (1f1b, interleaved, dualpipev)")


def _cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tf", type=float, default=1.0, help="forward time of one 1F1B stage")
    p.add_argument("--tb", type=float, default=1.0, help="input-grad backward time")
    p.add_argument("--tw", type=float, default=1.0, help="weight-grad backward time")
    p.add_argument("--p2p-latency", type=float, default=0.0)


def _model_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--embed-cost", type=_triple, default=(0.0, 0.0, 0.0), metavar="F,B,W",
                   help="extra times of the embedding on stage 0 (e.g. a large vocabulary)")
    p.add_argument("--head-cost", type=_triple, default=(0.0, 0.0, 0.0), metavar="F,B,W",
                   help="extra times of the LM head and loss on the last stage (spread over every rank's "
                        "S and T passes with --vocab-parallel)")
    p.add_argument("--head-memory", type=float, default=0.0,
                   help="what one micro-batch's logits hold, in one stage's activations of one micro-batch")


def _costs(names: str):
    """An argparse type: len(names) non-negative numbers, comma-separated (names "F,B,W": three)."""
    count, words = names.count(",") + 1, {2: "two", 3: "three"}

    def parse(text: str) -> tuple:
        try:
            vals = tuple(float(x) for x in text.split(","))
        except ValueError:
            vals = ()
        if len(vals) != count or any(v < 0 for v in vals):
            raise argparse.ArgumentTypeError(f"{text!r}: give {words[count]} non-negative numbers {names}")
        return vals
    return parse


_triple, _pair = _costs("F,B,W"), _costs("F,B")


def _segment_lengths(args):
    """Token counts of the segments, as pipe/plan/plan.py cuts them (None without --seq-length)."""
    if args.seq_length is None or args.seq_splits == 1:
        return None
    if args.seq_split_method == "even":
        if args.seq_length % args.seq_splits:
            raise ScheduleError(f"--seq-length {args.seq_length} must be a multiple of --seq-splits "
                                f"{args.seq_splits} for the even split")
        return even_segment_lengths(args.seq_length, args.seq_splits)
    if args.hidden_size is None:
        raise ScheduleError("--seq-length with the balanced split needs --hidden-size (segment FLOPs depend on it)")
    return balanced_segment_lengths(args.seq_length, args.seq_splits, args.hidden_size, args.ffn_hidden_size,
                                    SEGMENT_MULTIPLE)


def _build(args) -> object:
    return build_schedule(args.schedule, args.pp, args.micro_batches,
                          virtual_stages=args.virtual_stages, seq_splits=args.seq_splits,
                          split_backward=args.split_backward, segment_lengths=_segment_lengths(args),
                          op_costs=args.op_costs, vocab_parallel=args.vocab_parallel, overlap=args.overlap)


def _export(args) -> None:
    text = _build(args).to_json(indent=2)
    if args.out in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as fh:
            fh.write(text)


def _show(args) -> None:
    costs = ModelCosts(args.tf, args.tb, args.tw, embed=args.embed_cost, head=args.head_cost,
                       head_memory=args.head_memory)
    sched = _build(args)
    seq_costs = None
    if sched.segment_lengths:  # a segment costs its FLOPs (bench/layer_costs.py), else its tokens
        seq_costs = (segment_costs(sched.segment_lengths, args.hidden_size, args.ffn_hidden_size)
                     if args.hidden_size else list(sched.segment_lengths))
    moe = {"all_to_all": args.all_to_all, "overlap_host": args.overlap_host} if args.all_to_all else {}
    res = evaluate(sched, costs, p2p_latency=args.p2p_latency, seq_costs=seq_costs, **moe)
    print(ascii_timeline(res, width=args.width))
    print()
    print(summary_table(res))
    if args.plot:
        print(f"timeline drawn to {plot_timeline(res, args.plot)}")


SHAPE = ("num_layers", "hidden_size", "num_attention_heads")  # what the context-parallel table cannot do without


def _context_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("context parallelism", "with --seq-length (and --context-parallel-size C): each "
                             "schedule's peak memory per rank and step at CP 1, 2, 4, ... C, from the model's shape")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sequence")
    g.add_argument("--context-parallel-size", type=int, default=None, metavar="C",
                   help="the largest CP size set beside CP=1 (powers of two between them too)")
    g.add_argument("--cp-comm-type", choices=COMM_TYPES, default="p2p", help="the attention's communication")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs=2, default=None, metavar=("A", "P"),
                   help="a2a+p2p's all-to-all over A ranks and ring over P (smaller CP sizes: A where it divides them)")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-key-value-heads", type=int, default=None, help="grouped-query attention (default: heads)")
    g.add_argument("--kv-channels", type=int, default=None, help="head size (default hidden / heads)")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x --hidden-size")
    g.add_argument("--vocab-size", type=int, default=None, help="the head's cost and logits (default 50304)")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["layernorm", "rmsnorm"], default="layernorm")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "alibi"], default="rope")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--activation-bytes", type=int, default=2, help="bytes per activation element (bf16: 2)")
    g.add_argument("--no-logits", action="store_true",
                   help="the loss holds no logits between ops (--loss-chunk-size, --use-liger-kernel)")
    g.add_argument("--device-tflops", type=float, default=DEVICE_FLOPS / 1e12, help="FLOP rate one GPU reaches")
    g.add_argument("--cp-bandwidth", type=float, default=BANDWIDTH / 1e9, metavar="GB/s",
                   help="one way between two CP ranks")
    g.add_argument("--seq-split-method", choices=["balanced", "even"], default="balanced",
                   help="Seq1F1B's segments (each a multiple of 2 x CP)")


def _context_compare(args) -> None:
    missing = [f"--{name.replace('_', '-')}" for name in ("seq_length", *SHAPE) if getattr(args, name) is None]
    if missing:
        raise ScheduleError(f"the context-parallel table needs the model's shape and sequence: give {', '.join(missing)}")
    cp = args.context_parallel_size or 1
    sizes, rows = context_rows(args.pp, args.micro_batches, args, args.seq_length, cp, args.cp_comm_type,
                               virtual_stages=args.virtual_stages, seq_splits=args.seq_splits,
                               seq_split_method=args.seq_split_method, batch=args.micro_batch_size,
                               dtype_bytes=args.activation_bytes, flops=args.device_tflops * 1e12,
                               bandwidth=args.cp_bandwidth * 1e9, logits=not args.no_logits)
    kv = args.num_key_value_heads or args.num_attention_heads
    levels = args.hierarchical_context_parallel_sizes
    hierarchy = f" (A {levels[0]} x P {levels[1]})" if levels and args.cp_comm_type == "a2a+p2p" else ""
    title = (f"context parallelism: seq {args.seq_length}, micro-batch {args.micro_batch_size}, p={args.pp} "
             f"m={args.micro_batches}; L={args.num_layers} h={args.hidden_size} heads {args.num_attention_heads}/{kv} "
             f"ffn {args.ffn_hidden_size or 4 * args.hidden_size}{' SwiGLU' if args.swiglu else ''} "
             f"V={args.vocab_size or 50304}{' (no logits held)' if args.no_logits else ''}; {args.cp_comm_type}{hierarchy} at "
             f"{args.cp_bandwidth:g} GB/s, {args.device_tflops:g} TFLOP/s, {args.activation_bytes}-byte activations")
    print(format_context_table(sizes, rows, title))


def _compare(args) -> None:
    if args.seq_length is not None or args.context_parallel_size is not None:
        return _context_compare(args)
    rows = compare_rows(args.pp, args.micro_batches, args.tf, args.tb, args.tw,
                        p2p_latency=args.p2p_latency, virtual_stages=args.virtual_stages,
                        seq_splits=args.seq_splits, embed=args.embed_cost, head=args.head_cost,
                        head_memory=args.head_memory, vocab_parallel=args.vocab_parallel)
    title = (f"p={args.pp} m={args.micro_batches} TF={args.tf:g} TB={args.tb:g} TW={args.tw:g} "
             f"p2p={args.p2p_latency:g}")
    if any(args.head_cost) or any(args.embed_cost):
        title += f" head={','.join(f'{x:g}' for x in args.head_cost)} embed={','.join(f'{x:g}' for x in args.embed_cost)}"
    print(format_table(rows, title))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m megatron_ds.schedules",
                                  description="Pipeline schedules as data.")
    sub = top.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write a schedule's per-rank op lists as JSON")
    _schedule_args(exp)
    exp.add_argument("--out", help="output file (default: stdout)")
    exp.set_defaults(run=_export)
    show = sub.add_parser("show", help="ASCII timeline, bubble and peak memory per rank")
    _schedule_args(show)
    _cost_args(show)
    _model_cost_args(show)
    show.add_argument("--width", type=int, default=None, help="columns of the timeline")
    show.add_argument("--all-to-all", type=_pair, default=None, metavar="F,B",
                      help="a MoE model's all-to-all inside one 1F1B stage's F and B (BW) ops, on top of --tf/--tb")
    show.add_argument("--overlap-host", type=float, default=0.0, metavar="H",
                      help="with --overlap: host time one side of an overlapped unit adds on one 1F1B stage "
                           "(its pieces' launches and waits)")
    show.add_argument("--plot", metavar="PATH", help="also draw the timeline to PATH (.png or .svg; matplotlib)")
    show.set_defaults(run=_show)
    cmp_ = sub.add_parser("compare", help="every schedule's makespan, bubble and memory")
    cmp_.add_argument("--pp", type=int, required=True)
    cmp_.add_argument("--micro-batches", type=int, required=True)
    cmp_.add_argument("--virtual-stages", type=int, default=2, help="for schedules that take virtual stages")
    cmp_.add_argument("--seq-splits", type=int, default=2, help="for schedules that split the sequence")
    cmp_.add_argument("--vocab-parallel", action="store_true",
                      help="beside each row, the same schedule with the vocabulary passes on every rank")
    _cost_args(cmp_)
    _model_cost_args(cmp_)
    _context_args(cmp_)
    cmp_.set_defaults(run=_compare)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except ScheduleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
