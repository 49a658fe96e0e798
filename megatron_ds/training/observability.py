"""--log-level (BigScience's flags) and --profile (Megatron-LM's torch.profiler window).

Log levels set Python logging for DeepSpeed, codecarbon and the root logger on every rank: rank 0 takes
--log-level, the other ranks --log-level-replica (default: the same). "passive" leaves the libraries' own
levels alone. Above "info", rank 0 also skips the argument dump.

--profile records iterations --profile-step-start + 1 .. --profile-step-end (Megatron-LM's counting:
profiling starts once `start` iterations are done) on --profile-ranks with torch.profiler, CPU plus CUDA
when there is a GPU, and writes one Chrome/Perfetto trace per rank. The pipeline engine names each
schedule op it runs (F0, B1, W1, ... as in its own traces) with record_function while the profiler
records, so the op names sit above their kernels on the same timeline.
"""
import logging
import os

from .errors import ArgumentsError

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
        tmp = f"{self.path}.tmp{os.getpid()}.json"
        self.prof.export_chrome_trace(tmp)
        os.replace(tmp, self.path)
        self.prof, self.active = None, False
        print(f"profile of iterations {self.start + 1}-{self.end} written to {self.path}", flush=True)
