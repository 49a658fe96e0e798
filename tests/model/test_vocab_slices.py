"""model/vocab_slices.normal_rows: a vocabulary slice's initial rows without the whole matrix, bit-equal
to the rows of the whole fill (the single-process model's), for chunks that end mid-matrix, a last chunk
too short to stand alone, widths that are no multiple of 16, and slices that start inside a chunk."""
import pytest
import torch

from megatron_ds.model import vocab_slices
from megatron_ds.model.vocab_slices import normal_rows


@pytest.mark.parametrize("rows,width,chunk", [(48, 32, 16), (50, 30, 16), (33, 7, 16), (1001, 30, 64), (40, 3, 32)])
def test_rows_equal_the_whole_fill(monkeypatch, rows, width, chunk):
    monkeypatch.setattr(vocab_slices, "CHUNK_ROWS", chunk)
    whole = torch.empty(rows, width).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(7))
    for start, end in [(0, rows), (0, rows // 3), (rows // 3, 2 * rows // 3), (rows - rows // 4, rows), (5, 6)]:
        got = normal_rows((rows, width), start, end, 0.02, torch.Generator().manual_seed(7))
        assert torch.equal(got, whole[start:end]), (rows, width, chunk, start, end)


def test_the_slice_is_all_a_rank_allocates(monkeypatch):
    """No tensor of the whole matrix's size: the largest one made is a chunk or the slice."""
    monkeypatch.setattr(vocab_slices, "CHUNK_ROWS", 16)
    made = []
    real_empty = torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        made.append(t.numel())
        return t
    monkeypatch.setattr(torch, "empty", empty)
    normal_rows((256, 8), 64, 128, 0.02, torch.Generator().manual_seed(1))
    assert max(made) == 64 * 8 and sum(made) < 256 * 8


@pytest.mark.parametrize("untied", [False, True])
def test_each_slice_holds_the_single_process_models_rows(untied):
    from megatron_ds.model.layers import Embedding, LMHead
    from tests.gpt_harness import tiny_config
    from tests.pipe.vocab.test_vocab_engine import LLAMA
    config = tiny_config(4, **(LLAMA if untied else {}))
    wte, head = Embedding(config, 0).wte.weight, LMHead(config, config.num_layers + 2).weight if untied else None
    for rank in range(4):
        s = vocab_slices.VocabSlice(config, rank, 4)
        assert (s.start, s.end) == (16 * rank, 16 * (rank + 1)) and torch.equal(s.wte, wte[s.start:s.end])
        assert (s.head is None) != untied and (not untied or torch.equal(s.head, head[s.start:s.end]))
