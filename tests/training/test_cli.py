"""pretrain_gpt.py on bad input: one clear message, exit code 2, at once (no process group, no hang)."""
import json
import os
import subprocess
import sys

from megatron_ds.testing.launcher import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--data-path", "corpus",
         "--vocab-file", __file__, "--merge-file", __file__]


def run(*extra, env=None):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, *extra],
                          capture_output=True, text=True, timeout=600,
                          env=child_env(ROOT, **(env or {})))
    return proc.returncode, proc.stderr


def test_batch_size_disagreement(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "gradient_clipping": 1.0}))
    rc, err = run("--global-batch-size", "16", "--deepspeed_config", str(cfg),
                  "--pipeline-model-parallel-size", "2", env={"WORLD_SIZE": "4", "RANK": "0"})
    assert rc == 2
    assert err.strip().splitlines() == [
        f'pretrain_gpt.py: error: --global-batch-size 16 disagrees with ds_config "train_batch_size" = 32 in {cfg}']


def test_unknown_schedule_and_missing_config(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"pipeline": {"schedule": "2f2b"}}))
    rc, err = run("--deepspeed_config", str(cfg))
    assert rc == 2 and "pipeline.schedule" in err and "2f2b" in err and "Traceback" not in err
    rc, err = run("--deepspeed_config", str(tmp_path / "missing.json"))
    assert rc == 2 and "missing.json: file not found" in err


def test_bad_data_fails_cleanly_after_start(tmp_path):
    # one process, a real (gloo) start-up: a corrupt dataset is reported once, with no traceback
    from megatron_ds.data.tokenizer import default_gpt2_files
    vocab, merges = default_gpt2_files()
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" * 8)
    rc, err = run("--data-path", str(tmp_path / "bad"), "--vocab-file", vocab, "--merge-file", merges,
                  env={"OMP_NUM_THREADS": "1"})
    assert rc == 2 and "bad.idx" in err and "Traceback" not in err, err[-3000:]
    rc, err = run("--data-path", str(tmp_path / "nothing"), "--vocab-file", vocab, "--merge-file", merges)
    assert rc == 2 and "nothing.idx not found" in err


MISSING = ("pretrain_gpt.py: error: missing required flags --num-layers, --num-attention-heads, --seq-length "
           "(python pretrain_gpt.py --help lists every flag)")


def _bare(*argv, env=None):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], capture_output=True,
                          text=True, timeout=600, env=child_env(ROOT, **(env or {})))
    return proc.returncode, proc.stderr.strip().splitlines()


def test_a_missing_or_bad_flag_is_one_line_not_the_usage():
    assert _bare("--hidden-size", "32") == (2, [MISSING])
    rc, lines = _bare(*FLAGS, "--hidden-size", "big")
    assert (rc, lines) == (2, ["pretrain_gpt.py: error: argument --hidden-size: invalid int value: 'big' "
                               "(python pretrain_gpt.py --help lists every flag)"])
    assert _bare("--hidden-size", "32", env={"RANK": "1"}) == (2, [])  # rank 0 alone prints it


def test_torchrun_reports_the_cause_last(tmp_path):
    """torchrun gives each rank an error file (TORCHELASTIC_ERROR_FILE) and ends its report with the root
    cause's record in it: our line, not "To enable traceback see ...". Here torch's own report is built
    from the file a failed rank wrote, as torchrun builds it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    error_file = tmp_path / "error.json"
    for argv, line in ((["--hidden-size", "32"], MISSING),
                       ([*FLAGS, "--deepspeed_config", str(tmp_path / "none.json")],
                        f"pretrain_gpt.py: error: --deepspeed_config {tmp_path / 'none.json'}: file not found")):
        rc, _ = _bare(*argv, env={"TORCHELASTIC_ERROR_FILE": str(error_file), "RANK": "1"})
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=rc, error_file=str(error_file))
        report = ChildFailedError("pretrain_gpt.py", {1: failure}).format_msg().strip().splitlines()
        assert rc == 2 and report[-2] == f"  traceback : {line}", report
        assert "exitcode  : 2" in "\n".join(report)
        error_file.unlink()


def test_under_torchrun_a_moe_start_up_error_is_the_first_line(tmp_path):
    """Every rank fails the same flag check at parse time; torchrun stops the others at the first exit, which
    was often not rank 0's, so the line stood only in torchrun's failure table. Now it comes first, once.
    Rank 0 starts a second late here (a wrapper), as a loaded machine may start it."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    late = tmp_path / "rank0_late.sh"
    late.write_text(f'#!/bin/sh\n[ "$LOCAL_RANK" = 0 ] && sleep 1\nexec {sys.executable} "$@"\n')
    late.chmod(0o755)
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "4", "--no-python", str(late),
                           os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, "--global-batch-size", "8",
                           "--pipeline-model-parallel-size", "2", "--num-experts", "3", "--expert-model-parallel-size",
                           "2"], capture_output=True, text=True, timeout=600, env=child_env(ROOT, OMP_NUM_THREADS="1"))
    line = ("pretrain_gpt.py: error: --expert-model-parallel-size (2) must divide --num-experts (3): each rank "
            "holds whole experts")
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0 and lines[0] == line, proc.stderr[-3000:]
    assert sum(text == line for text in lines) == 1
