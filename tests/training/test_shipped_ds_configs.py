"""Every shipped ds_configs/*.json trains through the training command of docs/TRAINING.md and fits the quickstart.

The command is read from docs/TRAINING.md itself; the test changes only the sizes that make it cheap
(2 iterations, 1 warm-up iteration, 2 ranks = pipeline 2 x data 1, one eval iteration) and the paths.
One launch of 2 ranks runs the configs one after the other (a fresh process group each), instead of one
launch per config.
"""
import json
import os
import pathlib
import re
import shlex
import socket

import pytest

from megatron_ds.testing.corpus import write_corpus
from megatron_ds.testing.launcher import run_ranks
from megatron_ds.training.config.arguments import parse_args
from megatron_ds.training.initialize import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "ds_configs").glob("*.json"))


def training_command():
    """The argv after pretrain_gpt.py of docs/TRAINING.md's torchrun example."""
    text = (ROOT / "docs" / "TRAINING.md").read_text()
    match = re.search(r"torchrun [^\n]*pretrain_gpt\.py \\\n((?:[^\n]*\\\n)*[^\n]*\n)", text)
    assert match, "docs/TRAINING.md lost its torchrun training command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def with_values(argv, **values):
    """argv with the given flags' values replaced (flag names with _ for -)."""
    argv = list(argv)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        alias = {"--deepspeed-config": "--deepspeed_config"}.get(flag, flag)
        i = argv.index(alias)
        argv[i + 1] = str(value)
    return argv


def _train_each(argvs, sync_dir):
    """Rank 0 picks each run's port just before it starts (a port picked minutes ahead may be taken by then)."""
    import time

    from megatron_ds.training.loop import main
    results = []
    for i, argv in enumerate(argvs):
        path = os.path.join(sync_dir, f"port{i}")
        if os.environ["RANK"] == "0":
            with open(path + ".tmp", "w") as fh:
                fh.write(str(free_port()))
            os.replace(path + ".tmp", path)
        deadline = time.monotonic() + 300
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(path) as fh:
            os.environ["MASTER_PORT"] = fh.read()
        results.append(main(argv))
    return results


def observability_flags(run):
    """Riding on the ZB-V run: a profile of iteration 2, codecarbon, an eval at the last iteration."""
    return ["--profile", "--profile-step-start", "1", "--profile-step-end", "2", "--profile-ranks", "0", "1",
            "--profile-dir", str(run / "profile"), "--codecarbon-dir", str(run / "cc"), "--eval-interval", "2",
            "--log-validation-ppl-to-tensorboard"]


def check_observability(run):
    # torch.profiler traces of both ranks hold the schedule's ops by name (record_function)
    for rank in (0, 1):
        events = json.loads((run / "profile" / f"profile_rank{rank:05d}_iterations2-2.json").read_text())
        names = {e.get("name") for e in events["traceEvents"]}
        assert {"F0", "B0", "W0", "F0'", "B0'", "W0'"} <= names, sorted(n for n in names if n)[:40]
    # codecarbon: one tracker for the machine, not one per rank
    assert [p.name for p in (run / "cc").iterdir()] == [f"emissions-{socket.gethostname()}.csv"]
    # TensorBoard: BigScience's tags; the eval at iteration 2 is not repeated by the end-of-training eval
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    tags = set(tb.Tags()["scalars"])
    assert {"steps-vs-samples/y=steps,x=samples", "steps-vs-tokens/y=tokens,x=steps",
            "learning-rate/learning-rate vs tokens", "grad-norm/grad-norm vs tokens",
            "iteration-time/TFLOPs per gpu (estimated)", "lm-loss-validation/lm loss validation vs tokens",
            "lm-loss-validation/lm loss validation ppl vs tokens"} <= tags
    assert [e.step for e in tb.Scalars("lm-loss-validation/lm loss validation")] == [2]
    assert [e.step for e in tb.Scalars("steps-vs-samples/y=samples,x=steps")] == [1, 2]


@pytest.mark.timeout(1800)  # ten trainings of two iterations in one launch on a loaded 2-core machine
def test_every_shipped_ds_config_trains_through_the_training_command(tmp_path):
    from megatron_ds.data.tokenizer import default_gpt2_files
    vocab, merges = default_gpt2_files()
    corpus = write_corpus(str(tmp_path / "corpus"), num_docs=120)
    base = training_command()
    assert base.count("--deepspeed_config") == 1
    argvs, metrics = [], []
    for path in CONFIGS:
        run = tmp_path / path.stem
        metrics.append(run / "metrics.jsonl")
        argvs.append(with_values(base, train_iters=2, lr_warmup_iters=1, data_path=corpus, vocab_file=vocab,
                                 merge_file=merges,
                                 save=run / "ckpt", load=run / "ckpt", tensorboard_dir=run / "tb",
                                 deepspeed_config=path)
                     + ["--eval-iters", "1", "--metrics-file", str(run / "metrics.jsonl"), "--log-interval", "1",
                        "--distributed-backend", "gloo"]
                     + (observability_flags(run) if path.name == "ds_config_zbv.json" else []))
    (tmp_path / "ports").mkdir()
    codes = run_ranks(2, _train_each, argvs, str(tmp_path / "ports"), timeout=1700)
    assert all(c == [0] * len(CONFIGS) for c in codes), dict(zip([p.name for p in CONFIGS], codes[0]))
    for path, file in zip(CONFIGS, metrics):
        rows = [json.loads(line) for line in file.read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2], path.name
        assert all(0 < r["loss"] < 20 for r in rows), (path.name, rows)
        assert (file.parent / "ckpt" / "latest").read_text() == "global_step2", path.name
    check_observability(tmp_path / "ds_config_zbv")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_quickstart_knob_parses_with_every_config(path, tmp_path, monkeypatch):
    """scripts/quickstart.sh's shape (NPROC 4, PP 2, micro-batch 2, global batch 8) under DS_CONFIG=path."""
    script = (ROOT / "scripts" / "quickstart.sh").read_text()
    assert "MBS=2" in script and "GBS=$((MBS * 2 * NPROC / PP))" in script and "--num-layers 4 " in script
    monkeypatch.chdir(tmp_path)
    write_corpus(str(tmp_path / "corpus"), num_docs=4)
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "300", "--lr", "2e-3",
            "--clip-grad", "1.0", "--data-path", "corpus", "--vocab-file", __file__, "--merge-file", __file__,
            "--pipeline-model-parallel-size", "2", "--deepspeed_config", str(path)]
    args = parse_args(argv, env={"WORLD_SIZE": "4", "RANK": "0"})
    assert args.gradient_accumulation_steps == 2
