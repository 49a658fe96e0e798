"""The Hugging Face folder a run saves (pipe/hf/save.py write_folder, on rank 0): the model and the tokenizer its
ids were made with, whole or not at all; a source without a tokenizer leaves none, and says so."""
import os

import pytest

from megatron_ds.pipe.hf.save import write_folder
from tests.convert.helpers import tiny_hf_gpt2

TEXT = "The quick brown fox's 3 cafés:\n\tdef f(x): return x ** 2"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("source")
    return folder, tiny_hf_gpt2(folder, with_tokenizer=True)


def test_the_saved_folder_holds_the_sources_tokenizer(source, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, model = source
    said = write_folder(model, str(tmp_path / "saved"), str(folder))
    assert said == f"with the tokenizer of {folder}"
    theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ours = AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True)
    assert ours(TEXT)["input_ids"] == theirs(TEXT)["input_ids"] and len(ours(TEXT)["input_ids"]) > 10
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "saved", local_files_only=True)).__name__ == \
        "GPT2LMHeadModel"


def test_a_source_without_a_tokenizer_saves_none_and_says_so(source, tmp_path):
    _, model = source
    bare = tmp_path / "bare"
    model.save_pretrained(bare)  # config.json and weights only
    said = write_folder(model, str(tmp_path / "saved"), str(bare))
    assert said.startswith(f"no tokenizer: {bare} holds none (tokenizer_config.json, ")
    assert not any(os.path.exists(tmp_path / "saved" / f) for f in ("tokenizer_config.json", "tokenizer.json"))
    assert write_folder(model, str(tmp_path / "hub"), "gpt2").endswith("gpt2 is not a local folder")


def test_a_tokenizer_that_fails_to_save_leaves_no_folder(source, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase
    folder, model = source

    def full(*_, **__):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    with pytest.raises(OSError, match="No space left"):
        write_folder(model, str(tmp_path / "saved"), str(folder))
    assert os.listdir(tmp_path) == []  # neither the folder nor its temporary sibling
