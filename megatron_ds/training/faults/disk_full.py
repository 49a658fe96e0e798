"""A save that runs out of room (ENOSPC, or EDQUOT: a quota) stops the run, or with a flag is skipped.

Every file of a save is written through `open_for_write` (DeepSpeed's layer, model-states and ZeRO files
through our checkpoint engine, ours directly): an out-of-room error there is recorded, the half-written
file removed, and the save goes on without raising, so that every rank still meets every collective of
DeepSpeed's save. Then the ranks exchange what they recorded (`Save.agree`): if any rank ran out of room,
rank 0 removes the step folder (never the one `latest` names), `latest` is not written, and every rank
raises the same DiskFullError, naming the file and the bytes it needed (exit code 2, printed once), or,
under --keep-training-on-disk-full, rank 0 prints it as a warning and training goes on until the next
--save-interval tries again. torch.save hides the OSError of a file object's write behind its own
RuntimeError, hence the wrapper that keeps it.

--inject-enospc ITERATION NAME (fault injection, repeatable): the save of that iteration fails with
ENOSPC half-way through writing the file whose name contains NAME (on whichever rank writes it).
"""
import errno
import os
import shutil

from megatron_ds.errors import UserError, print_error
from megatron_ds.files import write_atomic

from ..errors import ArgumentsError

OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT)


def add_disk_full_args(parser):
    g = parser.add_argument_group("running out of disk")
    g.add_argument("--keep-training-on-disk-full", action="store_true",
                   help="a save that runs out of disk space (or quota) is reported and skipped, and the next "
                        "--save-interval tries again; without it the run stops (exit code 2)")
    g.add_argument("--inject-enospc", nargs=2, action="append", default=None, metavar=("ITER", "NAME"),
                   help="fault injection: the save at iteration ITER fails with ENOSPC half-way through the file "
                        "whose name contains NAME (e.g. layer_01, model_states, optim_states, manifest.json, "
                        "latest); repeatable")


def check_disk_full_args(args):
    for it, _ in args.inject_enospc or ():
        if not it.isdigit():
            raise ArgumentsError(f"--inject-enospc {it}: ITER must be an iteration number")


class DiskFullError(UserError, OSError):
    """A checkpoint that could not be written for lack of room; the previous one and `latest` are intact."""


class _Failure:
    def __init__(self, path, needed, error):
        self.path, self.needed, self.error = path, needed, error

    def describe(self, iteration):
        path = self.path.split(".tmp-")[0]  # the file it was to become
        where = os.path.dirname(path) or "."
        try:
            free = f", {shutil.disk_usage(where).free} are free there"
        except OSError:
            free = ""
        needed = f"it needed {self.needed} bytes" if self.needed is not None else "size unknown"
        return (f"saving iteration {iteration}: {path}: {os.strerror(self.error.errno)} "
                f"({errno.errorcode.get(self.error.errno, self.error.errno)}): {needed}{free}")


_state = {"iteration": None, "inject": (), "failures": []}


def is_out_of_room(error):
    return isinstance(error, OSError) and error.errno in OUT_OF_ROOM


class _File:
    """A file being written: keeps the OSError its write raised (torch.save replaces it by a RuntimeError),
    and raises the injected ENOSPC after half of the first write."""

    def __init__(self, path, mode, inject):
        self.path, self.raw, self.inject, self.error, self.written, self.needed = path, open(path, mode), inject, \
            None, 0, None

    def write(self, data):
        try:
            if self.inject:
                self.raw.write(data[:len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (--inject-enospc)", self.path)
            n = self.raw.write(data)
            self.written += len(data)
            return n
        except OSError as e:
            if self.error is None:
                self.error, self.needed = e, self.written + len(data)
            raise

    def flush(self):
        self.raw.flush()

    def fileno(self):
        return self.raw.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.raw.close()


def open_for_write(path, mode="w"):
    name = os.path.basename(path)
    inject = any(int(it) == _state["iteration"] and part in name for it, part in _state["inject"])
    _state["last_file"] = _File(path, mode, inject)
    return _state["last_file"]


class _Counter:
    """A write-only sink that counts bytes: the size a torch.save would have had."""
    def __init__(self):
        self.size = 0

    def write(self, data):
        self.size += len(data)
        return len(data)

    def flush(self):
        pass


def _record(path, needed, error):
    _state["failures"].append(_Failure(path, needed, error))
    try:
        os.remove(path)  # half a file is worse than none: nothing may read it
    except OSError:
        pass


def failed():
    return bool(_state["failures"])


def write_torch(state_dict, path, save=None, **save_kwargs):
    """torch.save into `path` (or `save(state_dict, file)`, a writer of the same format); out of room: recorded,
    the partial file removed, no exception. After a failure this rank writes nothing more of the save (the disk
    is full)."""
    import torch
    if failed():
        return
    if save is None:
        save = lambda obj, out: torch.save(obj, out, **save_kwargs)  # noqa: E731
    f = None
    try:
        with open_for_write(path, "wb") as f:
            save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        cause = f.error if f is not None and f.error is not None else e
        if not is_out_of_room(cause):
            raise
        counter = _Counter()
        save(state_dict, counter)
        _record(path, counter.size, cause)


def write_text(path, text):
    """`text` into `path` through a temporary file and an atomic rename; out of room: recorded."""
    if failed():
        return False
    try:
        write_atomic(path, text, opener=open_for_write)
        return True
    except OSError as e:
        if not is_out_of_room(e):
            raise
        _record(f"{path}.tmp-{os.getpid()}", len(text.encode()), e)  # the name without ".tmp-PID" in the message
        return False


def guarded(fn, path):
    """fn() (a write of ours that does its own I/O, collectives included: it always runs); an out-of-room
    OSError is recorded against `path`."""
    try:
        return fn()
    except OSError as e:
        if not is_out_of_room(e):
            raise
        last = _state.get("last_file")
        _record(e.filename or path, last.needed if last is not None and last.error is e else None, e)
        return None


def report_alone_and_exit(error, iteration):
    """Out of room outside our checkpoint engine: only this rank knows; it says so and exits, and the
    others stop when their next collective finds it gone (timeouts.py)."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    print_error(f"rank {rank}: " + _Failure(error.filename or "?", None, error).describe(iteration)
                + "; the previous checkpoint and `latest` are intact")
    os._exit(DiskFullError.exit_code)


def begin(args, iteration):
    _state.update(iteration=iteration, inject=tuple(args.inject_enospc or ()), failures=[])


def agree(step_dir, latest_tag):
    """Every rank: the first failure any rank recorded, as one message (None: the save is complete).
    Rank 0 then removes the incomplete step folder, unless `latest` names it."""
    import torch.distributed as dist
    mine = _state["failures"][0].describe(_state["iteration"]) if _state["failures"] else None
    reports = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
    failures = [r for r in reports if r]
    if not failures:
        return None
    if (not dist.is_initialized() or dist.get_rank() == 0) and os.path.basename(step_dir) != latest_tag:
        shutil.rmtree(step_dir, ignore_errors=True)
    return failures[0] + (f" (and {len(failures) - 1} more ranks)" if len(failures) > 1 else "")
