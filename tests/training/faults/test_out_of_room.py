"""Out of room, out of memory, a signal, and files that would run code: real pretrain_gpt.py runs (2 gloo
ranks, PP=2, our 1F1B), with tools/fault_injection.py.

One chain of launches is shared (each launch costs half a minute of start-up on a loaded 2-core machine):
1. the reference: save every iteration, ENOSPC injected at each stage of a save in turn (a layer file,
   the model states holding the client state, a ZeRO shard, the manifest, `latest`), under
   --keep-training-on-disk-full: each failed save is reported and removed, training goes on;
2. ENOSPC in a ZeRO shard at the save of iteration 4, no flag: both ranks exit 2, one line naming the
   file and the bytes it needed, `latest` still names global_step2;
3. resumed from there, rank 1's allocator fails in F of micro-batch 1 at iteration 4: it names itself,
   its stage, the op, the peak and the knobs and exits 4, the other rank ends at once (exit 1), `latest`
   untouched;
4. resumed again under an srun-like launch with --exit-signal-handler, SIGUSR1 to rank 1 alone after
   iteration 4: both ranks save the same iteration and exit 0;
5. resumed from that save to the end: every loss after iteration 2 equals the reference's bit for bit.
Then the chain's last checkpoint and index cache are replaced by pickles that would create a file, and
resumed under torchrun (three checkpoint files at once), srun (the index cache) and the deepspeed launcher
(the client state): the payload never runs, each run stops with exit code 2 naming every crafted file.
The chain's ranks are forked from the test launcher's fork server (fault_injection's `fork`: ~4 s of CPU of imports
a rank less): its cases are the ranks' handling of the faults, not the launcher; the refusals keep every launcher.
"""
import os
import re
import shutil

import pytest

from megatron_ds.testing.corpus import write_corpus
from tools import fault_injection as fi

ITERS = 8


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("out_of_room"))
    write_corpus(os.path.join(workdir, "corpus"))
    result = fi.out_of_room_chain(workdir, train_iters=ITERS, fork=True)
    yield workdir, result
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.timeout(1800)  # five launches
def test_disk_full_out_of_memory_and_signal_lose_nothing(chain):
    workdir, r = chain
    keep, enospc, oom, sig, final = r["keep"], r["enospc"], r["oom"], r["signal"], r["final"]
    ref = keep["losses"]
    assert keep["exit_codes"] == {0: 0, 1: 0}, keep["output"][-3000:]
    assert sorted(ref) == list(range(1, ITERS + 1))
    for (name, iteration), line in zip(fi.ENOSPC_STAGES, keep["warnings"]):
        where = "ckpt/latest" if name == "latest" else rf"ckpt/global_step{iteration}/\S*{name}\S*"
        assert re.search(rf"saving iteration {iteration}: \S+/{where}: No space left on device \(ENOSPC\): it needed "
                         r"[1-9]\d* bytes", line), line
    assert len(keep["warnings"]) == len(fi.ENOSPC_STAGES)
    assert keep["steps"] == ["global_step1", "global_step7", "global_step8"] and keep["latest"] == "global_step8"

    out = enospc["output"]
    assert enospc["exit_codes"] == {0: 2, 1: 2}, out[-3000:]
    assert len(enospc["errors"]) == 1, enospc["errors"]
    assert re.search(r"error: saving iteration 4: \S+/global_step4/zero_pp_rank_0_mp_rank_00_optim_states\.pt: No "
                     r"space left on device \(ENOSPC\): it needed \d{6,} bytes, \d+ are free there; the previous "
                     r"checkpoint and \S+/latest are intact", enospc["errors"][0]), enospc["errors"][0]
    assert max(enospc["exit_seconds"].values()) < 120, enospc["exit_seconds"]
    assert not fi.worker_tracebacks(out)
    assert {i: enospc["losses"][i] for i in range(1, 5)} == {i: ref[i] for i in range(1, 5)}

    out = oom["output"]
    assert oom["exit_codes"] == {0: 1, 1: 4}, out[-3000:]  # 4: out of memory; 1: the peer that died
    first, second = sorted(oom["errors"], key=lambda line: "out of memory" not in line)
    assert re.search(r"error: rank 1, pipeline stage 1: out of memory in F of micro-batch 1 \(replica 0, virtual "
                     r"stage 1\) at iteration 4: --inject-oom: allocation failed .*; \d+\.\d+ GiB resident \(peak\); "
                     r"to lower it: lower --micro-batch-size \(now 2\); .*memory_budget.*--checkpoint-activations "
                     r"\(now off\); more Seq1F1B segments pipeline.seq_splits \(now 1\)", first), first
    assert re.search(r"error: rank 0: \w+ from rank 1 .* a peer is frozen or died", second), second
    assert len(oom["errors"]) == 2 and max(oom["exit_seconds"].values()) < 60, oom["exit_seconds"]
    assert oom["latest"] == "global_step2" and oom["steps"] == ["global_step2"]  # the failed save left nothing
    assert oom["losses"] == {3: ref[3]}

    assert sig["exit_codes"] == {0: 0, 1: 0}, sig["output"][-3000:]
    assert sig["saved_at"] >= 5 and sig["latest"] == f"global_step{sig['saved_at']}", sig["reason"]
    assert "after receiving a signal on another rank (--exit-signal-handler)" in sig["reason"]  # rank 0 agreed
    assert final["exit_codes"] == {0: 0, 1: 0} and final["resumed_at"] == sig["saved_at"]
    resumed = {**sig["losses"], **final["losses"]}
    assert resumed == {i: ref[i] for i in range(3, ITERS + 1)}


@pytest.mark.timeout(1200)  # three launches that stop at the load
def test_files_that_would_run_code_are_refused_under_every_launcher(chain):
    workdir, _ = chain
    assert fi.latest(workdir) == f"global_step{ITERS}"
    step = os.path.join("ckpt", fi.latest(workdir))
    checkpoint = [os.path.join(step, f) for f in ("mp_rank_01_model_states.pt",
                                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                  "layer_01-model_states.pt")]
    runs = {"torchrun": fi.unsafe_resume(workdir, checkpoint, "torchrun", train_iters=ITERS),
            "srun": fi.unsafe_resume(workdir, [fi.index_cache(workdir)], "srun", train_iters=ITERS),
            "deepspeed": fi.unsafe_resume(workdir, [os.path.join(step, "mp_rank_00_model_states.pt")], "deepspeed",
                                          train_iters=ITERS)}
    for launcher, run in runs.items():
        out = run["output"]
        assert run["ran"] == [], (launcher, run["ran"])
        assert len(run["errors"]) == 1 and all(run["named"].values()), (launcher, run["errors"], out[-3000:])
        assert "needs io.open" in run["errors"][0] and "could run code" in run["errors"][0] or launcher == "srun"
        assert not fi.worker_tracebacks(out), (launcher, out[-3000:])
        assert "successfully loaded checkpoint" not in out
    assert runs["srun"]["exit_codes"] == {0: 2, 1: 2}
    assert "it holds pickled data, which could run code when loaded" in runs["srun"]["errors"][0]
    codes = set(runs["torchrun"]["worker_codes"].values())  # torchrun SIGTERMs a rank it finds still running
    assert 2 in codes and codes <= {2, -15}, runs["torchrun"]["output"][-3000:]
    assert runs["torchrun"]["exit_codes"] != 0 and runs["deepspeed"]["exit_codes"] != 0
    assert "checkpoint files are refused: " in runs["torchrun"]["errors"][0]
