"""`"schedule": "auto"` in the ds_config and on the command line: its keys are checked at start-up, the
plan starts on a schedule that fits the budget, and a budget too small for every schedule stops
pretrain_gpt.py with one line naming the smallest budget that fits, exit code 2."""
import json
import re
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.pipe.plan.auto_start import seq1f1b_cuts
from megatron_ds.pipe.plan.plan import PipelinePlan, make_plan
from megatron_ds.testing.launcher import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SIZES = SimpleNamespace(num_layers=8, hidden_size=32, ffn_hidden_size=128, max_position_embeddings=16,
                        num_attention_heads=4)


def cfg(**pipeline):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 1},
            "pipeline": pipeline}


@pytest.mark.parametrize("section,message", [
    ({"schedule": "auto"}, 'needs "memory_budget"'),
    ({"schedule": "auto", "memory_budget": -1}, "give a positive number"),
    ({"schedule": "auto", "memory_budget": "lots"}, "give a positive number"),
    ({"schedule": "auto", "memory_budget": 4, "virtual_stages": 2}, "chooses the schedule and its knobs itself"),
    ({"schedule": "auto", "memory_budget": 4, "timers_start_iter": 3, "timers_end_iter": 3}, "must be greater"),
    ({"schedule": "zbv", "memory_budget": 4}, 'apply to "schedule": "auto" only'),
])
def test_bad_auto_sections(section, message):
    with pytest.raises(ConfigError, match=message):
        pipeline_settings({"pipeline": section})


def test_plan_starts_on_a_schedule_that_fits():
    plan, start = make_plan(SIZES, cfg(schedule="auto", memory_budget=2), 4, 1)
    assert plan.schedule.name == "zbv-min" and start.budget == 2 and start.timers == (1, 4)
    plan, start = make_plan(SIZES, cfg(schedule="auto", memory_budget=100, timers_end_iter=9), 4, 1)
    assert plan.schedule.name == "zb-h1" and start.timers == (1, 9)
    assert PipelinePlan.from_config(SIZES, cfg(schedule="auto", memory_budget=100, timers_end_iter=9), 4, 1) == plan
    assert plan.places_alike({"schedule": "zb-h2"}) and not plan.places_alike({"schedule": "zbv"})
    switched = plan.switch({"schedule": "zb-h2"})
    assert switched.schedule.name == "zb-h2" and switched.settings.schedule == "zb-h2"
    assert plan.schedule.name == "zb-h1" and plan.settings.schedule == "zb-h1"  # a switch is a new plan


def test_seq1f1b_cuts_and_switch():
    # seq 16, balanced segments in multiples of 8: only k=2 cuts it; the probe times 2-segment ops
    plan, start = make_plan(SIZES, cfg(schedule="auto", memory_budget=100), 4, 1)
    assert [(c.k, c.lengths) for c in start.cuts] == [(2, (8, 8))]
    assert sum(start.cuts[0].costs) == pytest.approx(2) and start.cuts[0].costs[1] > start.cuts[0].costs[0]
    assert start.probe == {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True}
    plan = plan.switch({"schedule": "seq1f1b", "seq_splits": 2}, cuts=start.cuts)
    assert (plan.schedule.name, plan.schedule.seq_splits, plan.segment_lengths) == ("seq1f1b", 2, (8, 8))
    assert plan.segment(1) == slice(8, 16) and plan.message_shape((0, 0, 1)) == (2, 8, 32)
    plan = plan.switch({"schedule": "zb-h1"})  # back: whole sequences again
    assert plan.segment_lengths is None and plan.segment(0) == slice(None)
    # even segments: k=2 and k=4; under sequence parallelism over 8 ranks 4-token segments cannot be split
    _, even = make_plan(SIZES, cfg(schedule="auto", memory_budget=100, seq_split_method="even"), 4, 1)
    assert [(c.k, c.lengths) for c in even.cuts] == [(2, (8, 8)), (4, (4, 4, 4, 4))]
    assert even.probe["seq_splits"] == 4  # the most segments that fit
    sp = SimpleNamespace(**vars(SIZES), tensor_model_parallel_size=8, sequence_parallel=True)
    assert [c.k for c in seq1f1b_cuts(pipeline_settings(cfg(schedule="auto", memory_budget=100,
                                                            seq_split_method="even")), sp, 16)] == [2]
    # a budget only Seq1F1B fits starts on it (B/W split, so F, B and W are timed) and probes the other size
    small, small_start = make_plan(SIZES, cfg(schedule="auto", memory_budget=1.8, seq_split_method="even"), 4, 1)
    assert (small.schedule.name, small.schedule.seq_splits, small.segment_lengths) == ("seq1f1b", 4, (4,) * 4)
    assert small_start.probe is None  # k=2 needs 2.5 units


def test_budget_in_bytes():
    # one unit at pp=4: 2 layers x 16*2*32*(34 + 5*4*16/32) * 4/2 bytes (fp32) = 180224 bytes; a micro-batch's
    # logits 16*2*64 x 4 bytes = 8192 bytes = 0.04545 units, held once on the loss stage of zbv-min (rank 0)
    sizes = SimpleNamespace(**vars(SIZES), vocab_size=64)
    plan, start = make_plan(sizes, cfg(schedule="auto", memory_budget="540672B"), 4, 1)
    assert start.budget == pytest.approx(3.0) and plan.schedule.name == "seq1f1b"  # 2 segments: 2.5 units
    assert start.head_memory == pytest.approx(8192 / 180224)
    with pytest.raises(ConfigError, match=r'"368639B" = 2.045 micro-batches of 180224 bytes, a micro-batch\'s logits '
                                          r'0.0455 of them .*the smallest budget that fits is 2.04545 .* '
                                          r'\(x 180224 bytes = 368640 bytes\)'):
        PipelinePlan.from_config(sizes, cfg(schedule="auto", memory_budget="368639B"), 4, 1)
    assert make_plan(sizes, cfg(schedule="auto", memory_budget="368640B"), 4, 1)[0].schedule.name == "zbv-min"
    assert make_plan(sizes, cfg(schedule="auto", memory_budget=2), 4, 1)[1].head_memory == 0  # units: activations


def test_budget_in_bytes_counts_a_context_parallel_ranks_tokens():
    """At --context-parallel-size 2 a rank holds 8 of the 16 tokens, whose queries score all 16 keys: the unit is
    half of test_budget_in_bytes' 180224 bytes, and so are the logits."""
    sizes = SimpleNamespace(**vars(SIZES), vocab_size=64, context_parallel_size=2)
    start = make_plan(sizes, cfg(schedule="auto", memory_budget="540672B"), 4, 1)[1]
    assert start.budget == pytest.approx(6.0) and start.head_memory == pytest.approx(4096 / 90112)
    assert "micro-batches of 90112 bytes" in start.budget_text


def test_budget_in_bytes_counts_the_logits_per_slice_under_vocabulary_parallelism():
    """A 50304-token vocabulary on this tiny model: a micro-batch's logits are 35.7 units, whole on one rank
    without vocabulary parallelism, a quarter on each of 4 ranks with it, which needs a quarter of the budget."""
    sizes = SimpleNamespace(**vars(SIZES), vocab_size=50304)
    smallest = {}
    for vp in (False, True):
        with pytest.raises(ConfigError) as err:
            make_plan(sizes, cfg(schedule="auto", memory_budget="1MB", vocab_parallel=vp), 4, 1)
        smallest[vp] = float(re.search(r"the smallest budget that fits is ([\d.]+)", str(err.value)).group(1))
    logits = 16 * 2 * 50304 * 4 / 180224
    assert logits + 1 < smallest[False] < logits + 3  # zb-h1 starts: its loss stage holds one micro-batch's logits
    # each rank holds a slice (a quarter) from each S to its T; Seq1F1B's 4 segments a quarter of that
    assert logits / 16 < smallest[True] < smallest[False] / 4
    plan, start = make_plan(sizes, cfg(schedule="auto", memory_budget="3MB", vocab_parallel=True), 4, 1)
    assert plan.schedule.vocab_parallel and start.budget < smallest[False]


def test_too_small_budget():
    with pytest.raises(ConfigError, match=r"memory_budget\" = 1: memory_budget 1 .*the smallest budget that fits is 2"):
        PipelinePlan.from_config(SIZES, cfg(schedule="auto", memory_budget=1), 4, 1)


def parse(tmp_path, monkeypatch, *extra, length=("--train-iters", "10")):
    from megatron_ds.training.config.arguments import parse_args
    monkeypatch.chdir(tmp_path)
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    (tmp_path / "ds.json").write_text(json.dumps({"pipeline": {"schedule": "auto", "memory_budget": 8}}))
    return parse_args(["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                       "--lr", "1e-3", *length, "--data-path", "corpus", "--vocab-file", __file__,
                       "--merge-file", __file__, "--micro-batch-size", "1", "--global-batch-size", "8",
                       "--pipeline-model-parallel-size", "2", "--deepspeed_config", "ds.json", *extra],
                      env={"WORLD_SIZE": "2", "RANK": "0"})


def test_fork_flags_set_the_timers(tmp_path, monkeypatch):
    args = parse(tmp_path, monkeypatch, "--zero-bubble-pipeline-timers-start-iter", "2",
                 "--zero-bubble-pipeline-timers-end-iter", "5")
    assert args.ds_config["pipeline"] == {"schedule": "auto", "memory_budget": 8, "timers_start_iter": 2,
                                          "timers_end_iter": 5}


def test_rampup_is_refused(tmp_path, monkeypatch):
    from megatron_ds.training.config.arguments import ArgumentsError
    with pytest.raises(ArgumentsError, match="a batch-size ramp-up is not offered with it"):
        parse(tmp_path, monkeypatch, "--rampup-batch-size", "4", "2", "16", length=("--train-samples", "64"))


def test_cli_refuses_a_budget_too_small_with_one_line(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"pipeline": {"schedule": "auto", "memory_budget": 1.5}}))
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--num-layers", "8", "--hidden-size",
                           "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
                           "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
                           "--data-path", str(tmp_path / "corpus"), "--vocab-file", __file__, "--merge-file", __file__,
                           "--pipeline-model-parallel-size", "4", "--deepspeed_config", str(ds)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=child_env(ROOT, WORLD_SIZE="4", RANK="0"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert 'memory_budget" = 1.5' in lines[0] and "the smallest budget that fits is 2 (zbv-min needs 2" in lines[0]
