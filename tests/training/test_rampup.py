"""Batch-size ramp-up under a named schedule: the engine plans each micro-batch count as it comes.

Two real launches (2 ranks, PP=2, 4 layers) of the same ramp (1, 2, 3, 4 micro-batches per step):
DeepSpeed's stock 1F1B engine and ours under ZB-V. Without dropout the two see the same
numbers, so every iteration's loss and grad norm must agree.
"""
import json
import os

import pytest

from megatron_ds.testing.corpus import write_corpus
from tests.training.test_resume import ROOT, launch


@pytest.mark.timeout(1200)
def test_rampup_under_zbv_equals_deepspeeds_engine(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    with open(os.path.join(ROOT, "ds_configs", "ds_config_1f1b_stock.json")) as fh:
        zbv = dict(json.load(fh), pipeline={"schedule": "zbv"})
    (tmp_path / "zbv.json").write_text(json.dumps(zbv))
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0", "--num-layers", "4"]
    stock, _ = launch(tmp_path, "stock", *no_dropout, launcher="forked")
    ours, out = launch(tmp_path, "zbv", *no_dropout, "--deepspeed_config", str(tmp_path / "zbv.json"),
                     launcher="forked")
    assert "pipeline engine: ScheduleEngine, schedule zbv" in out
    assert [r["global_batch_size"] for r in ours] == [r["global_batch_size"] for r in stock] == [2, 2, 2, 4, 4, 6, 8, 8]
    for a, b in zip(stock, ours):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
    assert ours[-1]["loss"] < ours[0]["loss"]
