"""A resumed "schedule": "auto" run builds the schedule its checkpoint chose and times nothing.

Run A (pretrain_gpt.py, 2 gloo ranks, PP=2, fp32, no dropout; rank 0's choice forced to zbv, another
chunk placement than the zb-h1 it starts on) times iterations 1-2, decides, saves at 2 (still on
zb-h1's placement: the rebuild follows the save, and the decision is saved with it), rebuilds on zbv
and saves at 4 and 6. Resumed from step 4 with the same ds_config, run B starts on zbv, times nothing,
and its losses equal A's bit for bit. Resumed from step 2 with another budget, run C times again,
says why in one line, and its losses equal A's (1e-5: it may choose another schedule). Three launches."""
import json
import re

from megatron_ds.testing.corpus import write_corpus
from tests.training.test_auto_schedule_loop import config
from tests.training.test_resume import ROOT, launch

HARD = ("--train-iters", "6", "--num-layers", "4", "--hidden-dropout", "0", "--attention-dropout", "0")
AUTO = {"schedule": "auto", "memory_budget": 4, "timers_start_iter": 0, "timers_end_iter": 2}
FORCE = f"""import sys
sys.path.insert(0, {ROOT!r})
from megatron_ds.pipe.auto import AutoSwitch
from tests.pipe.test_auto_engine import forcing
AutoSwitch.choose = staticmethod(forcing("zbv"))
from megatron_ds.training.loop import entry_point
sys.exit(entry_point())
"""
MEASURED = re.compile(r"^auto schedule: [^(]+ \(simulated makespan", re.M)  # schedules/auto.describe: it timed


def losses(records, after):
    return {r["iteration"]: r["loss"] for r in records if r["iteration"] > after}


def resume(tmp_path, name, step, pipeline):
    (tmp_path / "a" / "latest").write_text(f"global_step{step}")
    return launch(tmp_path, name, "--load", str(tmp_path / "a"), ds_config=config(tmp_path, name, pipeline), hard=HARD,
                  launcher="forked")


def test_resume_builds_the_chosen_schedule(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    (tmp_path / "force.py").write_text(FORCE)
    a, out_a = launch(tmp_path, "a", "--save", str(tmp_path / "a"), "--save-interval", "2",
                      ds_config=config(tmp_path, "a", AUTO), hard=HARD, entry=str(tmp_path / "force.py"),
                      launcher="forked")
    assert MEASURED.search(out_a) and "switched from zb-h1 to zbv" in out_a
    saved = json.loads((tmp_path / "a" / "global_step2" / "auto_schedule.json").read_text())
    assert saved["decided_at"] == 2 and saved["decision"]["choice"]["label"] == "zbv"
    assert saved["key"]["budget"] == 4 and saved["key"]["micro_batches"] == 4
    assert "auto_schedule.json" in json.loads((tmp_path / "a" / "global_step4" / "manifest.json").read_text())["files"]

    b, out_b = resume(tmp_path, "b", 4, AUTO)
    assert "auto schedule: zbv from the checkpoint of iteration 4 (decided at iteration 2)" in out_b, out_b[-3000:]
    assert "pipeline engine: ScheduleEngine, schedule zbv" in out_b
    assert not MEASURED.search(out_b) and "switched from" not in out_b
    assert "same pipeline layout: everything" in out_b
    assert losses(b, 4) == losses(a, 4), (b, a)  # bit for bit

    c, out_c = resume(tmp_path, "c", 2, {**AUTO, "memory_budget": 3})
    line = next(l for l in out_c.splitlines() if l.startswith("auto schedule: timing again"))
    assert "the checkpoint of iteration 2 chose zbv for another run" in line and "4 then, 3 now" in line, line
    assert "pipeline engine: ScheduleEngine, schedule auto" in out_c and MEASURED.search(out_c)
    for it, loss in losses(a, 2).items():
        assert abs(losses(c, 2)[it] - loss) <= 1e-5, (it, c, a)
    print(line)
