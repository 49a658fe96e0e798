"""tools/evaluate_gpt.py --eval-max-tokens N: the first N tokens of the stream are scored, with the loss of
Hugging Face's model on those tokens; the documents after them are not read; a progress bar counts windows."""
import json

import pytest
import torch

from megatron_ds.inference.perplexity import stream_from_indexed
from megatron_ds.testing.corpus import write_corpus
from tests.convert.helpers import tiny_hf_gpt2, tool


def test_the_first_n_tokens_are_scored_as_hugging_face_scores_them(tmp_path, capsys):
    hf = tiny_hf_gpt2(str(tmp_path / "hf"))
    assert tool("checkpoint/import_hf.py", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt") == 0
    write_corpus(str(tmp_path / "corpus"), num_docs=40)
    stream = torch.as_tensor(stream_from_indexed(str(tmp_path / "corpus")))
    capsys.readouterr()
    results = tmp_path / "eval.json"
    assert tool("evaluate_gpt.py", "--load", tmp_path / "ckpt", "--data-path", tmp_path / "corpus", "--seq-length",
                16, "--eval-max-tokens", 40, "--micro-batch-size", 2, "--results-file", results) == 0
    got = json.loads(results.read_text())
    total = 0.0
    with torch.no_grad():
        for start in (0, 16, 32):  # windows of 16 targets over the first 41 tokens: 16 + 16 + 8
            window = stream[start:min(start + 17, 41)].unsqueeze(0)
            total += float(torch.nn.functional.cross_entropy(hf(window[:, :-1]).logits[0], window[0, 1:],
                                                             reduction="sum"))
    assert (got["tokens"], got["windows"]) == (40, 3)
    assert got["loss"] == pytest.approx(total / 40, rel=1e-5)
    err = capsys.readouterr().err
    assert "scoring 40 tokens" in err and "3/3" in err, err
    assert tool("evaluate_gpt.py", "--load", tmp_path / "ckpt", "--data-path", tmp_path / "corpus",
                "--eval-max-tokens", 0) == 2
    assert "--eval-max-tokens 0 must be at least 1" in capsys.readouterr().err


def test_a_bounded_stream_reads_only_the_documents_it_needs(tmp_path, monkeypatch):
    write_corpus(str(tmp_path / "corpus"), num_docs=40)
    whole = stream_from_indexed(str(tmp_path / "corpus"))
    assert (stream_from_indexed(str(tmp_path / "corpus"), 100) == whole[:100]).all()
    from megatron_ds.data.indexed_dataset import MMapIndexedDataset
    read = []
    original = MMapIndexedDataset.__getitem__
    monkeypatch.setattr(MMapIndexedDataset, "__getitem__", lambda self, i: read.append(i) or original(self, i))
    stream_from_indexed(str(tmp_path / "corpus"), 100)
    assert len(read) <= 5  # of 40 documents of 21..121 tokens: 100 tokens take at most 5
