"""Launcher environments map to RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT."""
from megatron_ds.training.initialize import set_launcher_env


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
