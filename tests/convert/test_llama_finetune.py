"""A Hugging Face LLaMA (grouped-query attention) and a Qwen3-MoE (per-head q/k norms, head_dim twice hidden / heads:
--kv-channels, 4 experts, one dense layer) imported and continued by pretrain_gpt.py under ZB-V.

One launch each (2 gloo ranks, PP=2, 3 iterations) of a tiny random LlamaForCausalLM / Qwen3MoeForCausalLM imported with
tools/checkpoint/import_hf.py: the first iteration's loss is HF's on the same batch, and every
iteration's loss is the single-process reference's (the checkpoint's GPTModel, the run's optimizer
and lr schedule, the same samples)."""
import pytest
import torch

from megatron_ds.testing.corpus import write_corpus
from tests.convert.helpers import hf_loss, stack_samples, tiny_hf_family, tool, train

MBS, GBS, ITERS = 2, 8, 3


def _run_args(flags, run, ds_config):
    from megatron_ds.data.tokenizer import build_tokenizer
    from megatron_ds.training.config.arguments import parse_args
    args = parse_args(flags + run + ["--deepspeed_config", ds_config], env={"WORLD_SIZE": "2"})
    build_tokenizer(args)
    return args


def _reference_losses(ckpt, args, steps):
    """Each step's mean micro-batch loss, trained on one process as the run's engine does."""
    from megatron_ds.convert.reference import load_checkpoint_model
    from megatron_ds.training.learning_rates import AnnealingLR
    from megatron_ds.training.model_setup import build_optimizer
    model = load_checkpoint_model(str(ckpt))[0].train()
    opt = build_optimizer(model, args)
    sched = AnnealingLR(opt, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_steps,
                        decay_steps=args.lr_decay_steps, decay_style=args.lr_decay_style,
                        global_batch_size=args.global_batch_size)
    losses = []
    for batch in steps:
        opt.zero_grad()
        micro = batch.split(args.micro_batch_size)
        total = 0.0
        for mb in micro:
            loss = torch.nn.functional.cross_entropy(model(mb[:, :-1]).float().flatten(0, 1), mb[:, 1:].flatten())
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        sched.step()
    from megatron_ds.model.moe import RouterLossLog
    RouterLossLog.take()  # a MoE's backward logged its experts' load: leave this process's log empty
    return losses


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_llama_import_continues_under_zbv(tmp_path, family):
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "imported"
    source = tiny_hf_family(family, hf_dir, num_layers=4)
    assert tool("checkpoint/import_hf.py", "--input", hf_dir, "--output", ckpt, "--seq-length", 16) == 0
    flags = (ckpt / "megatron_ds_args.txt").read_text().split()
    assert "--num-key-value-heads" in flags and flags[flags.index("--num-key-value-heads") + 1] == "2"
    if family == "qwen3_moe":  # mlp_only_layers=[1]; head_dim 16 (not 32 / 4): the pipeline's attention is wider
        assert "--qk-layernorm" in flags and flags[flags.index("--moe-layer-freq") + 1] == "1,0,1,1"
        assert flags[flags.index("--kv-channels") + 1] == "16"
    write_corpus(str(tmp_path / "corpus"))
    run = ["--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--train-iters", str(ITERS),
           "--lr", "3e-3", "--pipeline-model-parallel-size", "2", "--data-path", str(tmp_path / "corpus"),
           "--split", "90,10,0", "--eval-iters", "0"]
    records, out = train(str(tmp_path), "finetune", "zbv", flags + run, 2)
    assert "successfully loaded checkpoint from" in out and "schedule zbv" in out
    args = _run_args(flags, run, str(tmp_path / "finetune.json"))
    from megatron_ds.data.samplers import build_datasets
    train_ds, _, _ = build_datasets(args)
    steps = stack_samples(train_ds, ITERS * GBS).split(GBS)
    expected = hf_loss(source, steps[0])
    reference = _reference_losses(ckpt, args, steps)
    got = [r["loss"] for r in records]
    print(f"zbv: losses {got}, reference {reference}, HF first batch {expected:.7f}")
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert got[0] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert got == pytest.approx(reference, rel=1e-5, abs=1e-5)
    untrained = hf_loss(source, steps[2])
    assert abs(got[2] - untrained) > 1e-3, (got[2], untrained)  # the steps did move the weights
