import os

import numpy as np
import pytest

from megatron_ds.data import gpt_dataset
from megatron_ds.data.dataset_utils import DataConfigError
from megatron_ds.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets, index_cache_paths
from megatron_ds.data.indexed_dataset import IndexedDatasetError, make_builder, make_dataset

from .megatron_reference import build_index_mappings_reference


def write_docs(prefix, docs, dtype=np.uint16):
    b = make_builder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_item(np.asarray(d))
        b.end_document()
    b.finalize(prefix + ".idx")
    return prefix


def random_docs(seed, n, base=0, max_len=40):
    rng = np.random.default_rng(seed)
    return [base + rng.integers(0, 1000, int(rng.integers(1, max_len))) for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
    docs = random_docs(0, 50)
    return write_docs(str(tmp_path / "corpus_text_document"), docs), docs


def test_each_sample_is_a_seq_length_plus_one_window_of_the_shuffled_stream(corpus):
    prefix, docs = corpus
    ds = GPTDataset("train", prefix, np.arange(50, dtype=np.int32), make_dataset(prefix), 300, 16, 1234)
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    assert len(ds) >= 300
    for i in range(len(ds)):
        sample = ds[i]["text"]
        j = int(ds.shuffle_idx[i])
        assert sample.dtype == np.int64 and sample.shape == (17,)
        assert np.array_equal(sample, stream[j * 16: j * 16 + 17])


@pytest.mark.parametrize("num_samples, seq_length, seed", [
    (10, 8, 1), (300, 16, 1234), (95, 32, 3), (40, 2, 5), (0, 16, 7), (1000, 64, 11)])
def test_index_mappings_and_cache_files_equal_megatrons(corpus, num_samples, seq_length, seed):
    prefix, _ = corpus
    documents = np.arange(5, 45, dtype=np.int32)
    indexed = make_dataset(prefix)
    ds = GPTDataset("train", prefix, documents, indexed, num_samples, seq_length, seed)
    doc_idx, sample_idx, shuffle_idx, _, _ = build_index_mappings_reference(
        documents, indexed.sizes, num_samples, seq_length, seed)
    for ours, theirs in ((ds.doc_idx, doc_idx), (ds.sample_idx, sample_idx), (ds.shuffle_idx, shuffle_idx)):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    paths = index_cache_paths("train", prefix, documents, indexed.sizes, num_samples, seq_length, seed)
    names = [os.path.basename(p) for p in paths]
    stem = f"corpus_text_document_train_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_5-45docs_"
    assert all(n.startswith(stem) for n in names) and len({n[len(stem):len(stem) + 10] for n in names}) == 1
    assert [n[len(stem) + 10:] for n in names] == ["_doc_idx.npy", "_sample_idx.npy", "_shuffle_idx.npy"]
    for ours, path in zip((ds.doc_idx, ds.sample_idx, ds.shuffle_idx), paths):
        assert np.array_equal(ours, np.load(path))
    assert all(os.path.isfile(os.path.join(os.path.dirname(prefix), n)) for n in names)


def test_the_short_last_epoch_is_shuffled_separately(corpus):
    prefix, _ = corpus
    indexed = make_dataset(prefix)
    documents = np.arange(50, dtype=np.int32)
    per_epoch = (int(indexed.sizes.sum()) - 1) // 16
    for num_samples, separate in ((per_epoch + 3, True), (2 * per_epoch - 2, False)):
        *_, epochs, was_separate = build_index_mappings_reference(documents, indexed.sizes, num_samples, 16, 9)
        assert (epochs, was_separate) == (2, separate)
        ds = GPTDataset("train", prefix, documents, indexed, num_samples, 16, 9)
        first = int(((epochs - 1) * indexed.sizes.sum() - 1) // 16)
        # Separated: the first (epochs-1) epochs' samples all come before the last epoch's.
        assert (ds.shuffle_idx[:first].max() < first) == separate


def test_index_cache_is_built_once_and_reused(corpus, monkeypatch):
    prefix, _ = corpus
    first = build_train_valid_test_datasets([prefix], "mmap", "90,10,0", [100, 10, 0], 16, 5, True)
    train_docs = np.arange(0, 45, dtype=np.int32)  # 90 % of the fixture's 50 documents
    paths = index_cache_paths("train", prefix, train_docs, make_dataset(prefix).sizes, 100, 16, 5)
    stamps = [os.path.getmtime(p) for p in paths]

    def refuse(*a, **k):
        raise AssertionError("the index was rebuilt although its cache exists")
    monkeypatch.setattr(gpt_dataset, "_build_and_save", refuse)
    again = build_train_valid_test_datasets([prefix], "infer", "90,10,0", [100, 10, 0], 16, 5, True)
    assert [os.path.getmtime(p) for p in paths] == stamps
    assert all(np.array_equal(first[0][i]["text"], again[0][i]["text"]) for i in range(100))
    assert first[2] is None and again[2] is None  # the test split has no documents
    assert len(first[1]) >= 10


def test_split_949_50_1_covers_contiguous_document_ranges(tmp_path):
    docs = [np.full(20, i, dtype=np.uint16) for i in range(1000)]  # doc i is all i
    prefix = write_docs(str(tmp_path / "split"), docs)
    train, valid, test = build_train_valid_test_datasets([prefix], "mmap", "949,50,1", [50, 20, 5], 8, 1, True)
    seen = [{int(t) for i in range(len(d)) for t in d[i]["text"]} for d in (train, valid, test)]
    assert max(seen[0]) < 949 and min(seen[1]) >= 949 and max(seen[1]) < 999 and seen[2] == {999}


def _source(sample):
    # Dataset A's tokens are < 1000, B's are >= 1000 (see the fixture below).
    return int(sample["text"][0] >= 1000)


@pytest.fixture
def two_corpora(tmp_path):
    a = write_docs(str(tmp_path / "A"), random_docs(1, 200))
    b = write_docs(str(tmp_path / "B"), random_docs(2, 300, base=1000))
    return a, b


def test_blending_draws_within_one_percent_of_the_weights_and_is_deterministic(two_corpora, tmp_path):
    a, b = two_corpora
    n = 20000
    caches = [tmp_path / "cache1", tmp_path / "cache2"]
    for c in caches:
        c.mkdir()
    runs = [build_train_valid_test_datasets(["0.3", a, "0.7", b], "mmap", "100,0,0", [n, 0, 0], 16, 1234,
                                            True, data_cache_path=str(c))[0] for c in caches]
    train = runs[0]
    sources = np.array([_source(train[i]) for i in range(n)])
    assert abs(sources.mean() - 0.7) < 0.01
    for start in range(0, n, 5000):  # also locally, not just on average
        assert abs(sources[start:start + 5000].mean() - 0.7) < 0.01
    assert len(train) >= n
    assert all(np.array_equal(train[i]["text"], runs[1][i]["text"]) for i in range(0, n, 7))
    other_seed = build_train_valid_test_datasets(["0.3", a, "0.7", b], "mmap", "100,0,0", [n, 0, 0], 16, 99,
                                                 True)[0]
    assert not all(np.array_equal(train[i]["text"], other_seed[i]["text"]) for i in range(20))


def test_bad_data_paths_are_reported(tmp_path, two_corpora):
    a, _ = two_corpora
    with pytest.raises(IndexedDatasetError, match="missing.idx: index file not found"):
        build_train_valid_test_datasets([str(tmp_path / "missing")], "mmap", "1,0,0", [1, 0, 0], 8, 1, True)
    with pytest.raises(DataConfigError, match="weight/prefix pairs"):
        build_train_valid_test_datasets(["0.5", a, "0.5"], "mmap", "1,0,0", [1, 0, 0], 8, 1, True)
    tiny = write_docs(str(tmp_path / "tiny"), [[7]])
    with pytest.raises(DataConfigError, match="1 token"):
        build_train_valid_test_datasets([tiny], "mmap", "1,0,0", [1, 0, 0], 8, 1, True)


def test_a_changed_corpus_or_split_builds_its_own_cache(tmp_path):
    prefix = write_docs(str(tmp_path / "data"), random_docs(4, 30))
    build_train_valid_test_datasets([prefix], "mmap", "1,0,0", [50, 0, 0], 8, 1, True)
    docs = random_docs(5, 45)
    write_docs(prefix, docs)  # re-preprocessed under the same prefix
    train = build_train_valid_test_datasets([prefix], "mmap", "1,0,0", [50, 0, 0], 8, 1, True)[0]
    assert set(int(t) for i in range(50) for t in train[i]["text"]) <= set(int(t) for d in docs for t in d)
    assert len(train.doc_idx) % 45 == 0  # indices over the 45 new documents, not the 30 old ones
    cache = tmp_path / "new" / "cache"  # --data-cache-path need not exist
    ends = []
    for split in ("9,1,0", "7,3,0", "9,1,0"):  # a changed --split just works, also going back
        train, valid, _ = build_train_valid_test_datasets([prefix], "mmap", split, [50, 10, 0], 8, 1, True,
                                                          data_cache_path=str(cache))
        end = int(max(train.doc_idx)) + 1
        assert set(np.asarray(train.doc_idx)) == set(range(end))
        assert set(np.asarray(valid.doc_idx)) == set(range(end, 45))
        ends.append(end)
    assert ends[0] == ends[2] > ends[1]
    assert len([n for n in os.listdir(cache) if n.endswith("_doc_idx.npy")]) == 4  # 2 splits x (train, valid)


def test_blend_skips_a_dataset_without_valid_documents_but_not_without_train(tmp_path):
    small = write_docs(str(tmp_path / "small"), random_docs(6, 10))  # 949,50,1 -> no valid docs
    big = write_docs(str(tmp_path / "big"), random_docs(7, 400, base=1000))
    train, valid, _ = build_train_valid_test_datasets(["0.5", small, "0.5", big], "mmap", "949,50,1",
                                                      [100, 20, 0], 8, 1, True)
    assert len(train.datasets) == 2 and len(valid.datasets) == 1
    assert all(_source(valid[i]) == 1 for i in range(20))
    # Another split over the same prefix gets its own cache (Megatron's name alone would collide)
    other = build_train_valid_test_datasets(["0.5", small, "0.5", big], "mmap", "0,1,0", [100, 20, 0], 8, 1,
                                            True)[1]
    assert all(0 <= int(d) < 400 for d in other.datasets[1].doc_idx)
    (tmp_path / "cache").mkdir()
    with pytest.raises(DataConfigError, match="no training documents"):  # 1 % of 10 docs is none
        build_train_valid_test_datasets(["0.5", small, "0.5", big], "mmap", "1,99,0", [100, 20, 0], 8, 1, True,
                                        data_cache_path=str(tmp_path / "cache"))


def test_blending_indices_are_cached_and_reloaded(two_corpora, tmp_path, monkeypatch):
    from megatron_ds.data import blendable_dataset
    a, b = two_corpora
    cache = tmp_path / "blend_cache"  # created on first use
    blend = ["0.3", a, "0.7", b]
    first = build_train_valid_test_datasets(blend, "mmap", "100,0,0", [5000, 0, 0], 16, 1, True,
                                            data_cache_path=str(cache))[0]
    assert len([n for n in os.listdir(cache) if n.startswith("blending_indices_2ds_")]) == 1

    def refuse(*args):
        raise AssertionError("blending indices recomputed although cached")
    monkeypatch.setattr(blendable_dataset, "build_blending_indices", refuse)
    again = build_train_valid_test_datasets(blend, "mmap", "100,0,0", [5000, 0, 0], 16, 1, True,
                                            data_cache_path=str(cache))[0]
    assert np.array_equal(first.dataset_index, again.dataset_index)
    assert np.array_equal(first.dataset_sample_index, again.dataset_sample_index)
    with pytest.raises(AssertionError, match="recomputed"):  # other weights: another cache
        build_train_valid_test_datasets(["0.4", a, "0.6", b], "mmap", "100,0,0", [5000, 0, 0], 16, 1, True,
                                        data_cache_path=str(cache))
