"""The run's settings are one frozen object (training/config/run_config.py): parse_args returns it, a write
raises, a new value is a new RunConfig, and no module outside the flag-parsing package writes to it."""
import copy
import glob
import os
import pickle

import pytest

import megatron_ds
from megatron_ds.errors import UserError
from megatron_ds.gpt_config import GPTConfig
from megatron_ds.pipe.plan.config import PipelineSettings
from megatron_ds.training.batch_schedule import BatchSizeSchedule
from megatron_ds.training.config.arguments import parse_args
from megatron_ds.training.config.run_config import FrozenSettingsError, RunConfig
from tests.training.config.test_arguments import _attributes_written

BASE = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", __file__,
        "--merge-file", __file__, "--micro-batch-size", "2", "--pipeline-model-parallel-size", "2"]
ROOT = os.path.dirname(megatron_ds.__file__)
# Their Namespaces are their own: a checkpoint's saved `args` the conversion tools complete, the
# preprocessing tool's parser. The flag-parsing package writes while it parses (test_arguments.py: DERIVED).
OWN_NAMESPACES = ("training/config/", "convert/", "data/preprocessing/")

pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def parse(*extra):
    return parse_args(BASE + list(extra), env={"WORLD_SIZE": "4", "RANK": "0"})


def test_parse_args_returns_frozen_settings_with_typed_parts():
    args = parse()
    assert type(args) is RunConfig
    assert isinstance(args.model, GPTConfig) and args.model is args.gpt_config
    assert isinstance(args.batch, BatchSizeSchedule) and isinstance(args.pipeline, PipelineSettings)
    assert args.plan is None and args.auto is None  # DeepSpeed's own engine: no plan of ours
    assert args.ds_config["train_micro_batch_size_per_gpu"] == 2
    with pytest.raises(FrozenSettingsError, match=r"args\.train_iters: .*frozen.*args\.replace\(train_iters=") as e:
        args.train_iters = 3
    assert not isinstance(e.value, UserError) and args.train_iters == 10  # a bug: its traceback stays
    with pytest.raises(FrozenSettingsError):
        del args.lr
    with pytest.raises(FrozenSettingsError):
        setattr(args, "new_name", 1)


def test_replace_is_a_new_value_and_knows_the_names():
    args = parse()
    later = args.replace(train_iters=3, padded_vocab_size=128)  # padded_vocab_size: learned at start
    assert (later.train_iters, later.padded_vocab_size, args.train_iters) == (3, 128, 10)
    assert type(later) is RunConfig and not hasattr(args, "padded_vocab_size")
    with pytest.raises(FrozenSettingsError, match=r"replace\(trian_iters\): not a setting"):
        args.replace(trian_iters=3)


def test_copies_pickles_and_the_plain_flags():
    args = parse()
    for other in (copy.copy(args), copy.deepcopy(args), pickle.loads(pickle.dumps(args))):
        assert type(other) is RunConfig and vars(other).keys() == vars(args).keys()
        with pytest.raises(FrozenSettingsError):
            other.lr = 1.0
    flags = args.flags()
    flags.lr = 5.0  # a plain Namespace: Megatron's saved args, a tool's own copy
    assert type(flags).__name__ == "Namespace" and args.lr == 1e-3


def test_a_schedule_of_ours_has_its_plan(tmp_path):
    (tmp_path / "ds.json").write_text('{"pipeline": {"schedule": "1f1b"}}')
    args = parse("--deepspeed_config", str(tmp_path / "ds.json"))
    assert args.plan is args.pipeline_plan and args.plan.schedule.name == "1f1b"


def test_no_module_outside_the_flag_parsing_package_writes_to_the_settings():
    """Before the frozen settings: 10 writes in 6 modules (the loop, initialize, model_setup, auto_schedule,
    checkpoint/universal, data/tokenizer), and 5 more through config functions the auto switch called at run
    time. A new value is returned to its owner instead (run_config.py's docstring lists them)."""
    repo = os.path.dirname(ROOT)
    paths = glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
    paths += [os.path.join(repo, "pretrain_gpt.py")] + glob.glob(os.path.join(repo, "tools", "*.py"))
    writes = []
    for path in paths:
        if os.path.relpath(path, ROOT).replace(os.sep, "/").startswith(OWN_NAMESPACES):
            continue
        writes += [f"{os.path.relpath(path, repo)}:{line} args.{name}" for name, line in _attributes_written(path)]
    assert writes == []
