"""--keep-last-checkpoints N / --keep-every K: which committed steps of --save are deleted after a commit.

Run by rank 0 right after a step is committed (`latest` names it). A committed step is a global_stepN folder
with a manifest and N at most `latest`'s; the last N of them stay, and so do steps at multiples of K, the one
`latest` names and the one this run loaded. Folders without a manifest (a save a crash cut short, whose
step `latest` never named) are left alone: the next save of that iteration writes over them. A step is
renamed to a hidden name first, then removed, so a crash half-way leaves no half step under its own name:
no load ever reads a hidden folder (`latest` names global_stepN only, and never a step being deleted), and the
next prune finishes what a killed one left (and names it in the log).
"""
import os
import re
import shutil

from megatron_ds.data.dist_utils import print_rank_0

from . import kill_points
from .manifest import NAME as MANIFEST

STEP = re.compile(r"global_step(\d+)\Z")
TRASH = re.compile(r"\.deleting-global_step(\d+)\Z")


def to_delete(committed, latest, keep_last, keep_every=None, protected=()):
    """The iterations of `committed` to delete (sorted), `latest` (an iteration) committed last."""
    steps = sorted(s for s in committed if s <= latest)
    recent = set(steps[-keep_last:])
    return [s for s in steps if s not in recent and s != latest and s not in protected
            and not (keep_every and s % keep_every == 0)]


def committed_steps(save_dir):
    found = []
    for name in os.listdir(save_dir):
        m = STEP.match(name)
        if m and os.path.isfile(os.path.join(save_dir, name, MANIFEST)):
            found.append(int(m.group(1)))
    return sorted(found)


def prune(save_dir, latest, keep_last, keep_every=None, protected=()):
    """Delete what to_delete names; returns those iterations."""
    if not keep_last:
        return []
    left = sorted(int(m.group(1)) for m in map(TRASH.match, os.listdir(save_dir)) if m)
    for step in left:
        shutil.rmtree(os.path.join(save_dir, f".deleting-global_step{step}"), ignore_errors=True)
    if left:
        print_rank_0(f"  finished deleting the checkpoints of iterations {', '.join(map(str, left))} (an earlier "
                     "run stopped while deleting them)")
    gone = to_delete(committed_steps(save_dir), latest, keep_last, keep_every, protected)
    for step in gone:
        path = os.path.join(save_dir, f"global_step{step}")
        trash = os.path.join(save_dir, f".deleting-global_step{step}")
        try:
            os.replace(path, trash)
        except OSError:
            continue
        _remove(trash, step)
    if gone:
        print_rank_0(f"  deleted checkpoints of iterations {', '.join(map(str, gone))} (--keep-last-checkpoints "
                     f"{keep_last}{f', --keep-every {keep_every}' if keep_every else ''})")
    return gone


def _remove(trash, step):
    """rmtree, one file first so that a kill injected here (kill_points "deleting") leaves a half folder."""
    names = sorted(os.listdir(trash)) if os.path.isdir(trash) else []
    if names and os.path.isfile(os.path.join(trash, names[0])):
        os.remove(os.path.join(trash, names[0]))
        kill_points.maybe_kill("deleting", step, 0)
    shutil.rmtree(trash, ignore_errors=True)
