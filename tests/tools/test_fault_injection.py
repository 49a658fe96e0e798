"""tools/fault_injection.py's readers of a run's output, on text as launchers print it."""
import os

import deepspeed.launcher
import torch

import megatron_ds
from tools import fault_injection as fi

# torchrun's own failure summary from a clone in a folder named megatron_ds with the README's .venv inside
# it: torch's frames lie under megatron_ds/.venv/, and none of them is a worker's
TORCHRUN_SUMMARY = """Traceback (most recent call last):
  File "/home/u/megatron_ds/.venv/bin/torchrun", line 10, in <module>
    sys.exit(main())
  File "/home/u/megatron_ds/.venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 362, in wrapper
    return f(*args, **kwargs)
  File "/home/u/megatron_ds/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 936, in main
    run(args)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""
CLONE = "/home/u/megatron_ds"
DIRS = [f"{CLONE}/megatron_ds", f"{CLONE}/.venv/lib/python3.11/site-packages/deepspeed"]


def test_launcher_frames_under_a_venv_in_a_folder_named_megatron_ds_are_not_the_workers():
    assert fi.worker_tracebacks(TORCHRUN_SUMMARY, DIRS) == []


def test_frames_of_our_package_and_of_deepspeed_are_the_workers():
    worker = f"""Traceback (most recent call last):
  File "{CLONE}/pretrain_gpt.py", line 12, in <module>
  File "{CLONE}/megatron_ds/training/loop.py", line 301, in pretrain
  File "{CLONE}/.venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 99, in load_checkpoint
  File "{CLONE}/.venv/lib/python3.11/site-packages/torch/serialization.py", line 1500, in load
"""
    assert fi.worker_tracebacks(worker + TORCHRUN_SUMMARY, DIRS) == [
        f'File "{CLONE}/megatron_ds/training/loop.py", line 301',
        f'File "{CLONE}/.venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 99']
    assert fi.worker_tracebacks(worker.replace(CLONE, "/elsewhere/clone"), DIRS) == []  # another install's


def test_the_folders_are_the_imported_packages():
    here = fi._package_dirs()
    ours = os.path.dirname(os.path.abspath(megatron_ds.__file__))
    theirs = os.path.dirname(os.path.dirname(os.path.abspath(deepspeed.launcher.__file__)))
    torch_frame = f'File "{os.path.abspath(torch.__file__)}", line 1'
    assert ours in here and theirs in here
    assert fi.worker_tracebacks(f'File "{ours}/training/loop.py", line 3\n{torch_frame}') == [
        f'File "{ours}/training/loop.py", line 3']


class _Recorded:
    """Job's stand-in: records how each launch was asked for and ends at once (every rank exit 0, no output)."""

    launches = []

    def __init__(self, workdir, args, nproc=4, max_restarts=0, name="job", launcher="torchrun", env=None, fork=False):
        self.launches.append((name, launcher, fork))
        self.direct = launcher in ("direct", "srun")
        self.procs = [type("Done", (), {"poll": lambda self: 0})() for _ in range(nproc)]

    def wait(self, timeout, ranks=None):
        return {r: 0 for r in range(len(self.procs))} if self.direct else 0

    def wait_for(self, predicate, timeout, poll=0.05):
        return False

    def output(self):
        return ""

    def kill(self):
        pass


def test_the_scenarios_spawn_unless_asked_to_fork_and_torchrun_stays_torchrun(tmp_path, monkeypatch):
    """Each scenario the tests call, with and without `fork`: the tool's default spawns every rank as before; with
    it every rank not torchrun's is forked, and the restart's torchrun job keeps its agent."""
    monkeypatch.setattr(fi, "Job", _Recorded)

    def launches(fork):
        _Recorded.launches = []
        workdir = tmp_path / str(fork)
        (workdir / "ckpt").mkdir(parents=True)
        (workdir / "ckpt" / "latest").write_text("global_step4")  # the damaged case's save
        (workdir / "restart").mkdir()
        fi.scenario_freeze(str(workdir), fork=fork)
        fi.resume_damaged(str(workdir), "damaged", [], nproc=2, fork=fork)
        fi.scenario_restart(str(workdir / "restart"), nproc=2, fork=fork)
        fi.scenario_inf_grad(str(workdir), nproc=2, fork=fork)
        fi.out_of_room_chain(str(workdir), fork=fork)
        return _Recorded.launches

    names = ["freeze", "damaged-save", "damaged", "uninterrupted", "restart", "inf-grad", "keep-training", "enospc",
             "oom", "signal", "resume"]
    assert launches(False) == list(zip(names, ["direct", "torchrun", "direct", "torchrun", "torchrun", "direct",
                                               "direct", "direct", "direct", "srun", "direct"], [False] * 11))
    assert launches(True) == list(zip(names, ["direct", "direct", "direct", "direct", "torchrun", "direct", "direct",
                                              "direct", "direct", "srun", "direct"], [True] * 4 + [False] + [True] * 6))
