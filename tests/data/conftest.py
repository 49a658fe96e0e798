import json
import types

import pytest

from megatron_ds.data.tokenizer import build_tokenizer, default_gpt2_files


@pytest.fixture(scope="session")
def gpt2_files():
    return default_gpt2_files()


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_files):
    vocab, merges = gpt2_files
    args = types.SimpleNamespace(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, rank=1)
    return build_tokenizer(args)


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)
