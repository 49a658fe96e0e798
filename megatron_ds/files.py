"""Files written whole or not at all, and JSON files read with one message (torch-free, no package import).

Every temporary-file-and-rename writer of the package goes through write_atomic (but the indexed dataset's
builder, which streams its .bin while it builds and renames it with its .idx, and the folder renames of
convert/staging.py and training/checkpoint/universal.py); the JSON readers of the run's files (ds_config, costs, the
manifest, "auto"'s record, op traces, a Hugging Face weight index) through read_json.
"""
import contextlib
import json
import os


def write_atomic(path, data, *, suffix: str = "", opener=open, fsync: bool = True) -> None:
    """`data` into `path` through a temporary file beside it and an atomic rename: a reader finds the old file
    or the new one, never half of one. `data`: text, bytes, or a function that writes the file at the path it
    is given (numpy, torch, a profiler's export; `suffix` ends the temporary name with the extension such a
    writer would add). `opener(path, mode)` opens the temporary file for text and bytes (disk_full's names the
    file in an out-of-room error); `fsync`: on disk before the rename. On any failure the temporary file is
    removed and the error raised."""
    tmp = f"{path}.tmp-{os.getpid()}{suffix}"
    try:
        if callable(data):
            data(tmp)
        else:
            with opener(tmp, "wb" if isinstance(data, (bytes, bytearray)) else "w") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class UnreadableFile(ValueError):
    """A file that cannot be opened or does not hold JSON; the message names it and why."""


def read_json(path, what=None):
    """The JSON value in `path`; UnreadableFile "WHAT cannot be read (why)" (WHAT: `what`, else the path)
    when it cannot be opened or decoded or is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        why = f"not valid JSON: {exc}"
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        why = str(exc)
    raise UnreadableFile(f"{what or path} cannot be read ({why})")
