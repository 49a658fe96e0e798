"""Checkpoint files are read without running code: torch.load(weights_only=True) and a short allow-list.

A pickle may name any importable callable and call it while it loads (a `__reduce__` returning
`(open, (path, "w"))` creates a file, `os.system` runs a command). Megatron-DeepSpeed checkpoints are
pickles and are passed around between people, so every load of ours goes through torch's weights-only
unpickler, which builds tensors, containers and plain values only, plus the types below, which is all
that our checkpoints hold (found with torch.serialization.get_unsafe_globals_in_checkpoint on every
file of a save):

- the client state (mp_rank_XX_model_states.pt): `args` is an argparse.Namespace of plain values
  (checkpointing._plain_args), and the RNG states hold numpy's MT19937 key, a uint32 ndarray;
- DeepSpeed's ZeRO shards: its fragment_address (where a parameter sits in the flat partition), its loss
  scalers and ZeroStageEnum;
- the fragments DeepSpeed's ds_to_universal writes: its SubparamShape (how QKV's sections are cut).

Allowing a class lets a pickle create it and set its attributes, never call anything else; numpy's
`_reconstruct` makes an array only of the allow-listed ndarray type. A file that needs anything else is
refused with a CheckpointError naming the file and the type (exit code 2).

`check_step` tries every file of a step this way before anything loads (the ranks share the files, as the
manifest check does, and all stop with the same error); DeepSpeed reads its model and optimizer files
through our checkpoint engine (engine.py), whose load is `load` below. DeepSpeed's universal
loader reads its fragment files with torch.load itself: check_step has tried them first (they are in the
step folder latest_universal names), and `weights_only_everywhere` forces weights-only loading on every
torch.load while DeepSpeed loads.
"""
import contextlib
import os
import re

from ..errors import CheckpointError
from .rank_share import from_rank0, gather, share


def allowed_globals():
    """What our checkpoints hold beyond tensors and plain values (imported late: numpy and DeepSpeed)."""
    import argparse
    import numpy as np
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed np.core
    return [argparse.Namespace, core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType,
            fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum, SubparamShape]


def _offending(path, error):
    """torch's 'Unsupported global: GLOBAL io.open was not ...' -> 'io.open'; where torch stops before a
    global (an opcode its unpickler lacks), the first global of the pickle read without running it."""
    text = str(error)
    found = re.search(r"GLOBAL (\S+)", text) or re.search(r"but got <class '([^']+)'>", text)
    if found:
        return found.group(1)
    name = _first_global(path)
    if name:
        return name
    reason = text.split("WeightsUnpickler error:")[-1].strip().splitlines()
    return reason[0] if reason else type(error).__name__


def _first_global(path):
    """The first global a pickle names that is not allowed (zip: its data.pkl), read from its opcodes
    without running them; None if unreadable."""
    import io
    import pickletools
    import zipfile
    from torch import _weights_only_unpickler as unpickler
    allowed = set(unpickler._get_allowed_globals()) | {f"{g.__module__}.{g.__name__}" for g in allowed_globals()}
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        else:
            with open(path, "rb") as f:
                data = f.read()
        strings = []
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            name = (arg.replace(" ", ".") if op.name == "GLOBAL" else
                    f"{strings[-2]}.{strings[-1]}" if op.name == "STACK_GLOBAL" and len(strings) >= 2 else None)
            if name and name not in allowed:
                return name
            if isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - only for the message: the load was refused already
        return None
    return None


HOLDS = ("(a checkpoint holds tensors, plain values and the few types listed in megatron_ds/training/checkpoint/safe_load.py); "
         "nothing was loaded")
WHY = f"which could run code {HOLDS}"


class Refused(Exception):
    def __init__(self, path, needs):
        super().__init__(f"{path} is refused: loading it needs {needs}, {WHY}")
        self.path, self.needs = path, needs


_depth = [0]


@contextlib.contextmanager
def _allowing():
    """torch's safe_globals, entered once however deep the nesting: its exit removes the globals, also
    those an enclosing one added (our engine's loads run inside weights_only_everywhere)."""
    from torch.serialization import safe_globals
    _depth[0] += 1
    try:
        if _depth[0] > 1:
            yield
        else:
            with safe_globals(allowed_globals()):
                yield
    finally:
        _depth[0] -= 1


def _load(path, map_location="cpu", mmap=False):
    import pickle
    import torch
    try:
        with _allowing():
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise Refused(path, _offending(path, e)) from None


def load(path, map_location="cpu", mmap=False):
    """torch.load of one checkpoint file, weights only; a CheckpointError naming the file and type."""
    try:
        return _load(path, map_location, mmap)
    except Refused as e:
        raise CheckpointError(str(e)) from None


def _try(path):
    """None if `path` loads weights-only, else (path, what it needs) or (path, why it cannot be read).
    mmap: the tensors' bytes are not read."""
    try:
        try:
            _load(path, mmap=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                raise
            _load(path)  # torch's old format, or not torch's format at all: the unpickler decides
    except Refused as e:
        return (path, f"needs {e.needs}")
    except Exception as e:  # noqa: BLE001 - every reason is reported, the same on every rank
        return (path, f"cannot be read: {type(e).__name__}: {e}")
    return None


def step_files(step_dir, skip=lambda rel: False):
    found = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if name.endswith(".pt") and not skip(rel):
                found.append(rel)
    return sorted(found)


def check_step(step_dir, skip=lambda rel: False):
    """Every rank: try a share of the step's .pt files weights-only; all raise one error naming every
    file refused (or that cannot be read) and what it needs."""
    files = from_rank0(lambda: step_files(step_dir, skip))
    mine = [p for p in (_try(os.path.join(step_dir, rel)) for rel in share(files)) if p]
    problems = sorted({tuple(p) for part in gather(mine) for p in part})
    if len(problems) == 1 and problems[0][1].startswith("needs "):
        path, needs = problems[0]
        raise CheckpointError(f"{path} is refused: loading it {needs}, {WHY}")
    if problems:
        listed = "; ".join(f"{path} {why}" for path, why in problems[:3])
        listed += f"; and {len(problems) - 3} more files" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint files are refused: {listed}: loading them could run code {HOLDS}")
    return len(files)


@contextlib.contextmanager
def weights_only_everywhere():
    """Every torch.load inside (DeepSpeed's universal loader calls it directly) is weights-only with our
    allow-list, whatever its caller asked for."""
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with _allowing():
            yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before
