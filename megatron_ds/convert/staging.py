"""Write a folder completely or not at all: into a temporary sibling, renamed at the end."""
import os
import shutil
from contextlib import contextmanager

from . import ToolError


def check_new_folder(out_dir):
    """`out_dir` must not exist and its parent must: checked first, before minutes of loading."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise ToolError(f"{out_dir}: already exists (the output folder must be new; nothing is overwritten)")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise ToolError(f"{parent}: no such folder (the output folder's parent must exist)")
    return out_dir, parent


@contextmanager
def staged_folder(out_dir):
    """Yields a temporary folder beside `out_dir`, which becomes `out_dir` if the block succeeds."""
    out_dir, parent = check_new_folder(out_dir)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
