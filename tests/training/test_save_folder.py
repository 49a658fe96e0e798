"""What a --save folder holds for its user, and what a restart leaves: real pretrain_gpt.py runs (2 gloo ranks,
BitPipe at PP=2: two replicas), 4 iterations saved every 2, then restarted from global_step2 to 4 (as a run
killed after iteration 4's log lines and before its save would be).

- SAVE/zero_to_fp32.py is ours (training/checkpoint/recovery_script.py), not DeepSpeed's copy (which unpickles with
  weights_only=False and fails on our checkpoints): `python zero_to_fp32.py . OUT` run in the folder writes
  the step's weights as one fp32 state dict (pytorch_model.bin, or model.safetensors), equal to the layer
  files' tensors; a layer file that would run code is refused with one line and exit code 2, its payload
  never runs; a step without its manifest.json is loaded with a warning that nothing was checked.
- --metrics-file after the restart holds each iteration once: the killed attempt's records of iterations
  after the resumed one are dropped.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import child_env
from tests.convert.helpers import ROOT, gpt2_files, train
from tools.fault_injection import craft

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def _flags(*extra):
    vocab, merges = gpt2_files()
    return [*MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3",
            "--pipeline-model-parallel-size", "2", "--data-path", "corpus", "--split", "90,10,0",
            "--vocab-file", vocab, "--merge-file", merges, "--eval-interval", "1000", "--eval-iters", "1",
            "--save", "ckpt", "--save-interval", "2", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(work folder, the first run's metrics records, the records after the restart)."""
    work = tmp_path_factory.mktemp("save_folder")
    write_corpus(str(work / "corpus"))
    first, _ = train(str(work), "run", "bitpipe", _flags(), nproc=2)
    (work / "ckpt" / "latest").write_text("global_step2")  # iteration 4's save never happened
    again, out = train(str(work), "run", "bitpipe", _flags("--load", "ckpt"), nproc=2)
    assert "at iteration 2" in out
    return work, first, again


def _script(ckpt, *argv):
    """`python zero_to_fp32.py ARGV` in the folder, as a user runs the one there: (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "zero_to_fp32.py", *map(str, argv)], cwd=ckpt, text=True,
                          capture_output=True, env=child_env(ROOT, OMP_NUM_THREADS="1"), timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def _layer_files(step):
    """{GPTModel state-dict name: tensor} read straight from the step's layer files (weights-only)."""
    from megatron_ds.convert.model_args import config_from_args, with_defaults
    from megatron_ds.model import GPTModel
    from megatron_ds.training.checkpoint import safe_load
    args = with_defaults(safe_load.load(str(step / "mp_rank_00_model_states.pt"))["args"])
    model = GPTModel(config_from_args(args))
    full = {id(p): name for name, p in model.named_parameters()}
    return {full[id(p)]: safe_load.load(str(step / f"layer_{idx:02d}-model_states.pt"))[name]
            for (idx, name), p in model.named_parameters_by_layer().items()}


@pytest.mark.timeout(1800)  # two launches
def test_metrics_file_holds_each_iteration_once_after_a_restart(runs):
    _, first, again = runs
    assert [r["iteration"] for r in first] == [1, 2, 3, 4]
    assert [r["iteration"] for r in again] == [1, 2, 3, 4]
    assert again[:2] == first[:2]  # the records up to the resumed iteration are kept as they were


@pytest.mark.timeout(1800)
def test_zero_to_fp32_in_the_folder_is_ours_and_writes_the_weights_in_fp32(runs):
    work, _, _ = runs
    ckpt = work / "ckpt"
    script = (ckpt / "zero_to_fp32.py").read_text()
    assert "weights_only=False" not in script and "megatron_ds" in script
    assert not (ckpt / "zero_to_torch.py").exists()  # DeepSpeed's other copy, which imports its zero_to_fp32
    assert os.access(ckpt / "zero_to_fp32.py", os.X_OK)
    rc, out, err = _script(ckpt, ".", "../fp32/out")  # the output's parent folders are made
    assert rc == 0, out + err
    state = torch.load(work / "fp32" / "out" / "pytorch_model.bin", weights_only=True)
    expected = _layer_files(ckpt / "global_step4")
    assert sorted(state) == sorted(expected)
    for name, t in state.items():
        assert t.dtype == torch.float32 and torch.equal(t, expected[name].float()), name
    rc, out, err = _script(ckpt, ckpt, work / "st", "--safe_serialization", "-t", "global_step2")
    assert rc == 0, out + err
    from safetensors.torch import load_file
    older = load_file(str(work / "st" / "model.safetensors"))
    earlier = _layer_files(ckpt / "global_step2")
    assert all(torch.equal(t, earlier[name].float()) for name, t in older.items()) and older.keys() == state.keys()
    assert any(not torch.equal(older[name], state[name]) for name in state)  # another step's weights


@pytest.mark.timeout(1800)
def test_zero_to_fp32_refuses_a_file_that_would_run_code(runs):
    work, _, _ = runs
    ckpt = work / "tampered"
    shutil.copytree(work / "ckpt", ckpt)
    payload = work / "payload-ran"
    craft(str(ckpt / "global_step4" / "layer_01-model_states.pt"), str(payload))  # removes the manifest too
    rc, out, err = _script(ckpt, ".", work / "never")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, out + err
    assert lines[0].startswith("zero_to_fp32.py: error: ") and "layer_01-model_states.pt is refused: loading it " \
                                                               "needs io.open" in lines[0], lines
    assert "WARNING: ./global_step4 has no manifest.json: the sizes and CRC-32s of its files were " \
           "not checked" in out, out
    assert not payload.exists() and not (work / "never").exists()
