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
