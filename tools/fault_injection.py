"""Inject faults into tiny pretrain_gpt.py runs and print a table of what was tried and how each ended.

    python -m tools.fault_injection                 # every scenario (about 10 minutes on 2 cores)
    python -m tools.fault_injection freeze restart  # some of them

Each scenario trains a 2-layer GPT on 4 gloo ranks (pipeline 2 x data 2) on a random corpus and injects
one fault, from outside (a signal to one worker, a damaged checkpoint file) or with
--inject-inf-grad-iterations. The restart runs under torchrun; the others start one process a rank, as
srun does, so that each rank's own exit code is seen (torchrun would SIGTERM the rest after the first).

| scenario | fault                                                     | promised                                  |
|----------|-----------------------------------------------------------|-------------------------------------------|
| freeze   | SIGSTOP to rank 3 mid-training, 1-minute timeout          | ranks 0-2 exit 1 within 2 min, one line each |
| shard    | a ZeRO optimizer shard of the last checkpoint deleted     | exit 2 on every rank, the file named once |
| truncate | a layer file of the last checkpoint cut in half           | exit 2 on every rank, the file named once |
| restart  | SIGKILL to rank 1 after the second save, --max-restarts 1 | the job resumes, losses bit-equal         |
| inf-grad | an inf gradient at iterations 2, 4, 5 (bf16), limit 2     | each skipped and counted; saved, exit 3   |

The launching helpers are shared with tests/training/test_faults.py.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import child_env
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

    launcher "torchrun" (with --max-restarts), or "direct": one process a rank with RANK, WORLD_SIZE and
    MASTER_* set, as srun starts them, so that each rank's own exit code and output are seen.
    """

    def __init__(self, workdir, args, nproc=4, max_restarts=0, name="job", launcher="torchrun"):
        self.workdir, self.name, self.tag = workdir, name, uuid.uuid4().hex
        self.log_path = os.path.join(workdir, f"{name}.log")
        script = [os.path.join(ROOT, "pretrain_gpt.py"), *args]
        env = child_env(ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{MARK: self.tag})
        port = str(free_port())
        self._log = open(self.log_path, "w")
        self.start = time.monotonic()
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_addr", "127.0.0.1", "--master_port", port, "--max-restarts", str(max_restarts),
                   "--monitor-interval", "0.5", *script]
            self.procs = [subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                           start_new_session=True)]
        else:
            env.update(WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            self.procs = [subprocess.Popen([sys.executable, *script], cwd=workdir, stdout=self._log,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                          for r in range(nproc)]
        self.direct = launcher != "torchrun"

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


def worker_tracebacks(out):
    """Traceback frames of the workers' code (torchrun's own summary traceback is not theirs)."""
    return re.findall(r'File ".*?(?:megatron_ds|deepspeed)/[^"]+", line \d+', out)


def rank_errors(out):
    """The one-line errors the ranks printed ('pretrain_gpt.py: error: ...')."""
    return [line for line in out.splitlines() if "pretrain_gpt.py: error:" in line]


def worker_exit_codes(out):
    """{rank: exitcode} from torchrun's failure summary (ranks that exited non-zero, and the first one)."""
    codes = {}
    for m in re.finditer(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out):
        codes[int(m.group(1))] = int(m.group(2))
    return codes


# --------------------------------------------------------------------------- scenarios

def scenario_freeze(workdir, timeout_minutes=1.0, nproc=4, frozen=3):
    """SIGSTOP one rank mid-training; the others must exit on their own, naming what they waited on.

    Launched as srun does (one process a rank, nothing kills the others) to see every rank's own exit.
    """
    job = Job(workdir, gpt_args(workdir, "--distributed-timeout-minutes", str(timeout_minutes), train_iters=400,
                                save_interval=1000), nproc=nproc, name="freeze", launcher="direct")
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


def _train_then(workdir, name, train_iters=4, nproc=4):
    """A short run that leaves a complete checkpoint at its last iteration."""
    job = Job(workdir, gpt_args(workdir, train_iters=train_iters), nproc=nproc, name=name)
    rc = job.wait(600)
    if rc != 0:
        raise RuntimeError(f"{name} failed (rc {rc}):\n{job.output()[-3000:]}")
    return os.path.join(workdir, "ckpt", latest(workdir))


def resume_damaged(workdir, name, damages, nproc=4):
    """Save, damage files of the checkpoint, resume: every rank must stop with exit code 2, each file named once."""
    _train_then(workdir, name + "-save", nproc=nproc)
    step_dir = os.path.join(workdir, "ckpt", latest(workdir))
    paths = [damage(step_dir) for damage in damages]
    job = Job(workdir, gpt_args(workdir, train_iters=6), nproc=nproc, name=name, launcher="direct")
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


def scenario_restart(workdir, train_iters=12, save_interval=2, kill_rank=1, nproc=4):
    """SIGKILL one rank right after the second save; torchrun restarts the job, which resumes from --load."""
    reference_dir = os.path.join(workdir, "reference")
    os.makedirs(reference_dir, exist_ok=True)
    os.symlink(os.path.join(workdir, "corpus.bin"), os.path.join(reference_dir, "corpus.bin"))
    os.symlink(os.path.join(workdir, "corpus.idx"), os.path.join(reference_dir, "corpus.idx"))
    reference = Job(reference_dir, gpt_args(reference_dir, train_iters=train_iters, save_interval=save_interval),
                    nproc=nproc, name="uninterrupted")
    ref_rc = reference.wait(900)
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


def scenario_inf_grad(workdir, iterations=(2, 4, 5), limit=2, train_iters=7, nproc=4):
    """An inf gradient at `iterations`: each is skipped and counted; `limit` of them in a row save and stop."""
    job = Job(workdir, gpt_args(workdir, "--inject-inf-grad-iterations", *map(str, iterations),
                                "--exit-after-nan-iterations", str(limit), train_iters=train_iters,
                                save_interval=1000, bf16=True), nproc=nproc, name="inf-grad", launcher="direct")
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


SCENARIOS = {"freeze": scenario_freeze, "shard": scenario_shard, "truncate": scenario_truncate,
             "restart": scenario_restart, "inf-grad": scenario_inf_grad}
FAULTS = {"freeze": "SIGSTOP rank 3 at iteration 3, 1-minute timeout",
          "shard": "delete a ZeRO shard of the last checkpoint, resume",
          "truncate": "truncate a layer file of the last checkpoint, resume",
          "restart": "SIGKILL rank 1 after the 2nd save, torchrun --max-restarts 1",
          "inf-grad": "inf gradient at iterations 2, 4, 5 (bf16), --exit-after-nan-iterations 2"}


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
