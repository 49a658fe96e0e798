"""megatron_ds.initialize under context parallelism: a user's own DeepSpeed PipelineModule of megatron_ds.model's
layers (LayerSpecs of Embedding, TransformerLayer, FinalNorm, LMHead: a LLaMA-style GPT with RoPE and GQA), with
the ds_config's "context_parallel" section at CP 2 x PP 2 (4 gloo ranks, one launch), trains as the same model on
one process does: every step's loss, the eval loss and every weight after 3 AdamW steps within 1e-5 (fp32), under
zbv with gpt_loss, under 1f1b with a plain mean cross entropy (exact: every rank scores as many tokens), and under
zbv with gpt_loss and a quarter of the labels ignored (-100: exact only with the micro-batch's count, which
gpt_loss is given). Each rank's stages see (b, s / 2) tokens and its attention the CP group. In the same launch
the refusals, the same one line on every rank: torch's MultiheadAttention in a layer, no attention of ours, ours
built for CP 1, DeepSpeed's own engine, training_data, a sequence that does not cut into 2 x CP chunks."""
import functools

import pytest
import torch

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import (EVAL_STEP, layer_key, micro_batch, optimizer_for, reference_run, tiny_config,
                               whole_tensors)
from tests.gpt_harness import ds_config as make_ds_config
from tests.pipe.parallel.test_context_parallel import LLAMA, LR, SEQ

CP, PP, GAS, LAYERS, STEPS = 2, 2, 4, 4, 3
IGNORED = -100


def mean_cross_entropy(logits, labels):
    """A user's own loss: the mean over the tokens it is given."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten())


def masked_batch(step, index, vocab=64, seq=SEQ):
    """micro_batch with about a quarter of its labels ignored (not scored), other counts in every chunk."""
    inputs, labels = micro_batch(step, index, vocab, seq)
    g = torch.Generator().manual_seed(5000 + 1000 * step + index)
    return inputs, labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.25, IGNORED)


def user_layers(config):
    """What a user writes: our layers as LayerSpecs, each drawing its weights from (config.seed, its index)."""
    from deepspeed.pipe import LayerSpec
    from megatron_ds.model import Embedding, FinalNorm, LMHead, TransformerLayer
    L = config.num_layers
    return [LayerSpec(Embedding, config, 0), *(LayerSpec(TransformerLayer, config, i) for i in range(1, L + 1)),
            LayerSpec(FinalNorm, config, L + 1), LayerSpec(LMHead, config, L + 2)]


def _initialize(layers, loss_fn, cfg, method="type:TransformerLayer", **kw):
    from deepspeed.pipe import PipelineModule
    import megatron_ds
    net = PipelineModule(layers=layers, loss_fn=loss_fn, num_stages=PP, partition_method=method)
    engine, *_ = megatron_ds.initialize(model=net, optimizer=optimizer_for(net.named_parameters(), LR), config=cfg,
                                        **kw)
    return engine


def _config(pipeline, cp=CP, **section):
    cfg = make_ds_config(PP, 1, GAS, pipeline=pipeline, lr=LR)
    return {**cfg, "context_parallel": {"context_parallel_size": cp, **section}}


def train(schedule, loss, batch):
    from megatron_ds.model import Embedding, gpt_loss
    from megatron_ds.model.attention import CausalSelfAttention
    config = tiny_config(LAYERS, SEQ, **LLAMA, context_parallel_size=CP)
    engine = _initialize(user_layers(config), {"gpt_loss": gpt_loss, "mean": mean_cross_entropy}[loss],
                         _config({"schedule": schedule}))
    seen = []  # the token shape the embedding is given on this rank
    for m in engine.module.modules():
        if isinstance(m, Embedding):
            m.register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0][0].shape)))
    out = replica_run(engine, config, {"plain": micro_batch, "masked": masked_batch}[batch], GAS, STEPS)
    attention = [m.cp_layout.size for m in engine.module.modules() if isinstance(m, CausalSelfAttention)
                 and m.cp_group is not None]
    return dict(out, tokens=sorted(set(seen)), attention=attention, engine=type(engine).__name__)


def replica_run(engine, config, make, gas, steps):
    """`steps` steps on this rank's replica's micro-batches (every CP rank of a replica reads the same ones), then
    an eval: the losses, the eval loss, every weight whole, the replica."""
    replica = engine.grid.get_data_parallel_rank() // config.context_parallel_size

    def batches(step):
        return iter([make(step, replica * gas + j, config.vocab_size, config.max_position_embeddings)
                     for j in range(gas)])
    losses = [float(engine.train_batch(batches(step))) for step in range(steps)]
    weights = whole_tensors(engine, config, {layer_key(engine.module, n): p.detach()
                                             for n, p in engine.module.named_parameters()})
    return dict(losses=losses, eval_loss=float(engine.eval_batch(batches(EVAL_STEP))), weights=weights,
                replica=replica)


def refusal(make):
    from megatron_ds.errors import UserError
    try:
        make()
    except UserError as exc:
        return str(exc)
    return None


class TorchMHABlock(torch.nn.Module):
    """A layer attending through torch's MultiheadAttention: under CP it would see its rank's shard alone."""

    def __init__(self, hidden):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(hidden, 4, batch_first=True)

    def forward(self, x):
        return x + self.attn(x, x, x, need_weights=False)[0]


def refusals():
    from deepspeed.pipe import LayerSpec
    from megatron_ds.model import gpt_loss
    config = tiny_config(LAYERS, SEQ, **LLAMA, context_parallel_size=CP)
    layers = user_layers(config)
    one = _config({"schedule": "1f1b"})
    torch_attention = [*layers[:2], LayerSpec(TorchMHABlock, 32), *layers[2:]]
    plain = tiny_config(LAYERS, SEQ, **LLAMA)
    return {
        "torch_attention": refusal(lambda: _initialize(torch_attention, gpt_loss, one)),
        "no_attention": refusal(lambda: _initialize([layers[0], *(LayerSpec(torch.nn.Linear, 32, 32) for _ in range(3)),
                                                     *layers[-2:]], gpt_loss, one, "uniform")),
        "built_for_cp1": refusal(lambda: _initialize(user_layers(plain), gpt_loss, one)),
        "stock": refusal(lambda: _initialize(layers, gpt_loss, _config(None))),
        "training_data": refusal(lambda: _initialize(layers, gpt_loss, one, training_data=[0])),
        "section": refusal(lambda: _initialize(layers, gpt_loss, _config({"schedule": "1f1b"}, cp="2"))),
        "odd_sequence": refusal(lambda: _initialize(layers, gpt_loss, one).train_batch(
            iter([micro_batch(0, j, 64, SEQ - 2) for j in range(GAS)]))),
    }


CASES = [("zbv", "gpt_loss", "plain"), ("1f1b", "mean", "plain"), ("zbv", "gpt_loss", "masked")]


def rank_side():
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    return [train(*case) for case in CASES], refusals()


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(CP * PP, rank_side, timeout=900)


@functools.lru_cache(maxsize=None)
def _reference(batch):
    return reference_run(tiny_config(LAYERS, SEQ, **LLAMA), 1, GAS, STEPS, lr=LR,
                         batch={"plain": micro_batch, "masked": masked_batch}[batch])


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(case) for case in CASES])
def test_a_user_pipeline_module_under_context_parallelism_equals_one_process(per_rank, index):
    schedule, loss, batch = CASES[index]
    ref, results = _reference(batch), [runs[index] for runs, _ in per_rank]
    for r in results:
        assert r["engine"] == "ForeignScheduleEngine"
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert worst <= 1e-5, (r["losses"], ref["losses"])
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= 1e-5, (r["eval_loss"], ref["eval_loss"])
        assert r["attention"] and set(r["attention"]) == {CP}  # every attention of the rank over the CP pair
    assert {t for r in results for t in r["tokens"]} == {(2, SEQ // CP)}  # the embedding's ranks get their halves
    weights = {}
    for r in results:
        for key, w in r["weights"].items():
            weights.setdefault(key, []).append(w)
    assert set(weights) == set(ref["weights"])
    diff = max((w - ref["weights"][key]).abs().max().item() for key, copies in weights.items() for w in copies)
    print(f"{schedule} {loss} {batch}: losses {results[0]['losses']} (reference {ref['losses']}), weights after "
          f"{STEPS} steps within {diff:.2e}")
    assert diff <= 1e-5


def test_ignored_labels_need_the_micro_batch_count():
    """The control: with ignored labels the mean of each CP rank's own mean is not the micro-batch's mean (the
    ranks score other numbers of tokens), so the masked case's exactness comes from gpt_loss's count."""
    from megatron_ds.model.context_parallel import ContextLayout
    _, labels = masked_batch(0, 0)
    logits = torch.randn(*labels.shape, 64, generator=torch.Generator().manual_seed(3))
    ranks = [ContextLayout(CP, r) for r in range(CP)]
    assert len({int((r.shard(labels) >= 0).sum()) for r in ranks}) == CP
    mean_of_means = sum(mean_cross_entropy(r.shard(logits), r.shard(labels)) for r in ranks) / CP
    assert abs(mean_of_means - mean_cross_entropy(logits, labels)) > 1e-3


def test_refusals_are_one_line_and_the_same_on_every_rank(per_rank):
    found = [r for _, r in per_rank]
    assert all(f == found[0] for f in found), found
    got = found[0]
    print("\n".join(f"{k}: {v}" for k, v in got.items()))
    assert all(message and "\n" not in message for message in got.values()), got
    assert "MultiheadAttention" in got["torch_attention"] and "1/2 of the sequence" in got["torch_attention"]
    assert "no layer holds megatron_ds.model's attention" in got["no_attention"]
    assert "built with context_parallel_size 1" in got["built_for_cp1"]
    assert "runs under a named schedule" in got["stock"]
    assert "training_data" in got["training_data"]
    assert "context_parallel_size\" = '2'" in got["section"]
    assert "dim 1 of a micro-batch's input tensor (30) must be divisible" in got["odd_sequence"], got["odd_sequence"]
