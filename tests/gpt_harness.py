"""Shared by the pipeline tests: a tiny GPT, deterministic micro-batches, the
single-process reference, and the per-rank side that trains the same steps on a
DeepSpeed pipeline engine and reports losses, gradients and weights keyed by
(global layer index, local parameter name)."""

import torch

from megatron_ds.model import GPTConfig, GPTModel, gpt_loss, position_ids_like
from megatron_ds.model.moe import RouterLossLog, set_grad_scale
from megatron_ds.model.moe_router import Router

SEQ, MBS = 16, 2


def tiny_config(num_layers=4, seq=SEQ, **kw):
    return GPTConfig(vocab_size=64, hidden_size=32, num_layers=num_layers, num_attention_heads=4,
                     max_position_embeddings=seq, seed=11, **kw)


def micro_batch(step, index, vocab=64, seq=SEQ):
    """Micro-batch `index` of the global batch of optimizer step `step` (same on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.randint(0, vocab, (MBS, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return (x, position_ids_like(x)), y


EOD = 1  # the end-of-document token of packed micro-batches
PACKED = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, eod_token=EOD)  # GPTConfig's


def packed_text(step, index, vocab=64, seq=SEQ):
    """The (MBS, seq + 1) tokens of packed_micro_batch: random, about one in five an EOD (a document's end)."""
    g = torch.Generator().manual_seed(1000 * step + index + 7)
    tokens = torch.randint(0, vocab, (MBS, seq + 1), generator=g)
    tokens[tokens == EOD] = EOD + 1
    tokens[torch.rand(MBS, seq + 1, generator=g) < 0.2] = EOD
    return tokens


def packed_micro_batch(step, index, vocab=64, seq=SEQ):
    """micro_batch's kind of tokens with documents packed in (packed_text), as pretraining with all three
    document flags batches them: positions restart after each EOD and the predictions made at an EOD are
    not scored (model/documents.Packing)."""
    from megatron_ds.model.documents import Packing
    tokens = packed_text(step, index, vocab, seq)
    return Packing(tiny_config(seq=seq, **PACKED)).batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def ds_config(pp, dp, gas, *, zero=1, clip=0.0, bf16=False, pipeline=None, lr=1e-2):
    cfg = {"train_batch_size": MBS * gas * dp, "train_micro_batch_size_per_gpu": MBS,
           "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "zero_optimization": {"stage": zero}, "steps_per_print": 10 ** 9,
           "wall_clock_breakdown": False}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if pipeline:
        cfg["pipeline"] = dict(pipeline)
    return cfg


def auto_engine_builder(config, pp, dp, lr):
    """build(ds_config) -> an engine of `config` on pp x dp ranks with the plan (and "auto"'s start) the ds_config
    asks for: what a test starts "auto" with and training/auto_schedule.switch_engine rebuilds through."""
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    from megatron_ds.pipe.plan.plan import make_plan

    def build(cfg):
        plan, auto_plan = make_plan(config, cfg, pp, dp)
        module = build_pipeline_module(config, cfg, pp, plan=plan)
        return initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), lr),
                                 auto_plan=auto_plan)
    return build


def optimizer_for(params_by_name, lr=1e-2):
    """AdamW with Megatron's groups: no weight decay on biases and norms.

    eps is 1e-6, not 1e-8: the attention key bias has an exactly-zero true gradient
    (softmax ignores a per-query constant), so its computed gradient is fp32 rounding
    noise of ~1e-11 whose bits depend on summation order; Adam's update lr*g/(|g|+eps)
    would turn that noise into 1e-5 weight differences with eps=1e-8."""
    decay, no_decay = [], []
    for name, p in params_by_name:
        (no_decay if p.dim() == 1 else decay).append(p)
    from megatron_ds.pipe.moe.moe import optimizer_param_groups  # expert-parallel parameters in groups of their own
    groups = [{"params": decay, "weight_decay": 0.1, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return torch.optim.AdamW(optimizer_param_groups(groups), lr=lr, betas=(0.9, 0.95), eps=1e-6)


EVAL_STEP = 99  # eval micro-batches are those of this (never trained) step


def reference_run(config, dp, gas, steps, clip=0.0, lr=1e-2, batch=None):
    """Losses of every step, the first step's gradients, weights after `steps` steps, then the eval loss.
    `batch`: the micro-batch maker (micro_batch's signature; default micro_batch)."""
    micro_batch = batch or globals()["micro_batch"]
    model = GPTModel(config)
    opt = optimizer_for(model.named_parameters(), lr)
    losses, norms, first_grads = [], [], None
    n = dp * gas
    set_grad_scale(1.0 / n)  # a MoE's router losses scaled as each micro-batch's loss is
    RouterLossLog.take()  # (what another model's passes left)
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for i in range(n):
            (x, pos), y = micro_batch(step, i, config.vocab_size, config.max_position_embeddings)
            loss = gpt_loss(model(x, pos), y) / n
            loss.backward()
            total += loss.item()
        losses.append(total)
        if first_grads is None:
            first_grads = {k: p.grad.clone() for k, p in model.named_parameters_by_layer().items()}
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        for module in model.modules():
            if isinstance(module, Router):
                module.update_expert_bias()
    weights = {k: p.detach().clone() for k, p in model.named_parameters_by_layer().items()}
    weights.update(expert_biases(enumerate(model.pipeline_layers())))
    with torch.no_grad():
        eval_loss = sum(gpt_loss(model(x, pos), y).item()
                        for (x, pos), y in (micro_batch(EVAL_STEP, i, config.vocab_size, config.max_position_embeddings)
                                            for i in range(n))) / n
    return dict(losses=losses, grads=first_grads, weights=weights, eval_loss=eval_loss, grad_norms=norms)


def expert_biases(named_layers):
    """{(layer key, buffer name): expert bias} of MoE routers, compared as the weights are."""
    return {(key, name): b.detach().clone() for key, layer in named_layers
            for name, b in layer.named_buffers() if name.endswith("expert_bias")}


def layer_key(module, name):
    """PipelineModule parameter name -> (global layer index, local name); None for the unused copy."""
    head, rest = name.split(".", 1)
    if head == "vocab_slice":  # one rank's rows; whole_vocabulary gathers them
        return (head, rest)
    if head == "tied_modules":
        key, local = rest.split(".", 1)
        return (0, local)
    return (int(head), rest)


def capture_grads_before_reduce(engine, store: list):
    """Record each local gradient (after tied-weight reduction, before the DP reduction)."""
    from deepspeed.runtime.pipe.schedule import ReduceGrads
    cls = type(engine)
    original = cls._INSTRUCTION_MAP[ReduceGrads]

    def capturing(self, *args, **kwargs):
        store.append({layer_key(self.module, n): p.grad.detach().float().clone()
                      for n, p in self.module.named_parameters() if p.grad is not None})
        return original(self, *args, **kwargs)

    cls._INSTRUCTION_MAP = {**cls._INSTRUCTION_MAP, ReduceGrads: capturing}


def engine_rank_runs(pp, gas, steps, pipelines, **kw):
    """engine_rank_run for several pipeline sections in one launch (saves the start-up cost)."""
    return [engine_rank_run(pp, gas, steps, pipeline, **kw) for pipeline in pipelines]


def engine_rank_run(pp, gas, steps, pipeline=None, zero=1, clip=0.0, bf16=False, num_layers=4, lr=1e-2, seq=SEQ,
                    model=None, batch=None):
    """Per-rank side: train `steps` steps, return losses, first-step grads and final weights.
    The pipeline section's "activation_checkpoint_interval" (a DeepSpeed key) checkpoints layers.
    `model`: GPTConfig options (a model family) on top of tiny_config. `batch`: the micro-batch maker
    (micro_batch's signature; default micro_batch)."""
    micro_batch = batch or globals()["micro_batch"]
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    config = tiny_config(num_layers, seq, **(model or {}))
    dp = dist.get_world_size() // (pp * config.tensor_model_parallel_size)
    cfg = ds_config(pp, dp, gas, zero=zero, clip=clip, bf16=bf16, pipeline=pipeline, lr=lr)
    module = build_pipeline_module(config, cfg, pp, (pipeline or {}).get("activation_checkpoint_interval", 0))
    engine = initialize_engine(module, cfg, optimizer=optimizer_for(module.named_parameters(), lr))
    grads = []
    capture_grads_before_reduce(engine, grads)
    dp_rank = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(steps):
        batches = iter([micro_batch(step, dp_rank * gas + j, config.vocab_size, seq) for j in range(gas)])
        losses.append(float(engine.train_batch(batches)))
        norms.append(float(engine.get_global_grad_norm()))
    weights = {layer_key(module, n): p.detach().float().clone() for n, p in module.named_parameters()}
    grads, weights = whole_tensors(engine, config, grads[0]), whole_tensors(engine, config, weights)
    weights.update(expert_biases((int(name), layer) for name, layer in module.named_children() if name.isdigit()))
    eval_batches = iter([micro_batch(EVAL_STEP, dp_rank * gas + j, config.vocab_size, seq) for j in range(gas)])
    eval_loss = float(engine.eval_batch(eval_batches))
    return dict(losses=losses, grads=grads, weights=weights, dp_rank=dp_rank, eval_loss=eval_loss,
                grad_norms=norms, engine=engine_facts(engine))


def whole_tensors(engine, config, tensors):
    """`tensors` ({layer key: tensor} of this rank's parameters or gradients) with every tensor-parallel slice
    and every vocabulary slice (over TP, then over the pipeline ranks) gathered into the whole tensor, keyed as
    the reference keys them (collectives: every rank)."""
    import torch.distributed as dist
    from megatron_ds.model.tensor_parallel import gather_full, tensor_parallel_group
    module, group, out = engine.module, tensor_parallel_group(config), {}
    for name, _ in module.named_parameters():
        owner, pname = name.rsplit(".", 1)
        key = layer_key(module, name)
        if key not in tensors:
            continue
        if key[0] == "vocab_slice" and group is not None:  # pipeline rank j's block: its TP ranks' rows in order
            parts = [torch.empty_like(tensors[key]) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, tensors[key].contiguous(), group=group)
            out[key] = torch.cat(parts)
        else:
            out[key] = gather_full(module.get_submodule(owner), pname, tensors[key], group)
    return whole_vocabulary(engine, config, out)


def whole_vocabulary(engine, config, tensors):
    """`tensors` with a vocabulary-parallel run's slices (keys ("vocab_slice", name)) gathered over the
    pipeline ranks into whole matrices, keyed as the reference keys them (a collective: every rank)."""
    import torch.distributed as dist
    whole = {"wte": (0, "wte.weight"), "head": (config.num_layers + 2, "weight")}
    out = {k: t for k, t in tensors.items() if k[0] != "vocab_slice"}
    for (_, name), t in sorted((k, t) for k, t in tensors.items() if k[0] == "vocab_slice"):
        parts = [torch.empty_like(t) for _ in range(engine.num_stages)]
        dist.all_gather(parts, t.contiguous(), group=engine.grid.get_pipe_parallel_group())
        out[whole[name]] = torch.cat(parts)
    return out


def engine_facts(engine):
    """What a test may want to know about the engine after the run (plain data)."""
    sync = getattr(engine.module, "replica_sync", None)
    return {"stage": engine.stage_id, "chunks": list(getattr(engine.module, "chunks", [])),
            "parts": [int(b) for b in engine.module.parts],
            "replica_syncs": list(sync.launched) if sync else [],
            "last_backward_end": sync.last_backward_end if sync else None,
            "router_metrics": getattr(engine, "router_metrics", None)}


def assert_matches_reference(results, ref, *, atol=1e-5, check_weights=True):
    ref_losses, ref_grads, ref_weights = ref["losses"], ref["grads"], ref["weights"]
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= atol, (r["losses"], ref_losses)
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= atol, ("eval loss", r["eval_loss"], ref["eval_loss"])
    dp = 1 + max(r["dp_rank"] for r in results)
    seen = set()
    for key, ref_grad in ref_grads.items():
        by_dp = {}
        for r in results:
            if key in r["grads"]:
                by_dp.setdefault(r["dp_rank"], []).append(r["grads"][key])
        assert len(by_dp) == dp, f"no rank of some DP replica holds a gradient for {key}"
        copies = list(zip(*by_dp.values()))  # every stage's copy of this parameter, across DP
        for per_dp in copies:
            mean = sum(per_dp) / dp
            diff = (mean - ref_grad).abs().max().item()
            assert diff <= atol, f"gradient of {key}: max abs diff {diff:.3g}"
        seen.add(key)
    assert seen == set(ref_grads)
    if check_weights:
        for key, w in ref_weights.items():
            for r in results:
                if key in r["weights"]:
                    diff = (r["weights"][key] - w).abs().max().item()
                    assert diff <= atol, f"weight {key} after {len(ref_losses)} steps: max abs diff {diff:.3g}"


def assert_schedules_match_reference(world, pp, gas, layers, pipelines, steps=3, timeout=600):
    """One launch of `world` ranks runs every ds_config pipeline section in `pipelines` on a tiny GPT;
    each must equal the single-process reference (assert_matches_reference). Returns every rank's results."""
    from megatron_ds.testing.launcher import run_ranks
    ref = reference_run(tiny_config(layers), world // pp, gas, steps)
    per_rank = run_ranks(world, engine_rank_runs, pp, gas, steps, pipelines, num_layers=layers, timeout=timeout)
    for i, pipeline in enumerate(pipelines):
        try:
            assert_matches_reference([r[i] for r in per_rank], ref)
        except AssertionError as exc:
            raise AssertionError(f"{pipeline}: {exc}") from None
    return per_rank
