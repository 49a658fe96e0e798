"""megatron_ds.initialize under context parallelism with data parallelism, and with MoE layers: a user's own
DeepSpeed PipelineModule of megatron_ds.model's layers at CP 2 x DP 2 (PP 1: 4 gloo ranks, one launch; the data
axis is DP x CP = 4, gradients and ZeRO-1's shards over it), each CP rank of a replica handed the replica's
micro-batches (replica = engine.grid.get_data_parallel_rank() // CP), trains as the same model on one process:

- a LLaMA-style dense module under zbv (two virtual stages on the one pipeline rank) with gpt_loss and a quarter of
  the labels ignored (exact only when each rank's loss divides by the micro-batch's count / CP);
- a module of MoE layers (tests/pipe/moe's softmax model: 8 experts, top-2, a shared expert, aux loss and z-loss)
  under 1f1b, the experts shared out over the CP pair (EP 2: the groups made before the module is built,
  expert_parallel_groups), the optimizer an AdamW over the user's two groups that initialize splits for ZeRO's
  expert groups (and, one step, the ds_config's optimizer over model_parameters=net.parameters()). The router's
  losses enter the gradients as in the reference (a reference without them is the control).

Every step's loss, the eval loss and every weight after 3 AdamW steps within 1e-5 (fp32); the EP group check
refuses groups made for another topology, one line on every rank."""
import dataclasses

import pytest
import torch

from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import micro_batch, optimizer_for, reference_run, tiny_config
from tests.gpt_harness import ds_config as make_ds_config
from tests.pipe.foreign.test_foreign_context_parallel import masked_batch, refusal, replica_run, user_layers
from tests.pipe.moe.test_moe_engine import MODELS
from tests.pipe.parallel.test_context_parallel import LLAMA, LR, SEQ

CP, DP, GAS, LAYERS, STEPS = 2, 2, 2, 2, 3
MOE = {**MODELS["softmax"], "moe": dataclasses.replace(MODELS["softmax"]["moe"], expert_model_parallel_size=2)}
CASES = {"dense-zbv-masked": (LLAMA, "zbv", masked_batch), "moe-ep2-1f1b": (MOE, "1f1b", micro_batch)}


def user_optimizer(named_parameters):
    """What a user writes: AdamW over two groups (no decay on vectors), knowing nothing of expert groups."""
    decay, no_decay = [], []
    for _, p in named_parameters:
        (no_decay if p.dim() == 1 else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95), eps=1e-6)


def train(name):
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule
    import megatron_ds
    from megatron_ds.model import gpt_loss
    from megatron_ds.model.moe import MoE
    from megatron_ds.pipe.foreign.foreign_moe import expert_parallel_groups
    model, schedule, make = CASES[name]
    config = tiny_config(LAYERS, SEQ, **model, context_parallel_size=CP)
    expert_parallel_groups(config, num_stages=1)  # before the layers are built (nothing without EP)
    net = PipelineModule(layers=user_layers(config), loss_fn=gpt_loss, num_stages=1)
    cfg = {**make_ds_config(1, DP, GAS, pipeline={"schedule": schedule}, lr=LR),
           "context_parallel": {"context_parallel_size": CP}}
    optimizer = user_optimizer(net.named_parameters()) if config.moe else optimizer_for(net.named_parameters(), LR)
    engine, *_ = megatron_ds.initialize(model=net, optimizer=optimizer, config=cfg)
    out = dict(replica_run(engine, config, make, GAS, STEPS), data_world=engine.dp_world_size,
               engine=[c.__name__ for c in type(engine).__mro__[:3]])
    if config.moe:
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
        from megatron_ds.pipe.foreign.foreign_moe import check_experts
        out["router_metrics"] = engine.router_metrics
        out["moe_groups"] = sorted(g["name"] for g in engine.optimizer.optimizer.param_groups if g.get("moe"))
        out["other_topology"] = refusal(lambda: check_experts(engine.module, PipeDataParallelTopology(num_pp=4, num_dp=1)))
        out["ep_ranks"] = sorted({tuple(dist.get_process_group_ranks(m.ep_group)) for m in engine.module.modules()
                                  if isinstance(m, MoE)})
        out["ds_config_optimizer"] = other_optimizer_path(config, cfg)
    return out


def other_optimizer_path(config, cfg):
    """The documented call: model_parameters=net.parameters() (a flat list) and the ds_config's optimizer, which
    DeepSpeed builds over them; (its expert groups, the first step's loss): ZeRO-1 asserts the expert groups."""
    from deepspeed.pipe import PipelineModule
    import megatron_ds
    from megatron_ds.model import gpt_loss
    net = PipelineModule(layers=user_layers(config), loss_fn=gpt_loss, num_stages=1)
    engine, *_ = megatron_ds.initialize(model=net, model_parameters=net.parameters(), config={
        **cfg, "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}})
    replica = engine.grid.get_data_parallel_rank() // CP
    loss = float(engine.train_batch(iter([micro_batch(0, replica * GAS + j, config.vocab_size, SEQ)
                                          for j in range(GAS)])))
    return sorted(g["name"] for g in engine.optimizer.optimizer.param_groups if g.get("moe")), loss


def rank_side():
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    return {name: train(name) for name in CASES}


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(CP * DP, rank_side, timeout=900)


def _reference(name, **moe):
    model, _, make = CASES[name]
    if "moe" in model:  # one process holds every expert
        model = {**model, "moe": dataclasses.replace(model["moe"], expert_model_parallel_size=1, **moe)}
    return reference_run(tiny_config(LAYERS, SEQ, **model), DP, GAS, STEPS, lr=LR, batch=make)


@pytest.mark.parametrize("name", CASES)
def test_a_user_module_at_cp_x_dp_equals_one_process(per_rank, name):
    ref, results = _reference(name), [r[name] for r in per_rank]
    assert [r["replica"] for r in results] == [0, 0, 1, 1]  # CP inner on the data axis
    weights = {}
    for r in results:
        assert r["data_world"] == CP * DP  # DeepSpeed's gradient mean and ZeRO-1 over DP x CP
        assert "ForeignScheduleEngine" in r["engine"]
        worst = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        assert worst <= 1e-5, (r["losses"], ref["losses"])
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= 1e-5, (r["eval_loss"], ref["eval_loss"])
        for key, w in r["weights"].items():
            weights.setdefault(key, []).append(w)
    assert set(weights) == set(ref["weights"])  # the experts' union over the EP ranks is every weight
    diff = max((w - ref["weights"][key]).abs().max().item() for key, copies in weights.items() for w in copies)
    print(f"{name}: losses {results[0]['losses']} (reference {ref['losses']}), weights after {STEPS} steps within "
          f"{diff:.2e}")
    assert diff <= 1e-5


def test_moe_under_cp_shares_its_experts_and_counts_its_router_losses(per_rank):
    name = "moe-ep2-1f1b"
    results = [r[name] for r in per_rank]
    experts = {k for r in results for k in r["weights"] if ".experts." in str(k[1])}
    assert all(len([k for k in r["weights"] if k in experts]) == len(experts) // 2 for r in results)  # EP 2
    assert [r["ep_ranks"] for r in results] == [[(0, 1)], [(0, 1)], [(2, 3)], [(2, 3)]]  # each replica's CP pair
    assert all(r["moe_groups"] == ["ep_size_2"] for r in results)  # the user's decay group's experts (no-decay: none)
    ref = _reference(name)
    for r in results:  # the ds_config's optimizer over model_parameters
        groups, loss = r["ds_config_optimizer"]
        assert groups == ["ep_size_2"] and abs(loss - ref["losses"][0]) <= 1e-5, (groups, loss)
    metrics = [r["router_metrics"] for r in results]
    assert all(m == metrics[0] for m in metrics) and metrics[0]["load_balancing_loss"] > 0 and metrics[0]["z_loss"] > 0
    # the control: without the router's losses the router weights end elsewhere, so the match above counts them
    bare = _reference(name, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    routers = [k for k in ref["weights"] if "router" in str(k[1])]
    assert routers and max((ref["weights"][k] - bare["weights"][k]).abs().max().item() for k in routers) > 1e-4
    refused = {r["other_topology"] for r in results}
    assert len(refused) == 1 and "\n" not in refused.pop(), refused
    assert "the PipelineModule's topology gives it" in results[0]["other_topology"], results[0]["other_topology"]


def test_expert_groups_split_the_users_groups_and_name_them():
    from megatron_ds.errors import UserError
    from megatron_ds.pipe.foreign.foreign_moe import expert_groups
    dense, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, 2))
    expert.allreduce, expert.group_name = False, "ep_size_2"  # as MoE marks its experts under EP
    plain = [{"params": [dense], "weight_decay": 0.0}]
    assert expert_groups(plain) is plain  # no experts: untouched
    split = expert_groups([{"params": [dense, expert], "weight_decay": 0.1}])
    assert [(g["name"], g.get("moe", False), len(g["params"]), g["weight_decay"]) for g in split] == \
        [("group_0", False, 1, 0.1), ("ep_size_2", True, 1, 0.1)]
    with pytest.raises(UserError, match="a name of its own"):
        expert_groups([{"params": [dense], "name": "a"}, {"params": [expert], "name": "a"}])
