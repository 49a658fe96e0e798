"""Checkpoint manifests: every file of a saved step with its size and CRC-32, checked before loading.

SAVE/global_stepN/manifest.json (written after every rank's files, before `latest` names the step):

    {"format": 1, "files": {"layer_01-model_states.pt": {"size": 10417, "crc32": "5c0e97a1"}, ...}}

The ranks share the reading: rank r checksums files r, r + world, ... of the sorted list, and rank 0
writes what they gathered (temp file, then rename). On --load every rank checks its share the same way,
before DeepSpeed reads anything, and they exchange what they found: a missing, truncated or corrupt file
stops every rank with the same error (a CheckpointError: exit code 2, printed once, by rank 0), instead
of one traceback per rank that names no file. A step without a manifest (written before manifests, or
by DeepSpeed itself, or whose manifest was deleted) loads unchecked, and rank 0 says so in one line. CRC-32
(zlib) runs at about 1 GB/s a core; each rank reads 1/world of the checkpoint, once when saving, once when
loading.
"""
import json
import os
import zlib

from megatron_ds.data.dist_utils import print_rank_0
from megatron_ds.files import UnreadableFile, read_json, write_atomic

from ..faults import disk_full
from .rank_share import from_rank0, gather, share
from ..errors import CheckpointError

NAME = "manifest.json"
FORMAT = 1
CHUNK = 8 << 20


def checksum(path):
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                return f"{crc:08x}"
            crc = zlib.crc32(block, crc)


def _files(step_dir):
    found = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != NAME and ".tmp-" not in name:
                found.append(rel)
    return sorted(found)


def entry(path):
    return {"size": os.path.getsize(path), "crc32": checksum(path)}


def write_manifest(step_dir, known=None):
    """Every rank: checksum a share of step_dir's files; rank 0 writes the manifest. Call after a barrier.
    `known`: {file: entry} already taken (by the background writers, async_save.py), not read again."""
    import torch.distributed as dist
    known = known or {}
    files = from_rank0(lambda: _files(step_dir))  # one list, even where a shared file system lags
    mine = {rel: entry(os.path.join(step_dir, rel)) for rel in share([f for f in files if f not in known])}
    entries = {rel: known[rel] for rel in files if rel in known}
    for part in gather(mine):
        entries.update(part)
    if not dist.is_initialized() or dist.get_rank() == 0:
        text = json.dumps({"format": FORMAT, "files": dict(sorted(entries.items()))}, indent=0)
        # disk_full's opener: an out-of-room error names the file and its size
        write_atomic(os.path.join(step_dir, NAME), text, opener=disk_full.open_for_write)
    return entries


def _problem(step_dir, rel, entry):
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
        return f"{rel} is missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{rel} has {size} bytes, {entry['size']} were saved (truncated or overwritten)"
    if checksum(path) != entry["crc32"]:
        return f"{rel} is corrupt: its CRC-32 differs from the one saved"
    return None


def verify_manifest(step_dir, skip=lambda rel: False, warn_missing=True):
    """Every rank: check a share of the files the manifest lists (not those `skip` names).

    Returns the number of files checked in all, or None when step_dir has no manifest; raises
    CheckpointError, the same on every rank, naming the first damaged file.
    """
    path = os.path.join(step_dir, NAME)
    present = os.path.isfile(path)
    manifest = None
    if present:
        try:
            manifest = read_json(path, NAME)
        except UnreadableFile as e:
            manifest = {"error": str(e)}
    problems = []
    if manifest is not None and "error" in manifest:
        problems.append(manifest["error"])
    elif manifest is not None:
        listed = sorted(rel for rel in manifest["files"] if not skip(rel))
        problems = [p for p in (_problem(step_dir, rel, manifest["files"][rel]) for rel in share(listed)) if p]
    reports = gather((present, problems))
    if len({p for p, _ in reports}) > 1:
        problems.append(f"{NAME} is visible to some ranks only")
    elif not present and warn_missing:  # a universal folder never has one
        print_rank_0(f"WARNING: {step_dir} has no {NAME}: the sizes and CRC-32s of its files were not "
                     f"checked (a step saved before manifests, or by DeepSpeed itself, or its {NAME} was deleted)")
    problems = sorted({p for _, ps in reports for p in ps} | set(problems))
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint {step_dir} is damaged: {'; '.join(problems[:3])}{more}; to resume from an earlier "
                              f"save, write its tag (global_stepN) into {os.path.join(os.path.dirname(step_dir), 'latest')}")
    return None if manifest is None else len(manifest["files"])
