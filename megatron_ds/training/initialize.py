"""Process-group start-up for every launcher, and the random seeds.

- torchrun / deepspeed launcher: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
  are in the environment (the deepspeed launcher also passes --local_rank).
- srun without a wrapper: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID give the
  rank, world size and local rank; MASTER_ADDR comes from the environment (the
  slurm/ script exports the first host of the job) or `scontrol show hostnames`.
- a plain `python pretrain_gpt.py`: one process on a free local port.

The backend is --distributed-backend, else nccl with CUDA and gloo without; the
timeout (--distributed-timeout-minutes) makes a rank whose peer died fail
instead of waiting forever.

On CPU, torch starts one thread per core in every rank; several ranks on one machine then fight over
the cores (an iteration 20x slower). torchrun sets OMP_NUM_THREADS=1 for more than one process, the
deepspeed launcher and srun do not: without OMP_NUM_THREADS each rank takes its share of the cores.
"""
import contextlib
import datetime
import io
import os
import random
import socket
import subprocess

from .faults import timeouts
from .errors import ArgumentsError


def free_port():
    """A free local TCP port for a rendezvous, drawn below the kernel's ephemeral range: a port the kernel hands
    out for bind(0) is one it may hand out again, as the local end of any connection (gloo opens many), between
    this check and rank 0's bind; one below the range is taken only by another explicit bind."""
    low = ephemeral_ports()[0]
    for port in random.Random().sample(range(max(1024, low - 12000), low), 32):  # not the seeded global random
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_ports():
    """(first, last) of the ports the kernel gives connections' local ends (Linux's default where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            first, last = map(int, fh.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def _first_slurm_host(env):
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    if "[" not in nodelist and "," not in nodelist:
        return nodelist
    raise RuntimeError(f"cannot find the first host of SLURM_JOB_NODELIST={nodelist!r} without scontrol; "
                       "export MASTER_ADDR")


def set_launcher_env(local_rank_flag=None, env=None):
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT for whichever launcher started us."""
    env = os.environ if env is None else env
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("LOCAL_WORLD_SIZE", str(local_world_size(env)))
        if "MASTER_ADDR" not in env:
            env["MASTER_ADDR"] = _first_slurm_host(env)
        env.setdefault("MASTER_PORT", "6000")
    if "RANK" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    if "LOCAL_RANK" not in env:
        env["LOCAL_RANK"] = str(local_rank_flag if local_rank_flag is not None else 0)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])


def local_world_size(env):
    """Ranks on this machine, as the launcher says: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's
    LOCAL_SIZE, Slurm's tasks per node (this node's entry of SLURM_STEP_TASKS_PER_NODE, e.g. "2(x3),1"),
    Open MPI's or MPICH's local size; 1 when none says."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "MPI_LOCALNRANKS"):
        try:
            return max(1, int(env[name].split("(")[0]))
        except (KeyError, ValueError):
            continue
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    try:
        counts = []
        for part in (spec or "").split(","):
            count, _, times = part.partition("(x")
            counts += [int(count)] * int(times.rstrip(")") or 1)
        node = int(env.get("SLURM_NODEID", "0"))
        return max(1, counts[node] if node < len(counts) else counts[0])
    except (ValueError, IndexError):
        return 1


def usable_cores():
    """The cores this process may run on (its affinity, which a container or a cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def cpu_threads(env, cores):
    """(torch threads for this rank, local ranks) on a machine without CUDA, or None to leave torch as it is:
    OMP_NUM_THREADS given, or one rank here. When every rank is a Slurm task (srun started them, not a
    launcher inside one task) and --cpus-per-task was given, that count: the task's own cores. Else the
    cores this process may use // local ranks, at least 1."""
    if env.get("OMP_NUM_THREADS"):
        return None
    local = local_world_size(env)
    if local <= 1:
        return None
    if "SLURM_PROCID" in env and env.get("SLURM_NTASKS") == env.get("WORLD_SIZE"):
        try:
            return max(1, int(env["SLURM_CPUS_PER_TASK"])), local
        except (KeyError, ValueError):
            pass
    return max(1, cores // local), local


def set_cpu_threads(rank, env=None):
    """Apply cpu_threads to torch (and OMP_NUM_THREADS, for this rank's children); rank 0 says so once."""
    import torch
    env = os.environ if env is None else env
    cores = usable_cores()
    decided = cpu_threads(env, cores)
    if decided is None:
        if env.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
        return torch.get_num_threads()
    threads, local = decided
    env["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    if rank == 0:
        print(f"> CPU threads: {local} ranks on this machine, {cores} cores and no OMP_NUM_THREADS: "
              f"torch runs {threads} thread(s) per rank (export OMP_NUM_THREADS to choose)", flush=True)
    return threads


def initialize_distributed(args):
    """Start the process group; returns the run's settings with what it learned: rank, world size (parse_args
    read the environment before the SLURM mapping), local rank and backend."""
    import torch
    rank, world, local_rank = set_launcher_env(args.local_rank)
    cuda = torch.cuda.is_available()
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ArgumentsError("--distributed-backend nccl needs CUDA, and no GPU is visible; use gloo on CPU")
    if args.fp16 and not cuda:
        raise ArgumentsError("fp16 (--fp16 / ds_config fp16.enabled) needs a GPU: DeepSpeed's CPU accelerator "
                             "has no fp16; use --bf16 or fp32 on CPU")
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        set_cpu_threads(rank)
    import deepspeed
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    timeouts.install(timeout)  # before DeepSpeed's backend keeps references to torch.distributed's functions
    store = elastic_store(os.environ, world, timeout)
    if store is not None:
        device = {"device_id": torch.device("cuda", local_rank % torch.cuda.device_count())} if cuda else {}
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                             **device)
    # on CPU DeepSpeed builds its shared-memory op here and prints so in every process: rank 0's copy is enough
    with contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout,
                                   verbose=rank == 0)
    if rank == 0:
        print(f"> torch.distributed: backend {torch.distributed.get_backend()}, world size {world}", flush=True)
    return args.replace(rank=rank, world_size=world, local_rank=local_rank, distributed_backend=backend)


def elastic_store(env, world_size, timeout):
    """torchrun's store with this restart's own key space, or None outside torchrun.

    torchrun's static rendezvous (--master-addr/--master-port, the multi-node form) keeps one TCPStore for
    the whole job, and torch 2.13 no longer prefixes the workers' keys by restart ("a new TCPStore for
    every retry", which only the c10d rendezvous does). The ranks of a restart then read the addresses of
    the dead ranks of the previous attempt and fail in gloo's connectFullMesh ("timed out connecting:
    Connection refused"). A prefix per TORCHELASTIC_RESTART_COUNT gives each attempt fresh keys.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    from torch.distributed import PrefixStore, TCPStore
    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    return PrefixStore(f"megatron_ds/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def set_random_seed(seed, pipeline_rank=0):
    """Megatron: seed + 100 x pipeline rank; data-parallel replicas share the stream."""
    import numpy as np
    import torch
    seed = seed + 100 * pipeline_rank
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    return seed


def get_rng_state():
    """python, numpy, torch (and cuda) and the tensor-parallel tracker's states (Megatron's
    rng_tracker_states: dropout in split regions draws from it)."""
    import numpy as np
    import torch
    from megatron_ds.model.tensor_parallel import get_rng_tracker  # lazy: torch (free_port is torch-free)
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    import numpy as np
    import torch
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    if state.get("rng_tracker_states"):  # absent in checkpoints saved before it was
        from megatron_ds.model.tensor_parallel import get_rng_tracker  # lazy: torch (free_port is torch-free)
        get_rng_tracker().set_states(state["rng_tracker_states"])
