"""The model, its optimizer, lr schedule and engine, built from the parsed flags (the loop's set-up,
below it: the "auto" switch and the checkpoint writer build with it too)."""
import dataclasses

import torch

from megatron_ds.data.dist_utils import print_rank_0
from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
from megatron_ds.pipe.moe.moe import optimizer_param_groups
from megatron_ds.schedules import simulate
from megatron_ds.schedules.recompute import Recompute

from .errors import ArgumentsError
from .learning_rates import AnnealingLR


def build_optimizer(module, args):
    """AdamW with Megatron's groups (no decay on biases/norms); on GPU apex FusedAdam when importable,
    else torch's fused AdamW."""
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() == 1 else decay).append(p)
    # expert-parallel parameters in groups of their own (ZeRO cuts them over their expert-data-parallel groups)
    groups = optimizer_param_groups([{"params": decay, "weight_decay": args.weight_decay, "name": "decay"},
                                     {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}])
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)
    adam = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    if torch.cuda.is_available():
        try:
            from apex.optimizers import FusedAdam  # NVIDIA apex only; PyPI's "apex" is another project
            return FusedAdam(groups, **adam)
        except Exception:  # noqa: BLE001 - any import problem means: no apex
            pass
        return torch.optim.AdamW(groups, fused=True, **adam)  # torch's one-kernel AdamW
    return torch.optim.AdamW(groups, **adam)


def model_config(args):
    """The run's GPTConfig (parse_args built it) with the vocabulary the tokenizer padded and, for packed
    documents, its end-of-document token."""
    return dataclasses.replace(args.gpt_config, vocab_size=args.padded_vocab_size,
                               eod_token=getattr(args, "eod_token", None))


def lr_schedule(optimizer, args):
    """Megatron's AnnealingLR from the flags."""
    return AnnealingLR(optimizer, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_steps,
                       decay_steps=args.lr_decay_steps, decay_style=args.lr_decay_style,
                       global_batch_size=args.batch_schedule.global_batch_size(0),
                       use_checkpoint_lr_scheduler=args.use_checkpoint_lr_scheduler,
                       override_lr_scheduler=args.override_lr_scheduler)


def setup_hf_model(args, on_auto_decision=None, model=None):
    """(engine, lr schedule, the transformers model) of --hf-model's folder (pipe/hf/engine.py); `model`: that
    model already loaded ("auto"'s rebuild: the same weights object), `on_auto_decision` as below."""
    from megatron_ds.pipe.hf.engine import build_engine  # lazy: transformers, only for --hf-model runs
    print_rank_0(f"> building the Hugging Face model of {args.hf_model} ...")
    settings = args.pipeline_settings
    engine, model = build_engine(args.hf_model if model is None else model, args.ds_config, settings,
                                 args.pipeline_model_parallel_size, args.data_parallel_size,
                                 lambda module: build_optimizer(module, args),
                                 lambda optimizer: lr_schedule(optimizer, args),
                                 activation_checkpoint_interval=args.activation_checkpoint_interval,
                                 seq_length=args.seq_length, cp=args.context_parallel_size,
                                 comm_type=args.cp_comm_type, on_auto_decision=on_auto_decision,
                                 planned=(args.pipeline_plan, args.auto_plan) if settings.auto else None)
    starts = f" (memory_budget {args.auto_plan.budget_text}; starts on {args.pipeline_plan.settings.schedule})" \
        if settings.auto else ""
    layout = getattr(engine.module, "context_layout", None)
    cp = f"; each sequence over {layout.size} context-parallel ranks ({args.cp_comm_type})" if layout else ""
    print_rank_0(f"> pipeline engine: {type(engine).__name__}, schedule {settings.schedule}{starts}; "
                 f"{type(model).__name__} from {args.hf_model}{cp}")
    return engine, engine.lr_scheduler, model


def check_hf_vocabulary(tokenizer, model, args):
    """The tokenizer's ids must be rows of the model's embedding."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ArgumentsError(f"--hf-model {args.hf_model}: the tokenizer ({args.tokenizer_name_or_path}) has "
                             f"{tokenizer.vocab_size} tokens, the model's embedding {model.config.vocab_size} rows")


def setup_model_and_optimizer(args, on_auto_decision=None):
    """(engine, lr schedule); `on_auto_decision`: an "auto" run's hook (auto_schedule.AutoSchedule.report)."""
    print_rank_0("> building GPT model ...")
    config = model_config(args)
    module = build_pipeline_module(config, args.ds_config, args.pipeline_model_parallel_size,
                                   activation_checkpoint_interval=args.activation_checkpoint_interval,
                                   seq_length=args.seq_length, settings=args.pipeline_settings,
                                   plan=args.pipeline_plan)
    optimizer = build_optimizer(module, args)
    lr_scheduler = lr_schedule(optimizer, args)
    engine = initialize_engine(module, args.ds_config, optimizer=optimizer, lr_scheduler=lr_scheduler,
                               settings=args.pipeline_settings, auto_plan=args.auto_plan,
                               on_auto_decision=on_auto_decision)
    print_rank_0(engine_line(type(engine).__name__, args.pipeline_settings, args.pipeline_plan, args.auto_plan,
                             config))
    return engine, lr_scheduler


def engine_line(engine, settings, plan, auto_plan=None, config=None):
    """The start-up line: the engine and the schedule as the ds_config names it (with its overlapped units per
    rank, ranks 0, 1, ... where they differ), then what the plan runs that the name does not say: "auto"'s budget and the schedule it starts on, Seq1F1B's segments, vocabulary parallelism,
    a schedule file's simulated makespan; and packed documents (`config`'s flags)."""
    line = f"> pipeline engine: {engine}, schedule {settings.schedule}"
    if plan is not None and plan.schedule.overlap:
        counts = sorted({len(positions) for positions in plan.schedule.overlap})
        per_rank = counts[0] if len(counts) == 1 else [len(positions) for positions in plan.schedule.overlap]
        line += f" (overlapped F/B units: {per_rank} per rank)"
    if config is not None and config.packs_documents:
        flags = [name for name, on in (("positions restart", config.reset_position_ids),
                                       ("attention within documents", config.reset_attention_mask),
                                       ("EOD predictions not scored", config.eod_mask_loss)) if on]
        line += f"; packed documents ending at token {config.eod_token}: {', '.join(flags)}"
    if plan is None:  # DeepSpeed's own engine
        return line
    sched, more = plan.schedule, []
    if auto_plan is not None:
        more.append(f"memory_budget {auto_plan.budget_text}; starts on {plan.settings.schedule}")
    if config is not None and (config.recompute_granularity or (auto_plan is not None and auto_plan.knobs)):
        more.append(f"recompute {Recompute.of(config).label}" + (" (auto_recompute: the least under which a start-up "
                                                                 "schedule fits)" if auto_plan is not None else ""))
    if sched.seq_splits > 1:
        more.append(f"seq_splits {sched.seq_splits}, segment lengths {list(plan.segment_lengths)} tokens")
    if plan.settings.vocab_parallel:
        more.append(f"vocabulary parallel (embedding and output layer sliced over the {plan.pp} pipeline ranks)")
    if settings.file:
        result = simulate(sched)
        more.append(f"{sched.name!r} from the file, pp {sched.pp}, {sched.micro_batches} micro-batches: simulated "
                    f"makespan {result.makespan:g} (TF = TB = TW = 1), bubble {result.bubble_ratio:.3f}")
    return line + "".join(f"; {part}" for part in more)
