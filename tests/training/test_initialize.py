"""Launcher environments map to RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, and CPU ranks
share the cores."""
import os
import re
import subprocess
import sys

import pytest

from megatron_ds.testing.launcher import child_env
from megatron_ds.training.initialize import (cpu_threads, ephemeral_ports, free_port, local_world_size, set_launcher_env,
                                             usable_cores)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_free_port_is_bindable_and_below_the_ephemeral_range():
    """No connection's local end can take it between the check and rank 0's bind (a launch that failed so)."""
    import socket
    first, last = ephemeral_ports()
    assert 1024 <= first <= last
    ports = {free_port() for _ in range(8)}
    assert all(p < first for p in ports) and len(ports) > 1, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_srun_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu-node-17"}
    assert set_launcher_env(env=env) == (5, 8, 1)
    assert env["MASTER_ADDR"] == "gpu-node-17" and env["MASTER_PORT"] == "6000"


def test_srun_with_exported_master_and_torchrun_wins():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "MASTER_ADDR": "10.0.0.1"}
    set_launcher_env(env=env)
    assert env["MASTER_ADDR"] == "10.0.0.1"
    # srun starting torchrun: torchrun's RANK is the one that counts
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3",
           "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert set_launcher_env(env=env) == (3, 4, 3)


def test_deepspeed_local_rank_flag_and_single_process():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert set_launcher_env(local_rank_flag=1, env=env) == (1, 2, 1) and env["LOCAL_RANK"] == "1"
    env = {}
    assert set_launcher_env(env=env) == (0, 1, 0) and int(env["MASTER_PORT"]) > 0


def test_cpu_threads_per_rank_without_omp_num_threads():
    assert cpu_threads({"LOCAL_SIZE": "4"}, 16) == (4, 4)  # the deepspeed launcher
    assert cpu_threads({"LOCAL_WORLD_SIZE": "3"}, 8) == (2, 3)  # torchrun, or set_launcher_env under srun
    assert cpu_threads({"LOCAL_SIZE": "8"}, 2) == (1, 8)  # at least one
    assert cpu_threads({"LOCAL_SIZE": "4", "OMP_NUM_THREADS": "3"}, 16) is None  # the user's choice stands
    assert cpu_threads({"LOCAL_SIZE": "1"}, 16) is None and cpu_threads({}, 16) is None  # one rank: all cores
    # srun: this node's entry of the tasks per node; --cpus-per-task when each rank is a task
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "WORLD_SIZE": "7", "SLURM_NODEID": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2),3"}
    assert local_world_size(slurm) == 3 and cpu_threads(slurm, 12) == (4, 3)
    assert cpu_threads(dict(slurm, SLURM_CPUS_PER_TASK="6"), 6) == (6, 3)
    assert local_world_size({"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4
    # the deepspeed launcher inside one Slurm task: --cpus-per-task is the task's, shared by its ranks
    inside = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_CPUS_PER_TASK": "32", "WORLD_SIZE": "8",
              "LOCAL_SIZE": "8"}
    assert cpu_threads(inside, 32) == (4, 8)
    assert local_world_size({"LOCAL_WORLD_SIZE": "x", "SLURM_TASKS_PER_NODE": "bad"}) == 1


def test_srun_local_world_size_from_the_tasks_per_node():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4",
           "MASTER_ADDR": "h"}
    set_launcher_env(env=env)
    assert env["LOCAL_WORLD_SIZE"] == "4"


RANK_SCRIPT = """
import argparse, os, torch
from megatron_ds.training.config.run_config import RunConfig
from megatron_ds.training.initialize import initialize_distributed
args = RunConfig.freeze(argparse.Namespace(rank=0, local_rank=None, world_size=2, distributed_backend=None, fp16=False,
                                           distributed_timeout_minutes=2))
rank = initialize_distributed(args).rank
print(f"rank {rank} threads {torch.get_num_threads()} OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}", flush=True)
"""


def test_ranks_under_the_deepspeed_launcher_share_the_cores(tmp_path):
    """No OMP_NUM_THREADS: each of the 2 ranks the deepspeed launcher starts runs cores // 2 threads (it
    would run one a core, and the ranks would fight over them), and rank 0 says so once; DeepSpeed's line
    about the op it builds there is rank 0's alone too."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("CPU threads only")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = child_env(ROOT)
    for name in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                           str(free_port()), str(script)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    threads = max(1, usable_cores() // 2)
    found = sorted(re.findall(r"rank (\d) threads (\d+) OMP_NUM_THREADS (\w+)", out))  # \w: another rank's line may follow
    assert found == [("0", str(threads), str(threads)), ("1", str(threads), str(threads))], out[-3000:]
    assert out.count("> CPU threads: 2 ranks on this machine") == 1, out[-3000:]
    assert out.count("deepspeed_shm_comm_op built successfully") <= 1, out[-3000:]  # DeepSpeed's, once: rank 0's
