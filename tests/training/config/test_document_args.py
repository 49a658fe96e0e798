"""The packed-document flags (--reset-position-ids, --reset-attention-mask, --eod-mask-loss): they reach the run's
GPTConfig and its batches; what cannot honour them is one line and exit 2 (at parse time, or for a tokenizer
without an end-of-document token at start-up); and pretrain_gpt.py trains with them end to end."""
import json
import types

import pytest

from megatron_ds.data.tokenizer import TokenizerError
from megatron_ds.training.config.arguments import ArgumentsError
from tests.training.config.parsing import parse_with
from megatron_ds.training.config.document_args import eod_token
from tests.training.test_cli import run as run_cli

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", __file__,
        "--merge-file", __file__, "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"]
FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def parse(*extra, pipeline=None, tmp_path=None):
    return parse_with(BASE, *extra, world=2, ds=None if pipeline is None else {"pipeline": pipeline}, folder=tmp_path)


def test_the_flags_reach_the_model_config_and_every_stage_reads(tmp_path):
    args = parse(*FLAGS, "--position-embedding-type", "rope", pipeline={"schedule": "1f1b"}, tmp_path=tmp_path)
    config = args.gpt_config
    assert (config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss) == (True, True, True)
    assert config.eod_token is None  # the tokenizer gives it at start-up
    assert args.pipeline_plan.documents  # every stage reads the micro-batches (pipe/plan/plan.needs_data)
    plain = parse(pipeline={"schedule": "1f1b"}, tmp_path=tmp_path)
    assert not plain.gpt_config.packs_documents and not plain.pipeline_plan.documents
    # learned positions restart in the embedding only: the middle stages need nothing
    args = parse("--reset-position-ids", "--eod-mask-loss", pipeline={"schedule": "1f1b"}, tmp_path=tmp_path)
    assert args.gpt_config.packs_documents and not args.pipeline_plan.documents


def test_seq1f1b_cuts_by_the_work_the_mask_leaves(tmp_path):
    """Documents of 21..121 tokens in 512-token samples: the balanced cut under the mask is nearly even, where
    causal attention's makes the first segment longest."""
    from megatron_ds.testing.corpus import write_corpus
    corpus = write_corpus(str(tmp_path / "docs"))
    shape = ["--data-path", corpus, "--seq-length", "512", "--hidden-size", "64"]
    section = {"schedule": "seq1f1b", "seq_splits": 4}
    masked = parse(*shape, "--reset-attention-mask", pipeline=section, tmp_path=tmp_path)
    causal = parse(*shape, pipeline=section, tmp_path=tmp_path).pipeline_plan.segment_lengths
    lengths = masked.pipeline_plan.segment_lengths
    assert sum(lengths) == 512 and max(lengths) - min(lengths) < max(causal) - min(causal)
    assert causal[0] > lengths[0]


@pytest.mark.parametrize("extra,pipeline,words", [
    (["--reset-attention-mask"], None, ["--reset-attention-mask", "DeepSpeed's own engine", "1f1b"]),
    (["--reset-position-ids", "--position-embedding-type", "rope"], None, ["--reset-position-ids", "own engine"]),
    (["--reset-attention-mask"], {"schedule": "1f1b", "cuda_graphs": True}, ["cuda_graphs", "--reset-attention-mask"]),
])
def test_what_cannot_honour_them_is_refused(extra, pipeline, words, tmp_path):
    with pytest.raises(ArgumentsError) as err:
        parse(*extra, pipeline=pipeline, tmp_path=tmp_path)
    assert all(word in str(err.value) for word in words), str(err.value)


def test_what_needs_no_other_stage_runs_on_deepspeeds_engine(tmp_path):
    """The loss mask travels with the labels, learned positions with the inputs: the stock engine carries both."""
    args = parse("--reset-position-ids", "--eod-mask-loss")
    assert args.pipeline_plan is None and args.gpt_config.eod_mask_loss


def test_a_tokenizer_without_an_end_of_document_token_is_an_error():
    args = types.SimpleNamespace(reset_position_ids=False, reset_attention_mask=True, eod_mask_loss=False,
                                 padded_vocab_size=128, tokenizer_type="PretrainedFromHF")
    assert eod_token(types.SimpleNamespace(eod=5), args) == 5
    for tokenizer in (types.SimpleNamespace(eod=None), types.SimpleNamespace(eod=200)):
        with pytest.raises(TokenizerError) as err:
            eod_token(tokenizer, args)
        assert "--reset-attention-mask" in str(err.value) and "end-of-document" in str(err.value)
    args.reset_attention_mask = False
    assert eod_token(types.SimpleNamespace(eod=None), args) is None  # no flag: nothing asked of it


def test_refusal_is_one_line_and_exit_2():
    rc, err = run_cli("--reset-attention-mask", "--pipeline-model-parallel-size", "2",
                      env={"WORLD_SIZE": "2", "RANK": "0"})
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--reset-attention-mask" in err, err


@pytest.mark.timeout(900)
def test_pretrain_trains_packed_documents(tmp_path):
    """One launch (PP=2, Seq1F1B with 2 segments, GPT-2 BPE, documents of 20..120 tokens in 64-token samples): the
    tokenizer's EOD reaches the engine, which trains (its equality with the reference: tests/pipe)."""
    from megatron_ds.testing.corpus import write_corpus
    from tests.training.test_resume import launch
    write_corpus(str(tmp_path / "corpus"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "pipeline": {"schedule": "seq1f1b", "seq_splits": 2}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    records, out = launch(tmp_path, "seq1f1b", *FLAGS, "--seq-length", "64", "--position-embedding-type", "rope",
                          "--save", str(tmp_path / "save"), ds_config=tmp_path / "ds.json", hard=("--train-iters", "4"),
                          launcher="forked")
    assert ("packed documents ending at token 50256: positions restart, attention within documents, "
            "EOD predictions not scored") in out
    assert len(records) == 4 and records[-1]["loss"] < records[0]["loss"]
    # the offline tools' model of the checkpoint (tools/evaluate_gpt.py, generate_samples_gpt.py) reads documents
    # as the run trained: its perplexity of a packed stream is each document's scored alone
    import dataclasses
    import torch
    from megatron_ds.convert.reference import load_checkpoint_model
    from megatron_ds.inference.perplexity import evaluate_stream
    from megatron_ds.model import GPTModel
    from tests.model.test_documents import documents_alone
    model, _, _ = load_checkpoint_model(str(tmp_path / "save"))
    packing = model.packing
    assert (packing.eod, packing.reset_position_ids, packing.reset_attention_mask, packing.eod_mask_loss) == \
        (50256, True, True, True)
    alone = GPTModel(dataclasses.replace(model.config, reset_position_ids=False, reset_attention_mask=False,
                                         eod_mask_loss=False)).eval()
    alone.load_state_dict(model.state_dict())
    stream = torch.randint(0, 50000, (60,), generator=torch.Generator().manual_seed(0))
    stream[[9, 10, 30]] = 50256
    with torch.no_grad():
        total, count = documents_alone(alone, stream[None], eod=50256)
        got = evaluate_stream(model, stream.tolist(), 59)
    assert got["tokens"] == count and abs(got["loss"] - total / count) <= 1e-5, (got, total / count)
