"""The zero_to_fp32.py of every --save folder: ours, in place of DeepSpeed's.

DeepSpeed's save copies its recovery scripts zero_to_fp32.py and zero_to_torch.py into the save folder (rank 0,
at the end of its ZeRO save), for its users to get consolidated weights out of a checkpoint. They unpickle
every file with weights_only=False (a tampered checkpoint runs its code) and do not read our pipeline
checkpoints. So each save of ours turns DeepSpeed's copy off (`take_over`: DeepSpeed 0.19's private
`_copy_recovery_script`, shadowed on the engine object, so its stock pipeline engine too) and rank 0 writes
megatron_ds/convert/zero_to_fp32.py there instead (`write`): the same command, `python zero_to_fp32.py .
OUT_DIR`, which has the installed megatron_ds write the step's weights in fp32, read weights-only
(convert/consolidate.py). It is a file of the save like any other: written to a temporary name and renamed,
out of room recorded (disk_full.py). A zero_to_torch.py that an earlier save left (DeepSpeed's: it imports the
zero_to_fp32.py beside it, which is ours now) is removed.
"""
import os
import stat

from megatron_ds.pipe.deepspeed import ds_internals

from ..faults import disk_full

NAME = "zero_to_fp32.py"
SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "convert", NAME)
DEEPSPEEDS_OTHER = "zero_to_torch.py"
EXECUTABLE = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH


def _not_deepspeeds(save_path):
    """DeepSpeed's copy of its recovery script, turned off: `write` puts ours there."""


def take_over(engine):
    ds_internals.replace_recovery_script(engine, _not_deepspeeds)


def _imports_zero_to_fp32(path):
    try:
        with open(path) as f:
            return "import zero_to_fp32" in f.read()
    except (OSError, UnicodeDecodeError):
        return False


def write(save_dir):
    """Rank 0: SAVE/zero_to_fp32.py, executable as DeepSpeed's was; DeepSpeed's zero_to_torch.py gone."""
    with open(SOURCE) as f:
        text = f.read()
    path = os.path.join(save_dir, NAME)
    if disk_full.write_text(path, text):
        os.chmod(path, os.stat(path).st_mode | EXECUTABLE)
    other = os.path.join(save_dir, DEEPSPEEDS_OTHER)
    if os.path.isfile(other) and _imports_zero_to_fp32(other):
        os.remove(other)
