"""Shared by the tests of megatron_ds.initialize: three DeepSpeed PipelineModules that are not our GPT, their
deterministic micro-batches, the single-process reference (sequential gradient accumulation) and the per-rank
side that trains the same steps through megatron_ds.initialize and reports losses and weights keyed by
(global layer index, local parameter name), or ("tied", key, name) for a TiedLayerSpec's module."""
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec

MBS, WIDTH, VOCAB, TOKENS, CLASSES = 2, 8, 16, 4, 5


def _seeded(module, seed):
    """Every parameter drawn from its own generator: the same weights however many ranks build the layer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 0.1))
    return module


class SeededLinear(torch.nn.Linear):
    def __init__(self, n_in, n_out, seed):
        super().__init__(n_in, n_out)
        _seeded(self, seed)


class SeededEmbedding(torch.nn.Embedding):
    def __init__(self, rows, width, seed):
        super().__init__(rows, width)
        _seeded(self, seed)


class SeededConv(torch.nn.Conv2d):
    def __init__(self, n_in, n_out, seed):
        super().__init__(n_in, n_out, 3, padding=1)
        _seeded(self, seed)


class SeededGroupNorm(torch.nn.GroupNorm):
    def __init__(self, groups, channels, seed):
        super().__init__(groups, channels)
        _seeded(self, seed)


class SeededLayerNorm(torch.nn.LayerNorm):
    def __init__(self, width, seed):
        super().__init__(width)
        _seeded(self, seed)


class WithMask(torch.nn.Module):
    """Hands on a tuple: the feature map and an integer mask of its positive entries (not a float: no
    gradient travels back for it)."""

    def forward(self, x):
        return x, (x > 0).to(torch.int64)


class Masked(torch.nn.Module):
    """Takes the tuple and keeps the masked features, plus a leak of the rest."""

    def forward(self, inputs):
        x, mask = inputs
        return x * mask + 0.1 * x


def head(embedding, x):
    """A TiedLayerSpec's forward_fn: the embedding's weight as the output layer."""
    return torch.nn.functional.linear(x, embedding.weight)


def mean_tokens(x):
    return x.mean(dim=1) if x.dim() == 3 else x


def linear_tanh():
    """A Linear/Tanh stack (LayerSpecs and built modules mixed), cut by DeepSpeed's default ("parameters")."""
    layers = []
    for i in range(8):
        layers += [LayerSpec(SeededLinear, WIDTH, WIDTH, seed=100 + i) if i % 2 else SeededLinear(WIDTH, WIDTH, 100 + i),
                   torch.nn.Tanh()]
    return dict(layers=layers, loss_fn=torch.nn.MSELoss(), partition_method="parameters")


def tied():
    """Token embedding ... tied output layer (TiedLayerSpec at both ends), cut by its Linear layers."""
    layers = [TiedLayerSpec("embed", SeededEmbedding, VOCAB, WIDTH, seed=7)]
    for i in range(6):
        layers += [LayerSpec(SeededLinear, WIDTH, WIDTH, seed=200 + i), torch.nn.Tanh()]
    layers += [mean_tokens, TiedLayerSpec("embed", SeededEmbedding, VOCAB, WIDTH, seed=7, forward_fn=head)]
    return dict(layers=layers, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="type:SeededLinear")


def conv_norm():
    """A small conv classifier: conv, group and layer norms, parameter-free layers (whole chunks of them), and
    a tuple of a float and an integer tensor handed across stage bounds; cut uniformly, as the ds_config says."""
    layers = [LayerSpec(SeededConv, 3, 4, seed=300), LayerSpec(SeededGroupNorm, 2, 4, seed=301), torch.nn.ReLU(),
              WithMask(), Masked(), LayerSpec(SeededConv, 4, 4, seed=302), LayerSpec(SeededGroupNorm, 2, 4, seed=303),
              WithMask(), Masked(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
              LayerSpec(SeededLinear, 4 * 4 * 4, WIDTH, seed=304), LayerSpec(SeededLayerNorm, WIDTH, seed=305),
              torch.nn.GELU(), LayerSpec(SeededLinear, WIDTH, WIDTH, seed=306),
              LayerSpec(SeededLinear, WIDTH, CLASSES, seed=307)]
    return dict(layers=layers, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform",
                section={"partition_method": "uniform"})


def dynamic():
    """The Linear/Tanh stack over sequences whose length changes from micro-batch to micro-batch
    (PipelineModule(dynamic_shape=True): every message carries its shape)."""
    return {**linear_tanh(), "dynamic_shape": True}


MODELS = {"linear_tanh": linear_tanh, "tied": tied, "conv_norm": conv_norm}
EXTRA = {"dynamic": dynamic}  # run in some cases only


def micro_batch(model, step, index):
    """Micro-batch `index` of optimizer step `step` of `model`'s data (same on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    if model == "dynamic":
        length = 1 + (step + index) % 3
        return torch.randn(MBS, length, WIDTH, generator=g), torch.randn(MBS, length, WIDTH, generator=g)
    if model == "linear_tanh":
        return torch.randn(MBS, WIDTH, generator=g), torch.randn(MBS, WIDTH, generator=g)
    if model == "tied":
        return torch.randint(0, VOCAB, (MBS, TOKENS), generator=g), torch.randint(0, VOCAB, (MBS,), generator=g)
    return torch.randn(MBS, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (MBS,), generator=g)


EVAL_STEP, LR = 99, 1e-2


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)


def grouped(named):
    """Two param groups of (name, parameter) pairs: weights as optimizer() sets them, biases without weight
    decay at twice the learning rate."""
    named = list(named)
    return [{"params": [p for n, p in named if not n.endswith("bias")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 2 * LR}]


def reference_run(model, n, steps, clip=0.0, groups=False):
    """Single process: each step's loss (mean over the n micro-batches), weights after `steps`, the eval loss;
    `groups`: the optimizer over grouped()'s param groups."""
    spec = {**MODELS, **EXTRA}[model]()
    layers, tied_modules, calls = {}, {}, []
    for idx, layer in enumerate(spec["layers"]):
        if isinstance(layer, TiedLayerSpec):
            module = tied_modules.setdefault(layer.key, layer.build())
            calls.append(module if layer.forward_fn is None else (lambda x, f=layer.forward_fn, m=module: f(m, x)))
        elif isinstance(layer, (LayerSpec, torch.nn.Module)):
            layers[idx] = layer.build() if isinstance(layer, LayerSpec) else layer
            calls.append(layers[idx])
        else:
            calls.append(layer)
    named = {(idx, name): p for idx, m in layers.items() for name, p in m.named_parameters()}
    named.update({("tied", key, name): p for key, m in tied_modules.items() for name, p in m.named_parameters()})
    opt = optimizer(grouped((k[-1], p) for k, p in named.items()) if groups else list(named.values()))

    def forward(x):
        for call in calls:
            x = call(x)
        return x

    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for i in range(n):
            x, y = micro_batch(model, step, i)
            loss = spec["loss_fn"](forward(x), y) / n
            loss.backward()
            total += loss.item()
        losses.append(total)
        if clip:
            torch.nn.utils.clip_grad_norm_(list(named.values()), clip)
        opt.step()
    with torch.no_grad():
        eval_loss = sum(spec["loss_fn"](forward(x), y).item()
                        for x, y in (micro_batch(model, EVAL_STEP, i) for i in range(n))) / n
    return dict(losses=losses, weights={k: p.detach().clone() for k, p in named.items()}, eval_loss=eval_loss)


def ds_config(gas, dp, pipeline, zero=1, clip=0.0):
    return {"train_batch_size": MBS * gas * dp, "train_micro_batch_size_per_gpu": MBS,
            "gradient_accumulation_steps": gas, "gradient_clipping": clip, "zero_optimization": {"stage": zero},
            "steps_per_print": 10 ** 9, "pipeline": dict(pipeline)}


def weight_key(name):
    head, rest = name.split(".", 1)
    if head == "tied_modules":
        key, local = rest.split(".", 1)
        return ("tied", key, local)
    return (int(head), rest)


def _distributed():
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    return dist


def build_engine(model, pp, gas, pipeline, zero=1, clip=0.0, groups=False):
    """`model`'s PipelineModule as its user builds it, through megatron_ds.initialize with an optimizer object
    over its parameters (which it rebinds to the chunks' own; `groups`: over grouped()'s param groups): our
    engine when `pipeline` names a schedule, DeepSpeed's own (its PipelineModule, cut its own way) when it
    names none."""
    import megatron_ds
    from deepspeed.pipe import PipelineModule
    dist = _distributed()
    spec = {**MODELS, **EXTRA}[model]()
    user = PipelineModule(layers=spec["layers"], num_stages=pp, loss_fn=spec["loss_fn"],
                          partition_method=spec["partition_method"], dynamic_shape=spec.get("dynamic_shape", False))
    section = {**spec.get("section", {}), **pipeline} if pipeline.get("schedule") else dict(pipeline)
    config = ds_config(gas, dist.get_world_size() // pp, section, zero, clip)
    params = grouped(user.named_parameters()) if groups else user.parameters()
    return megatron_ds.initialize(model=user, optimizer=optimizer(params), config=config)[0]


def rank_runs(pp, gas, steps, cases):
    """Per-rank side: for each (model, pipeline section, clip, ZeRO stage[, param groups]) in `cases` build the
    engine (build_engine), train `steps` steps, evaluate once."""
    out = []
    for model, pipeline, clip, zero, *groups in cases:
        engine = build_engine(model, pp, gas, pipeline, zero, clip, groups=bool(groups and groups[0]))
        losses = [_train(engine, model, gas, step) for step in range(steps)]
        dp_rank = engine.grid.get_data_parallel_rank()
        eval_loss = float(engine.eval_batch(iter([micro_batch(model, EVAL_STEP, dp_rank * gas + j)
                                                  for j in range(gas)])))
        out.append(dict(losses=losses, eval_loss=eval_loss, weights=_weights(engine), engine=type(engine).__name__,
                        parts=list(engine.module.parts), first=engine.is_first_stage(), last=engine.is_last_stage(),
                        weights_in_w=engine.weights_in_w, whole=sorted(cause for _, cause in engine._said)))
    return out


def assert_matches(results, ref, atol=1e-5):
    """Every rank's losses, eval loss and weights equal the reference's (each weight held by some rank)."""
    held = set()
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])) <= atol, (r["losses"], ref["losses"])
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= atol, (r["eval_loss"], ref["eval_loss"])
        for key, w in r["weights"].items():
            diff = (w - ref["weights"][key]).abs().max().item()
            assert diff <= atol, f"weight {key}: max abs diff {diff:.3g}"
            held.add(key)
    assert held == set(ref["weights"]), set(ref["weights"]) - held


def _weights(engine):
    return {weight_key(n): p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _train(engine, model, gas, step):
    dp_rank = engine.grid.get_data_parallel_rank()
    return float(engine.train_batch(iter([micro_batch(model, step, dp_rank * gas + j) for j in range(gas)])))


def checkpoint_round_trip(model, pp, gas, schedule, save_dir):
    """Per-rank side: train 2 steps on our engine under `schedule` and save; load that into DeepSpeed's stock
    engine (megatron_ds.initialize without a schedule: its own PipelineModule, cut its own way), train a step
    and save; load that into our engine again. Returns each phase's weights ({key: tensor} of this rank) and losses."""
    import os

    def engine(ours):
        return build_engine(model, pp, gas, {"schedule": schedule} if ours else {})  # none: DeepSpeed's engine

    out = {}
    first = engine(ours=True)
    out["losses"] = [_train(first, model, gas, step) for step in range(2)]
    out["saved"] = _weights(first)
    first.save_checkpoint(os.path.join(save_dir, "ours"), tag="step2")
    stock = engine(ours=False)
    path, _ = stock.load_checkpoint(os.path.join(save_dir, "ours"), tag="step2", load_optimizer_states=False)
    out["stock_loaded"], out["stock_engine"] = _weights(stock), type(stock).__name__
    out["stock_loss"] = _train(stock, model, gas, 2)
    out["stock_saved"] = _weights(stock)
    stock.save_checkpoint(os.path.join(save_dir, "stock"), tag="step3")
    again = engine(ours=True)
    again.load_checkpoint(os.path.join(save_dir, "stock"), tag="step3", load_optimizer_states=False)
    out["ours_loaded"] = _weights(again)
    out["eval"] = {"stock": _evaluations(stock, model, gas), "ours": _evaluations(again, model, gas)}
    out["stages"] = {"stock": (stock.is_first_stage(), stock.is_last_stage()),
                     "ours": (again.is_first_stage(), again.is_last_stage())}
    return out


def _evaluations(engine, model, gas):
    """eval_batch's kinds of result, on the same weights and data: the mean loss (every rank), the
    micro-batches' losses and the mean output (the loss stage's rank; None elsewhere), the loss with the last
    micro-batch's logits."""
    dp_rank = engine.grid.get_data_parallel_rank()

    def data():
        return iter([micro_batch(model, EVAL_STEP, dp_rank * gas + j) for j in range(gas)])

    def plain(value):
        if value is None or torch.is_tensor(value):
            return None if value is None else value.detach().float().clone()
        return [plain(v) for v in value]

    results = {"mean": plain(engine.eval_batch(data())),
               "each": plain(engine.eval_batch(data(), reduce_output=None, bcast_loss=False))}
    engine.total_loss = None  # DeepSpeed 0.19.8 adds the outputs to the last batch's loss sum, not a fresh one
    results["outputs"] = plain(engine.eval_batch(data(), compute_loss=False))
    results["logits"] = plain(engine.eval_batch(data(), return_logits=True))
    return results


def refusals_without_parameters(schedules):
    """Per-rank side: a PipelineModule whose layers after the first are parameter-free, cut uniformly over 2
    ranks, under each of `schedules`: the ConfigError megatron_ds.initialize raises on this rank (None: none)."""
    import megatron_ds
    from deepspeed.pipe import PipelineModule

    from megatron_ds.pipe.plan.config import ConfigError
    dist = _distributed()
    out = []
    for schedule in schedules:
        user = PipelineModule(layers=[SeededLinear(WIDTH, WIDTH, 1), torch.nn.Tanh(), torch.nn.Tanh(), torch.nn.Tanh()],
                              num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        try:
            megatron_ds.initialize(model=user, optimizer=optimizer,  # rank 1 could not build one over its stage
                                   config=ds_config(4, 1, {"schedule": schedule, "partition_method": "uniform"}))
            out.append(None)
        except ConfigError as exc:
            out.append(str(exc))
    dist.barrier()  # rank 0 holds the store: it leaves last
    return out


def outputs_without_loss(schedules):
    """Per-rank side: a PipelineModule without a loss_fn (its last layer's one output is the loss, as DeepSpeed
    takes it) and placeholder labels (0), evaluated under each of `schedules`: eval_batch's value on this rank,
    and the single-process forward's mean over the micro-batches."""
    import megatron_ds
    from deepspeed.pipe import PipelineModule
    _distributed()
    layers = [SeededLinear(WIDTH, WIDTH, 400 + i) for i in range(3)] + [SeededLinear(WIDTH, 1, 403)]
    data = [(torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(i)), 0) for i in range(4)]
    with torch.no_grad():
        reference = torch.stack([torch.nn.Sequential(*layers)(x) for x, _ in data]).mean(0)
    out = []
    for schedule in schedules:
        user = PipelineModule(layers=layers, num_stages=2, partition_method="uniform")
        config = {**ds_config(4, 1, {"schedule": schedule}), "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1}
        engine = megatron_ds.initialize(model=user, optimizer=optimizer, config=config)[0]
        out.append(engine.eval_batch(iter(data)).detach().clone())
    return out, reference
