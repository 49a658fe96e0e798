from megatron_ds.schedules import Op, build_schedule, order_text


def test_1f1b_order_matches_deepspeed_train_schedule():
    s = build_schedule("1f1b", 4, 6)
    assert order_text(s, [0, 3]) == (
        "rank0: F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 BW3 BW4 BW5\n"
        "rank3: F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4 F5 BW5")


def test_1f1b_fewer_micro_batches_than_ranks():
    s = build_schedule("1f1b", 4, 2)
    assert order_text(s, [0]) == "rank0: F0 F1 BW0 BW1"


def test_gpipe_all_forwards_first():
    s = build_schedule("gpipe", 2, 3)
    assert s.ranks[1] == [Op("F", 0, 1, 0), Op("F", 0, 1, 1), Op("F", 0, 1, 2),
                          Op("BW", 0, 1, 0), Op("BW", 0, 1, 1), Op("BW", 0, 1, 2)]
