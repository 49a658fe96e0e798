"""--exit-signal-handler's listener notes SIGUSR1 and SIGTERM without stopping the process; the loop and
the ranks' agreement are shown in test_out_of_room.py (SIGUSR1 to one rank of an srun-like launch)."""
import os
import signal

from megatron_ds.training.faults.exit_signal import SIGNALS, Listener


def test_listener_notes_the_first_signal_and_only_when_enabled():
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        assert Listener(False).received is None and signal.getsignal(signal.SIGUSR1) is before[signal.SIGUSR1]
        listener = Listener(True)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # still alive: noted, not acted on
        assert listener.received == "SIGUSR1"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
