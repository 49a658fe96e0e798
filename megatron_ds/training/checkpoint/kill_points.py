"""Fault injection for the moments of a save: MEGATRON_DS_KILL_DURING_SAVE=ITER:RANK[:MOMENT].

SIGKILLs rank RANK ("*": every rank) at MOMENT of the save of iteration ITER, so that tests can show what each
moment leaves on disk and that the next start resumes from the last committed step:

- copied: after the host copy, before the background writer writes any file (--async-save);
- writing: in the middle of the background write, after its first file (the default, the old two-field form);
- written: after every file of the rank is written and fsynced, before the ranks agree to commit (--async-save);
- agreed: after the ranks agreed the step is whole, before its manifest and `latest` are written (either path);
- deleting: in the middle of --keep-last-checkpoints' deletion of step ITER (rank 0 deletes), after the folder
  was renamed to its hidden name and its first file removed.
"""
import os
import signal

ENV = "MEGATRON_DS_KILL_DURING_SAVE"
MOMENTS = ("copied", "writing", "written", "agreed", "deleting")


def parse(spec):
    """(iteration, rank or "*", moment) of a spec, None when unset; ValueError names what is wrong."""
    if not spec:
        return None
    parts = [p.strip() for p in spec.split(":")]
    if len(parts) not in (2, 3) or not parts[0].isdigit() or not (parts[1] == "*" or parts[1].isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected ITER:RANK[:MOMENT], RANK a number or *")
    moment = parts[2] if len(parts) == 3 else "writing"
    if moment not in MOMENTS:
        raise ValueError(f"{ENV}={spec!r}: the moment is one of {', '.join(MOMENTS)}")
    return int(parts[0]), parts[1], moment


def due(moment, iteration, rank):
    found = parse(os.environ.get(ENV, ""))
    if found is None:
        return False
    it, r, m = found
    return m == moment and it == iteration and (r == "*" or int(r) == rank)


def maybe_kill(moment, iteration, rank):
    """SIGKILL this process if the spec names this moment, iteration and rank."""
    if due(moment, iteration, rank):
        os.kill(os.getpid(), signal.SIGKILL)
