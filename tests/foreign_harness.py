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


MODELS = {"linear_tanh": linear_tanh, "tied": tied, "conv_norm": conv_norm}


def micro_batch(model, step, index):
    """Micro-batch `index` of optimizer step `step` of `model`'s data (same on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    if model == "linear_tanh":
        return torch.randn(MBS, WIDTH, generator=g), torch.randn(MBS, WIDTH, generator=g)
    if model == "tied":
        return torch.randint(0, VOCAB, (MBS, TOKENS), generator=g), torch.randint(0, VOCAB, (MBS,), generator=g)
    return torch.randn(MBS, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (MBS,), generator=g)


EVAL_STEP, LR = 99, 1e-2


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)


def reference_run(model, n, steps, clip=0.0):
    """Single process: each step's loss (mean over the n micro-batches), weights after `steps`, the eval loss."""
    spec = MODELS[model]()
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
    opt = optimizer(list(named.values()))

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


def rank_runs(pp, gas, steps, cases):
    """Per-rank side: for each (model, pipeline section, clip, ZeRO stage) in `cases` build the user's
    PipelineModule, pass it to megatron_ds.initialize with an optimizer object over its parameters (which it
    rebinds to the chunks' own), train `steps` steps, evaluate once."""
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    import megatron_ds
    from deepspeed.pipe import PipelineModule
    out = []
    for model, pipeline, clip, zero in cases:
        dp = dist.get_world_size() // pp
        spec = MODELS[model]()
        user = PipelineModule(layers=spec["layers"], num_stages=pp, loss_fn=spec["loss_fn"],
                              partition_method=spec["partition_method"])
        section = {**spec.get("section", {}), **pipeline}
        engine, _, _, _ = megatron_ds.initialize(model=user, optimizer=optimizer(user.parameters()),
                                                 config=ds_config(gas, dp, section, zero, clip))
        dp_rank = engine.grid.get_data_parallel_rank()
        losses = []
        for step in range(steps):
            batches = iter([micro_batch(model, step, dp_rank * gas + j) for j in range(gas)])
            losses.append(float(engine.train_batch(batches)))
        eval_loss = float(engine.eval_batch(iter([micro_batch(model, EVAL_STEP, dp_rank * gas + j)
                                                  for j in range(gas)])))
        weights = {weight_key(n): p.detach().float().clone() for n, p in engine.module.named_parameters()}
        out.append(dict(losses=losses, eval_loss=eval_loss, weights=weights, engine=type(engine).__name__,
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

    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    import megatron_ds
    from deepspeed.pipe import PipelineModule

    def engine(ours):
        spec = MODELS[model]()
        user = PipelineModule(layers=spec["layers"], num_stages=pp, loss_fn=spec["loss_fn"],
                              partition_method=spec["partition_method"])
        pipeline = {**spec.get("section", {}), "schedule": schedule} if ours else {}  # none: DeepSpeed's engine
        return megatron_ds.initialize(model=user, optimizer=optimizer(user.parameters()),
                                      config=ds_config(gas, dist.get_world_size() // pp, pipeline))[0]

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
