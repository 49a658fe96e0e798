"""Sampling filters and the generation loop, on hand-made logits and a stub model."""
import torch

from megatron_ds.inference.generation import filter_logits, generate, next_token


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.0, 0.5])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()
    # sorted: 0.5, 0.3 (0.8), 0.1 (0.9): p=0.75 keeps the first two, p=0.85 three
    assert torch.isfinite(filter_logits(logits, top_p=0.75)).tolist() == [False, True, False, True, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.85)).tolist() == [False, True, True, True, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.0)).all()  # 0 means off, as in Megatron


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    draw = [next_token(logits, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert draw[0] == draw[1]
    assert next_token(logits, top_k=1, generator=torch.Generator()) == next_token(logits, greedy=True)


class _Counter(torch.nn.Module):
    """Predicts (last token + 1) mod 10."""

    def forward(self, tokens):
        return torch.nn.functional.one_hot((tokens + 1) % 10, 10).float()


def test_generate_stops_at_eod_and_at_max_length():
    assert generate(_Counter(), [3], 20, 100, eod=7, greedy=True) == [4, 5, 6, 7]
    assert generate(_Counter(), [3], 20, 5, eod=None, greedy=True) == [4, 5, 6, 7]  # 5 tokens in all
    assert generate(_Counter(), [3], 2, 100, eod=None, greedy=True) == [4, 5]
