"""Where a user's LayerSpec model starts under megatron_ds.initialize: the schedule cuts the layers otherwise
than DeepSpeed's engine (zbv at PP 2: four virtual stages against two stages), so a rank builds other layers
from the global RNG and the weights differ; with DeepSpeed's seed_layers (each layer seeded with base_seed + its
global index) they are the same under both engines. DeepSpeed 0.19.8's own seed_layers=True fails while the
module is built (its default partition gives numpy ints, which Python's random.seed refuses), so the module takes
seed_fn=megatron_ds.seed_layer, or ours takes ds_config "pipeline.seed_layers". One launch of 2 ranks."""
import numpy
import pytest
import torch

import megatron_ds
from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.foreign.foreign import check_settings
from megatron_ds.testing.launcher import run_ranks

BATCH = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def starts(cases):
    """Per case: {parameter name: weights} of the whole model after initialize, gathered from both ranks."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    out = []
    for seeding, pipeline in cases:
        torch.manual_seed(0)
        seed = {"seed_layers": True, "seed_fn": megatron_ds.seed_layer} if seeding else {}
        net = PipelineModule([LayerSpec(torch.nn.Linear, 6, 6) for _ in range(4)], num_stages=2,
                             loss_fn=torch.nn.MSELoss(), **seed)
        config = {**BATCH, **({"pipeline": pipeline} if pipeline else {})}
        engine, *_ = megatron_ds.initialize(model=net, config=config, model_parameters=net.parameters())
        mine = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        out.append({name: p for rank in everyone for name, p in rank.items()})
    return out


@pytest.fixture(scope="module")
def weights():
    cases = [(True, None), (True, {"schedule": "zbv"}), (False, {"schedule": "zbv", "seed_layers": True}),
             (False, None), (False, {"schedule": "zbv"})]
    per_rank = run_ranks(2, starts, cases, timeout=600)
    assert all(len(r) == len(cases) for r in per_rank)
    return per_rank[0]


def test_seeded_layers_start_alike_under_both_engines(weights):
    stock, ours, ours_by_key = weights[:3]
    assert sorted(stock) == sorted(ours) == sorted(ours_by_key) == sorted(f"{i}.{w}" for i in range(4)
                                                                             for w in ("weight", "bias"))
    for name in stock:
        assert torch.equal(stock[name], ours[name]), name
        assert torch.equal(stock[name], ours_by_key[name]), name


def test_unseeded_layers_start_otherwise_when_the_cut_differs(weights):
    """megatron_ds.initialize builds the chunks again (zbv's rank 1 holds layers 1 and 2, DeepSpeed's 2 and 3)
    from the RNG where the user's module left it: no layer starts as under DeepSpeed's engine."""
    stock, ours = weights[3:]
    assert not any(torch.equal(stock[name], ours[name]) for name in stock if name.endswith("weight"))


def test_seed_layer_takes_deepspeeds_numpy_seed():
    megatron_ds.seed_layer(numpy.int64(1234) + numpy.int64(2))
    drawn = torch.rand(3)
    torch.manual_seed(1236)
    assert torch.equal(drawn, torch.rand(3))


def test_the_seed_key_must_be_a_bool():
    ds_config = {"pipeline": {"schedule": "zbv", "seed_layers": 1}}
    with pytest.raises(ConfigError, match='"seed_layers" = 1: must be true or false'):
        check_settings(pipeline_settings(ds_config), ds_config)
