"""The research forks' and Megatron-LM's flags, as aliases of ds_config "pipeline" keys and our flags.

A user of sail-sg zero-bubble, BitPipe, thunlp Seq1F1B, Megatron-DeepSpeed or Megatron-LM keeps the launch
line: each flag here writes the ds_config key it stands for (docs/MIGRATION.md's table lists them). A flag
and a ds_config key that disagree stop the run with one message naming both, as the batch sizes do. A flag
nobody knows gets one line naming the closest known flag, or the ds_config key that replaces it.

The schedule's shape is checked next door (config/pipeline.py), at parse time.
"""
import argparse
import dataclasses
import difflib
import json
import os

from megatron_ds.errors import report_stop
from megatron_ds.pipe.plan.config import PipelineSettings
from megatron_ds.pipe.plan.layout import PREFIX as LAYOUT_PREFIX, LayoutError, first_last_layout
from megatron_ds.pipe.plan.recompute import stock_problem
from megatron_ds.schedules.catalog import ANY, CATALOG, takes
from megatron_ds.schedules.recompute import Recompute

from ..errors import ArgumentsError

# Flags of the anchors that have no alias here, with what replaces them (printed when one is given).
REPLACED = {
    "--zero-bubble-v-schedule-mem-setup": 'ds_config "pipeline": {"schedule": "zbv-half"} (half), '
                                          '"zbv-min" (min) or "zbv" (zb, --zero-bubble-v-schedule)',
    "--zero-bubble-adaptive-memory-limit-percentile": "not offered: use --zero-bubble-max-pending-backward "
                                                      "p (zb-h1) or 2p (zb-h2)",
    "--enable-zbh1-exact-semantics": 'use --enable-zbh1-pipeline with --enable-optimizer-post-validation '
                                     '(ds_config "pipeline": {"schedule": "zb-h1", "post_validation": true})',
    "--num-seq-splits": '--pipe-sp-splits K (ds_config "pipeline": {"schedule": "seq1f1b", "seq_splits": K})',
    "--enable-seq1f1b": '--pipe-sp-splits K (ds_config "pipeline": {"schedule": "seq1f1b", "seq_splits": K})',
    "--seq1f1b-splits": '--pipe-sp-splits K (ds_config "pipeline": {"schedule": "seq1f1b", "seq_splits": K})',
    "--seq1f1b-balance-method": '--pipe-sp-strategy (ds_config "pipeline.seq_split_method")',
    "--virtual-pipeline-model-parallel-size": '--num-layers-per-virtual-pipeline-stage N (ds_config "pipeline": '
                                              '{"schedule": "interleaved", "virtual_stages": V})',
    "--partition-activations": "not offered: the recomputed layers keep whole activations on every "
                               "tensor-parallel rank",
    "--train-micro-batch-size-per-gpu": '--micro-batch-size (ds_config "train_micro_batch_size_per_gpu")',
    "--gradient-accumulation-steps": '--global-batch-size (ds_config "gradient_accumulation_steps")',
    "--wandb-project": "not offered: use --tensorboard-dir or --metrics-file",
}

_FLASH_NOTE = ("--use-flash-attn: accepted and changes nothing; attention already runs through torch's "
               "scaled_dot_product_attention, which picks FlashAttention kernels on GPU in bf16/fp16")


class ForkAwareParser(argparse.ArgumentParser):
    """argparse, except that a flag mistake (unknown, missing, a bad value) gets one line with a hint instead
    of the usage text (a hundred lines), printed by rank 0 and recorded for torchrun."""

    def parse_args(self, args=None, namespace=None):
        parsed, rest = self.parse_known_args(args, namespace)
        if rest:
            self._fail(unknown_flag_lines(self, rest))
        return parsed

    def error(self, message):
        missing = message.partition("the following arguments are required: ")[2]
        what = f"missing required flag{'s' if ',' in missing else ''} {missing}" if missing else message
        self._fail([f"{what} (python {self.prog} --help lists every flag)"])

    def _fail(self, lines):
        text = "".join(f"{self.prog}: error: {line}\n" for line in lines)
        report_stop(text, int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))))
        raise SystemExit(2)


def unknown_flag_lines(parser, rest):
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    flags = [word.split("=", 1)[0] for word in rest if word.startswith("-")]
    if not flags:
        return [f"unrecognized arguments: {' '.join(rest)}"]
    lines = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        hint = REPLACED.get(flag) or (f"did you mean {close[0]}?" if close else "see --help for the flags")
        lines.append(f"unrecognized argument {flag}: {hint}")
    return lines


def add_fork_args(parser):
    g = parser.add_argument_group("aliases: research forks, Megatron-LM, Megatron-DeepSpeed (docs/MIGRATION.md)")
    g.add_argument("--enable-zero-bubble", action="store_true",
                   help='sail-sg: ZB-H1, or ZB-H2 with --zero-bubble-max-pending-backward 2p ("pipeline.schedule")')
    g.add_argument("--zero-bubble-max-pending-backward", type=int, default=None,
                   help="sail-sg: p gives zb-h1, 2p gives zb-h2 (p = pipeline size)")
    g.add_argument("--zero-bubble-v-schedule", action="store_true", help='sail-sg: "pipeline.schedule" = "zbv"')
    g.add_argument("--enable-zbh1-pipeline", action="store_true",
                   help='Megatron-DeepSpeed: "pipeline.schedule" = "zb-h1"')
    g.add_argument("--enable-optimizer-post-validation", action="store_true",
                   help='sail-sg: "pipeline.post_validation" = true')
    g.add_argument("--enable-bitpipe-schedule", action="store_true", help='BitPipe: "pipeline.schedule" = "bitpipe"')
    g.add_argument("--allow-padding-num-layers", action="store_true",
                   help='sail-sg: --num-layers need not be a multiple of the virtual stages; some hold one layer '
                        'less ("pipeline.allow_padding_num_layers" = true)')
    g.add_argument("--enable-vocab-parallel", action="store_true",
                   help='sail-sg VocabularyParallelism: the embedding and output layer sliced over the pipeline '
                        'ranks by vocabulary ("pipeline.vocab_parallel" = true)')
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help='Megatron-LM: "pipeline.schedule" = "interleaved", "virtual_stages" = '
                        "layers / (pipeline size x N)")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help='Megatron-core: each virtual stage\'s layers, e.g. "Et*3|t*4|t*4|t*3L" (E embedding, t transformer '
                        'layer, L loss, | between stages; "pipeline.partition_method" = "layout:...")')
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help='Megatron-core: overlapped forward-and-backward units, each one\'s expert-parallel all-to-all '
                        'behind the other\'s compute (1f1b, interleaved, dualpipev; "pipeline.overlap" = true)')
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Megatron-core: transformer layers of the first stage (the others an even share)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Megatron-core: transformer layers of the last stage (the others an even share)")
    g.add_argument("--pipe-sp-splits", type=int, default=None,
                   help='Seq1F1B: "pipeline.schedule" = "seq1f1b", "seq_splits" = K')
    g.add_argument("--pipe-sp-strategy", choices=["uniform_comp", "average", "balanced", "even"], default=None,
                   help='Seq1F1B: "pipeline.seq_split_method" (uniform_comp = balanced, average = even)')
    g.add_argument("--zero-bubble-pipeline-timers-start-iter", type=int, default=None,
                   help='sail-sg: "pipeline.timers_start_iter" (schedule "auto": first timed iteration)')
    g.add_argument("--zero-bubble-pipeline-timers-end-iter", type=int, default=None,
                   help='sail-sg: "pipeline.timers_end_iter" (schedule "auto": switches after the iteration before it)')
    g.add_argument("--use-flash-attn", "--use-flash-attn-v2", "--use-flash-attn-triton", dest="use_flash_attn",
                   action="store_true", help="accepted; attention already uses scaled_dot_product_attention")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM: = --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="Megatron-LM: selective recomputes each layer's attention core in backward, full whole "
                        "layers (chosen by --recompute-method)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="Megatron-LM, with --recompute-granularity full: uniform (default) recomputes each virtual "
                        "stage's layers in groups of --recompute-num-layers, block its first --recompute-num-layers "
                        "layers and keeps the others")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="Megatron-LM: N of --recompute-method (default 1)")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="Megatron-DeepSpeed: accepted; --checkpoint-activations always uses DeepSpeed's")
    g.add_argument("--kill-switch-file", default=None, help="Megatron-DeepSpeed's name for --kill-switch-path")


def _err(msg):
    raise ArgumentsError(msg)


def _flag_schedules(args):
    """[(flag, schedule)] the fork flags ask for; at most one schedule may come out."""
    p = args.pipeline_model_parallel_size
    chosen = []
    pending = args.zero_bubble_max_pending_backward
    if pending is not None and not args.enable_zero_bubble:
        _err("--zero-bubble-max-pending-backward needs --enable-zero-bubble")
    if args.enable_zero_bubble and not args.zero_bubble_v_schedule:
        if pending not in (None, p, 2 * p):
            _err(f"--zero-bubble-max-pending-backward {pending}: give p = {p} (zb-h1) or 2p = {2 * p} (zb-h2) "
                 f"for --pipeline-model-parallel-size {p}; other memory limits are not offered")
        chosen.append(("--enable-zero-bubble", "zb-h2" if pending == 2 * p else "zb-h1"))
    if args.zero_bubble_v_schedule:
        if pending is not None:
            _err("--zero-bubble-max-pending-backward does not apply to --zero-bubble-v-schedule")
        chosen.append(("--zero-bubble-v-schedule", "zbv"))
    if args.enable_zbh1_pipeline:
        chosen.append(("--enable-zbh1-pipeline", "zb-h1"))
    if args.enable_bitpipe_schedule:
        chosen.append(("--enable-bitpipe-schedule", "bitpipe"))
    if args.pipe_sp_splits is not None:
        if args.pipe_sp_splits < 1:
            _err(f"--pipe-sp-splits must be positive, got {args.pipe_sp_splits}")
        if args.pipe_sp_splits > 1:
            chosen.append(("--pipe-sp-splits", "seq1f1b"))
    differ = [(f, s) for f, s in chosen if s != chosen[0][1]]
    if differ:
        (f1, s1), (f2, s2) = chosen[0], differ[0]
        _err(f"{f1} ({s1}) and {f2} ({s2}) ask for different schedules: give one")
    return chosen


class _Section:
    """The ds_config "pipeline" section being written by flags; a clash names the flag and the key."""

    def __init__(self, section, src):
        self.section, self.src, self.set_by = dict(section), src, {}

    def set(self, key, value, flag):
        have = self.section.get(key)
        if key in self.section and have != value:
            by = f"{self.set_by[key]} (\"{key}\" = {json.dumps(have)})" if key in self.set_by else \
                f'ds_config "pipeline.{key}" = {json.dumps(have)} in {self.src}'
            # a cut written out as DeepSpeed's default (as the shipped configs once were) is no choice of its own
            way = (f"drop the key from {self.src} ({json.dumps(have)} is the default)"
                   if key == "partition_method" and have == PipelineSettings.partition_method
                   and key not in self.set_by else "give one of them, or make them equal")
            _err(f"{flag} (\"pipeline.{key}\" = {json.dumps(value)}) disagrees with {by}; {way}")
        self.section[key] = value
        self.set_by.setdefault(key, flag)


def apply_fork_flags(args, ds_config):
    """The ds_config with the fork flags' "pipeline" keys written in; also maps the recompute/kill flags."""
    src = args.deepspeed_config or "(no --deepspeed_config)"
    pipe = _Section(ds_config.get("pipeline") or {}, src)
    for flag, schedule in _flag_schedules(args):
        pipe.set("schedule", schedule, flag)
    _apply_virtual_stages(args, pipe)
    _apply_layout(args, pipe)
    if args.pipe_sp_strategy is not None:
        method = {"uniform_comp": "balanced", "average": "even"}.get(args.pipe_sp_strategy, args.pipe_sp_strategy)
        pipe.set("seq_split_method", method, f"--pipe-sp-strategy {args.pipe_sp_strategy}")
    if args.pipe_sp_splits is not None and args.pipe_sp_splits > 1:
        pipe.set("seq_splits", args.pipe_sp_splits, f"--pipe-sp-splits {args.pipe_sp_splits}")
    for key in ("timers_start_iter", "timers_end_iter"):
        value = getattr(args, f"zero_bubble_pipeline_{key}")
        if value is not None:
            pipe.set(key, value, f"--zero-bubble-pipeline-{key.replace('_', '-')} {value}")
    if args.enable_optimizer_post_validation:
        pipe.set("post_validation", True, "--enable-optimizer-post-validation")
    if args.allow_padding_num_layers:
        pipe.set("allow_padding_num_layers", True, "--allow-padding-num-layers")
    if args.overlap_moe_expert_parallel_comm:
        pipe.set("overlap", True, "--overlap-moe-expert-parallel-comm")
    if args.enable_vocab_parallel:
        pipe.set("vocab_parallel", True, "--enable-vocab-parallel")
    if args.compile_layers is not None:
        pipe.set("compile_layers", args.compile_layers, "--compile-layers" if args.compile_layers else "--no-compile-layers")
    if args.enable_cuda_graph:
        pipe.set("cuda_graphs", True, "--enable-cuda-graph")
    _apply_recompute(args, pipe)
    if args.kill_switch_file is not None:
        if args.kill_switch_path not in (None, args.kill_switch_file):
            _err(f"--kill-switch-file {args.kill_switch_file} disagrees with --kill-switch-path "
                 f"{args.kill_switch_path}: give one")
        args.kill_switch_path = args.kill_switch_file
    if args.use_flash_attn and args.rank == 0:
        print(_FLASH_NOTE, flush=True)
    if pipe.section == (ds_config.get("pipeline") or {}):
        return ds_config
    return {**ds_config, "pipeline": pipe.section}


def _apply_virtual_stages(args, pipe):
    n = args.num_layers_per_virtual_pipeline_stage
    if n is None:
        return
    p, layers = args.pipeline_model_parallel_size, args.num_layers
    flag = f"--num-layers-per-virtual-pipeline-stage {n}"
    if n < 1 or layers % (n * p):
        _err(f"{flag}: --num-layers {layers} must be a multiple of N x --pipeline-model-parallel-size {p} "
             f"= {n * p}")
    v = layers // (n * p)
    schedule = pipe.section.get("schedule")
    if schedule is None:  # Megatron-LM's meaning of the flag
        pipe.set("schedule", "interleaved", flag)
        schedule = "interleaved"
    chunks = CATALOG[schedule].virtual_stages if schedule in CATALOG else None
    if chunks == ANY:
        if v > 1 or "virtual_stages" in pipe.section:
            pipe.set("virtual_stages", v, flag)
    elif chunks and v != chunks:
        _err(f"{flag} gives {v} virtual stages per rank, but schedule {schedule!r} always uses {chunks}: "
             f"--num-layers {layers} = {chunks} x {p} ranks x N")
    elif not chunks and v > 1:
        _err(f"{flag} gives {v} virtual stages per rank, which schedule {schedule!r} does not take "
             f"(only {' and '.join(takes('virtual_stages'))} do)")


def _apply_layout(args, pipe):
    """Megatron-core's written cut: "pipeline.partition_method" = "layout:..." (pipe/plan/layout.py)."""
    layout = args.pipeline_model_parallel_layout
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if layout is None and first is None and last is None:
        return
    if layout is not None:
        if first is not None or last is not None:
            _err("--pipeline-model-parallel-layout and --decoder-first/last-pipeline-num-layers both cut the layers: "
                 "give one")
        pipe.set("partition_method", LAYOUT_PREFIX + layout, f"--pipeline-model-parallel-layout {layout}")
        return
    schedule = pipe.section.get("schedule")
    chunks = CATALOG[schedule].virtual_stages if schedule in CATALOG else 1
    chunks = pipe.section.get("virtual_stages", 1) if chunks == ANY else chunks or 1  # None: one per rank
    flags = " ".join(f"--decoder-{name}-pipeline-num-layers {n}" for name, n in (("first", first), ("last", last))
                     if n is not None)
    if chunks != 1:
        _err(f"{flags}: schedule {schedule!r} places {chunks} virtual stages on each rank; write each stage's "
             "layers with --pipeline-model-parallel-layout")
    try:
        text = first_last_layout(first, last, args.num_layers, args.pipeline_model_parallel_size)
    except LayoutError as exc:
        _err(str(exc))
    pipe.set("partition_method", LAYOUT_PREFIX + text, flags)


def _apply_recompute(args, pipe):
    """Megatron's recompute flags into the run's GPTConfig (its recompute_* fields, pipe/plan/recompute.py), checked
    against each other and against the engine; --checkpoint-activations stays DeepSpeed's interval."""
    granularity = args.recompute_granularity
    if args.recompute_activations and granularity not in (None, "selective"):
        _err(f"--recompute-activations (selective, as in Megatron-LM) disagrees with --recompute-granularity "
             f"{granularity}: give one")
    granularity = granularity or ("selective" if args.recompute_activations else None)
    recompute = Recompute(granularity, args.recompute_method, args.recompute_num_layers)
    problem = recompute.problem()
    if problem:
        _err(problem)
    given = "--recompute-granularity" if granularity else "--checkpoint-activations" if args.checkpoint_activations \
        else None
    if pipe.section.get("auto_recompute") and given:
        _err(f'{given} with ds_config "pipeline.auto_recompute": true, which chooses the recompute itself (none, '
             "selective or full); give one of them")
    if granularity is None:
        return
    if granularity == "selective" and args.checkpoint_activations:
        _err("--checkpoint-activations recomputes whole layers, --recompute-granularity selective the attention "
             "core only: give one")
    if granularity == "selective" and pipe.section.get("cuda_graphs"):
        _err("--recompute-granularity selective with CUDA graphs (--enable-cuda-graph): the recomputed attention "
             "core keeps q, k and v between two graphs whose replays reuse their memory")
    if recompute.full:
        if args.checkpoint_num_layers not in (1, recompute.n):
            _err(f"--recompute-num-layers {recompute.n} disagrees with --checkpoint-num-layers "
                 f"{args.checkpoint_num_layers}: give one")
        if pipe.section.get("schedule", "deepspeed") == "deepspeed" and stock_problem(recompute):
            _err(stock_problem(recompute))
        args.checkpoint_activations, args.checkpoint_num_layers = True, recompute.n
    args.gpt_config = dataclasses.replace(args.gpt_config, recompute_granularity=granularity,
                                          recompute_method=recompute.method, recompute_num_layers=recompute.num_layers)
