"""Checkpoints trained by pretrain_gpt.py export to Hugging Face and back.

Three small launches (gloo, tiny 4-layer GPT-2, hidden 32, seq 16, GPT-2 vocabulary):
ZB-V at PP=2 x DP=2 and BitPipe at PP=2 (two replicas) train 3 iterations and save;
an imported random HF GPT-2 continues under 1F1B at PP=2 with --load --finetune.
"""
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_ds.testing.corpus import write_corpus
from tests.convert.helpers import (batch_loss, gpt2_files, hf_loss, stack_samples, tiny_hf_gpt2, tool,
                                      train)

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
GBS = 8


def _train_flags(save):
    vocab, merges = gpt2_files()
    return [*MODEL, "--micro-batch-size", "2", "--global-batch-size", str(GBS), "--train-iters", "3",
            "--lr", "3e-3", "--pipeline-model-parallel-size", "2", "--data-path", "corpus", "--split", "90,10,0",
            "--vocab-file", vocab, "--merge-file", merges, "--eval-interval", "1000", "--eval-iters", "1",
            "--save", save]


def _final_valid_loss(out):
    return float(re.search(r"validation loss at the end of training for val data \| lm loss value: (\S+)", out)[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{schedule: (checkpoint folder, the end-of-training validation loss the run printed)}."""
    work = tmp_path_factory.mktemp("runs")
    write_corpus(str(work / "corpus"))
    found = {}
    for schedule, nproc in (("zbv", 4), ("bitpipe", 2)):
        _, out = train(str(work), schedule, schedule, _train_flags(f"ckpt_{schedule}"), nproc)
        found[schedule] = (work / f"ckpt_{schedule}", _final_valid_loss(out))
    found["cwd"] = work
    return found


@pytest.fixture(scope="module")
def zbv_export(runs, tmp_path_factory):
    """(HF model, HF tokenizer) of the ZB-V checkpoint's export, shared by the tests that only read it."""
    return _export(runs["zbv"][0], tmp_path_factory.mktemp("zbv_export") / "hf")


def _valid_batch(ckpt, cwd):
    """The validation batch the run's final evaluation read: valid samples [0, global batch)."""
    from megatron_ds.convert.reference import load_checkpoint_model
    from megatron_ds.data.samplers import build_datasets
    model, args, _ = load_checkpoint_model(str(ckpt))
    old = os.getcwd()
    os.chdir(cwd)  # the run's --data-path is relative
    try:
        _, valid, _ = build_datasets(args)
    finally:
        os.chdir(old)
    return model, stack_samples(valid, args.global_batch_size)


def _export(ckpt, out):
    assert tool("checkpoint/export_hf.py", "--load", ckpt, "--output", out) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    return hf, tok


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("schedule", ["zbv", "bitpipe"])
def test_export_loads_in_hf_with_the_runs_eval_loss(runs, zbv_export, schedule, tmp_path):
    ckpt, printed = runs[schedule]
    hf, tok = zbv_export if schedule == "zbv" else _export(ckpt, tmp_path / "hf")
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.vocab_size == 50304
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    vocab, merges = gpt2_files()
    from megatron_ds.data.tokenizer import GPT2BPETokenizer
    text = "Pipeline schedules, exported: they load."
    assert tok.encode(text) == GPT2BPETokenizer(vocab, merges).tokenize(text)
    # the HF weights are the layer files, bit for bit
    hf_sd = hf.state_dict()
    layer1 = torch.load(ckpt / "global_step3" / "layer_01-model_states.pt")
    assert torch.equal(hf_sd["transformer.h.0.ln_1.weight"], layer1["ln_1.weight"])
    assert torch.equal(hf_sd["transformer.h.0.attn.c_attn.weight"], layer1["attn.c_attn.weight"].t())
    model, batch = _valid_batch(ckpt, runs["cwd"])
    theirs = hf_loss(hf, batch)
    ours = batch_loss(model(batch[:, :-1]).detach(), batch)
    print(f"{schedule}: run's validation loss {printed:.6E}, reference {ours:.7f}, HF {theirs:.7f}")
    assert theirs == pytest.approx(printed, rel=1e-5)  # the run printed 7 significant digits
    assert theirs == pytest.approx(ours, rel=1e-5, abs=1e-5)


@pytest.mark.timeout(900)
def test_greedy_generation_equals_hf_generate(runs, zbv_export, tmp_path):
    ckpt, _ = runs["zbv"]
    hf, tok = zbv_export
    prompts = ["The pipeline", "Zero bubble schedules split the backward pass"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "samples.jsonl"
    assert tool("generate_samples_gpt.py", "--load", ckpt, "--sample-input-file", tmp_path / "prompts.txt",
                "--sample-output-file", out, "--output-format", "jsonl", "--greedy", "--out-seq-length", 10) == 0
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["prompt"] for s in samples] == prompts
    for s in samples:
        ids = tok(s["prompt"], return_tensors="pt").input_ids
        new = min(10, 16 - ids.shape[1])  # the whole sequence fits the model's 16 positions
        want = hf.generate(ids, do_sample=False, max_new_tokens=new, pad_token_id=50256)[0, ids.shape[1]:]
        assert s["tokens"] == want.tolist() and len(s["tokens"]) >= 4, (s, want)
        assert s["text"] == tok.decode(want)
    # sampling: the same seed gives the same text; top-k 1 is greedy again
    def sample(*flags):
        assert tool("generate_samples_gpt.py", "--load", ckpt, "--sample-input-file", tmp_path / "prompts.txt",
                    "--sample-output-file", out, "--output-format", "jsonl", "--out-seq-length", 10, *flags) == 0
        return [json.loads(line)["tokens"] for line in out.read_text().splitlines()]
    seeded = sample("--temperature", "0.8", "--top_p", "0.9", "--top_k", "40", "--seed", "7")
    assert seeded == sample("--temperature", "0.8", "--top_p", "0.9", "--top_k", "40", "--seed", "7")
    assert sample("--top_k", "1") == [s["tokens"] for s in samples]


@pytest.mark.timeout(900)
def test_evaluate_tool_equals_hf(runs, zbv_export, tmp_path):
    ckpt, _ = runs["zbv"]
    hf, tok = zbv_export
    from megatron_ds.inference.perplexity import stream_from_indexed
    results = tmp_path / "eval.json"
    # a .bin/.idx prefix: the whole corpus as one stream, windows of 16 tokens
    assert tool("evaluate_gpt.py", "--load", ckpt, "--data-path", runs["cwd"] / "corpus",
                "--results-file", results) == 0
    got = json.loads(results.read_text())
    stream = torch.as_tensor(stream_from_indexed(str(runs["cwd"] / "corpus")))
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(stream) - 1, 16):
            window = stream[start:start + 17].unsqueeze(0)
            total += hf_loss(hf, window) * (window.shape[1] - 1)
            count += window.shape[1] - 1
    assert got["tokens"] == count == len(stream) - 1
    assert got["loss"] == pytest.approx(total / count, rel=1e-5)
    # a JSONL file: each text tokenized and ended with <|endoftext|>, one window here
    texts = ["Hello pipelines.", "A second, longer document."]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert tool("evaluate_gpt.py", "--load", ckpt, "--valid-data", tmp_path / "held_out.jsonl",
                "--results-file", results) == 0
    got = json.loads(results.read_text())
    ids = torch.tensor([sum((tok.encode(t) + [50256] for t in texts), [])])
    assert ids.shape[1] <= 17 and got["tokens"] == ids.shape[1] - 1
    assert got["loss"] == pytest.approx(hf_loss(hf, ids), rel=1e-5)


@pytest.mark.timeout(1800)
def test_import_round_trip_and_finetune(runs, tmp_path):
    hf_dir, ckpt = tmp_path / "hf_src", tmp_path / "imported"
    source = tiny_hf_gpt2(str(hf_dir), n_positions=16, with_tokenizer=True)
    assert tool("checkpoint/import_hf.py", "--input", hf_dir, "--output", ckpt) == 0
    flags = (ckpt / "megatron_ds_args.txt").read_text().split()
    assert flags[flags.index("--tokenizer-name-or-path") + 1] == str(ckpt / "tokenizer")
    assert flags[-3:] == ["--load", str(ckpt), "--finetune"]
    # HF -> ours -> HF: the same tensors, bit for bit
    _export(ckpt, tmp_path / "hf_back")
    before, after = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf_back" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    # continue it under 1F1B at PP=2: the first iteration's loss is HF's on the same batch
    run = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
           "--pipeline-model-parallel-size", "2", "--data-path", str(runs["cwd"] / "corpus"), "--split", "90,10,0",
           "--eval-iters", "0"]
    records, out = train(str(tmp_path), "finetune", "1f1b", flags + run, 2)
    assert "successfully loaded checkpoint from" in out
    from megatron_ds.data.samplers import build_datasets
    from megatron_ds.data.tokenizer import build_tokenizer
    from megatron_ds.training.config.arguments import parse_args
    args = parse_args(flags + run + ["--deepspeed_config", str(tmp_path / "finetune.json")], env={"WORLD_SIZE": "2"})
    build_tokenizer(args)
    train_ds, _, _ = build_datasets(args)
    expected = hf_loss(source, stack_samples(train_ds, 4))
    print(f"finetune: first-iteration loss {records[0]['loss']:.7f}, HF {expected:.7f}")
    assert records[0]["iteration"] == 1
    assert records[0]["loss"] == pytest.approx(expected, rel=1e-5)
