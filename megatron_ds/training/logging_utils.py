"""What a run tells the user: Megatron's log lines, TensorBoard, codecarbon, a loss-curve PNG.

Log lines keep Megatron's field names and number formats so that existing log
parsers work (`lm loss: 1.234567E+00`). Like Megatron, iteration lines and the
TensorBoard writer live on the last rank (last pipeline stage, which computes
the loss); messages about setup come from rank 0.
"""
import json
import logging
import math
import os
import shutil
import socket
import sys
import time

from megatron_ds.data.dist_utils import print_rank_0, rank_and_world
from megatron_ds.files import write_atomic
from megatron_ds.schedules.flops import model_flops_per_sequence

from .device_peak import this_device_peak


def is_last_rank():
    rank, world = rank_and_world()
    return rank == world - 1


def print_rank_last(message):
    if is_last_rank():
        print(message, flush=True)


class Timers:
    """Named wall-clock timers; elapsed() returns seconds since the last reset, names() those that ran since."""

    def __init__(self):
        self._elapsed, self._started = {}, {}

    def start(self, name):
        self._started[name] = time.perf_counter()

    def stop(self, name):
        begun = self._started.pop(name, None)
        if begun is not None:
            self._elapsed[name] = self._elapsed.get(name, 0.0) + time.perf_counter() - begun

    def elapsed(self, name, reset=True):
        return self._elapsed.pop(name, 0.0) if reset else self._elapsed.get(name, 0.0)

    def names(self):
        return sorted(self._elapsed)


def tflops(args, batch_size, seconds_per_iteration):
    """Model TFLOP/s per GPU/process: the model's FLOPs as schedules/flops.py counts them (GQA,
    SwiGLU, the untied head's GEMM, causal attention's half; 4 passes with activation recompute).
    The world is TP x CP x PP x DP processes, so tensor and context parallelism are divided out too."""
    if seconds_per_iteration <= 0:
        return 0.0
    flops = batch_size * model_flops_per_sequence(args, args.seq_length, recompute=args.checkpoint_activations)
    return flops / (seconds_per_iteration * args.world_size * 1e12)


def mfu(tflops_value, peak):
    """Model FLOPs utilisation in percent of the device's bf16 peak (None when the peak is unknown)."""
    return None if not peak else 100.0 * tflops_value / peak


def iteration_line(*, iteration, train_iters, consumed_samples, consumed_tokens, ms_per_iteration, learning_rate,
                   global_batch_size, losses, loss_scale, grad_norm, skipped, nan, samples_per_second, tflops_value,
                   mfu_value=None):
    """One Megatron iteration line; `losses` maps a name ('lm loss') to its interval mean."""
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" consumed tokens: {consumed_tokens:12d} |"
    line += f" elapsed time per iteration (ms): {ms_per_iteration:.1f} |"
    line += f" learning rate: {learning_rate:.3E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for name, value in losses.items():
        line += f" {name}: {value:.6E} |"
    if loss_scale is not None:
        line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan:3d} |"
    line += f" samples per second: {samples_per_second:.3f} |"
    line += f" TFLOPs: {tflops_value:.2f} |"
    if mfu_value is not None:
        line += f" MFU: {mfu_value:.1f}% |"
    return line


def perplexity(loss):
    return math.exp(min(20.0, loss))


def validation_block(prefix, loss):
    """Megatron's framed validation result."""
    text = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E} | "
    bar = "-" * (len(text) + 1)
    return f"{bar}\n{text}\n{bar}"


class TensorBoard:
    """SummaryWriter on the last rank only (None elsewhere, or without --tensorboard-dir)."""

    def __init__(self, args):
        self.writer = None
        self.args = args
        self.peak = this_device_peak()  # the log line's MFU reads it too
        if args.tensorboard_dir and is_last_rank():
            from torch.utils.tensorboard import SummaryWriter
            os.makedirs(args.tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
            self.writer.add_text("arguments", "\n".join(f"    {k}: {v}" for k, v in sorted(vars(args).items())
                                                        if k not in ("ds_config", "batch_schedule")), 0)
            self.writer.add_text("ds_config", "    " + json.dumps(args.ds_config, indent=2).replace("\n", "\n    "), 0)

    def scalar(self, tag, value, iteration):
        if self.writer is not None:
            self.writer.add_scalar(tag, value, iteration)

    def training(self, iteration, consumed_samples, consumed_tokens, loss, lr, batch_size, grad_norm,
                 samples_per_second, tokens_per_second, ms_per_iteration, loss_scale=None):
        """BigScience's tags: each value per step, vs samples and vs tokens, plus steps-vs-samples/tokens."""
        w = self.writer
        if w is None:
            return

        def three(tag, value):
            w.add_scalar(tag, value, iteration)
            w.add_scalar(f"{tag} vs samples", value, consumed_samples)
            w.add_scalar(f"{tag} vs tokens", value, consumed_tokens)
        w.add_scalar("steps-vs-samples/y=steps,x=samples", iteration, consumed_samples)
        w.add_scalar("steps-vs-samples/y=samples,x=steps", consumed_samples, iteration)
        w.add_scalar("steps-vs-tokens/y=steps,x=tokens", iteration, consumed_tokens)
        w.add_scalar("steps-vs-tokens/y=tokens,x=steps", consumed_tokens, iteration)
        three("lm-loss-training/lm loss", loss)
        three("learning-rate/learning-rate", lr)
        if self.args.log_batch_size_to_tensorboard:
            three("batch-size/batch-size", batch_size)
        if grad_norm is not None:
            three("grad-norm/grad-norm", grad_norm)
        if loss_scale is not None:
            three("loss-scale/loss-scale", loss_scale)
        three("iteration-time/iteration-time", ms_per_iteration / 1000.0)
        dp = self.args.data_parallel_size
        w.add_scalar("iteration-time/samples per second", samples_per_second, iteration)
        w.add_scalar("iteration-time/samples per second per replica", samples_per_second / dp, iteration)
        w.add_scalar("iteration-time/tokens per second", tokens_per_second, iteration)
        w.add_scalar("iteration-time/tokens per second per replica", tokens_per_second / dp, iteration)
        model_tflops = tflops(self.args, batch_size, ms_per_iteration / 1000.0)
        w.add_scalar("iteration-time/TFLOPs per gpu (estimated)", model_tflops, iteration)
        if self.peak:
            w.add_scalar("iteration-time/MFU (percent of bf16 peak)", mfu(model_tflops, self.peak), iteration)

    def timers(self, timers, iteration, normalizer=1.0):
        """Seconds per iteration spent in each timer that ran since the last call (Megatron's normalizer); a
        timer that did not run logs nothing (no zeros)."""
        for name in timers.names():
            self.timer(name, timers.elapsed(name, reset=True) / normalizer, iteration)

    def timer(self, name, seconds, iteration):
        """timers/NAME-time at `iteration` (--log-timers-to-tensorboard)."""
        if self.writer is not None and self.args.log_timers_to_tensorboard:
            self.writer.add_scalar(f"timers/{name}-time", seconds, iteration)

    def validation(self, iteration, consumed_samples, loss, prefix="lm-loss-validation"):
        w = self.writer
        if w is None:
            return
        tokens = consumed_samples * self.args.seq_length
        for tag, value in (("lm loss validation", loss), ("lm loss validation ppl", perplexity(loss))):
            if tag.endswith("ppl") and not self.args.log_validation_ppl_to_tensorboard:
                continue
            w.add_scalar(f"{prefix}/{tag}", value, iteration)
            w.add_scalar(f"{prefix}/{tag} vs samples", value, consumed_samples)
            w.add_scalar(f"{prefix}/{tag} vs tokens", value, tokens)

    def flush(self):
        if self.writer is not None:
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _iteration_of(line):
    """A record's iteration; None for a line that is no record (one torn by a killed run)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("iteration") if isinstance(record, dict) else None


def cut_metrics(path, iteration):
    """Drop the records of iterations after `iteration` (and torn lines) from `path`, rewritten through a
    temporary file and a rename; returns how many lines went."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines(keepends=True)
    kept = []
    for line in lines:
        at = _iteration_of(line) if line.endswith("\n") else None
        if isinstance(at, int) and at <= iteration:
            kept.append(line)
    if len(kept) == len(lines):
        return 0
    write_atomic(path, "".join(kept))
    return len(lines) - len(kept)


class MetricsFile:
    """One JSON object per iteration, exact floats (repr), from the last rank: for scripts and tests.

    `resumed_at`: the iteration a run restarted with --load continues from; the records after it, which an
    attempt killed before its next save wrote, are dropped first (as TensorBoard's purge_step drops events),
    so that every iteration has one record."""

    def __init__(self, path, resumed_at=None):
        self.file = None
        if path and is_last_rank():
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            dropped = cut_metrics(path, resumed_at) if resumed_at is not None else 0
            if dropped:
                print(f"{path}: dropped {dropped} lines of an earlier attempt (iterations after {resumed_at}, "
                      "which the checkpoint this run resumed from does not hold)", flush=True)
            self.file = open(path, "a")

    def write(self, **record):
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None


class CodeCarbon:
    """codecarbon's offline emissions tracker, once per machine: its "machine" mode measures the whole node, so
    one tracker per rank would count the node once per rank. The first local rank of each node runs it, writing
    emissions-HOSTNAME.csv; it starts before the model is built, so the start-up is counted too."""

    def __init__(self, directory, country_iso_code, local_rank=0):
        self.tracker = None
        if not directory or local_rank != 0:
            return
        try:
            from codecarbon import OfflineEmissionsTracker
        except ImportError:
            print_rank_0("WARNING: --codecarbon-dir given but codecarbon is not installed; no emissions tracking")
            return
        os.makedirs(directory, exist_ok=True)
        logging.getLogger("codecarbon").setLevel(logging.ERROR)  # its start-up chatter, once per node
        host = socket.gethostname()
        try:
            self.tracker = OfflineEmissionsTracker(
                output_dir=directory, output_file=f"emissions-{host}.csv", country_iso_code=country_iso_code,
                log_level="error", measure_power_secs=60, save_to_file=True, project_name=f"megatron_ds-{host}")
            self.tracker.start()
        except Exception as e:  # noqa: BLE001 - tracking must never stop training
            print(f"WARNING: {host}: codecarbon could not start ({e}); no emissions tracking", flush=True)
            self.tracker = None

    def flush(self):
        if self.tracker is not None:
            try:
                self.tracker.flush()
            except Exception as e:  # noqa: BLE001
                print(f"WARNING: codecarbon flush failed: {e}", flush=True)

    def stop(self):
        if self.tracker is not None:
            try:
                self.tracker.stop()
            except Exception as e:  # noqa: BLE001
                print(f"WARNING: codecarbon stop failed: {e}", flush=True)
            self.tracker = None


def write_loss_curve(path, train_points, valid_points, title="GPT pretraining"):
    """PNG of training loss (per iteration) and validation loss, with matplotlib's Agg backend."""
    if not path or not train_points:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    its, losses = zip(*train_points)
    window = max(1, len(losses) // 30)
    ax.plot(its, losses, lw=0.8, alpha=0.35 if window > 1 else 1.0, color="C0",
            label="train lm loss" if window == 1 else "train lm loss (per iteration)")
    if window > 1:
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                  for i in range(len(losses))]
        ax.plot(its, smooth, lw=1.8, color="C0", label=f"train lm loss (mean of {window})")
    if valid_points:
        v_its, v_losses = zip(*valid_points)
        ax.plot(v_its, v_losses, "o-", ms=4, lw=1.2, color="C1", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def progress_bar(total, initial):
    """A tqdm bar on the last rank when stderr is a terminal (log files stay clean)."""
    if not (is_last_rank() and sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    width = shutil.get_terminal_size((100, 20)).columns or 100  # a pty may report 0 columns
    return tqdm(total=total, initial=initial, unit="it", ncols=min(width, 120), leave=False)
