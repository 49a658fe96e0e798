"""ds_config keys: DeepSpeed's own, read from its source, stay accepted; a misspelt one is refused with
the closest known key (DeepSpeed itself would ignore it)."""
import glob
import json
import os
import subprocess
import sys

from megatron_ds.pipe.plan.config import DEEPSPEED_KEYS
from megatron_ds.pipe.plan.ds_keys import deepspeed_keys, unknown_keys_line
from megatron_ds.testing.launcher import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_deepspeeds_sections_are_known():
    from deepspeed.runtime import constants
    from deepspeed.runtime.config import get_pipeline_config
    known = deepspeed_keys()
    sections = {"zero_optimization", "bf16", "fp16", "pipeline", "tensorboard", "wandb", "csv_monitor", "comet",
                "flops_profiler", "activation_checkpointing", "aio", "autotuning", "comms_logger", "data_efficiency",
                "checkpoint", "compile", "tensor_parallel", "elasticity", "torch_autocast", "timers"}
    assert sections <= known, sections - known
    top = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str) and v.islower()
           and v.isidentifier()}
    assert top <= known, top - known
    assert set(get_pipeline_config({})) <= DEEPSPEED_KEYS  # the pipeline section's hand list is DeepSpeed's
    for path in glob.glob(os.path.join(ROOT, "ds_configs", "*.json")):
        with open(path) as fh:
            assert unknown_keys_line(json.load(fh), known, path) is None


def test_a_misspelt_section_names_the_closest_key():
    line = unknown_keys_line({"pipline": {"schedule": "bitpipe"}, "zero_optimisation": {}, "xyzzy": 1, "bf16": {}},
                             deepspeed_keys(), "ds_config ds.json")
    assert line == ('ds_config ds.json has unknown keys "pipline" (did you mean "pipeline"?), "zero_optimisation" '
                    '(did you mean "zero_optimization"?), "xyzzy"')


def test_cli_refuses_a_misspelt_section_with_one_line_exit_2(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"pipline": {"schedule": "bitpipe"}}))
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--num-layers", "4", "--hidden-size",
                           "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
                           "--train-iters", "4", "--lr", "1e-3", "--data-path", "corpus", "--vocab-file", __file__,
                           "--merge-file", __file__, "--pipeline-model-parallel-size", "2",
                           "--deepspeed_config", "ds.json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=child_env(ROOT, WORLD_SIZE="2", RANK="0"))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        'pretrain_gpt.py: error: ds_config ds.json has unknown key "pipline" (did you mean "pipeline"?): DeepSpeed '
        "would ignore it and train without it"], proc.stderr
