"""Language-model loss and perplexity of a token stream, Megatron's zero-shot way (tasks/zeroshot_gpt).

The documents are one stream of tokens. Windows of seq_length inputs move by
`stride` (= seq_length, or --overlapping-eval); each target token is scored once:
all of the first window's, then only the last `stride` of each later window,
which thereby sees up to seq_length - stride tokens of context before them.
"""
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from megatron_ds.convert import ToolError
from megatron_ds.data.indexed_dataset import MMapIndexedDataset


def windows(num_tokens, seq_length, stride):
    """(start, first scored position) of each window; window i reads tokens [start, start + seq_length]."""
    if not 0 < stride <= seq_length:
        raise ValueError(f"the stride {stride} must be in [1, seq_length={seq_length}]")
    targets = num_tokens - 1
    count = 1 + max(0, math.ceil((targets - seq_length) / stride))
    return [(i * stride, 0 if i == 0 else seq_length - stride) for i in range(count)]


@torch.no_grad()
def evaluate_stream(model, tokens, seq_length, stride=None, micro_batch_size=8, progress=None):
    """{"loss": mean token cross-entropy, "ppl": exp(loss), "tokens": scored tokens, "windows"}.
    `progress(n)` is told the n windows of each micro-batch when they are scored (a progress bar's update).
    A model trained on packed documents (its config's document flags) reads each window as it was trained:
    positions and attention restart at every EOD, and under --eod-mask-loss the token after an EOD (the next
    document's first, which its own document cannot predict) is not scored."""
    packing = getattr(model, "packing", None)
    tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    if len(tokens) < 2:
        raise ValueError("need at least 2 tokens to score one")
    total, count = 0.0, 0
    spans = windows(len(tokens), seq_length, stride or seq_length)
    batches = {}
    for start, first in spans:
        chunk = tokens[start:start + seq_length + 1]
        batches.setdefault(len(chunk), []).append((chunk, first))
    for group in batches.values():
        for i in range(0, len(group), micro_batch_size):
            part = group[i:i + micro_batch_size]
            chunk = torch.stack([c for c, _ in part])
            logits = model(chunk[:, :-1]).float()
            labels = packing.labels(chunk[:, :-1], chunk[:, 1:]) if packing else chunk[:, 1:]
            losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(len(part), -1)
            for row, scored, (_, first) in zip(losses, labels >= 0, part):
                total += float(row[first:].double().sum())
                count += int(scored[first:].sum())
            if progress:
                progress(len(part))
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": count, "windows": len(spans)}


def stream_from_indexed(prefix, limit=None):
    """The documents of a Megatron .bin/.idx pair, in order (preprocess_data.py --append-eod ends each with eod):
    all of them, or the first `limit` tokens (the documents after them are not read)."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise ToolError(f"{prefix + ext}: missing (--data-path takes the prefix of a .bin/.idx pair)")
    data = MMapIndexedDataset(prefix, skip_warmup=True)
    docs, size = [], 0
    for i in range(len(data)):
        if limit is not None and size >= limit:
            break
        docs.append(np.asarray(data[i], dtype=np.int64))
        size += len(docs[-1])
    return np.concatenate(docs)[:limit]


def stream_from_jsonl(path, tokenizer, json_key="text"):
    """Each JSON line's `json_key` text, tokenized, followed by the end-of-document token."""
    import json
    if not os.path.isfile(path):
        raise ToolError(f"{path}: no such file")
    tokens = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[json_key]
            except (ValueError, KeyError, TypeError):
                raise ToolError(f"{path}:{n}: not a JSON object with a {json_key!r} string") from None
            tokens += list(tokenizer.tokenize(text)) + [tokenizer.eod]
    return np.asarray(tokens, dtype=np.int64)
