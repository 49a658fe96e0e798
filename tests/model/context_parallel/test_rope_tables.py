"""A context-parallel rank's RoPE tables (documents.context_parallel_rope_tables): CP 1's values at the rank's
global positions, bit for bit, under every RoPE scaling and for Seq1F1B segments; made once per op and shared by
its layers (one pair kept, not one a layer), the open documents' restarted positions per micro-batch."""
import pytest
import torch

from megatron_ds.model.context_parallel import ContextLayout
from megatron_ds.model.documents import Documents, context_parallel_rope_tables
from megatron_ds.model.positions import rope_tables, rope_tables_at
from megatron_ds.rope_scaling import RopeScaling

HEAD, THETA, EOD = 8, 100.0, 0
SCALINGS = [None, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
            dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=16)]


def _tables(layout, length, start, scaling, dtype=torch.float32):
    return context_parallel_rope_tables(HEAD, THETA, layout, length, start, torch.device("cpu"), dtype, scaling)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("cp", [2, 4])
def test_a_ranks_tables_are_cp1s_at_its_positions_made_once(scaling, cp):
    scaling = None if scaling is None else RopeScaling.from_dict(scaling)
    for rank in range(cp):
        layout = ContextLayout(cp, rank)
        for start, length in ((0, 64), (24, 16 * cp)):  # the whole sequence; a later Seq1F1B segment
            cos, sin = _tables(layout, length, start, scaling)
            want = rope_tables(HEAD, THETA, 0, start + length, torch.device("cpu"), torch.float32, scaling)
            positions = layout.positions(length, start)
            assert cos.shape == (1, 1, length // cp, HEAD)
            assert torch.equal(cos[0, 0], want[0][positions]) and torch.equal(sin[0, 0], want[1][positions])
            again = _tables(layout, length, start, scaling)
            assert again[0] is cos and again[1] is sin  # every layer of every op rotates by this one pair
    other = _tables(ContextLayout(cp, 0), 64, 8, scaling)[0]
    assert not torch.equal(other, _tables(ContextLayout(cp, 0), 64, 0, scaling)[0])  # a segment's own start


def _packed(seed, s=32):
    tokens = torch.randint(1, 9, (2, s), generator=torch.Generator().manual_seed(seed))
    tokens[0, [3, 17]] = EOD
    tokens[1, [seed % 20 + 5]] = EOD
    index = torch.arange(s).expand_as(tokens)
    starts = torch.ones_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == EOD
    return tokens, index - torch.where(starts, index, 0).cummax(dim=1).values


def test_packed_documents_tables_are_made_once_per_op_of_their_own_positions():
    layout, scaling = ContextLayout(2, 1), RopeScaling.from_dict(SCALINGS[1])
    made = []
    for seed in (1, 2):  # two micro-batches: their documents restart at other positions
        tokens, positions = _packed(seed)
        documents = Documents(tokens, EOD, positions)
        for start, length in ((0, 16), (16, 16)):  # two Seq1F1B segments, an op each
            with documents.opened():
                cos, sin = _tables(layout, length, start, scaling)
                assert _tables(layout, length, start, scaling)[0] is cos  # the op's layers share it
                local = positions[:, layout.positions(length, start)]
                want = rope_tables_at(HEAD, THETA, local, torch.float32, scaling)
                assert cos.shape == (2, 1, 8, HEAD) and torch.equal(cos, want[0]) and torch.equal(sin, want[1])
            made.append(cos)
            assert not documents._tables  # the op's end lets its tables go (its layers' saved tensors hold them)
    assert not torch.equal(made[0], made[2])  # the first segment of each micro-batch: their own positions
