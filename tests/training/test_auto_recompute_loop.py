"""pretrain_gpt.py with "schedule": "auto" and "auto_recompute": true: at a budget that no start-up schedule fits
without recomputing every layer, the run starts under full recompute, chooses a schedule and a recompute setting,
switches to them (rebuilding the engine), and every iteration's loss equals a run with that schedule and that
recompute given by hand (fp32, no dropout)."""
import json
import re

import pytest

from megatron_ds.testing.corpus import write_corpus
from tests.training.test_auto_schedule_loop import NO_DROPOUT, config
from tests.training.test_resume import launch

# 4 layers, hidden 32, seq 16, mbs 2, 4 micro-batches on 2 stages (schedules/recompute.py's account, in one
# stage's activations): Seq1F1B k=2 with the B/W split needs 1.5 without recompute, 1.51 under selective (its B
# attends again), 1.02 recomputing every layer; the other start-up schedules more than 1.5 under each; Seq1F1B
# k=2 without the split 1.494 under selective. The run starts under full recompute and may leave it.
BUDGET = 1.497
FLAGS = {"none": [], "selective": ["--recompute-granularity", "selective"],
         "full uniform 1": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1"]}


@pytest.mark.timeout(1800)
def test_auto_recompute_trains_as_its_choice_by_hand(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    auto, out = launch(tmp_path, "auto", ds_config=config(tmp_path, "auto", {
        "schedule": "auto", "auto_recompute": True, "memory_budget": BUDGET, "timers_start_iter": 0,
        "timers_end_iter": 2}), hard=NO_DROPOUT, launcher="forked")
    start = next(l for l in out.splitlines() if "pipeline engine: ScheduleEngine, schedule auto" in l)
    assert "starts on seq1f1b; recompute full uniform 1 (auto_recompute" in start, start
    line = next(l for l in out.splitlines() if l.startswith("auto schedule: ") and "simulated makespan" in l)
    chosen = re.search(r"; recompute (none|selective|full uniform 1), the fastest that fits \(the fastest under "
                       r"each: none: (.*?); selective: (.*?); full uniform 1: (.*?)\)$", line)
    assert chosen, line
    label = re.match(r"auto schedule: (.*?) \(simulated", line).group(1)
    if chosen.group(1) != "full uniform 1" or not label.startswith("seq1f1b seq_splits=2 split_backward"):
        assert "auto schedule: switched from seq1f1b to " in out  # rebuilt under the chosen setting
        rebuilt = [l for l in out.splitlines() if "pipeline engine: ScheduleEngine, schedule " in l][-1]
        assert f"recompute {chosen.group(1)}" in rebuilt or chosen.group(1) == "none", rebuilt
    section = {"schedule": "zb-h1"} if label.startswith("zb-search") else section_of(label)
    by_hand, _ = launch(tmp_path, "by_hand", *FLAGS[chosen.group(1)], ds_config=config(tmp_path, "by_hand", section),
                        hard=NO_DROPOUT, launcher="forked")
    assert [r["iteration"] for r in auto] == [1, 2, 3, 4, 5]
    for a, b in zip(auto, by_hand):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (line, auto, by_hand)
    print(line)


def section_of(label: str) -> dict:
    """The ds_config "pipeline" section of a candidate's label (schedules/auto.Candidate.label)."""
    name, _, knobs = label.partition(" ")
    costs = re.search(r"op_costs=\(([^)]*)\)", knobs)
    section = {"schedule": name, **{k: json.loads(v.lower()) for k, v in re.findall(r"(\w+)=(\w+)", knobs) if k != "op_costs"}}
    return {**section, "op_costs": [float(x) for x in costs.group(1).split(",")]} if costs else section
