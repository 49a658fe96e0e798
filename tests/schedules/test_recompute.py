"""schedules/recompute.py: Megatron's groups (which layers a chunk checkpoints), its rules, and what the
simulator makes of each setting: a layer's activations less what recompute frees, B paying the forward it runs
again, and a B's rise while it recomputes. The memory counts themselves are checked against autograd's saved
tensors in tests/model/test_recompute.py, the whole against the engine in bench/recompute.py."""
import pytest

from megatron_ds.schedules import build_schedule, simulate
from megatron_ds.schedules.costs import ModelCosts
from megatron_ds.schedules.recompute import LayerMemory, Recompute, checkpoint_groups, evaluate

P, M, LAYERS = 4, 8, 8
# a layer keeps 10; the core 6 of it, its inputs 1 more than the core kept (selective: 5 less); input 1; W 4; 7
# after the core, freed in backward before the core is recomputed (so no rise), of which W keeps 3
MEMORY = LayerMemory(kept=10.0, core=6.0, core_inputs=1.0, input=1.0, for_w=4.0, after_core=7.0, after_core_w=3.0)
FULL, BLOCK = Recompute("full", "uniform", 1), Recompute("full", "block", 1)


def test_checkpoint_groups_are_megatrons():
    """uniform: groups of N transformer layers from each chunk's first; block: the first N one by one; the
    embedding, final norm and head never (DeepSpeed's interval would group them with layers, then skip)."""
    first = [False, True, True, True, True, True]  # a first stage: the embedding, five layers
    assert checkpoint_groups(Recompute("full", "uniform", 2), first) == [(0, 1, False), (1, 3, True), (3, 5, True),
                                                                        (5, 6, True)]
    assert checkpoint_groups(Recompute("full", "block", 2), first) == [(0, 1, False), (1, 2, True), (2, 3, True),
                                                                      (3, 6, False)]
    last = [True, True, True, False, False]  # three layers, the final norm, the head
    assert checkpoint_groups(Recompute("full", "uniform", 5), last) == [(0, 3, True), (3, 5, False)]
    assert checkpoint_groups(Recompute("full", "block", 9), last) == [(0, 1, True), (1, 2, True), (2, 3, True),
                                                                      (3, 5, False)]
    assert checkpoint_groups(Recompute("selective"), last) == [(0, 5, False)]
    assert checkpoint_groups(Recompute(), first) == [(0, 6, False)]


@pytest.mark.parametrize("settings, problem", [
    (Recompute("selective", "block"), "they need --recompute-granularity full"),
    (Recompute(None, None, 2), "they need --recompute-granularity full"),
    (Recompute("full", "block", 0), "--recompute-num-layers must be positive"),
    (Recompute("partial"), "recompute granularity 'partial'"),
])
def test_megatrons_rules(settings, problem):
    assert problem in settings.problem()


def test_recompute_labels_name_method_granularity_and_layers():
    assert [r.label for r in (Recompute(), Recompute("selective"), FULL, Recompute("full", "block", 2))] == \
        ["none", "selective", "full uniform 1", "full block 2"]


def run(name, recompute, core_share=0.25):
    return evaluate(build_schedule(name, P, M), ModelCosts(1, 1, 1), recompute, MEMORY, LAYERS, core_share)


def test_nothing_recomputed_is_the_plain_simulation():
    for name in ("1f1b", "zbv"):
        plain = simulate(build_schedule(name, P, M), 1, 1, 1, act_size=(1.0, 0.4))  # for_w / kept
        ours = run(name, Recompute())
        assert ours.makespan == plain.makespan and ours.peak_memory == pytest.approx(plain.peak_memory)


def test_selective_keeps_less_and_pays_the_core_again_in_backward():
    none, selective = run("1f1b", Recompute()), run("1f1b", Recompute("selective"))
    assert selective.peak_memory == pytest.approx([0.5 * x for x in none.peak_memory])  # (10 - 5) / 10
    assert none.makespan == (M + P - 1) * 3 and selective.makespan == (M + P - 1) * 3.25  # B + 0.25 F


def test_selective_rises_by_what_the_core_holds_beyond_the_part_after_it():
    """A chunk's last layer recomputes its core (6) first in backward, once its part after the core (here 4) is
    freed: a BW rises by 2; a split B keeps W's share of that part (3): it rises by 5."""
    memory = LayerMemory(kept=10.0, core=6.0, core_inputs=1.0, input=1.0, for_w=4.0, after_core=4.0, after_core_w=3.0)
    assert memory.stage(Recompute("selective"), 2) == (10.0, 8.0, 5.0, 2.0)
    one = evaluate(build_schedule("1f1b", P, M), ModelCosts(1, 1, 1), Recompute("selective"), memory, LAYERS, 0.25)
    assert one.peak_memory == pytest.approx([(P - r) * 0.5 + 0.1 for r in range(P)])  # 2 of a stage's 20


def test_full_keeps_the_inputs_and_rises_while_a_layer_is_recomputed():
    """1F1B, 2 layers a stage, each its own group: rank r holds p - r micro-batches of 2 inputs (2 of 20 = 0.1
    unit each), and the last BW rises by a layer (10) less the input it gives up (1): 0.45 unit."""
    full = run("1f1b", FULL)
    assert full.peak_memory == pytest.approx([(P - r) * 0.1 + 0.45 for r in range(P)])
    assert full.makespan == (M + P - 1) * 4  # B runs the whole forward again
    block = run("1f1b", BLOCK)  # the first layer recomputed: its rise is covered by the second's release
    assert block.peak_memory == pytest.approx([(P - r) * 0.55 for r in range(P)])
    assert block.makespan == (M + P - 1) * 3.5


def test_full_under_a_split_backward_keeps_what_w_needs():
    """ZB-V: each chunk one layer; a B keeps W's 4 of the layer's 10 whatever recomputed it."""
    none, full = run("zbv", Recompute()), run("zbv", FULL)
    assert max(full.peak_memory) < 0.6 * max(none.peak_memory)
    assert max(full.peak_memory) > max(simulate(build_schedule("zbv", P, M), act_size=(0.1, 0.4)).peak_memory)


def test_transient_counts_at_its_op_only():
    schedule = build_schedule("1f1b", 2, 2)
    plain = simulate(schedule, act_size=(1.0, 0.0))
    risen = simulate(schedule, act_size=(1.0, 0.0), transient=lambda op: 5.0 if op.kind.name == "BW" else 0.0)
    assert risen.peak_memory == [level + 5.0 for level in plain.peak_memory]  # each rank's first BW: at its peak
