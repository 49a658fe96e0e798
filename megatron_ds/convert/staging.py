"""Write a folder completely or not at all: into a temporary sibling, renamed at the end. Its missing parent
folders are made as `mkdir -p` would, when it is written (a run that fails leaves none of them)."""
import os
import shutil
from contextlib import contextmanager

from . import ToolError


def missing_folders(folder):
    """The folders of the path `folder` that do not exist yet, outermost first; the innermost one that exists
    must be a folder."""
    missing = []
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ToolError(f"{folder}: not a folder (the output path goes through it)")
    return missing[::-1]


def check_new_folder(out_dir):
    """`out_dir` must not exist, and its parents must be folders or missing: checked first, before minutes of
    loading."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise ToolError(f"{out_dir}: already exists (the output folder must be new; nothing is overwritten)")
    parent = os.path.dirname(out_dir)
    missing_folders(parent)
    return out_dir, parent


@contextmanager
def staged_folder(out_dir):
    """Yields a temporary folder beside `out_dir`, which becomes `out_dir` if the block succeeds."""
    out_dir, parent = check_new_folder(out_dir)
    made = missing_folders(parent)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    done = False
    try:
        yield tmp
        os.rename(tmp, out_dir)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in [] if done else reversed(made):  # the parents this call made, now empty again
            try:
                os.rmdir(folder)
            except OSError:
                break
