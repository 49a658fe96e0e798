"""examples/pipeline_classifier.py, as its docstring runs it: DeepSpeed's launcher, 2 ranks (gloo on CPU), a conv
classifier that is not a GPT trained under zbv through megatron_ds.initialize; the loss falls."""
import os
import re
import subprocess
import sys

import pytest

from megatron_ds.testing.launcher import child_env
from megatron_ds.training.initialize import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(900)
def test_the_example_trains_under_zbv_with_the_deepspeed_launcher(tmp_path):
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "pipeline_classifier.py"), "--steps", "20",
           "--deepspeed_config", os.path.join(ROOT, "examples", "ds_config_zbv_classifier.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(ROOT, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "engine ForeignScheduleEngine, schedule zbv, chunks of rank 0: [(0, 0), (0, 3)]" in out
    losses = {int(step): float(loss) for step, loss in re.findall(r"step (\d+) loss (\S+)", out)}
    assert sorted(losses) == [1, 10, 20] and losses[20] < losses[1] - 0.1, losses
    assert float(re.search(r"eval loss (\S+)", out).group(1)) < losses[1]
