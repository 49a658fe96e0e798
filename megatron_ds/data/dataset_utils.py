"""Parsing of --split and of a weighted --data-path, with Megatron's arithmetic."""
import math

from megatron_ds.errors import UserError


class DataConfigError(UserError, ValueError):
    """A --data-path / --split value that cannot describe datasets."""


def get_train_valid_test_split_(splits_string, size):
    """Item boundaries [0, a, b, size] of the train/valid/test ranges for "949,50,1".

    Commas or slashes separate the parts; missing parts are 0; they are normalised;
    each range gets int(round(fraction * size)) items (Python's round, half to
    even, as Megatron) and the ends are shifted so the last one is `size`.
    """
    text = str(splits_string)
    sep = "," if "," in text else "/"
    try:
        splits = [float(s) for s in text.split(sep)]
    except ValueError:
        raise DataConfigError(f"--split {splits_string!r}: expected up to three numbers "
                              f"separated by ',' or '/', e.g. 949,50,1") from None
    if any(s < 0 for s in splits):
        raise DataConfigError(f"--split {splits_string!r}: parts must not be negative")
    splits = (splits + [0.0, 0.0])[:3]
    total = sum(splits)
    if total <= 0:
        raise DataConfigError(f"--split {splits_string!r}: the parts sum to 0")
    splits = [s / total for s in splits]
    index = [0]
    for s in splits:
        index.append(index[-1] + int(round(s * float(size))))
    diff = index[-1] - size
    return [index[0]] + [i - diff for i in index[1:]]


def parse_data_prefix(data_prefix):
    """(weights, prefixes) of a --data-path list: ["P"] or ["0.3", "A", "0.7", "B"].

    Weights are normalised to sum to 1.
    """
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    data_prefix = list(data_prefix)
    if len(data_prefix) == 1:
        return [1.0], [str(data_prefix[0]).strip()]
    if len(data_prefix) % 2:
        raise DataConfigError(f"--data-path {' '.join(map(str, data_prefix))}: with several "
                              f"datasets give weight/prefix pairs, e.g. 0.3 A 0.7 B")
    weights, prefixes = [], []
    for w, p in zip(data_prefix[0::2], data_prefix[1::2]):
        try:
            weight = float(w)
        except (TypeError, ValueError):
            raise DataConfigError(f"--data-path: {w!r} (before {p!r}) is not a weight; give "
                                  f"weight/prefix pairs, e.g. 0.3 A 0.7 B") from None
        if not weight > 0 or math.isinf(weight):
            raise DataConfigError(f"--data-path: weight {w!r} of {p!r} must be a positive number")
        weights.append(weight)
        prefixes.append(str(p).strip())
    total = sum(weights)
    return [w / total for w in weights], prefixes


def get_datasets_weights_and_num_samples(data_prefix, train_valid_test_num_samples):
    """(prefixes, weights, per-dataset [train, valid, test] sample counts).

    Each dataset is asked for ceil(n * w * 1.005) samples: the blend is not
    exactly proportional and the 0.5 % margin keeps every dataset from running dry.
    """
    weights, prefixes = parse_data_prefix(data_prefix)
    num_samples = [[int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples]
                   for w in weights]
    return prefixes, weights, num_samples
