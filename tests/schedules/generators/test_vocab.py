from megatron_ds.schedules import Op, build_schedule, simulate
from megatron_ds.schedules.generators.vocab import delay_backwards


def _labels(ops):
    return [f"{op.kind}{op.mb}" for op in ops]


def test_delay_backwards_holds_one_more_micro_batch_and_keeps_w_after_b():
    ops = build_schedule("zb-h1", 2, 4).ranks[1]
    assert _labels(ops) == ["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "F3", "B3", "W2", "W3"]
    # each B after the next forward (the last one, with none left, where it was); W's keep their places
    assert _labels(delay_backwards(ops, 1)) == ["F0", "F1", "B0", "W0", "F2", "B1", "W1", "F3", "B2", "B3",
                                                "W2", "W3"]
    assert delay_backwards(ops, 0) == ops


def test_vocab_parallel_1f1b_hides_the_barrier():
    """The head's cost spread over the ranks costs no more than the balanced ideal at TF = TB = TW."""
    p, m, head = 4, 16, 1.0
    vocab = simulate(build_schedule("1f1b", p, m, vocab_parallel=True), head=(head,) * 3)
    share = 1 + head / p
    ideal = simulate(build_schedule("1f1b", p, m), share, share, share)
    assert vocab.makespan <= ideal.makespan * 1.01
    assert Op("S", 0, 3, 0) in vocab.start
