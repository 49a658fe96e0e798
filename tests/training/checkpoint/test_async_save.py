"""--async-save and --keep-last-checkpoints: real pretrain_gpt.py runs (2 gloo ranks, PP=2, zbv, dropout on),
launched one process a rank (each rank's own exit code), through tools/fault_injection.py; each rank is forked
from the test launcher's fork server (its imports done once: Job(fork=True), test_resume's "forked" srun-like
launch), except the torchrun agents' workers.

One chain of launches is shared:
1. the reference: synchronous saves every 2 iterations, --keep-last-checkpoints 2 --keep-every 4;
2. in the background, rank 1 killed (SIGKILL) in the middle of its write of iteration 4: `latest` stays at
   global_step2, whose files are whole;
3. resumed from there in the background, ENOSPC in a ZeRO shard written in the background at iteration 6:
   both ranks exit 2 with the synchronous path's one line, `latest` at global_step4, global_step6 gone;
4. resumed from there in the background to the end (--exit-interval at the last iteration: the exit waits for
   the save in flight), --keep-last-checkpoints 2: every loss equals the reference's bit for bit, and so do
   the weights and the optimizer state saved at iteration 8.
The moments of a save, each a SIGKILL of every rank (MEGATRON_DS_KILL_DURING_SAVE=ITER:*:MOMENT), chained in one
folder beside the reference: after the host copy (copied) at 4, resumed from 2 and killed by rank 0 in the middle
of --keep-last-checkpoints 1 deleting step 4 (deleting) once 6 was committed, resumed from 6 and killed after the
writes (written) and after the agreement (agreed) of 8, then resumed from 6 to the end: each start loads the
last committed step and every logged loss is the reference's; the end's weights and Adam state too.
Across a layout change: a run at PP2 x DP2 saving in the background at 3, and its resume from there at PP4
(the ZeRO-1 state re-cut by name, relayout.py): iterations 4..8 equal the uninterrupted run's (rel 1e-5: the
DP all-reduce's order differs) and the fp32 masters and Adam's moments and step come back exactly.
SIGUSR1 to one rank under --exit-signal-handler while a background save is in flight: both ranks wait for it,
save the iteration they agree on, and exit 0.
Two torchrun agents on this machine as two nodes (--nnodes 2, c10d rendezvous, one rank each): saved in the
background, stopped at 4, resumed by two new agents to 8: the reference's losses.
And a mixture of experts (an expert bias, a buffer the checkpoint carries) under Seq1F1B (2 segments):
saved in the background at 2 and 4, stopped by --exit-interval 4, resumed to 8: the losses of a run
without saves, bit for bit.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import child_env
from megatron_ds.training.initialize import free_port
from tools import fault_injection as fi

ITERS = 8
# a slow disk: training runs on for iterations while the writers write (a copy that shared the live tensors
# would be written after the optimizer changed them), and the next save waits for the one in flight
SLOW = {"MEGATRON_DS_TEST_SAVE_DELAY_S": "0.6"}
# the resumed run asserts that the save of iteration 8 waited for iteration 6's: its write outlasts two iterations
# of a loaded machine (one iteration took up to 3 s with the 2 cores shared by 40 processes)
SLOWER = {"MEGATRON_DS_TEST_SAVE_DELAY_S": "6"}
ZBV = ("--num-layers", "4", "--save-write-probe-mib", "2")
LINE = re.compile(r"checkpoint at iteration (\d+): training stopped (\d+\.\d+) s(?: to copy (\d+\.\d) MB to host "
                  r"memory)?, written (in the background|in it); per rank 0: (\d+\.\d) MB in (\d+\.\d+) s = "
                  r"(\d+\.\d) MB/s( \((\d+\.\d+)x the plain sequential write's (\d+\.\d) MB/s\))?; 1: ")


def _run(workdir, name, *extra, env=None):
    job = fi.Job(workdir, fi.gpt_args(workdir, *ZBV, *extra, train_iters=ITERS, schedule="zbv"), nproc=2, name=name,
                 launcher="direct", env=env, fork=True)
    codes = job.wait(900)
    out = job.output()
    return {"exit_codes": codes, "losses": fi.logged_losses(out), "latest": fi.latest(workdir),
            "steps": fi.step_dirs(workdir), "errors": fi.rank_errors(out), "output": out}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_save")
    ref_dir, dirs = str(root / "reference"), str(root / "chain")
    for d in (ref_dir, dirs):
        os.makedirs(d)
        write_corpus(os.path.join(d, "corpus"))
    runs = {"ref": _run(ref_dir, "reference", "--keep-last-checkpoints", "2", "--keep-every", "4")}
    runs["killed"] = _run(dirs, "killed", "--async-save", env={"MEGATRON_DS_KILL_DURING_SAVE": "4:1", **SLOW})
    runs["enospc"] = _run(dirs, "enospc", "--async-save", "--inject-enospc", "6", "mp_rank_00_optim_states", env=SLOW)
    runs["final"] = _run(dirs, "final", "--async-save", "--keep-last-checkpoints", "2", "--exit-interval", str(ITERS),
                         "--tensorboard-dir", str(root / "tb"), env=SLOWER)
    yield ref_dir, dirs, str(root / "tb"), runs
    shutil.rmtree(root, ignore_errors=True)


def _tensors_equal(a, b, where):
    import torch
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _tensors_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _tensors_equal(x, y, f"{where}[{i}]")


def _saved_states(step_dir):
    from megatron_ds.training.checkpoint import safe_load
    states = {}
    for name in sorted(os.listdir(step_dir)):
        if name.startswith("layer_"):
            states[name] = safe_load.load(os.path.join(step_dir, name))
        elif "optim_states" in name:
            states[name] = safe_load.load(os.path.join(step_dir, name))["optimizer_state_dict"]
    return states


@pytest.mark.timeout(2400)  # four launches
def test_background_saves_commit_whole_steps_and_resume_bit_exact(chain):
    ref_dir, dirs, tb_dir, runs = chain
    ref, killed, enospc, final = runs["ref"], runs["killed"], runs["enospc"], runs["final"]
    assert ref["exit_codes"] == {0: 0, 1: 0}, ref["output"][-3000:]
    assert sorted(ref["losses"]) == list(range(1, ITERS + 1))
    # retention: the last two plus the multiples of 4, each deleted only once a newer one was committed
    assert ref["steps"] == ["global_step4", "global_step6", "global_step8"] and ref["latest"] == "global_step8"
    assert "deleted checkpoints of iterations 2 (--keep-last-checkpoints 2, --keep-every 4)" in ref["output"]
    sync_lines = LINE.findall(ref["output"])
    assert [int(m[0]) for m in sync_lines] == [2, 4, 6, 8] and {m[3] for m in sync_lines} == {"in it"}
    assert all(m[7] for m in sync_lines), sync_lines  # the plain sequential write, measured once, beside each

    # 2. rank 1 died while its writer wrote iteration 4: nothing of iteration 4 is named
    assert killed["exit_codes"][1] == -9 and killed["exit_codes"][0] != 0, killed["output"][-3000:]
    assert "saving checkpoint at iteration       4 to" in killed["output"]
    assert "successfully saved checkpoint at iteration       4" not in killed["output"]
    assert killed["latest"] == "global_step2"
    assert {i: killed["losses"][i] for i in (1, 2, 3, 4)} == {i: ref["losses"][i] for i in (1, 2, 3, 4)}

    # 3. out of room in the background: the synchronous path's one line and exit code, committed steps intact
    out = enospc["output"]
    assert enospc["exit_codes"] == {0: 2, 1: 2}, out[-3000:]
    assert "successfully loaded checkpoint from" in out and "at iteration 2" in out
    assert len(enospc["errors"]) == 1, enospc["errors"]
    assert re.search(r"error: saving iteration 6: \S+/global_step6/zero_pp_rank_0_mp_rank_0\d_optim_states\.pt: No "
                     r"space left on device \(ENOSPC\): it needed \d+ bytes, \d+ are free there; the previous "
                     r"checkpoint and \S+/latest are intact", enospc["errors"][0]), enospc["errors"][0]
    assert not fi.worker_tracebacks(out), out[-3000:]
    assert enospc["latest"] == "global_step4" and "global_step6" not in enospc["steps"]

    # 4. resumed from the last committed step to the end: the reference's losses, weights and Adam state
    out = final["output"]
    assert final["exit_codes"] == {0: 0, 1: 0}, out[-3000:]
    assert "at iteration 4" in out and "successfully loaded checkpoint from" in out
    got = {**{i: killed["losses"][i] for i in (1, 2)}, **{i: enospc["losses"][i] for i in (3, 4)}, **final["losses"]}
    assert got == ref["losses"], (got, ref["losses"])
    ref_states = _saved_states(os.path.join(ref_dir, "ckpt", "global_step8"))
    got_states = _saved_states(os.path.join(dirs, "ckpt", "global_step8"))
    assert len(ref_states) == 8 and sorted(ref_states) == sorted(got_states)
    for name in ref_states:
        _tensors_equal(ref_states[name], got_states[name], name)
    # the step this run loaded is kept; global_step2 went once 6 was committed
    assert final["steps"] == ["global_step4", "global_step6", "global_step8"] and final["latest"] == "global_step8"
    lines = LINE.findall(out)
    assert [int(m[0]) for m in lines] == [6, 8] and {m[3] for m in lines} == {"in the background"}
    assert all(float(m[2]) > 1.0 and m[7] for m in lines), lines  # MB copied to host; the probe beside each
    assert re.search(r"waited \d+\.\d\d s for the background save of iteration 8 \(before exiting program at "
                     r"iteration 8 \(--exit-interval 8\)\)", out)
    assert re.search(r"waited \d+\.\d\d s for the background save of iteration 6 \(before the save of iteration 8\)",
                     out)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(next(os.path.join(tb_dir, f) for f in os.listdir(tb_dir) if "tfevents" in f))
    acc.Reload()
    by_step = {e.step: e.value for e in acc.Scalars("checkpoint/bytes")}
    step8 = os.path.join(dirs, "ckpt", "global_step8")
    on_disk = sum(os.path.getsize(os.path.join(step8, f)) for f in os.listdir(step8) if f.endswith(".pt"))
    assert by_step[8] == pytest.approx(on_disk, rel=1e-6), (by_step, on_disk)  # TensorBoard keeps float32
    for tag in ("checkpoint/blocking-time", "checkpoint/write-time", "checkpoint/write-MBps/rank0",
                "checkpoint/write-MBps/rank1", "checkpoint/write-over-sequential/rank0"):
        assert [e.step for e in acc.Scalars(tag)] == [6, 8], tag


@pytest.fixture(scope="module")
def moments(chain, tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("save_moments"))
    write_corpus(os.path.join(wd, "corpus"))
    runs = {}
    for name, kill, extra in (("copied", "4:*:copied", ()), ("deleting", "4:0:deleting", ("--keep-last-checkpoints", "1")),
                              ("written", "8:*:written", ()), ("agreed", "8:*:agreed", ()),
                              ("end", None, ("--keep-last-checkpoints", "1"))):
        env = {"MEGATRON_DS_KILL_DURING_SAVE": kill} if kill else None
        runs[name] = _run(wd, name, "--async-save", *extra, env=env)
        runs[name]["hidden"] = sorted(d for d in os.listdir(os.path.join(wd, "ckpt")) if d.startswith("."))
        runs[name]["manifests"] = {d: os.path.isfile(os.path.join(wd, "ckpt", d, "manifest.json"))
                                   for d in runs[name]["steps"]}
    yield chain[0], wd, chain[3]["ref"], runs
    shutil.rmtree(wd, ignore_errors=True)


LOADED = re.compile(r"successfully loaded checkpoint from \S+ at iteration (\d+)")
# each run: the step it loaded (None: a fresh start), `latest` after it, the step folders then and which have a
# manifest, the hidden folders left
EXPECTED = {
    "copied": (None, "global_step2", {"global_step2": True, "global_step4": False}, []),
    "deleting": ("2", "global_step6", {"global_step2": True, "global_step6": True}, [".deleting-global_step4"]),
    "written": ("6", "global_step6", {"global_step2": True, "global_step6": True, "global_step8": False},
                [".deleting-global_step4"]),
    "agreed": ("6", "global_step6", {"global_step2": True, "global_step6": True, "global_step8": False},
               [".deleting-global_step4"]),
    "end": ("6", "global_step8", {"global_step6": True, "global_step8": True}, []),
}


@pytest.mark.timeout(2400)  # the chain's four launches and five more
@pytest.mark.parametrize("moment", list(EXPECTED))
def test_a_kill_at_each_moment_of_a_background_save_resumes_from_the_last_committed_step(moments, moment):
    ref_dir, wd, ref, runs = moments
    run, (loaded, latest, manifests, hidden) = runs[moment], EXPECTED[moment]
    out = run["output"]
    if moment == "end":
        assert run["exit_codes"] == {0: 0, 1: 0}, out[-3000:]
        assert "finished deleting the checkpoints of iterations 4 (an earlier run stopped while deleting them)" in out
        assert "deleted checkpoints of iterations 2 (--keep-last-checkpoints 1)" in out  # 6 was loaded: kept
        ref_states = _saved_states(os.path.join(ref_dir, "ckpt", "global_step8"))
        got_states = _saved_states(os.path.join(wd, "ckpt", "global_step8"))
        assert len(ref_states) == 8 and sorted(ref_states) == sorted(got_states)
        for name in ref_states:
            _tensors_equal(ref_states[name], got_states[name], name)
    elif moment == "deleting":  # rank 0 died in the deletion, rank 1 at its next transfer from rank 0
        assert run["exit_codes"][0] == -9 and run["exit_codes"][1] != 0, out[-3000:]
    else:  # both ranks die at the moment, unless the first one's death reaches the other before its own
        # writer thread does (its training thread's next collective fails: one line, exit 1)
        codes = run["exit_codes"]
        assert -9 in codes.values() and all(c == -9 or c == 1 for c in codes.values()), out[-3000:]
        assert all(c == -9 for c in codes.values()) or "a peer is frozen or died" in out, out[-3000:]
    assert [m for m in LOADED.findall(out)] == ([loaded] if loaded else []), out[-3000:]
    assert run["latest"] == latest and run["manifests"] == manifests and run["hidden"] == hidden
    first = int(loaded) + 1 if loaded else 1
    assert run["losses"] and min(run["losses"]) == first, run["losses"]
    assert run["losses"] == {i: ref["losses"][i] for i in run["losses"]}


@pytest.mark.timeout(1800)  # two launches of 4 ranks
def test_a_background_save_at_pp2_dp2_resumes_at_pp4(tmp_path):
    from tests.training.checkpoint.test_universal_checkpoint import CAPTURE, assert_same_tensors, captured
    from tests.training.test_resume import launch
    write_corpus(str(tmp_path / "corpus"))
    # untied: each parameter on one stage, as the capture's comparison wants
    hard = ("--num-layers", "4", "--train-iters", str(ITERS), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--untie-embeddings-and-output-weights")
    ckpt = str(tmp_path / "ckpt")
    capture = lambda name: ("--capture-dir", str(tmp_path / "capture" / name))  # noqa: E731
    full, out = launch(tmp_path, "pp2_dp2", "--async-save", "--save", ckpt, "--save-interval", "3",
                       "--exit-interval", str(ITERS), *capture("pp2_dp2"), nproc=4, hard=hard, entry=CAPTURE,
                       launcher="forked")
    assert "(in the background)" in out and fi.latest(str(tmp_path)) == f"global_step{ITERS}"
    with open(os.path.join(ckpt, "latest"), "w") as f:  # resume from the background save of iteration 3
        f.write("global_step3")
    resumed, out = launch(tmp_path, "pp4", "--load", ckpt, "--pipeline-model-parallel-size", "4",
                          *capture("pp4"), nproc=4, hard=hard, entry=CAPTURE, launcher="forked")
    assert "re-cut parameter by parameter" in out and "at iteration 3" in out, out[-3000:]
    assert [r["iteration"] for r in full] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in resumed] == list(range(4, ITERS + 1))
    worst = max(abs(r["loss"] - f["loss"]) / abs(f["loss"]) for r, f in zip(resumed, full[3:]))
    assert worst < 1e-5, (resumed, full[3:])
    assert [r["lr"] for r in resumed] == pytest.approx([r["lr"] for r in full[3:]], rel=1e-12)
    runs = {"tmp": tmp_path}
    saved, saved_steps, _ = captured(runs, "pp2_dp2", "save3")
    loaded, steps, iterations = captured(runs, "pp4", "load")
    assert saved_steps == steps == {3} and iterations == {3}
    assert_same_tensors(loaded, saved, ("fp32", "exp_avg", "exp_avg_sq", "module"), "pp4")


MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--moe-aux-loss-coeff", "0.01")


@pytest.mark.timeout(1800)  # three launches
def test_moe_under_seq1f1b_resumes_bit_exact_from_a_background_save(tmp_path):
    config = tmp_path / "seq1f1b.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                                  "pipeline": {"schedule": "seq1f1b", "seq_splits": 2}}))
    write_corpus(str(tmp_path / "corpus"))
    wd = str(tmp_path)

    def run(name, *extra):
        args = fi.gpt_args(wd, "--num-layers", "4", *MOE, *extra, "--deepspeed_config", str(config),
                           train_iters=ITERS)
        job = fi.Job(wd, args, nproc=2, name=name, launcher="direct", env=SLOW, fork=True)
        codes, out = job.wait(900), job.output()
        assert codes == {0: 0, 1: 0}, out[-3000:]
        return fi.logged_losses(out), out

    ref, _ = run("reference", "--save", str(tmp_path / "ref_ckpt"), "--load", str(tmp_path / "ref_ckpt"),
                 "--save-interval", "1000")  # one synchronous save, at the end
    first, out = run("first", "--async-save", "--exit-interval", "4")
    assert "(in the background)" in out and fi.latest(wd) == "global_step4"
    second, out = run("second", "--async-save")
    assert "at iteration 4" in out and fi.latest(wd) == f"global_step{ITERS}"
    assert sorted(ref) == list(range(1, ITERS + 1))
    assert {**first, **second} == ref


def _two_nodes(workdir, name, *extra):
    """pretrain_gpt.py under two torchrun agents, one rank each, meeting through a c10d rendezvous."""
    port, script = free_port(), [os.path.join(fi.ROOT, "pretrain_gpt.py"), *fi.gpt_args(workdir, *ZBV, *extra,
                                                                                     train_iters=ITERS, schedule="zbv")]
    env = child_env(fi.ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **SLOW)
    logs = [open(os.path.join(workdir, f"{name}_node{n}.log"), "w") for n in (0, 1)]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                                "--node_rank", str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                "--rdzv-id", name, "--monitor-interval", "0.5", *script],
                               cwd=workdir, env=env, stdout=logs[n], stderr=subprocess.STDOUT) for n in (0, 1)]
    try:
        codes = [a.wait(timeout=900) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        for f in logs:
            f.close()
    out = "".join(open(f.name).read() for f in logs)
    return codes, out


@pytest.mark.timeout(1800)  # two launches of two agents
def test_two_agents_as_two_nodes_save_in_the_background_and_resume(chain, tmp_path):
    ref = chain[3]["ref"]["losses"]
    write_corpus(str(tmp_path / "corpus"))
    codes, first = _two_nodes(str(tmp_path), "first", "--async-save", "--exit-interval", "4")
    assert codes == [0, 0], first[-3000:]
    assert "(in the background)" in first and fi.latest(str(tmp_path)) == "global_step4"
    codes, second = _two_nodes(str(tmp_path), "second", "--async-save")
    assert codes == [0, 0], second[-3000:]
    assert "at iteration 4" in second and fi.latest(str(tmp_path)) == f"global_step{ITERS}"
    assert {**fi.logged_losses(first), **fi.logged_losses(second)} == ref


@pytest.mark.timeout(900)  # one launch
def test_a_signal_waits_for_the_save_in_flight(chain, tmp_path):
    import signal
    ref = chain[3]["ref"]["losses"]
    wd = str(tmp_path)
    write_corpus(os.path.join(wd, "corpus"))
    job = fi.Job(wd, fi.gpt_args(wd, *ZBV, "--async-save", "--exit-signal-handler", train_iters=ITERS, schedule="zbv"),
                 nproc=2, name="signal", launcher="srun", env=SLOW, fork=True)
    try:
        if job.wait_for(lambda: "(in the background)" in job.output(), 600, poll=0.01):
            job.signal(1, signal.SIGUSR1)
        codes = job.wait(600)
    finally:
        job.kill()
    out = job.output()
    assert codes == {0: 0, 1: 0}, out[-3000:]
    found = re.search(r"waited \d+\.\d\d s for the background save of iteration (\d+) \(before exiting program at "
                      r"iteration (\d+) after receiving (SIGUSR1|a signal on another rank)", out)
    assert found, out[-3000:]
    assert fi.latest(wd) == f"global_step{found.group(2)}" and int(found.group(2)) < ITERS
    losses = fi.logged_losses(out)
    assert losses == {i: ref[i] for i in range(1, int(found.group(2)) + 1)}
