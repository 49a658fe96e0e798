"""--log-level (BigScience's flags), what the ranks print, and --profile (Megatron-LM's torch.profiler window).

Log levels set Python logging for DeepSpeed, codecarbon and the root logger on every rank: rank 0 takes
--log-level, the other ranks --log-level-replica (default: the same). "passive" leaves the libraries' own
levels alone. Above "info", rank 0 also skips the argument dump.

tidy_output(rank), first thing on a rank: every print of the rank leaves in one write, a whole line (under
`python -u`, as torchrun and the deepspeed launcher start the ranks, print() writes the text and its newline
apart, and another rank's line landed between them); and the ranks other than 0 keep to themselves what
every process says the same (DeepSpeed's guess of the accelerator, torch's and DeepSpeed's deprecation
warnings about each other's code): rank 0 says it once.

--profile records iterations --profile-step-start + 1 .. --profile-step-end (Megatron-LM's counting:
profiling starts once `start` iterations are done) on --profile-ranks with torch.profiler, CPU plus CUDA
when there is a GPU, and writes one Chrome/Perfetto trace per rank. The pipeline engine names each
schedule op it runs (F0, B1, W1, ... as in its own traces) with record_function while the profiler
records, so the op names sit above their kernels on the same timeline.
"""
import io
import logging
import os
import sys
import warnings

from megatron_ds.files import write_atomic

from ..errors import ArgumentsError

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL, "passive": None}


def add_observability_args(parser):
    g = parser.add_argument_group("log levels and profiling")
    g.add_argument("--log-level", choices=list(LEVELS), default="passive",
                   help="Python logging level on rank 0 (DeepSpeed, codecarbon, ...); above info also "
                        "skips the argument dump; passive: leave the libraries' levels alone")
    g.add_argument("--log-level-replica", choices=list(LEVELS), default=None,
                   help="the same for every other rank (default: --log-level)")
    g.add_argument("--profile", action="store_true", help="torch.profiler over a window of iterations")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="profile from the iteration after this many are done (Megatron-LM)")
    g.add_argument("--profile-step-end", type=int, default=12, help="... up to and including this iteration")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks that profile")
    g.add_argument("--profile-dir", default=None,
                   help="where the traces go (default: --tensorboard-dir, else ./profile)")


def check_observability_args(args):
    if args.profile:
        if not 0 <= args.profile_step_start < args.profile_step_end:
            raise ArgumentsError(f"--profile-step-start {args.profile_step_start} and --profile-step-end "
                                 f"{args.profile_step_end}: need 0 <= start < end")
        bad = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
        if bad:
            raise ArgumentsError(f"--profile-ranks {bad[0]}: not a rank of this run (world size {args.world_size})")
    if args.log_level_replica is None:
        args.log_level_replica = args.log_level


def apply_log_level(args, rank):
    """Set the levels; returns whether rank 0's informational output (the argument dump) is wanted."""
    level = LEVELS[args.log_level if rank == 0 else args.log_level_replica]
    if level is not None:
        from deepspeed.utils import logger as ds_logger  # DeepSpeed sets its own level when imported
        for logger in (ds_logger, logging.getLogger("DeepSpeed"), logging.getLogger("codecarbon"),
                       logging.getLogger()):
            logger.setLevel(level)
    return level is None or level <= logging.INFO


# What each process of a run says the same: DeepSpeed's accelerator guess at its import (a warning on every
# rank), and deprecation warnings raised in torch's or DeepSpeed's own modules (DeepSpeed's ZeRO calls
# torch.distributed.all_gather_into_tensor, which torch 2.13 deprecates, on every rank)
REPEATED_LOGS = ("Setting accelerator to CPU",)
REPEATED_WARNINGS = ((FutureWarning, r"(torch|deepspeed)(\.|$)"), (DeprecationWarning, r"(torch|deepspeed)(\.|$)"))


class _Repeated(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith(REPEATED_LOGS)


def tidy_output(rank):
    """Whole lines on stdout and stderr; on ranks other than 0, none of what every rank says the same."""
    for stream in (sys.stdout, sys.stderr):
        if type(stream) is io.TextIOWrapper:  # the process's own (a capture reads its buffer unflushed)
            stream.reconfigure(line_buffering=True, write_through=False)
    if rank != 0:
        ds_logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed sets up when imported
        if not any(isinstance(f, _Repeated) for f in ds_logger.filters):
            ds_logger.addFilter(_Repeated())
        for category, module in REPEATED_WARNINGS:
            warnings.filterwarnings("ignore", category=category, module=module)


class Profile:
    """torch.profiler around iterations (start, end] on the chosen ranks; a no-op elsewhere."""

    def __init__(self, args, rank):
        self.prof = None
        self.active = bool(args.profile) and rank in args.profile_ranks
        self.start, self.end = args.profile_step_start, args.profile_step_end
        directory = args.profile_dir or args.tensorboard_dir or "profile"
        self.path = os.path.join(directory, f"profile_rank{rank:05d}_iterations{self.start + 1}-{self.end}.json")

    def before_iteration(self, done):
        """Call with the number of iterations done, before running the next one."""
        if not self.active:
            return
        if done == self.start and self.prof is None:
            import torch
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.start()
        elif done == self.end:
            self.stop()

    def stop(self):
        if self.prof is None:
            return
        self.prof.stop()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        write_atomic(self.path, self.prof.export_chrome_trace, suffix=".json")
        self.prof, self.active = None, False
        print(f"profile of iterations {self.start + 1}-{self.end} written to {self.path}", flush=True)
