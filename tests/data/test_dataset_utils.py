import pytest

from megatron_ds.data.dataset_utils import (DataConfigError, get_datasets_weights_and_num_samples,
                                            get_train_valid_test_split_, parse_data_prefix)


@pytest.mark.parametrize("splits, size, expected", [
    ("949,50,1", 1000, [0, 949, 999, 1000]),
    # Rounded sizes 9+0+0 fall one short, so every end shifts up by one (Megatron's "diff").
    ("949,50,1", 10, [0, 10, 10, 10]),
    ("969, 30, 1", 343, [0, 333, 343, 343]),
    ("98/2", 100, [0, 98, 100, 100]),
    ("1", 7, [0, 7, 7, 7]),
    ("1,1,1", 10, [0, 4, 7, 10]),  # 3+3+3 = 9, shifted by one
    ("1,2,1", 6, [0, 1, 4, 6]),  # round(1.5) = 2 (half to even): 2+3+2 = 7, shifted down by one
])
def test_split_boundaries_match_megatron(splits, size, expected):
    assert get_train_valid_test_split_(splits, size) == expected


@pytest.mark.parametrize("splits", ["a,b", "0,0,0", "1,-1,0"])
def test_bad_split_strings_are_rejected(splits):
    with pytest.raises(DataConfigError, match="--split"):
        get_train_valid_test_split_(splits, 10)


def test_weighted_data_path():
    assert parse_data_prefix(["/d/a"]) == ([1.0], ["/d/a"])
    weights, prefixes = parse_data_prefix(["3", "A", "7", "B"])
    assert prefixes == ["A", "B"] and weights == pytest.approx([0.3, 0.7])
    prefixes, weights, counts = get_datasets_weights_and_num_samples(["0.3", "A", "0.7", "B"], [1000, 100, 0])
    assert counts == [[302, 31, 0], [704, 71, 0]]  # ceil(n * w * 1.005)
    for bad, msg in ((["A", "B"], "not a weight"), (["0.3", "A", "0.7"], "pairs"), (["0", "A", "1", "B"], "positive")):
        with pytest.raises(DataConfigError, match=msg):
            parse_data_prefix(bad)
