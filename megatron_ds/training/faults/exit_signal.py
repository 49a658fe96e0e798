"""--exit-signal-handler: on SIGTERM or SIGUSR1, save a checkpoint at the current iteration and exit 0.

As Megatron's flag: the handler only notes the signal; the loop looks at iteration boundaries, and the
ranks agree through an all-reduce (any rank's signal counts), so every rank saves the same iteration
together even when the signal reached one of them alone. SIGUSR1 is what SLURM sends ahead of the time
limit (`#SBATCH --signal=USR1@120`), SIGTERM what it sends at the limit and what `scancel` and torchrun's
own shutdown send.
"""
import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def add_exit_signal_args(parser):
    g = parser.add_argument_group("signals")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1 (SLURM's warning before the time limit), save a checkpoint at "
                        "the current iteration and exit 0 (Megatron)")


class Listener:
    """Notes the first of SIGNALS this process receives (installed only with --exit-signal-handler)."""

    def __init__(self, enabled):
        self.received = None
        self.enabled = enabled
        if enabled:
            for sig in SIGNALS:
                signal.signal(sig, self._note)

    def _note(self, signum, frame):
        self.received = self.received or signal.Signals(signum).name
