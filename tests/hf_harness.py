"""Shared by the tests of megatron_ds.pipe.hf: tiny transformers causal LMs built from their config classes (the
same weights on every process: torch seeded before each build), deterministic micro-batches (optionally packed
documents: positions restart, the label across a document's end ignored), the single-process reference (the
transformers model itself, sequential gradient accumulation, AdamW) and the per-rank side that trains the same
steps through pipe.hf.pipeline_module + megatron_ds.initialize. Weights and gradients are keyed by the
transformers model's own parameter names."""
import contextlib
import io

import torch

MBS, SEQ, VOCAB, STEPS, LR = 2, 16, 64, 3, 1e-2
# AdamW's first steps move a weight by about lr * g / (|g| + eps): with transformers' small initial weights some
# gradients are ~1e-8, where eps 1e-6 would turn the summation order's rounding (~1e-9, the tied embedding's two
# halves summed across ranks) into weight differences of 1e-3; at 1e-4 they stay under 1e-6
EPS = 1e-4
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=None,
             eos_token_id=None, attention_dropout=0.0)


def config(name):
    """A tiny config of family `name`, dropout 0, fp32; a sliding window (4 tokens) that bites where the family
    has one."""
    import transformers as T
    if name == "llama":
        return T.LlamaConfig(**SIZES, tie_word_embeddings=True)
    if name == "qwen3":
        return T.Qwen3Config(**SIZES, head_dim=8)
    if name == "mistral":
        return T.MistralConfig(**SIZES, sliding_window=4)
    if name == "gemma3":  # tied, sliding layers with their own rotary, capped logits
        return T.Gemma3TextConfig(**SIZES, head_dim=8, sliding_window=4, final_logit_softcapping=30.0)
    if name == "phi3":
        return T.Phi3Config(**SIZES, resid_pdrop=0.0, embd_pdrop=0.0)
    if name == "olmo2":
        return T.Olmo2Config(**SIZES)
    if name == "gpt2":  # learned positions (wpe) added in their own layer, Conv1D projections, tied
        return T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    if name == "mixtral":
        return T.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    raise KeyError(name)


def build(name):
    """The model of family `name`, the same weights wherever it is built."""
    from megatron_ds.pipe.hf import load
    torch.manual_seed(1234)
    return load(config(name)).train()


def micro_batch(step, index, packed=False):
    """((token ids, position ids), labels) of micro-batch `index` of step `step`; `packed`: each row holds
    documents of 3 to 9 tokens (positions restart at 0), the label of a document's last token -100."""
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    positions = torch.arange(SEQ).repeat(MBS, 1)
    if packed:
        for row in range(MBS):
            start = 0
            while start < SEQ:
                length = int(torch.randint(3, 10, (1,), generator=g))
                end = min(start + length, SEQ)
                positions[row, start:end] = torch.arange(end - start)
                labels[row, end - 1] = -100
                start = end
    return (ids, positions), labels


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps the gradients it took in its first step (by parameter), before stepping."""
    first = None

    def step(self, closure=None):
        if RecordingAdamW.first is None:
            RecordingAdamW.first = {p: p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                                    if p.grad is not None}
        return super().step(closure)


def optimizer(params, record):
    """AdamW, recording its first gradients when `record` (ZeRO-1 takes torch's AdamW alone)."""
    kind = RecordingAdamW if record else torch.optim.AdamW
    return kind(params, lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.01)


def reference_run(name, n, steps=STEPS, packed=False):
    """The transformers model on one process: each step's loss (mean over the n micro-batches), the first step's
    gradients and the weights after `steps`, by the model's parameter names."""
    from megatron_ds.pipe.hf.layers import causal_lm_loss
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.01)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for i in range(n):
            (ids, positions), labels = micro_batch(step, i, packed)
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            loss = causal_lm_loss(logits, labels) / n
            loss.backward()
            total += loss.item()
        losses.append(total)
        if grads is None:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return dict(losses=losses, grads=grads, weights={k: p.detach().clone() for k, p in model.named_parameters()})


def ds_config(gas, dp, pipeline, zero=0):
    return {"train_batch_size": MBS * gas * dp, "train_micro_batch_size_per_gpu": MBS,
            "gradient_accumulation_steps": gas, "gradient_clipping": 0.0, "zero_optimization": {"stage": zero},
            "steps_per_print": 10 ** 9, "pipeline": dict(pipeline)}


def rank_runs(pp, gas, cases, steps=STEPS, save_dir=None, cp=1):
    """Per-rank side: for each (family, pipeline section, ZeRO stage, packed) in `cases` cut the model
    (pipe.hf.pipeline_module), build the engine (megatron_ds.initialize), train `steps` steps. Returns per case
    the losses, this rank's weights and (ZeRO 0: the optimizer sees whole gradients) first-step gradients by the
    model's names; `save_dir`: then save_pretrained into save_dir/CASE_INDEX. `cp` > 1: context parallelism
    (pipe.hf.engine.build_engine, pretrain_gpt's path), by the section's "cp_comm_type" (p2p if none); the CP
    ranks of a replica read its micro-batches."""
    import deepspeed
    import torch.distributed as dist

    import megatron_ds
    from megatron_ds.pipe.plan.config import pipeline_settings
    from megatron_ds.pipe.hf import PARTITION, hf_names, pipeline_module, save_pretrained
    from megatron_ds.pipe.hf.engine import build_engine
    from megatron_ds.training.auto_schedule import switch_engine
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    out = []
    dp = dist.get_world_size() // (pp * cp)
    for i, (name, pipeline, zero, packed) in enumerate(cases):
        model = build(name)
        section = {"partition_method": PARTITION, **{k: v for k, v in pipeline.items() if k != "cp_comm_type"}}
        config = ds_config(gas, dp, section, zero)
        RecordingAdamW.first = None
        reports, chose = [], None
        if pipeline.get("seq_splits", 1) > 1 or pipeline["schedule"] == "auto" or cp > 1:  # pipe.hf's own engine
            def build_from(cfg):  # Seq1F1B, CP, "auto" (and what it chose: training/auto_schedule.switch_engine)
                return build_engine(model, cfg, pipeline_settings(cfg), pp, dp,
                                    lambda module: optimizer(module.parameters(), zero == 0), seq_length=SEQ, cp=cp,
                                    comm_type=pipeline.get("cp_comm_type", "p2p"), on_auto_decision=reports.append)[0]
            engine = build_from(config)
        else:
            user = pipeline_module(model, num_stages=pp)
            engine = megatron_ds.initialize(model=user, optimizer=optimizer(user.parameters(), zero == 0),
                                            config=config)[0]
        dp_rank = engine.grid.get_data_parallel_rank() // cp
        losses = []
        for step in range(steps):
            data = iter([micro_batch(step, dp_rank * gas + j, packed) for j in range(gas)])
            with contextlib.redirect_stdout(io.StringIO()) as log:  # rank 0 logs "auto"'s decision
                losses.append(float(engine.train_batch(data)))
            if reports and chose is None:
                chose = (reports[0].decision["choice"]["label"], reports[0].rebuild, log.getvalue())
                if reports[0].rebuild:  # placed otherwise: rebuilt through a checkpoint, the same model
                    engine = switch_engine(engine, reports[0].decision, build_from)
        names = hf_names(engine.module, model)
        params = dict(engine.module.named_parameters())
        grads = ({names[n]: RecordingAdamW.first[p] for n, p in params.items() if p in RecordingAdamW.first}
                 if zero == 0 else None)
        if save_dir is not None:
            save_pretrained(engine, model, f"{save_dir}/{i}")
        out.append(dict(losses=losses, grads=grads, engine=type(engine).__name__, in_w=engine.weights_in_w, auto=chose,
                        segments=getattr(engine, "plan", None) and engine.plan.segment_lengths,
                        weights={names[n]: p.detach().clone() for n, p in params.items()}))
    return out


def assert_matches(results, ref, atol=1e-5):
    """Every rank's losses equal the reference's; each weight (and first-step gradient, where recorded) equals
    it on the rank(s) that hold it, and every weight is held somewhere."""
    held, graded = set(), set()
    for r in results:
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert diff <= atol, ("losses", r["losses"], ref["losses"])
        for key, w in r["weights"].items():
            diff = (w - ref["weights"][key]).abs().max().item()
            assert diff <= atol, f"weight {key}: max abs diff {diff:.3g}"
            held.add(key)
        for key, g in (r["grads"] or {}).items():
            diff = (g - ref["grads"][key]).abs().max().item()
            assert diff <= atol, f"first-step gradient {key}: max abs diff {diff:.3g}"
            graded.add(key)
    assert held == set(ref["weights"]), set(ref["weights"]) - held
    if any(r["grads"] is not None for r in results):
        assert graded == set(ref["grads"]), set(ref["grads"]) - graded
