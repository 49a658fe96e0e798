"""Inject faults into tiny pretrain_gpt.py runs and print a table of what was tried and how each ended.

    python -m tools.fault_injection                 # every scenario (about 15 minutes on 2 cores)
    python -m tools.fault_injection freeze restart  # some of them

Each scenario trains a 2-layer GPT on 4 gloo ranks (pipeline 2 x data 2) on a random corpus and injects
one fault, from outside (a signal to one worker, a damaged or crafted checkpoint file) or with
--inject-inf-grad-iterations, --inject-enospc or --inject-oom (out-of-room and unsafe: 2 ranks, PP=2).
The restart runs under torchrun; the others start one process a rank, as srun does, so that each rank's
own exit code is seen (torchrun would SIGTERM the rest after the first).

| scenario | fault                                                     | promised                                  |
|----------|-----------------------------------------------------------|-------------------------------------------|
| freeze   | SIGSTOP to rank 3 mid-training, 1-minute timeout          | ranks 0-2 exit 1 within 2 min, one line each |
| shard    | a ZeRO optimizer shard of the last checkpoint deleted     | exit 2 on every rank, the file named once |
| truncate | a layer file of the last checkpoint cut in half           | exit 2 on every rank, the file named once |
| restart  | SIGKILL to rank 1 after the second save, --max-restarts 1 | the job resumes, losses bit-equal         |
| inf-grad | an inf gradient at iterations 2, 4, 5 (bf16), limit 2     | each skipped and counted; saved, exit 3   |
| out-of-room | ENOSPC at each stage of a save, with --keep-training-on-disk-full | each save skipped, training goes on |
|          | ENOSPC in a ZeRO shard, no flag                           | exit 2 on every rank, `latest` intact     |
|          | an allocator failure on rank 1 (--inject-oom)              | exit 4 (rank 1) and 1 at once, one line each |
|          | SIGUSR1 to rank 1, srun-like, --exit-signal-handler       | both save one iteration, exit 0           |
|          | resume from each of those                                 | losses bit-equal to an uninterrupted run  |
| unsafe   | checkpoint files, an index cache: pickles creating a file | payload never runs; exit 2 naming each    |

The launching helpers are shared with tests/training/faults/test_faults.py and test_out_of_room.py, whose
cases pass `fork=True` where the launcher is not what they test: each rank forked from the test launcher's fork
server (Job's `fork`) instead of a fresh interpreter; this tool spawns every rank.
"""
import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import megatron_ds
from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import ForkedScript, child_env
from megatron_ds.training.initialize import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "MEGATRON_DS_FAULT_JOB"  # set in the workers' environment to find them among all processes


def gpt_args(workdir, *extra, train_iters=12, save_interval=2, bf16=False, schedule="1f1b"):
    """pretrain_gpt.py flags for a 2-layer GPT at PP=2 (our engine), saving to WORKDIR/ckpt and reading it back."""
    from megatron_ds.data.tokenizer import default_gpt2_files
    vocab, merges = default_gpt2_files()
    ckpt = os.path.join(workdir, "ckpt")
    ds_config = os.path.join(workdir, "ds_config.json")
    with open(ds_config, "w") as f:
        json.dump({"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9, "pipeline": {"schedule": schedule}}, f)
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(train_iters),
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
            "--pipeline-model-parallel-size", "2", "--data-path", os.path.join(workdir, "corpus"),
            "--split", "100,0,0", "--vocab-file", vocab, "--merge-file", merges,
            "--make-vocab-size-divisible-by", "128", "--log-interval", "1", "--eval-iters", "0",
            "--save", ckpt, "--load", ckpt, "--save-interval", str(save_interval),
            "--deepspeed", "--deepspeed_config", ds_config]
    if bf16:
        args.append("--bf16")
    return args + list(extra)


class Job:
    """pretrain_gpt.py on `nproc` local gloo ranks, its workers found by rank.

    launcher "torchrun" (with --max-restarts), "deepspeed" (its launcher), "direct": one process a rank with
    RANK, WORLD_SIZE and MASTER_* set, or "srun": one process a rank with only the SLURM_* variables srun
    sets; the last two show each rank's own exit code and output. `env`: more variables for the workers (a
    fault to inject). `fork` (direct and srun): each rank forked from the test launcher's fork server
    (megatron_ds.testing.launcher.ForkedScript: its imports done once, ~4 s of CPU a rank less) instead of a
    fresh interpreter.
    """

    def __init__(self, workdir, args, nproc=4, max_restarts=0, name="job", launcher="torchrun", env=None,
                 fork=False):
        self.workdir, self.name, self.tag = workdir, name, uuid.uuid4().hex
        self.log_path = os.path.join(workdir, f"{name}.log")
        script = [os.path.join(ROOT, "pretrain_gpt.py"), *args]
        env = child_env(ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{MARK: self.tag}, **(env or {}))
        port = str(free_port())
        self._log = open(self.log_path, "w")
        self.start = time.monotonic()
        if launcher in ("torchrun", "deepspeed"):
            cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                    "--master_addr", "127.0.0.1", "--master_port", port, "--max-restarts", str(max_restarts),
                    "--monitor-interval", "0.5", *script] if launcher == "torchrun" else
                   [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", port,
                    *script])
            self.procs = [subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                           start_new_session=True)]
        else:
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(name, None)
            if launcher == "srun":  # what srun gives each task: SLURM_* variables only
                env.update(SLURM_NTASKS=str(nproc), SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=port)
                per_rank = [dict(SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(nproc)]
            else:
                env.update(WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                per_rank = [dict(RANK=str(r), LOCAL_RANK=str(r)) for r in range(nproc)]
            if fork:
                self.procs = [ForkedScript(script[0], script[1:], dict(env, **per_rank[r]), workdir, self.log_path)
                              for r in range(nproc)]
            else:
                self.procs = [subprocess.Popen([sys.executable, *script], cwd=workdir, stdout=self._log,
                                               stderr=subprocess.STDOUT, start_new_session=True,
                                               env=dict(env, **per_rank[r])) for r in range(nproc)]
        self.direct = launcher in ("direct", "srun")

    def workers(self):
        """{rank: pid} of this job's live workers (of the latest restart)."""
        if self.direct:
            return {r: p.pid for r, p in enumerate(self.procs) if p.poll() is None}
        found = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if env.get(MARK.encode()) == self.tag.encode() and b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
                found[int(env[b"RANK"])] = int(pid)
        return found

    def signal(self, rank, sig):
        pid = self.workers()[rank]
        os.kill(pid, sig)
        return pid

    def output(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def running(self):
        return all(p.poll() is None for p in self.procs)

    def wait_for(self, predicate, timeout, poll=0.05):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if not self.running():
                return False
            time.sleep(poll)
        return False

    def wait(self, timeout, ranks=None):
        """torchrun's exit code, or {rank: exit code} of a direct launch (of `ranks`); None: still running."""
        deadline = time.monotonic() + timeout
        watched = [self.procs[r] for r in ranks] if ranks is not None else self.procs
        codes = []
        for p in watched:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        if not self.direct:
            return codes[0]
        return dict(zip(ranks if ranks is not None else range(len(self.procs)), codes))

    def kill(self):
        """Everything this job started, stopped workers included (SIGKILL reaches a stopped process)."""
        for pid in self.workers().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._log.close()


def latest(workdir):
    try:
        with open(os.path.join(workdir, "ckpt", "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


def logged_losses(out):
    """{iteration: printed lm loss} from Megatron's iteration lines (the last print of each iteration)."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|", out)}


def _last_line(out):
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _package_dirs():
    """The folders of our package and of DeepSpeed as imported here (the workers import the same ones), each
    as found and with its links resolved. Found by what they are, not by name: a clone in a folder named
    megatron_ds with its .venv inside holds torch's and torchrun's frames under megatron_ds/.venv/."""
    dirs = {os.path.dirname(os.path.abspath(megatron_ds.__file__))}
    spec = importlib.util.find_spec("deepspeed")  # its folder, without the seconds of importing it
    dirs.update(os.path.abspath(d) for d in (spec.submodule_search_locations or [] if spec else []))
    return sorted({form for d in dirs for form in (d, os.path.realpath(d))}, key=len, reverse=True)


def worker_tracebacks(out, package_dirs=None):
    """Traceback frames in our package's or DeepSpeed's code (the workers'; torchrun's own summary traceback,
    in torch, is not theirs). `package_dirs`: those folders (default: as imported here)."""
    dirs = _package_dirs() if package_dirs is None else package_dirs
    inside = "|".join(re.escape(d.rstrip(os.sep) + os.sep) for d in dirs)
    return re.findall(rf'File "(?:{inside})[^"]+", line \d+', out)


def rank_errors(out):
    """The one-line errors the ranks printed ('pretrain_gpt.py: error: ...'), each once: torchrun's failure
    report repeats a rank's line from its error file (errors.record_for_launcher)."""
    marker = "pretrain_gpt.py: error:"
    lines = [line[line.index(marker):].rstrip() for line in out.splitlines() if marker in line]
    return list(dict.fromkeys(lines))


def worker_exit_codes(out):
    """{rank: exitcode} from torchrun's failure summary (ranks that exited non-zero, and the first one)."""
    codes = {}
    for m in re.finditer(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out):
        codes[int(m.group(1))] = int(m.group(2))
    return codes


# --------------------------------------------------------------------------- scenarios

def scenario_freeze(workdir, timeout_minutes=1.0, nproc=4, frozen=3, fork=False):
    """SIGSTOP one rank mid-training; the others must exit on their own, naming what they waited on.

    Launched as srun does (one process a rank, nothing kills the others) to see every rank's own exit.
    `fork`: the ranks forked from the fork server (Job's `fork`), as in every scenario that takes it.
    """
    job = Job(workdir, gpt_args(workdir, "--distributed-timeout-minutes", str(timeout_minutes), train_iters=400,
                                save_interval=1000), nproc=nproc, name="freeze", launcher="direct", fork=fork)
    others = [r for r in range(nproc) if r != frozen]
    exits = {}
    try:
        if not job.wait_for(lambda: "iteration        3/" in job.output(), 300):
            return {"ok": False, "detail": f"never reached iteration 3: {_last_line(job.output())}", "output": job.output()}
        job.signal(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 300 and len(exits) < len(others):
            for r in others:
                if r not in exits and job.procs[r].poll() is not None:
                    exits[r] = time.monotonic() - stopped
            time.sleep(0.1)
        codes = job.wait(1, ranks=others)
    finally:
        job.kill()
    out = job.output()
    errors = rank_errors(out)
    ok = (len(exits) == len(others) and all(codes[r] not in (0, None) for r in others)
          and max(exits.values()) < 2 * 60 * timeout_minutes and len(errors) == len(others))
    return {"ok": ok, "exit_codes": codes, "exit_seconds": exits, "errors": errors, "output": out,
            "detail": f"ranks {others} exited {', '.join(f'{exits[r]:.0f}' for r in sorted(exits))} s after SIGSTOP of "
                      f"rank {frozen}, codes {[codes.get(r) for r in others]}, {len(errors)} one-line errors"}


def _train_then(workdir, name, train_iters=4, nproc=4, fork=False):
    """A short run that leaves a complete checkpoint at its last iteration (under torchrun; `fork`: its ranks
    forked, one a rank)."""
    job = Job(workdir, gpt_args(workdir, train_iters=train_iters), nproc=nproc, name=name,
              **({"launcher": "direct", "fork": True} if fork else {}))
    rc = job.wait(600)
    if rc != ({r: 0 for r in range(nproc)} if fork else 0):
        raise RuntimeError(f"{name} failed (rc {rc}):\n{job.output()[-3000:]}")
    return os.path.join(workdir, "ckpt", latest(workdir))


def resume_damaged(workdir, name, damages, nproc=4, fork=False):
    """Save, damage files of the checkpoint, resume: every rank must stop with exit code 2, each file named once."""
    _train_then(workdir, name + "-save", nproc=nproc, fork=fork)
    step_dir = os.path.join(workdir, "ckpt", latest(workdir))
    paths = [damage(step_dir) for damage in damages]
    job = Job(workdir, gpt_args(workdir, train_iters=6), nproc=nproc, name=name, launcher="direct", fork=fork)
    codes = job.wait(600)
    out = job.output()
    errors = rank_errors(out)
    named = [out.count(os.path.basename(p)) for p in paths]
    ok = set(codes.values()) == {2} and named == [1] * len(paths) and len(errors) == 1 and not worker_tracebacks(out)
    return {"ok": ok, "files": paths, "errors": errors, "exit_codes": codes, "output": out,
            "detail": f"exit codes {sorted(codes.values())}: " + (errors[0] if errors else "no error line")[:150]}


def delete_zero_shard(ckpt_dir):
    path = os.path.join(ckpt_dir, sorted(f for f in os.listdir(ckpt_dir) if f.endswith("_optim_states.pt"))[-1])
    os.remove(path)
    return path


def truncate_layer_file(ckpt_dir):
    path = os.path.join(ckpt_dir, sorted(f for f in os.listdir(ckpt_dir) if f.startswith("layer_"))[1])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return path


def scenario_shard(workdir):
    return resume_damaged(workdir, "shard", [delete_zero_shard])


def scenario_truncate(workdir):
    return resume_damaged(workdir, "truncate", [truncate_layer_file])


def scenario_restart(workdir, train_iters=12, save_interval=2, kill_rank=1, nproc=4, fork=False):
    """SIGKILL one rank right after the second save; torchrun restarts the job, which resumes from --load.
    `fork`: the uninterrupted reference's ranks forked (the restarted job is torchrun's in any case)."""
    reference_dir = os.path.join(workdir, "reference")
    os.makedirs(reference_dir, exist_ok=True)
    os.symlink(os.path.join(workdir, "corpus.bin"), os.path.join(reference_dir, "corpus.bin"))
    os.symlink(os.path.join(workdir, "corpus.idx"), os.path.join(reference_dir, "corpus.idx"))
    reference = Job(reference_dir, gpt_args(reference_dir, train_iters=train_iters, save_interval=save_interval),
                    nproc=nproc, name="uninterrupted", **({"launcher": "direct", "fork": True} if fork else {}))
    ref_rc = reference.wait(900)
    if fork:  # a direct launch's {rank: exit code}
        ref_rc = 0 if set(ref_rc.values()) == {0} else ref_rc
    expected = logged_losses(reference.output())
    job = Job(workdir, gpt_args(workdir, train_iters=train_iters, save_interval=save_interval), nproc=nproc,
              max_restarts=1, name="restart")
    second = f"global_step{2 * save_interval}"
    try:
        if not job.wait_for(lambda: latest(workdir) == second, 600, poll=0.01):
            return {"ok": False, "detail": f"never saved twice: {_last_line(job.output())}", "output": job.output()}
        job.signal(kill_rank, signal.SIGKILL)
        rc = job.wait(900)
    finally:
        job.kill()
    out = job.output()
    got = logged_losses(out)
    resumed = re.findall(r"successfully loaded checkpoint from .* at iteration (\d+)", out)
    before = logged_losses(out.split("successfully loaded checkpoint")[0])
    ok = ref_rc == 0 and rc == 0 and bool(resumed) and got == expected and len(got) == train_iters
    return {"ok": ok, "rc": rc, "expected": expected, "got": got, "resumed_at": resumed, "output": out,
            "detail": f"killed after iteration {max(before, default=0)}, resumed at {resumed[-1] if resumed else '-'}, "
                      f"{sum(got.get(i) == v for i, v in expected.items())}/{train_iters} losses bit-equal"}


def scenario_inf_grad(workdir, iterations=(2, 4, 5), limit=2, train_iters=7, nproc=4, fork=False):
    """An inf gradient at `iterations`: each is skipped and counted; `limit` of them in a row save and stop."""
    job = Job(workdir, gpt_args(workdir, "--inject-inf-grad-iterations", *map(str, iterations),
                                "--exit-after-nan-iterations", str(limit), train_iters=train_iters,
                                save_interval=1000, bf16=True), nproc=nproc, name="inf-grad", launcher="direct", fork=fork)
    codes = job.wait(600)
    out = job.output()
    line = r"iteration\s+(\d+)/.*?number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+)"
    found = re.findall(line, out)
    skipped = {int(i): int(s) for i, s, _ in found}
    nan = {int(i): int(n) for i, _, n in found}
    stop = next((i for i in iterations if all(j in iterations for j in range(i - limit + 1, i + 1))), None)
    expected = {i: int(i in iterations) for i in range(1, (stop or train_iters) + 1)}
    ok = (nan == expected and skipped == expected and set(codes.values()) == {3 if stop else 0}
          and (stop is None or latest(workdir) == f"global_step{stop}"))
    return {"ok": ok, "exit_codes": codes, "nan": nan, "skipped": skipped, "stopped_at": stop, "output": out,
            "detail": f"nan iterations {sorted(i for i, n in nan.items() if n)}, skipped "
                      f"{sorted(i for i, n in skipped.items() if n)}, exit codes {sorted(codes.values())}, "
                      f"latest {latest(workdir)}"}


# --------------------------------------------------------------------------- out of room, signals

ENOSPC_STAGES = (("layer_03", 2), ("mp_rank_01_model_states", 3), ("mp_rank_00_optim_states", 4),
                 ("manifest.json", 5), ("latest", 6))  # (file of the save, iteration): every stage of a save


def _sibling(workdir, name):
    """WORKDIR/NAME with the same corpus, for a run that must not share WORKDIR's checkpoints."""
    path = os.path.join(workdir, name)
    os.makedirs(path, exist_ok=True)
    for ext in (".bin", ".idx"):
        if not os.path.exists(os.path.join(path, "corpus" + ext)):
            os.symlink(os.path.join(workdir, "corpus" + ext), os.path.join(path, "corpus" + ext))
    return path


def _exit_seconds(job, since):
    """{rank: seconds from `since` to its exit} of a direct or srun launch (waits up to 10 minutes)."""
    seconds = {}
    while len(seconds) < len(job.procs) and time.monotonic() - since < 600:
        for r, p in enumerate(job.procs):
            if r not in seconds and p.poll() is not None:
                seconds[r] = time.monotonic() - since
        time.sleep(0.05)
    return seconds


def step_dirs(workdir):
    ckpt = os.path.join(workdir, "ckpt")
    return sorted(d for d in os.listdir(ckpt) if d.startswith("global_step")) if os.path.isdir(ckpt) else []


def keep_training_run(workdir, train_iters=8, stages=ENOSPC_STAGES, fork=False):
    """Save every iteration, ENOSPC at each stage of a save in turn, --keep-training-on-disk-full: every failed
    save is reported and removed, training goes on; its losses are those of an uninterrupted run."""
    inject = [a for name, it in stages for a in ("--inject-enospc", str(it), name)]
    job = Job(workdir, gpt_args(workdir, "--keep-training-on-disk-full", *inject, train_iters=train_iters,
                                save_interval=1), nproc=2, name="keep-training", launcher="direct", fork=fork)
    codes = job.wait(900)
    out = job.output()
    warnings = [line for line in out.splitlines() if line.startswith("WARNING: checkpoint not saved")]
    return {"exit_codes": codes, "losses": logged_losses(out), "warnings": warnings, "steps": step_dirs(workdir),
            "latest": latest(workdir), "output": out}


def enospc_stop_run(workdir, iteration=4, name="mp_rank_00_optim_states", train_iters=8, save_interval=2,
                    fork=False):
    """ENOSPC in `name` at the save of `iteration`, no flag: every rank stops, `latest` keeps the previous save."""
    job = Job(workdir, gpt_args(workdir, "--inject-enospc", str(iteration), name, train_iters=train_iters,
                                save_interval=save_interval), nproc=2, name="enospc", launcher="direct", fork=fork)
    return _stopped_run(job, workdir, f"saving checkpoint at iteration {iteration:7d}")


def oom_run(workdir, rank=1, iteration=4, train_iters=8, save_interval=2, fork=False):
    """Resume, and rank `rank`'s allocator fails in F of micro-batch 1 at `iteration`."""
    job = Job(workdir, gpt_args(workdir, "--inject-oom", str(rank), str(iteration), train_iters=train_iters,
                                save_interval=save_interval), nproc=2, name="oom", launcher="direct", fork=fork)
    return _stopped_run(job, workdir, "out of memory")


def _stopped_run(job, workdir, marker):
    """A run that must stop by itself once `marker` is logged: how long each rank took to exit, and what is left."""
    try:
        job.wait_for(lambda: marker in job.output(), 600)
        seconds = _exit_seconds(job, time.monotonic())
        codes = job.wait(5)
    finally:
        job.kill()
    out = job.output()
    return {"exit_codes": codes, "exit_seconds": seconds, "errors": rank_errors(out), "latest": latest(workdir),
            "steps": step_dirs(workdir), "losses": logged_losses(out), "output": out}


def signal_run(workdir, rank=1, after=4, train_iters=8, sig=signal.SIGUSR1, fork=False):
    """srun-like launch with --exit-signal-handler; `sig` to rank `rank` once iteration `after` is logged:
    every rank saves the iteration they agree on and exits 0."""
    job = Job(workdir, gpt_args(workdir, "--exit-signal-handler", train_iters=train_iters, save_interval=1000),
              nproc=2, name="signal", launcher="srun", fork=fork)
    try:
        if job.wait_for(lambda: f"iteration {after:8d}/" in job.output(), 600, poll=0.01):
            job.signal(rank, sig)
        codes = job.wait(600)
    finally:
        job.kill()
    out = job.output()
    found = re.search(r"exiting program at iteration (\d+) after receiving [^\n]*", out)
    return {"exit_codes": codes, "saved_at": int(found.group(1)) if found else None,
            "reason": found.group(0) if found else None, "latest": latest(workdir), "losses": logged_losses(out),
            "output": out}


def resume_run(workdir, train_iters=8, launcher="direct", fork=False):
    job = Job(workdir, gpt_args(workdir, train_iters=train_iters), nproc=2, name="resume", launcher=launcher,
              fork=fork)
    codes = job.wait(900)
    out = job.output()
    found = re.findall(r"successfully loaded checkpoint from .* at iteration (\d+)", out)
    return {"exit_codes": codes, "resumed_at": int(found[-1]) if found else None, "losses": logged_losses(out),
            "output": out}


def out_of_room_chain(workdir, train_iters=8, fork=False):
    """The keep-training run (the reference losses), then in WORKDIR: ENOSPC stops a run at iteration 4
    (latest: global_step2), an OOM stops the resumed run at iteration 4 (latest still global_step2), SIGUSR1
    saves a resumed run mid-way, and a last run resumes from there to the end. `fork`: every launch's ranks
    forked (Job's `fork`)."""
    keep = keep_training_run(_sibling(workdir, "reference"), train_iters, fork=fork)
    enospc = enospc_stop_run(workdir, train_iters=train_iters, fork=fork)
    oom = oom_run(workdir, train_iters=train_iters, fork=fork)
    sig = signal_run(workdir, train_iters=train_iters, fork=fork)
    final = resume_run(workdir, train_iters, fork=fork)
    ref = keep["losses"]
    resumed = {**{i: v for i, v in oom["losses"].items()}, **sig["losses"], **final["losses"]}
    return {"keep": keep, "enospc": enospc, "oom": oom, "signal": sig, "final": final,
            "bit_exact": sum(resumed.get(i) == ref.get(i) for i in range(3, train_iters + 1)),
            "compared": train_iters - 2}


def scenario_out_of_room(workdir):
    r = out_of_room_chain(workdir)
    k, e, o, s = r["keep"], r["enospc"], r["oom"], r["signal"]
    ok = (set(k["exit_codes"].values()) == {0} and len(k["warnings"]) == len(ENOSPC_STAGES)
          and set(e["exit_codes"].values()) == {2} and e["latest"] == "global_step2" and len(e["errors"]) == 1
          and o["exit_codes"] == {0: 1, 1: 4} and o["latest"] == "global_step2"
          and set(s["exit_codes"].values()) == {0} and s["latest"] == f"global_step{s['saved_at']}"
          and r["bit_exact"] == r["compared"])
    return {"ok": ok, "output": "", **{k2: {a: b for a, b in v.items() if a != "output"} if isinstance(v, dict) else v
                                        for k2, v in r.items()},
            "detail": f"ENOSPC: {len(k['warnings'])} failed saves skipped, stop exit codes "
                      f"{sorted(e['exit_codes'].values())} in {max(e['exit_seconds'].values(), default=0):.1f} s; "
                      f"OOM exit codes {sorted(o['exit_codes'].values())} in "
                      f"{max(o['exit_seconds'].values(), default=0):.1f} s; SIGUSR1 saved at {s['saved_at']}; "
                      f"{r['bit_exact']}/{r['compared']} resumed losses bit-equal"}


# --------------------------------------------------------------------------- files that would run code

class Payload:
    """Pickles as a call to open(path, "w"): unpickling it creates `path` (what a malicious file could do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def craft(path, payload_path, torch_format=True):
    """Replace `path` by a pickle that creates `payload_path` when loaded (torch.save's zip format, or a bare
    pickle as an .npy cache would be); the step's manifest goes too, as a sender would remove it."""
    import pickle
    import torch
    if torch_format:
        torch.save({"module": Payload(payload_path), "optimizer_state_dict": None}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(Payload(payload_path), f)
    manifest = os.path.join(os.path.dirname(path), "manifest.json")
    if os.path.exists(manifest):
        os.remove(manifest)
    return path


def unsafe_resume(workdir, targets, launcher, train_iters=8):
    """Craft each of `targets` (paths relative to WORKDIR), resume under `launcher`, put the files back.
    Returns the exit codes, the error lines and which payloads ran."""
    import shutil
    backup = {}
    payloads = {}
    for i, rel in enumerate(targets):
        path = os.path.join(workdir, rel)
        backup[path] = path + ".orig"
        shutil.copy2(path, backup[path])
        payloads[rel] = os.path.join(workdir, f"payload-ran-{i}")
        craft(path, payloads[rel], torch_format=rel.endswith(".pt"))
    step = os.path.dirname(os.path.join(workdir, targets[0]))
    manifest = os.path.join(step, "manifest.json")
    try:
        job = Job(workdir, gpt_args(workdir, train_iters=train_iters), nproc=2, name=f"unsafe-{launcher}",
                  launcher=launcher)
        codes = job.wait(600)
    finally:
        for path, orig in backup.items():
            os.replace(orig, path)
    out = job.output()
    return {"exit_codes": codes, "errors": rank_errors(out), "ran": [rel for rel, p in payloads.items()
                                                                     if os.path.exists(p)],
            "named": {rel: os.path.basename(rel) in "\n".join(rank_errors(out)) for rel in targets},
            "worker_codes": worker_exit_codes(out), "manifest_removed": not os.path.exists(manifest), "output": out}


def index_cache(workdir, kind="doc_idx"):
    return sorted(f for f in os.listdir(workdir) if f.endswith(f"_{kind}.npy"))[0]


def scenario_unsafe(workdir):
    """A checkpoint and an index cache replaced by pickles that create a file: refused, the payload never runs."""
    _train_then(workdir, "unsafe-save", train_iters=4, nproc=2)
    step = os.path.join("ckpt", latest(workdir))
    files = [os.path.join(step, f) for f in ("mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                             "layer_01-model_states.pt")]
    runs = {"torchrun": unsafe_resume(workdir, files, "torchrun", train_iters=4),
            "srun": unsafe_resume(workdir, [index_cache(workdir)], "srun", train_iters=4),
            "deepspeed": unsafe_resume(workdir, [os.path.join(step, "mp_rank_00_model_states.pt")], "deepspeed",
                                       train_iters=4)}
    ok = all(not r["ran"] and all(r["named"].values()) and len(r["errors"]) == 1 for r in runs.values())
    ok = ok and set(runs["srun"]["exit_codes"].values()) == {2}
    return {"ok": ok, "runs": {k: {a: b for a, b in v.items() if a != "output"} for k, v in runs.items()},
            "detail": "; ".join(f"{k}: payload ran {len(v['ran'])}x, exit {v['exit_codes']}" for k, v in runs.items())}


SCENARIOS = {"freeze": scenario_freeze, "shard": scenario_shard, "truncate": scenario_truncate,
             "restart": scenario_restart, "inf-grad": scenario_inf_grad, "out-of-room": scenario_out_of_room,
             "unsafe": scenario_unsafe}
FAULTS = {"freeze": "SIGSTOP rank 3 at iteration 3, 1-minute timeout",
          "shard": "delete a ZeRO shard of the last checkpoint, resume",
          "truncate": "truncate a layer file of the last checkpoint, resume",
          "restart": "SIGKILL rank 1 after the 2nd save, torchrun --max-restarts 1",
          "inf-grad": "inf gradient at iterations 2, 4, 5 (bf16), --exit-after-nan-iterations 2",
          "out-of-room": "ENOSPC at each stage of a save; allocator failure on rank 1; SIGUSR1 to rank 1; resume",
          "unsafe": "checkpoint files and an index cache replaced by pickles that create a file; resume"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--workdir", default=None, help="keep every run's files here (default: a temporary folder)")
    a = p.parse_args(argv)
    unknown = [s for s in a.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    base = a.workdir or tempfile.mkdtemp(prefix="fault_injection_")
    rows = []
    for name in a.scenarios or list(SCENARIOS):
        workdir = os.path.join(base, name)
        os.makedirs(workdir, exist_ok=True)
        write_corpus(os.path.join(workdir, "corpus"))
        start = time.monotonic()
        try:
            result = SCENARIOS[name](workdir)
        except Exception as e:  # noqa: BLE001 - a scenario that breaks is a row of the table
            result = {"ok": False, "detail": f"{type(e).__name__}: {e}"}
        rows.append((name, FAULTS[name], "as promised" if result["ok"] else "BROKEN",
                     f"{time.monotonic() - start:.0f} s",
                     result.get("detail", "").splitlines()[0] if result.get("detail") else ""))
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump({k: v for k, v in result.items() if k != "output"}, f, indent=1, default=str)
        print(f"{name}: {rows[-1][2]} ({rows[-1][4]})", flush=True)
    header = ("scenario", "fault injected", "outcome", "time", "how it ended")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print()
    for row in [header] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(f"\nlogs: {base}/<scenario>/*.log")
    return 0 if all(r[2] == "as promised" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
