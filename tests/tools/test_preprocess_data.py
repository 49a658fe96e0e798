"""tools/preprocess_data.py, preprocess_data_many_cores.py, merge_preprocessed_data.py."""
import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_ds.data.indexed_dataset import MMapIndexedDataset
from megatron_ds.data.preprocessing import many_cores, merge, pipeline
from megatron_ds.data.tokenizer import default_gpt2_files
from megatron_ds.testing.launcher import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = child_env(ROOT)  # what `pip install .` gives a tool run as a script


def corpus_texts():
    from pydoc_data.topics import topics
    texts = [topics[k][:3000] for k in sorted(topics)[:60]]
    # Empty documents are dropped, odd text must survive.
    texts[3] = ""
    texts[10] = "héllo wörld 🤗 日本語\n\n\ttab"
    return texts


def write_jsonl(path, texts, extra=None):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            row = {"text": t, "id": i}
            row.update(extra or {})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def flags(inp, out, *more):
    vocab, merges = default_gpt2_files()
    return ["--input", inp, "--output-prefix", out, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
            "--merge-file", merges, "--append-eod", "--dataset-impl", "mmap", "--log-interval", "20", *more]


def same_dataset(a, b):
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    d = tmp_path_factory.mktemp("whole")
    inp = write_jsonl(d / "corpus.jsonl", corpus_texts())
    assert pipeline.main(flags(inp, str(d / "whole"), "--workers", "2", "--chunk-size", "4")) == 0
    return inp, str(d / "whole_text_document")


def test_output_holds_each_nonempty_document_with_eod(whole, capsys):
    from megatron_ds.data.tokenizer import GPT2BPETokenizer
    _, prefix = whole
    tok = GPT2BPETokenizer(*default_gpt2_files())
    texts = [t for t in corpus_texts() if t]
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == len(texts) == 59
    assert ds.doc_idx.tolist() == list(range(60))
    for i in (0, 9, 58):
        assert ds[i].tolist() == tok.tokenize(texts[i]) + [50256]
    assert not [n for n in os.listdir(os.path.dirname(prefix)) if ".tmp" in n]


def test_whole_corpus_and_merged_shards_are_byte_identical(whole, tmp_path):
    _, prefix = whole
    texts = corpus_texts()
    shards = []
    for k, (a, b) in enumerate(((0, 17), (17, 18), (18, 60))):  # uneven, one shard of a single doc
        inp = write_jsonl(tmp_path / f"part{k}.jsonl", texts[a:b])
        assert pipeline.main(flags(inp, str(tmp_path / f"part{k}"), "--workers", "1")) == 0
        shards.append(str(tmp_path / f"part{k}_text_document"))
    merged = str(tmp_path / "merged")
    script = os.path.join(ROOT, "tools", "merge_preprocessed_data.py")
    run = subprocess.run([sys.executable, script, "--datasets", *shards, "--output-prefix", merged],
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert run.returncode == 0, run.stderr
    assert f"Merged 3 datasets to {merged}" in run.stdout
    assert same_dataset(prefix, merged)


def test_many_cores_output_is_byte_identical_to_one_worker(whole, tmp_path):
    inp, prefix = whole
    assert many_cores.main(flags(inp, str(tmp_path / "many"), "--workers", "3")) == 0
    assert same_dataset(prefix, str(tmp_path / "many_text_document"))
    assert sorted(os.listdir(tmp_path)) == ["many_text_document.bin", "many_text_document.idx"]


def test_hugging_face_dataset_input_gives_the_same_bytes(whole, tmp_path):
    import datasets
    _, prefix = whole
    saved = str(tmp_path / "hf")
    datasets.Dataset.from_dict({"text": corpus_texts()}).save_to_disk(saved)
    assert pipeline.main(flags(saved, str(tmp_path / "hf_out"), "--workers", "2")) == 0
    assert same_dataset(prefix, str(tmp_path / "hf_out_text_document"))
    assert many_cores.main(flags(saved, str(tmp_path / "hf_many"), "--workers", "2")) == 0
    assert same_dataset(prefix, str(tmp_path / "hf_many_text_document"))


def test_gpt2_bpe_without_vocab_and_merge_files_uses_the_installed_ones(whole, tmp_path):
    inp, prefix = whole
    args = flags(inp, str(tmp_path / "bare"))
    for flag in ("--vocab-file", "--merge-file"):
        del args[args.index(flag):args.index(flag) + 2]
    assert pipeline.main(args) == 0
    assert same_dataset(str(tmp_path / "bare_text_document"), prefix)


def test_several_json_keys_give_one_dataset_each(tmp_path):
    inp = write_jsonl(tmp_path / "c.jsonl", ["one two", "three"], extra={"title": "A title"})
    assert pipeline.main(flags(inp, str(tmp_path / "k"), "--json-keys", "text", "title")) == 0
    assert len(MMapIndexedDataset(str(tmp_path / "k_title_document"))) == 2
    assert MMapIndexedDataset(str(tmp_path / "k_text_document"))[1].tolist() == [15542, 50256]


def run_tool(name, *args):
    script = os.path.join(ROOT, "tools", name)
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60, env=ENV)


def test_progress_reports_documents_and_megabytes_per_second(whole, tmp_path):
    inp, _ = whole
    run = run_tool("preprocess_data.py", *flags(inp, str(tmp_path / "p"), "--workers", "1"))
    assert run.returncode == 0, run.stderr
    assert "Processed 20 documents (" in run.stderr and "docs/s" in run.stderr and "MB/s)." in run.stderr
    assert "Done: 60 documents," in run.stderr


@pytest.mark.parametrize("tool", ["preprocess_data.py", "preprocess_data_many_cores.py"])
@pytest.mark.parametrize("case, message", [
    ("bad_json", "bad.jsonl: "),  # plus 'line 31' or 'byte offset'
    ("missing_key", "no key 'text'"),
    ("missing_input", "nowhere.jsonl: file not found"),
    ("no_vocab", "GPT2BPETokenizer needs both --vocab-file and --merge-file"),
])
def test_bad_input_is_one_clear_line_and_leaves_no_output(tmp_path, tool, case, message):
    texts = corpus_texts()
    inp = write_jsonl(tmp_path / "bad.jsonl", texts)
    args = flags(inp, str(tmp_path / "out"), "--workers", "2")
    if case == "bad_json":
        lines = open(inp).read().splitlines()
        lines[30] = lines[30][:-5]
        open(inp, "w").write("\n".join(lines) + "\n")
    elif case == "missing_key":
        args += ["--json-keys", "body"]
        message = "no key 'body'"
    elif case == "missing_input":
        args[1] = str(tmp_path / "nowhere.jsonl")
    elif case == "no_vocab":
        i = args.index("--vocab-file")
        del args[i:i + 2]
    run = run_tool(tool, *args)
    assert run.returncode == 2
    assert message in run.stderr
    assert "Traceback" not in run.stderr
    assert [n for n in os.listdir(tmp_path) if n.startswith("out")] == []
    if case == "bad_json":
        assert "invalid JSON" in run.stderr


def test_wrong_flags_and_bad_merge_inputs(tmp_path, whole):
    run = run_tool("preprocess_data.py", *flags("x.jsonl", "o", "--dataset-impl", "lazy"))
    assert run.returncode == 2 and "invalid choice: 'lazy'" in run.stderr
    _, prefix = whole
    broken = str(tmp_path / "broken")
    with open(prefix + ".idx", "rb") as f:
        open(broken + ".idx", "wb").write(f.read()[:-3])
    open(broken + ".bin", "wb").write(open(prefix + ".bin", "rb").read())
    run = run_tool("merge_preprocessed_data.py", "--datasets", prefix, broken, "--output-prefix",
                   str(tmp_path / "m"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"{broken}.idx: index truncated" in run.stderr
    assert not os.path.exists(str(tmp_path / "m.bin")) and not os.path.exists(str(tmp_path / "m.bin.tmp"))


def test_merge_function_reports_totals(whole, tmp_path):
    _, prefix = whole
    lines = []
    total = merge.merge([prefix, prefix], str(tmp_path / "twice"), log=lines.append)
    assert total == 118 and lines[-1] == f"Merged 2 datasets to {tmp_path / 'twice'}"
    ds = MMapIndexedDataset(str(tmp_path / "twice"))
    assert ds.doc_idx.tolist() == list(range(119)) and np.array_equal(ds[59], ds[0])


@pytest.mark.parametrize("fmt", ["parquet", "csv", "arrow"])
def test_parquet_csv_and_arrow_inputs_give_the_same_bytes_as_jsonl(whole, tmp_path, fmt):
    import datasets
    import pyarrow as pa
    _, prefix = whole
    texts = corpus_texts()
    ds = datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts})
    path = str(tmp_path / f"corpus.{fmt}")
    if fmt == "parquet":
        ds.to_parquet(path)
    elif fmt == "csv":
        ds.to_csv(path, index=False)
    else:  # an Arrow IPC stream, as save_to_disk writes its shards
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
            writer.write_table(ds.data.table)
    assert pipeline.main(flags(path, str(tmp_path / "out"), "--workers", "2")) == 0
    assert same_dataset(prefix, str(tmp_path / "out_text_document"))


@pytest.mark.parametrize("tool", ["preprocess_data.py", "preprocess_data_many_cores.py"])
def test_a_key_that_yields_no_or_mostly_empty_documents_is_an_error(tmp_path, tool):
    texts = corpus_texts()[:20]
    inp = write_jsonl(tmp_path / "c.jsonl", texts, extra={"title": ""})
    run = run_tool(tool, *flags(inp, str(tmp_path / "out"), "--json-keys", "title", "--workers", "2"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"--input {inp}: --json-keys 'title' yields 0 documents (20 record(s), all empty)" in run.stderr
    (tmp_path / "none.jsonl").write_text("\n")
    run = run_tool(tool, *flags(str(tmp_path / "none.jsonl"), str(tmp_path / "out")))
    assert run.returncode == 2 and "yields 0 documents (the input holds no records)" in run.stderr
    half = write_jsonl(tmp_path / "half.jsonl", [t if i % 2 else "" for i, t in enumerate(texts)])
    run = run_tool(tool, *flags(half, str(tmp_path / "out"), "--workers", "2"))
    assert run.returncode == 2
    assert (f"--input {half}: --json-keys 'text' is empty in 11 of 20 records (55% > --max-empty-fraction 0.1)"
            in run.stderr)
    assert [n for n in os.listdir(tmp_path) if n.startswith("out")] == []
    run = run_tool(tool, *flags(half, str(tmp_path / "out"), "--workers", "2", "--max-empty-fraction", "0.6"))
    assert run.returncode == 0, run.stderr
    assert len(MMapIndexedDataset(str(tmp_path / "out_text_document"))) == 9  # corpus_texts()[3] is empty too


def test_stopping_the_workers_is_bounded_when_terminate_hangs():
    """stop_pool: a Pool.terminate that never returns (its task queue's lock held by an idle worker, seen once in
    CI) costs `grace` seconds, then the workers are killed and the run goes on to report its error."""
    import threading
    import time

    class Worker:
        killed = False

        def kill(self):
            self.killed = True

    class StuckPool:
        _pool = [Worker(), Worker()]

        def terminate(self):
            threading.Event().wait()  # never set

        def join(self):
            raise AssertionError("join after a terminate that never returned")

    pool = StuckPool()
    start = time.perf_counter()
    pipeline.stop_pool(pool, grace=0.2)
    assert 0.2 <= time.perf_counter() - start < 2.0
    assert all(w.killed for w in pool._pool)


def test_stopping_a_real_pool_leaves_no_worker():
    pool = pipeline.fork_pool(2, None)
    workers = list(pool._pool)
    assert pool.map(abs, [-1, -2]) == [1, 2]
    pipeline.stop_pool(pool, grace=5.0)
    assert all(w.exitcode is not None for w in workers)
