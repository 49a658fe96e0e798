"""Megatron's zero-shot LM windows: every target scored once; the loss equals a direct computation."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.inference.perplexity import evaluate_stream, windows
from megatron_ds.model import GPTConfig, GPTModel


@pytest.mark.parametrize("n,seq,stride", [(2, 8, 8), (9, 8, 8), (10, 8, 8), (50, 8, 8), (50, 8, 3), (50, 8, 1),
                                          (17, 8, 5)])
def test_every_target_is_scored_once(n, seq, stride):
    scored = []
    for start, first in windows(n, seq, stride):
        targets = range(start, min(start + seq, n - 1))  # target t predicts token t + 1
        scored += list(targets)[first:]
    assert scored == list(range(n - 1))


def test_loss_equals_direct_computation():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=40, hidden_size=16, num_layers=2, num_attention_heads=2,
                               max_position_embeddings=8)).eval()
    tokens = torch.randint(0, 40, (30,))
    with torch.no_grad():
        # stride = seq: consecutive windows of 8 inputs
        direct = [F.cross_entropy(model(tokens[s:s + 8][None, :len(tokens[s + 1:s + 9])])[0], tokens[s + 1:s + 9],
                                  reduction="sum") for s in range(0, 29, 8)]
        got = evaluate_stream(model, tokens.tolist(), 8, micro_batch_size=2)
        assert got["tokens"] == 29 and got["windows"] == 4
        assert got["loss"] == pytest.approx(float(sum(direct)) / 29, rel=1e-6)
        assert got["ppl"] == pytest.approx(math.exp(got["loss"]))
        # stride 1: each token after the first 8 is scored with 7 tokens of context
        slid = evaluate_stream(model, tokens.tolist(), 8, stride=1)
        last = F.cross_entropy(model(tokens[21:29][None])[0, -1:], tokens[29:30], reduction="sum")
        first = F.cross_entropy(model(tokens[0:8][None])[0], tokens[1:9], reduction="sum")
        assert slid["tokens"] == 29 and slid["windows"] == 22
        middle = sum(F.cross_entropy(model(tokens[s:s + 8][None])[0, -1:], tokens[s + 8:s + 9], reduction="sum")
                     for s in range(1, 21))
        assert slid["loss"] == pytest.approx(float(first + middle + last) / 29, rel=1e-6)
