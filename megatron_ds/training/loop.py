"""The pretraining loop (Megatron-DeepSpeed's `pretrain`), over the pipeline engine.

Order of one iteration, as in Megatron: apply the batch size of the ramp-up,
engine.train_batch() (forward, backward, ZeRO-1 reduction, optimizer step, lr
step), log, evaluate every --eval-interval, save every --save-interval, exit on
--exit-interval / --exit-duration-in-mins / --kill-switch-path (saving first).

Everything that decides the next iteration's numbers is restored on --load: the
weights, optimizer and lr schedule (DeepSpeed), the iteration and the consumed
samples (so the data samplers resume at the next sample), and the RNG states
(restored last, after everything that could draw from them is built).
"""
import os
import sys
import time
import warnings

from megatron_ds.data.dist_utils import print_rank_0
from megatron_ds.data.samplers import MicroBatchIterator, build_datasets
from megatron_ds.errors import UserError, report_stop

from .config.arguments import ArgumentsError, parse_args, print_args
from .config.document_args import eod_token
from .config.observability import Profile, apply_log_level, tidy_output
from .config.parallel_args import rank_coordinates
from .faults import exit_signal, out_of_memory, timeouts
from .faults.nonfinite import EXIT_CODE as NONFINITE_EXIT_CODE, NanGuard, NonFiniteStop
from .logging_utils import (CodeCarbon, MetricsFile, TensorBoard, Timers, is_last_rank, iteration_line,
                            mfu, print_rank_last, progress_bar, tflops, validation_block, write_loss_curve)


# --------------------------------------------------------------------------- loop

def _agree_to_exit(flag):
    """Every rank exits together: the flag of any rank counts (an all-reduce MAX)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def evaluate(engine, data_iterator, eval_iters):
    total = 0.0
    for _ in range(eval_iters):
        total += float(engine.eval_batch(data_iterator))
    return total / max(1, eval_iters)


class Cadence:
    """When the loop saves and evaluates: each owns its interval, and neither runs twice for one iteration.
    A save is due every --save-interval iterations and at the end (`last`); a run resumed from its own --save
    folder already has its first iteration on disk; a save skipped for lack of room (--keep-training-on-disk-full)
    is tried again at the next one. Validation is due every --eval-interval iterations and at the end,
    unless it just ran."""

    def __init__(self, args, iteration, validates: bool):
        self.save_dir, self.save_interval = args.save, args.save_interval
        self.validates, self.eval_interval = validates, args.eval_interval
        same_dir = args.load and args.save and os.path.abspath(args.load) == os.path.abspath(args.save)
        self.last_saved = iteration if same_dir and iteration > 0 else None
        self.last_evaluated = None

    def save_due(self, step: int, last: bool = False) -> bool:
        every = bool(self.save_interval) and step % self.save_interval == 0
        return bool(self.save_dir) and self.last_saved != step and (last or every)

    def eval_due(self, step: int, last: bool = False) -> bool:
        every = bool(self.eval_interval) and step % self.eval_interval == 0
        return self.validates and self.last_evaluated != step and (last or every)


class Trainer:

    def __init__(self, args, engine, lr_scheduler, state, train_ds, valid_ds, test_ds, codecarbon=None):
        self.args, self.engine, self.lr_scheduler = args, engine, lr_scheduler
        self.iteration = state["iteration"]
        self.consumed_train = state["consumed_train_samples"]
        self.consumed_valid = state["consumed_valid_samples"]
        # the replica whose samples this rank reads: under context parallelism its data-axis rank // CP (the CP
        # ranks of a replica read the same samples; pipe/parallel/context_parallel.py)
        self.dp_rank = engine.grid.get_data_parallel_rank() // getattr(args, "context_parallel_size", 1)
        self.train_iter = MicroBatchIterator(train_ds, self.consumed_train, args, self.dp_rank)
        self.valid_ds, self.test_ds = valid_ds, test_ds
        self.valid_iter = (MicroBatchIterator(valid_ds, self.consumed_valid, args, self.dp_rank)
                           if valid_ds is not None and args.eval_iters > 0 else None)
        self.cadence = Cadence(args, self.iteration, validates=self.valid_iter is not None)
        self.timers = Timers()
        self.tb = TensorBoard(args)
        from .checkpoint.saves import Saves  # lazy: DeepSpeed loads after the flags are checked
        self.saves = Saves(args, self.tb, state.get("loaded_tag"))
        self.metrics = MetricsFile(args.metrics_file, self.iteration if args.load and not args.finetune else None)
        self.codecarbon = codecarbon or CodeCarbon(None, None)  # started by pretrain, before the model
        self.train_points, self.valid_points = [], []
        self.bar = None
        self.current_gbs = None
        self.start_time = time.time()
        self.nan_guard = NanGuard(args, engine, lambda: self.iteration + 1)
        self.auto = None  # "schedule": "auto": its decision for the checkpoints (training/auto_schedule.py)
        self.hf_model = None  # --hf-model's transformers model ("auto"'s rebuild cuts it again)
        self.signals = exit_signal.Listener(args.exit_signal_handler)
        self.compile_logged = False  # compiled layers: the compile time is logged once, after the first steps
        self.first_iteration, self.after_first = None, [0.0, 0]  # its wall time (s); the later ones' sum, count

    # ---- pieces

    def _apply_batch_size(self):
        gbs = self.args.batch_schedule.global_batch_size(self.consumed_train)
        if gbs != self.current_gbs:
            # DeepSpeed counts each context-parallel rank as a data-parallel one (pipe/parallel/context_parallel.py)
            counted = gbs * getattr(self.args, "context_parallel_size", 1)
            if counted != self.engine.train_batch_size():
                self.engine.set_train_batch_size(counted)
            self.lr_scheduler.global_batch_size = gbs
            self.current_gbs = gbs
        return gbs

    def maybe_save(self, last=False):
        """Save this iteration if the cadence says so (every --save-interval, and at the end: `last`); a save in
        flight in the background is committed first once every rank's writer is done (checkpoint/saves.py)."""
        self.saves.poll()
        if self.saves.refused is not None and self.saves.refused == self.cadence.last_saved:
            self.cadence.last_saved = None  # its background save found no room: the end of training tries again
        if not self.cadence.save_due(self.iteration, last):
            return
        self.timers.start("save-checkpoint")  # the time training stopped (under --async-save: the host copy)
        saved = self.saves.save(self.engine, self.args, self.iteration, self.consumed_train, self.consumed_valid,
                                self.auto.checkpoint_files(self.iteration) if self.auto else ())
        self.timers.stop("save-checkpoint")
        if saved is not False:  # not saved for lack of room (--keep-training-on-disk-full): the next save tries again
            self.cadence.last_saved = self.iteration
        self.codecarbon.flush()

    def maybe_validate(self, prefix, last=False):
        """Validate on --eval-iters batches if the cadence says so (every --eval-interval, and at the end)."""
        if not self.cadence.eval_due(self.iteration, last):
            return
        loss, used = self.evaluate_and_print(prefix, self.valid_iter, self.args.eval_iters)
        self.consumed_valid += used
        self.valid_points.append((self.iteration, loss))
        self.cadence.last_evaluated = self.iteration

    def evaluate_and_print(self, prefix, data_iterator, eval_iters, tb_prefix="lm-loss-validation"):
        self.timers.start("evaluate")
        gbs = self.current_gbs or self.args.batch_schedule.global_batch_size(self.consumed_train)
        loss = evaluate(self.engine, data_iterator, eval_iters)
        self.timers.stop("evaluate")
        self.tb.timer("evaluate", self.timers.elapsed("evaluate"), self.iteration)  # at the evaluation's iteration
        if self.bar is not None:  # tqdm clears its bar line first
            self.bar.write(validation_block(prefix, loss))
        else:
            print_rank_last(validation_block(prefix, loss))
        self.tb.validation(self.iteration, self.consumed_train, loss, prefix=tb_prefix)
        return loss, gbs * eval_iters

    def _should_exit(self):
        args = self.args
        reason = None
        if args.exit_interval and self.iteration % args.exit_interval == 0:
            reason = f"exiting program at iteration {self.iteration} (--exit-interval {args.exit_interval})"
        local = False
        if args.exit_duration_in_mins is not None:
            local = (time.time() - self.start_time) / 60.0 > args.exit_duration_in_mins
        if args.kill_switch_path:
            local = local or os.path.exists(args.kill_switch_path)
        if (args.exit_duration_in_mins is not None or args.kill_switch_path) and _agree_to_exit(local):
            reason = reason or f"exiting program at iteration {self.iteration} (time limit or kill switch)"
        if args.exit_signal_handler and _agree_to_exit(self.signals.received is not None):
            reason = reason or (f"exiting program at iteration {self.iteration} after receiving "
                                f"{self.signals.received or 'a signal on another rank'} (--exit-signal-handler)")
        return reason

    # ---- the loop

    def train(self):
        args, engine = self.args, self.engine
        interval = {"loss": 0.0, "count": 0, "nan": 0, "skipped": 0, "time": 0.0, "iters": 0}
        bar = self.bar = progress_bar(args.train_iters, self.iteration)
        profile = Profile(args, args.rank)
        skipped_before = engine.skipped_steps
        print_rank_0(f"training ... from iteration {self.iteration} to {args.train_iters}")
        exit_reason = None
        while self.iteration < args.train_iters:
            profile.before_iteration(self.iteration)
            gbs = self._apply_batch_size()
            self.timers.start("train-step")
            start = time.perf_counter()
            loss = float(engine.train_batch(self.train_iter))
            elapsed = time.perf_counter() - start
            self.timers.stop("train-step")
            if self.first_iteration is None:
                self.first_iteration = elapsed
                units = getattr(engine, "overlapped_units_run", 0)  # DeepSpeed's engine runs none
                if units:  # what the start-up line planned, confirmed
                    print_rank_0(f"> overlapped F/B units run in the first iteration: {units} on rank 0")
            elif not self.compile_logged:
                self.after_first[0] += elapsed
                self.after_first[1] += 1
            self.iteration += 1
            self.consumed_train += gbs
            skipped = engine.skipped_steps - skipped_before
            skipped_before = engine.skipped_steps
            grad_norm = engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
            lr = self.lr_scheduler.get_last_lr()[0]
            loss_scale = getattr(engine.optimizer, "cur_scale", None) if args.fp16 else None
            is_nan = self.nan_guard.observe(loss, grad_norm, skipped)
            interval["time"] += elapsed
            interval["iters"] += 1
            interval["skipped"] += skipped
            interval["nan"] += int(is_nan)
            if not is_nan and not skipped:
                interval["loss"] += loss
                interval["count"] += 1
                self._router_metrics(engine, interval)
            tokens_per_s = gbs * args.seq_length / elapsed if elapsed > 0 else 0.0
            self.tb.training(self.iteration, self.consumed_train, self.consumed_train * args.seq_length, loss, lr,
                             gbs, grad_norm, gbs / elapsed if elapsed > 0 else 0.0, tokens_per_s,
                             elapsed * 1000.0, loss_scale)
            self.metrics.write(iteration=self.iteration, consumed_samples=self.consumed_train, loss=loss, lr=lr,
                               grad_norm=grad_norm, global_batch_size=gbs, skipped=skipped, time_s=elapsed)
            self.train_points.append((self.iteration, loss))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
            if self.iteration % args.log_interval == 0:
                self._log(interval, gbs, lr, grad_norm, loss_scale, bar)
                interval = {"loss": 0.0, "count": 0, "nan": 0, "skipped": 0, "time": 0.0, "iters": 0}
            self.maybe_validate(f"iteration {self.iteration}")
            self.maybe_save()
            if self.auto is not None and self.auto.reported is not None:
                self._take_auto_decision()
                args, engine = self.args, self.engine
            exit_reason = self._should_exit() or self.nan_guard.stop_reason()
            if exit_reason:
                break
        profile.stop()
        if bar is not None:
            bar.close()
        self.bar = None
        return exit_reason

    def _take_auto_decision(self):
        """"auto"'s decision: logged; where it places the chunks otherwise, the run's settings, engine and lr
        schedule of the chosen schedule (rebuilt through a checkpoint) replace this trainer's."""
        from . import auto_schedule  # lazy: as in pretrain (torch); only a run under "auto" gets here
        report = self.auto.take(self.iteration, self.tb)
        if not report.rebuild:
            return
        self.args, self.engine, self.lr_scheduler = auto_schedule.rebuild(self.args, self.engine, report.decision,
                                                                          self.hf_model)
        self.nan_guard = NanGuard(self.args, self.engine, lambda: self.iteration + 1)
        self.current_gbs = None  # the new engine takes the batch size of the ramp-up again

    def _router_metrics(self, engine, interval):
        """A MoE step's router losses (summed over the interval, logged as its mean beside the lm loss, as
        Megatron does) and its worst layer's expert load (max / mean tokens per expert), to TensorBoard."""
        metrics = getattr(engine, "router_metrics", None)
        if not metrics:
            return
        router = interval.setdefault("router", {})
        for name in ("load_balancing_loss", "z_loss"):
            if name in metrics:
                router[name] = router.get(name, 0.0) + metrics[name]
                self.tb.scalar(f"moe/{name}", metrics[name], self.iteration)
        for layer, load in metrics["expert_load"].items():
            self.tb.scalar(f"moe/expert_load_max_over_mean/layer_{layer}", load, self.iteration)
        if metrics["expert_load"]:
            router["expert load max/mean"] = router.get("expert load max/mean", 0.0) + max(metrics["expert_load"].values())

    def _log(self, interval, gbs, lr, grad_norm, loss_scale, bar):
        args = self.args
        n = max(1, interval["iters"])  # fewer than --log-interval right after a resume
        seconds = interval["time"] / n
        losses = {"lm loss": interval["loss"] / max(1, interval["count"])}
        losses.update({name: value / max(1, interval["count"]) for name, value in interval.get("router", {}).items()})
        model_tflops = tflops(args, gbs, seconds)
        line = iteration_line(
            iteration=self.iteration, train_iters=args.train_iters, consumed_samples=self.consumed_train,
            consumed_tokens=self.consumed_train * args.seq_length, ms_per_iteration=seconds * 1000.0,
            learning_rate=lr, global_batch_size=gbs, losses=losses, loss_scale=loss_scale, grad_norm=grad_norm,
            skipped=interval["skipped"], nan=interval["nan"],
            samples_per_second=gbs / seconds if seconds > 0 else 0.0, tflops_value=model_tflops,
            mfu_value=mfu(model_tflops, self.tb.peak))
        if bar is not None:
            bar.write(line)
        else:
            print_rank_last(line)
        if not self.compile_logged:
            from megatron_ds.model.compile import compile_summary  # lazy: torch, after the flags are checked
            later = self.after_first[0] / self.after_first[1] if self.after_first[1] else None
            summary = compile_summary(self.first_iteration, later)  # None while nothing compiled (eager runs)
            if summary:
                self.compile_logged = True
                print_rank_0(summary)
        self.tb.timers(self.timers, self.iteration, normalizer=n)
        self.tb.flush()

    def finish(self):
        args = self.args
        self.maybe_validate("the end of training for val data", last=True)
        if self.test_ds is not None and args.eval_iters > 0:
            test_iter = MicroBatchIterator(self.test_ds, 0, args, self.dp_rank)
            self.evaluate_and_print("the end of training for test data", test_iter, args.eval_iters,
                                    tb_prefix="lm-loss-test")

    def close(self):
        if is_last_rank() and self.args.loss_curve and self.train_points:
            path = write_loss_curve(self.args.loss_curve, self.train_points, self.valid_points,
                                    title=f"GPT {self.args.num_layers}L/{self.args.hidden_size}H, "
                                          f"TP={self.args.tensor_model_parallel_size} "
                                          f"PP={self.args.pipeline_model_parallel_size} "
                                          f"DP={self.args.data_parallel_size}")
            print(f"loss curve written to {path}", flush=True)
        self.tb.close()
        self.metrics.close()
        self.codecarbon.stop()


def save_hf_model(engine, model, save_dir, iteration, tokenizer_from):
    """--hf-model: the trained weights as a Hugging Face folder beside the checkpoints (SAVE/hf_iter_N), with the
    tokenizer of `tokenizer_from` (the folder the run's tokenizer was read from: by default --hf-model's)."""
    from megatron_ds.pipe.hf import save_pretrained  # lazy: transformers, only for --hf-model runs
    folder = os.path.join(save_dir, f"hf_iter_{iteration:07d}")
    said = save_pretrained(engine, model, folder, tokenizer_from)
    print_rank_0(f"Hugging Face model saved to {folder} ({said})")


def pretrain(args):
    tidy_output(args.rank)  # before DeepSpeed's import, where every rank says which accelerator it guessed
    # lazy: torch and DeepSpeed load only once the flags are checked (a bad flag fails in a fraction of a second)
    import torch.distributed as dist
    from megatron_ds.data.tokenizer import build_tokenizer
    from megatron_ds.model.tensor_parallel import model_parallel_manual_seed
    from . import auto_schedule
    from .checkpoint.save_load import load_checkpoint
    from .initialize import initialize_distributed, set_random_seed, set_rng_state
    from .model_setup import check_hf_vocabulary, setup_hf_model, setup_model_and_optimizer

    start = time.time()
    # DeepSpeed broadcasts tied weights inside autograd; torch warns once per rank that c10d has no autograd
    # kernel. The gradients are right (tests/pipe compares every one with the single-process reference).
    warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered")
    verbose = apply_log_level(args, args.rank)
    args = initialize_distributed(args)
    rank = args.rank
    codecarbon = CodeCarbon(args.codecarbon_dir, args.codecarbon_country_iso_code, args.local_rank)
    pipeline_rank, _, tensor_rank = rank_coordinates(args, rank)
    seed = set_random_seed(args.seed, pipeline_rank)
    # dropout inside split regions (heads) draws from a stream per tensor rank
    model_parallel_manual_seed(seed, tensor_rank)
    tokenizer = build_tokenizer(args)
    args = args.replace(padded_vocab_size=tokenizer.padded_vocab_size)
    args = args.replace(eod_token=eod_token(tokenizer, args))  # packed documents end at it (None without their flags)
    if rank == 0 and verbose:
        print_args(args)
    # data first: it is cheap, and a bad corpus should fail before minutes of model building
    train_ds, valid_ds, test_ds = build_datasets(args)
    if train_ds is None:
        raise ArgumentsError(f"--split {args.split!r} leaves no documents for training")
    args, auto = auto_schedule.prepare(args)  # a resumed "auto" run builds the schedule its checkpoint chose
    hf_model = None
    if args.hf_model:
        engine, lr_scheduler, hf_model = setup_hf_model(args, on_auto_decision=auto.report if auto else None)
        check_hf_vocabulary(tokenizer, hf_model, args)
    else:
        engine, lr_scheduler = setup_model_and_optimizer(args, on_auto_decision=auto.report if auto else None)
    if auto:
        auto.resume_search(engine)
    timeouts.label_groups(engine.grid, engine.module)
    out_of_memory.watch(args, engine)
    params = sum(p.numel() for p in engine.module.parameters())
    if engine.grid.get_data_parallel_rank() == 0:
        tensor_rank = engine.grid.get_slice_parallel_rank()
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({tensor_rank}, "
              f"{engine.stage_id}), global rank {rank}: {params}", flush=True)
    loading = time.time()
    state = load_checkpoint(engine, args)
    if args.load:
        print_rank_0(f"    load-checkpoint time: {time.time() - loading:.2f} s")
    trainer = Trainer(args, engine, lr_scheduler, state, train_ds, valid_ds, test_ds, codecarbon)
    trainer.auto, trainer.hf_model = auto, hf_model
    if state["rng_state"] is not None:
        set_rng_state(state["rng_state"])  # last: nothing built after this draws from the global RNGs
    dist.barrier()
    print_rank_0(f"[after model, optimizer, data and checkpoint are ready] {time.time() - start:.1f} s")
    try:
        exit_reason = trainer.train()
        trainer.maybe_save(last=True)
        trainer.saves.wait(f"before {exit_reason or 'the end of training'}")
        if hf_model is not None and args.save:
            save_hf_model(trainer.engine, hf_model, args.save, trainer.iteration,  # "auto" may have rebuilt it
                          args.tokenizer_name_or_path)
        if exit_reason:
            print_rank_0(exit_reason)
        else:
            trainer.finish()
        if trainer.nan_guard.stop_reason():
            raise NonFiniteStop(exit_reason)
    finally:
        trainer.close()
    dist.barrier()
    print_rank_0(f"done: {trainer.iteration} iterations, {trainer.consumed_train} samples, "
                 f"{time.time() - start:.1f} s")
    return trainer


def main(argv=None):
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    code = 0
    try:
        pretrain(parse_args(argv))
    except UserError as e:
        report_stop(f"pretrain_gpt.py: error: {e}", rank)
        code = e.exit_code
    except NonFiniteStop:  # every rank stops here, after the checkpoint they saved together
        code = NONFINITE_EXIT_CODE
    except timeouts.CollectiveError as e:
        timeouts.report_and_exit(e, rank)
    except Exception as e:  # noqa: BLE001 - out of memory only; anything else keeps its traceback
        if not out_of_memory.is_out_of_memory(e):
            raise
        out_of_memory.report_and_exit(e, rank)
    dist = sys.modules.get("torch.distributed")  # not imported: no group (a bad flag's path stays torch-free)
    if dist is not None and dist.is_initialized():
        if code:
            _exit_now(code)
        dist.destroy_process_group()
    return code


def entry_point(argv=None):
    """pretrain_gpt.py's and megatron-ds-pretrain's exit: main's code, and once torch.distributed ran, without
    the interpreter's finalisation (see _exit_now; a run that ended well aborted too: -6 after "done:", once
    in a test suite run two files at a time). main itself returns, for callers that train several runs in one
    process."""
    code = main(argv)
    if "torch.distributed" in sys.modules:
        _exit_now(code)
    return code


def _exit_now(code):
    """A stopped run's exit (its checkpoint saved or refused, its error printed) without the interpreter's
    finalisation. There the exception's frames release the engine late, while the process groups' gloo
    threads still run (destroy_process_group shuts the backends down but leaves the threads to the
    objects' destructors), and a rank aborted now and then: -6, "terminate called without an active
    exception", in CI after a NaN stop and after a save that found the disk full; here once in 3 runs of the
    NaN stop, then none in 15 with this exit)."""
    import logging
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
