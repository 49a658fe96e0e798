"""What megatron_ds.initialize refuses for a user's own PipelineModule (pipe/foreign/foreign.check_settings, one line
naming what a layer would need), what it rebinds to the rebuilt layers (user_pipeline._rebound), and the
metadata of learned message shapes and which receives are posted at an iteration's start (pipe/foreign/learned_p2p.py);
one process, no launch."""
import pytest
import torch

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.foreign.foreign import check_settings
from megatron_ds.pipe.foreign.foreign_context import context_settings
from megatron_ds.pipe.foreign import learned_p2p
from megatron_ds.pipe.foreign.learned_p2p import LearnedP2P, Shapes, decode, encode, gradient_spec, spec_of
from megatron_ds.pipe.plan.messages import MessagePlan
from megatron_ds.schedules import build_schedule
from megatron_ds.user_pipeline import _rebound


def refusal(section, zero=1):
    ds_config = {"pipeline": section, "zero_optimization": {"stage": zero}}
    with pytest.raises(ConfigError) as err:
        check_settings(pipeline_settings(ds_config), ds_config)
    return str(err.value)


def test_what_a_foreign_layer_cannot_run_is_refused_in_one_line():
    assert "SegmentKVCache" in refusal({"schedule": "seq1f1b", "seq_splits": 2})
    assert "model/vocab_slices.py" in refusal({"schedule": "zbv", "vocab_parallel": True})
    assert "name a schedule" in refusal({"schedule": "auto", "memory_budget": 4})
    assert "DeepSpeed's partition methods" in refusal({"schedule": "zbv", "partition_method": "flops"})
    assert "ZeRO stage 0 or 1" in refusal({"schedule": "zbv"}, zero=2)
    assert "post_validation: 1" in refusal({"schedule": "zbv", "post_validation": True}, zero=0)
    for message in map(refusal, [{"schedule": "seq1f1b", "seq_splits": 2}, {"schedule": "auto", "memory_budget": 4}]):
        assert "\n" not in message
    ok = {"pipeline": {"schedule": "zbv", "partition_method": "type:Linear"}, "zero_optimization": {"stage": 0}}
    check_settings(pipeline_settings(ok), ok)


def test_the_optimizer_and_model_parameters_are_bound_to_the_rebuilt_layers():
    """By parameter name (one process here: the ranks' exchange of names is the launch's, test_foreign_engine)."""
    user, rebuilt = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(user.parameters(), lr=0.5, betas=(0.8, 0.9))
    new, params = _rebound(user, rebuilt, optimizer, user.parameters(), None)
    assert [id(p) for p in params] == [id(p) for p in rebuilt.parameters()]
    assert [id(p) for p in new.param_groups[0]["params"]] == [id(p) for p in rebuilt.parameters()]
    assert type(new) is torch.optim.AdamW and new.defaults["lr"] == 0.5 and new.defaults["betas"] == (0.8, 0.9)
    # parameter groups, each with its settings, in the optimizer and in model_parameters; a parameter in no group
    # stays out
    sgd = torch.optim.SGD([{"params": [user.bias], "lr": 0.1}, {"params": [user.weight], "weight_decay": 0.0}],
                          lr=1.0, weight_decay=0.5)
    groups = [{"params": [user.weight], "name": "w"}, {"params": [], "name": "empty"}]
    new, params = _rebound(user, rebuilt, sgd, groups, None)
    assert [[id(p) for p in g["params"]] for g in new.param_groups] == [[id(rebuilt.bias)], [id(rebuilt.weight)]]
    assert [(g["lr"], g["weight_decay"]) for g in new.param_groups] == [(0.1, 0.5), (1.0, 0.0)]
    assert params == [{"name": "w", "params": [rebuilt.weight]}, {"name": "empty", "params": []}]
    with pytest.raises(ConfigError, match="lr_scheduler=lambda optimizer"):
        _rebound(user, rebuilt, optimizer, None, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    with pytest.raises(ConfigError, match="model_parameters: group 0 holds 1 tensor"):
        _rebound(user, rebuilt, None, [torch.nn.Parameter(torch.zeros(1))], None)
    with pytest.raises(ConfigError, match="in groups 0 and 1"):
        _rebound(user, rebuilt, None, [{"params": [user.weight]}, {"params": [user.weight]}], None)


def test_message_metadata_round_trips_and_gradients_keep_the_floating_tensors():
    payload = (torch.zeros(2, 3), torch.ones(4, dtype=torch.int64), torch.zeros(1, 2, 2, dtype=torch.bfloat16),
               torch.zeros(5, dtype=torch.bool))
    spec = spec_of(payload)
    assert decode(encode(spec)) == spec == (False, (((2, 3), torch.float32), ((4,), torch.int64),
                                                    ((1, 2, 2), torch.bfloat16), ((5,), torch.bool)))
    assert gradient_spec(spec) == (False, (((2, 3), torch.float32), ((1, 2, 2), torch.bfloat16)))
    assert decode(encode(spec_of(torch.zeros(7)))) == (True, (((7,), torch.float32),))
    with pytest.raises(TypeError, match="a tensor or a tuple of tensors"):
        spec_of((torch.zeros(1), 3))


def test_every_receive_of_known_shape_is_posted_at_the_start_in_each_senders_order(monkeypatch):
    """post_all (gloo): every message to this rank whose shape is known is received from the start, so it moves
    as soon as it is sent; none before its shape is (the first iteration, dynamic_shape), which its op posts."""
    posted = []
    monkeypatch.setattr(learned_p2p.dist, "irecv", lambda buf, peer: posted.append((tuple(buf.shape), peer)))
    sched = build_schedule("zbv", 2, 4)
    plan = MessagePlan(sched, sched.ranks)
    spec = (True, (((2, 3), torch.float32),))
    shapes = Shapes()
    p2p = LearnedP2P(plan, 1, lambda r: r, shapes, "cpu")
    p2p.post_all()  # the first iteration: no shape known yet
    assert posted == [] and not p2p.pending_recv
    shapes.edges.update({(0, 0): spec, (0, 2): spec})  # what the first iteration learned: stage 0's and 2's sends
    p2p.post_all()
    assert list(p2p.pending_recv) == plan.sends[(0, 1)] and posted == [((2, 3), 0)] * len(plan.sends[(0, 1)])
    dynamic = LearnedP2P(plan, 1, lambda r: r, Shapes(dynamic=True), "cpu")
    dynamic.post_all()
    assert not dynamic.pending_recv


def test_one_batch_key_is_one_micro_batch_a_step_as_deepspeed_reads_it():
    from megatron_ds.pipe.foreign.foreign import _deepspeed_batch
    from megatron_ds.pipe.plan.plan import micro_batches_per_step
    assert micro_batches_per_step(_deepspeed_batch({"train_batch_size": 8}), 2) == (4, 1)
    assert micro_batches_per_step(_deepspeed_batch({"train_micro_batch_size_per_gpu": 3}), 2) == (3, 1)
    given = {"train_batch_size": 8, "gradient_accumulation_steps": 2}
    assert _deepspeed_batch(given) is given and micro_batches_per_step(given, 2) == (2, 2)


def test_a_module_of_fewer_layers_than_stages_is_told_the_way_out():
    """Two layers under zbv at pipeline 2 (4 virtual stages): a schedule of one stage per rank runs them."""
    from types import SimpleNamespace
    from megatron_ds.pipe.foreign.foreign import plan_for
    topology = SimpleNamespace(get_axis_names=lambda: ["pipe", "data"], get_dim=lambda axis: {"pipe": 2, "data": 1}[axis])
    module = SimpleNamespace(topology=lambda: topology, _layer_specs=[torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                 "pipeline": {"schedule": "zbv"}}
    with pytest.raises(ConfigError) as err:
        plan_for(module, ds_config, pipeline_settings(ds_config))
    assert str(err.value) == ("schedule 'zbv' needs at least one layer per virtual stage: your PipelineModule's 2 "
                              "layers < 4 virtual stages (2 per rank x pipeline size 2); choose a schedule of one "
                              "virtual stage per rank (1f1b, zb-h1, zb-h2) or a pipeline size of at most 1")


def test_hierarchical_context_parallelism_is_refused_for_a_user_module_in_one_line():
    with pytest.raises(ConfigError) as err:
        context_settings({"context_parallel": {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p"}})
    assert "\"a2a+p2p\" with your own PipelineModule: not run yet" in str(err.value) and "\n" not in str(err.value)
