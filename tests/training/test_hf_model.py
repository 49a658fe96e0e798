"""pretrain_gpt.py --hf-model DIR: the whole run (data flags, lr schedule, logging, checkpoints, the folder's
tokenizer) on a Hugging Face causal LM cut by megatron_ds.pipe.hf. Three torchrun launches of 2 ranks (PP 2) on
a tiny LLaMA folder: 4 iterations under DeepSpeed's own engine (no schedule); 2 under zbv (the shipped ds_config,
its "type:transformer" cut), saved; resumed from
that save under 1f1b for iterations 3-4; and one more of 2 ranks, each sequence over them (--context-parallel-size
2, the p2p ring, PP 1, 1f1b). Every iteration's loss equals the stock run's within 1e-5, and the
Hugging Face folder each run saves at its end loads in transformers. The documents are packed (positions restart
after each end of document, attention within documents, the end-of-document predictions not scored). Bad
--hf-model input exits 2 with one line."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import child_env
from megatron_ds.training.initialize import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 1024  # the corpus's tokens are < 1000, its end of document VOCAB - 1


def hf_folder(path):
    """A tiny LLaMA (tied embeddings) and a word-level tokenizer of VOCAB tokens ("t0" ... , end "t1023")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    raw = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=f"t{VOCAB - 1}").save_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=VOCAB - 1, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def run(tmp_path, name, ds_config, *extra, nproc=2):
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(ds_config))
    metrics = tmp_path / f"{name}.jsonl"
    script = [os.path.join(ROOT, "pretrain_gpt.py"), "--hf-model", str(tmp_path / "hf"), "--seq-length", "16",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
              "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--pipeline-model-parallel-size", "2",
              "--data-path", str(tmp_path / "corpus"), "--split", "90,10,0", "--log-interval", "1",
              "--eval-interval", "2", "--eval-iters", "1", "--deepspeed", "--deepspeed_config", str(config),
              "--metrics-file", str(metrics), "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
              *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), *script]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(ROOT, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{out[-6000:]}"
    return [json.loads(line) for line in metrics.read_text().splitlines()], out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hf_run")
    hf_folder(tmp_path / "hf")
    write_corpus(str(tmp_path / "corpus"), vocab=VOCAB)
    base = {"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
    stock = run(tmp_path, "stock", base, "--train-iters", "4", "--save", str(tmp_path / "stock_save"))
    shipped = json.loads(open(os.path.join(ROOT, "ds_configs", "ds_config_zbv.json")).read())  # type:transformer
    zbv = run(tmp_path, "zbv", shipped, "--train-iters", "4",
              "--exit-interval", "2", "--save", str(tmp_path / "zbv_save"))
    resumed = run(tmp_path, "resumed", {**base, "pipeline": {"schedule": "1f1b"}}, "--train-iters", "4",
                  "--load", str(tmp_path / "zbv_save"), "--save", str(tmp_path / "resumed_save"))
    return tmp_path, stock, zbv, resumed


def _losses(records):
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def test_the_run_trains_as_deepspeeds_engine_and_resumes(runs):
    _, (stock, stock_out), (zbv, zbv_out), (resumed, resumed_out) = runs
    want = _losses(stock)
    assert sorted(want) == [1, 2, 3, 4], stock
    got = {**_losses(zbv), **_losses(resumed)}
    assert sorted(_losses(zbv)) == [1, 2] and sorted(_losses(resumed)) == [3, 4], (zbv, resumed)
    for it, loss in want.items():
        assert abs(got[it] - loss) <= 1e-5, (it, got[it], loss)
    assert "HFScheduleEngine, schedule zbv; LlamaForCausalLM" in zbv_out
    assert "PipelineEngine, schedule" in stock_out


def test_a_context_parallel_run_trains_as_deepspeeds_engine(runs):
    """The same samples with each sequence over 2 context-parallel ranks (the p2p ring, packed documents, the
    end-of-document predictions unscored): every iteration's loss as the stock run's."""
    tmp_path, (stock, _) = runs[0], runs[1]
    records, out = run(tmp_path, "cp", {"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                                        "pipeline": {"schedule": "1f1b"}},
                       "--train-iters", "4", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "2")
    want, got = _losses(stock), _losses(records)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4], records
    for it, loss in want.items():
        assert abs(got[it] - loss) <= 1e-5, (it, got[it], loss)
    assert "HFScheduleEngine, schedule 1f1b; LlamaForCausalLM from" in out
    assert "each sequence over 2 context-parallel ranks (p2p)" in out


def test_the_end_of_a_run_saves_a_transformers_folder(runs):
    from transformers import AutoModelForCausalLM
    tmp_path = runs[0]
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "stock_save" / "hf_iter_0000004", local_files_only=True)
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed_save" / "hf_iter_0000004",
                                                   local_files_only=True)
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    mine = dict(resumed.named_parameters())
    for name, p in stock.named_parameters():
        assert (p - mine[name]).abs().max().item() <= 1e-5, name
    assert (stock.model.embed_tokens.weight - first.model.embed_tokens.weight).abs().max().item() > 1e-4


@pytest.mark.parametrize("flags,message", [
    (["--hf-model", "no-such-folder"], "--hf-model no-such-folder: no such folder"),
    (["--hf-model", "HF", "--num-layers", "3"], "--num-layers 3 disagrees with --hf-model's num_hidden_layers 4"),
    (["--hf-model", "HF", "--swiglu"], "--swiglu describes our GPT's layers"),
    (["--hf-model", "HF", "--reset-attention-mask"], "--hf-model with --reset-attention-mask alone"),
    (["--hf-model", "HF", "--rope-scaling-type", "linear", "--rope-scaling-factor", "2"],
     "--rope-scaling-type describes our GPT's layers"),
    ([], "missing required flags --num-layers, --hidden-size, --num-attention-heads"),  # no --hf-model: the GPT's
    (["--hf-model", "HF", "--reset-position-ids", "--reset-attention-mask", "--deepspeed", "--deepspeed_config",
      "auto.json"], '--hf-model with "schedule": "auto" and packed documents'),
])
def test_bad_hf_model_input_exits_2(tmp_path, flags, message):
    _refused(tmp_path, flags, message)


@pytest.mark.parametrize("config,flags,message", [
    ({}, [], "--context-parallel-size 2 under DeepSpeed's own engine (no \"pipeline.schedule\"): name a schedule"),
    ({"sliding_window": 8}, ["--deepspeed", "--deepspeed_config", "pipe.json"],
     "its sliding window (8 tokens) is shorter than --seq-length 16, and the context-parallel attention has no window"),
    ({"attn_logit_softcapping": 50.0}, ["--deepspeed", "--deepspeed_config", "pipe.json"],
     "its attention caps the scores (attn_logit_softcapping)"),
    ({"num_key_value_heads": 1}, ["--deepspeed", "--deepspeed_config", "pipe.json", "--cp-comm-type", "a2a"],
     "--cp-comm-type a2a shares the attention heads out over the context-parallel ranks"),
    ({}, ["--deepspeed", "--deepspeed_config", "auto.json"], '"schedule": "auto" and --context-parallel-size > 1'),
])
def test_what_context_parallelism_cannot_run_exits_2(tmp_path, config, flags, message):
    """--hf-model with --context-parallel-size 2 (2 ranks): refused at parse time where the run could not be
    exact (the engine's own check of the built model: tests/pipe/hf/test_cut.py)."""
    (tmp_path / "pipe.json").write_text(json.dumps({"pipeline": {"schedule": "1f1b"}}))
    _refused(tmp_path, ["--hf-model", "HF", "--context-parallel-size", "2", *flags], message, config, WORLD_SIZE="2")


def test_hierarchical_context_parallelism_is_refused_for_a_hf_model(tmp_path):
    (tmp_path / "pipe.json").write_text(json.dumps({"pipeline": {"schedule": "1f1b"}}))
    _refused(tmp_path, ["--hf-model", "HF", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                        "--hierarchical-context-parallel-sizes", "2", "2", "--deepspeed", "--deepspeed_config",
                        "pipe.json"], "--hf-model with --cp-comm-type a2a+p2p: not run yet", WORLD_SIZE="4")


def _refused(tmp_path, flags, message, config=None, **env):
    """pretrain_gpt.py with `flags` on a folder whose config.json holds `config` too exits 2 with one line."""
    (tmp_path / "HF").mkdir()
    (tmp_path / "HF" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
         **(config or {})}))
    (tmp_path / "auto.json").write_text(json.dumps({"zero_optimization": {"stage": 1}, "pipeline": {
        "schedule": "auto", "memory_budget": 4}}))
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--seq-length", "16",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2",
           "--data-path", "corpus"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(ROOT, **env), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
