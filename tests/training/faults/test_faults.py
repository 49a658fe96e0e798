"""Faults injected into real pretrain_gpt.py runs (gloo, CPU), with tools/fault_injection.py.

- a frozen rank (SIGSTOP) at PP=2 x DP=2 with a 1-minute timeout: every other rank exits non-zero within
  2 minutes, each with one line naming the operation and the group it waited on (ranks started as srun
  does, so that nothing but the timeout ends them);
- a deleted ZeRO shard and a truncated layer file: exit code 2 on every rank, each file named once;
- torchrun --max-restarts 1 and a rank killed after the second save: the job resumes by itself and its
  losses equal an uninterrupted run's bit for bit;
- an inf gradient in bf16: the step is skipped and counted (skipped and nan iterations in the log line),
  and --exit-after-nan-iterations stops the run with exit code 3 after saving.
The smaller cases run on 2 ranks (PP=2) to keep CI short; the freeze case is the one 4-rank launch. Every
rank that is not torchrun's (and the restart case's uninterrupted reference) is forked from the test launcher's
fork server (the scenarios' `fork`: ~4 s of CPU of imports a rank less): these cases test the ranks, not how they
were started; torchrun's restart keeps its real agent.
"""
import os
import re
import zlib

import pytest

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import run_ranks
from megatron_ds.training.checkpoint import manifest
from tools import fault_injection as fi


@pytest.fixture
def workdir(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    return str(tmp_path)


@pytest.mark.timeout(600)  # one 4-rank launch: about 30 s of start-up, then the 1-minute timeout
def test_frozen_rank_stops_every_other_rank(workdir):
    result = fi.scenario_freeze(workdir, timeout_minutes=1.0, fork=True)
    out = result.get("output", "")
    assert sorted(result.get("exit_seconds", {})) == [0, 1, 2], result.get("detail")
    assert max(result["exit_seconds"].values()) < 120, result["exit_seconds"]
    assert all(result["exit_codes"][r] == 1 for r in (0, 1, 2)), result["exit_codes"]
    errors = result["errors"]
    assert sorted(int(re.search(r"error: rank (\d)", e).group(1)) for e in errors) == [0, 1, 2], out[-3000:]
    for line in errors:
        assert re.search(r"rank \d: \w+( (from|to) rank \d)? on the( \S+)? group ranks \[[\d, ]+\] failed after "
                         r"[\d.]+ s \(--distributed-timeout-minutes 1\)", line), line
    assert any("Timed out" in line for line in errors), errors
    assert not fi.worker_tracebacks(out), fi.worker_tracebacks(out)


@pytest.mark.timeout(900)
def test_damaged_checkpoint_stops_every_rank_naming_the_file(workdir):
    result = fi.resume_damaged(workdir, "damaged", [fi.delete_zero_shard, fi.truncate_layer_file], nproc=2,
                               fork=True)
    out = result["output"]
    assert result["exit_codes"] == {0: 2, 1: 2}, (result["exit_codes"], out[-3000:])
    assert len(result["errors"]) == 1, out[-3000:]  # printed once, by rank 0
    shard, layer = (os.path.basename(p) for p in result["files"])
    assert out.count(shard) == 1 and out.count(layer) == 1
    assert f"{shard} is missing" in result["errors"][0]
    assert re.search(layer + r" has \d+ bytes, \d+ were saved \(truncated", result["errors"][0])
    assert not fi.worker_tracebacks(out)
    assert "loading checkpoint" not in out  # stopped before DeepSpeed read anything


@pytest.mark.timeout(1200)  # two runs of 12 iterations, one of them started twice
def test_torchrun_restart_resumes_bit_exact(workdir):
    result = fi.scenario_restart(workdir, train_iters=8, save_interval=2, kill_rank=1, nproc=2, fork=True)
    out = result.get("output", "")
    assert result["rc"] == 0, out[-4000:]
    assert result["resumed_at"] and int(result["resumed_at"][-1]) >= 4, result["resumed_at"]
    assert "connectFullMesh" not in out
    assert result["got"] == result["expected"] and len(result["got"]) == 8, result
    assert fi.latest(workdir) == "global_step8"


@pytest.mark.timeout(900)
def test_inf_gradient_in_bf16_is_skipped_counted_and_stops_the_run(workdir):
    # inf at 2 (skipped, training goes on), then at 4 and 5: two in a row with --exit-after-nan-iterations 2
    result = fi.scenario_inf_grad(workdir, iterations=(2, 4, 5), limit=2, train_iters=7, nproc=2, fork=True)
    out = result["output"]
    assert result["nan"] == {1: 0, 2: 1, 3: 0, 4: 1, 5: 1}, out[-3000:]
    assert result["skipped"] == {1: 0, 2: 1, 3: 0, 4: 1, 5: 1}
    assert result["exit_codes"] == {0: 3, 1: 3}
    assert "stopping at iteration 5: 2 iterations in a row had a NaN or inf loss or gradient" in out
    assert fi.latest(workdir) == "global_step5"


def _manifest_roundtrip(step_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(os.path.join(step_dir, "sub"), exist_ok=True)
        for i in range(5):
            with open(os.path.join(step_dir, f"f{i}.pt"), "wb") as f:
                f.write(bytes(range(256)) * (i + 1))
        with open(os.path.join(step_dir, "sub", "g.pt"), "wb") as f:
            f.write(b"x" * 1000)
    dist.barrier()
    entries = manifest.write_manifest(step_dir)
    dist.barrier()
    checked = manifest.verify_manifest(step_dir)
    dist.barrier()
    if rank == 0:  # flip one byte, same size
        with open(os.path.join(step_dir, "f3.pt"), "r+b") as f:
            f.seek(100)
            f.write(b"\xff")
    dist.barrier()
    try:
        manifest.verify_manifest(step_dir)
        corrupt = None
    except Exception as e:  # noqa: BLE001 - the test compares the message
        corrupt = str(e)
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(step_dir, manifest.NAME))
    dist.barrier()
    unchecked = manifest.verify_manifest(step_dir)
    dist.destroy_process_group()
    return sorted(entries), checked, corrupt, unchecked


def test_manifest_lists_every_file_and_catches_a_flipped_byte(tmp_path):
    step = str(tmp_path / "global_step7")
    os.makedirs(step)
    results = run_ranks(3, _manifest_roundtrip, step, timeout=300)
    files = ["f0.pt", "f1.pt", "f2.pt", "f3.pt", "f4.pt", os.path.join("sub", "g.pt")]
    for entries, checked, corrupt, unchecked in results:
        assert entries == files and checked == 6 and unchecked is None
        assert corrupt == results[0][2] and "is damaged: f3.pt is corrupt: its CRC-32 differs" in corrupt
    with open(os.path.join(step, "sub", "g.pt"), "rb") as f:
        assert f"{zlib.crc32(f.read()):08x}" == manifest.checksum(os.path.join(step, "sub", "g.pt"))
    assert not os.path.exists(os.path.join(step, manifest.NAME))


def test_a_step_without_its_manifest_loads_with_a_warning(tmp_path, capsys):
    """One process: a deleted manifest.json is said in one line, naming the folder; a present one is not."""
    step = tmp_path / "global_step3"
    step.mkdir()
    (step / "layer_00-model_states.pt").write_bytes(b"x" * 10)
    assert manifest.verify_manifest(str(step)) is None
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"WARNING: {step} has no manifest.json: the sizes and CRC-32s of its files were not checked "
                     "(a step saved before manifests, or by DeepSpeed itself, or its manifest.json was deleted)"]
    manifest.write_manifest(str(step))
    assert manifest.verify_manifest(str(step)) == 1
    assert capsys.readouterr().out == ""
