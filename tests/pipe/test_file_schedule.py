"""`"schedule": "file:PATH.json"`: every catalogue schedule, exported by the CLI and run from its file,
trains as the named schedule does (the same losses, bit for bit) and as the single-process reference
(losses, gradients, weights, 1e-5), all 11 in one launch at PP=2."""
import json
import os
import subprocess
import sys

import pytest

from megatron_ds.pipe.plan.config import ConfigError, pipeline_settings
from megatron_ds.schedules import CATALOG, build_schedule
from megatron_ds.schedules.cli import main as schedules_cli
from megatron_ds.testing.launcher import child_env, run_ranks
from tests.gpt_harness import SEQ, assert_matches_reference, engine_rank_runs, reference_run, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PP, GAS, LAYERS, STEPS = 2, 4, 4, 3
KNOBS = {"interleaved": ["--virtual-stages", "2"],
         "seq1f1b": ["--seq-splits", "2", "--seq-length", str(SEQ), "--hidden-size", "32"]}
NAMED = {"interleaved": {"virtual_stages": 2}, "seq1f1b": {"seq_splits": 2}}


def test_every_exported_schedule_runs_from_its_file(tmp_path):
    assert len(CATALOG) == 11
    files, named = [], []
    for name in CATALOG:
        path = tmp_path / f"{name}.json"
        assert schedules_cli(["export", "--schedule", name, "--pp", str(PP), "--micro-batches", str(GAS),
                              *KNOBS.get(name, []), "--out", str(path)]) == 0
        files.append({"schedule": f"file:{path}"})
        named.append({"schedule": name, **NAMED.get(name, {})})
    per_rank = run_ranks(PP, engine_rank_runs, PP, GAS, STEPS, files + named, num_layers=LAYERS, timeout=900)
    ref = reference_run(tiny_config(LAYERS), 1, GAS, STEPS)
    for i, name in enumerate(CATALOG):
        from_file, as_named = [r[i] for r in per_rank], [r[len(files) + i] for r in per_rank]
        assert [r["losses"] for r in from_file] == [r["losses"] for r in as_named], name
        try:
            assert_matches_reference(from_file, ref)
        except AssertionError as exc:
            raise AssertionError(f"{name} from its file: {exc}") from None
        assert from_file[0]["engine"]["chunks"] == as_named[0]["engine"]["chunks"], name


def _pretrain(tmp_path, schedule_json, *flags):
    """pretrain_gpt.py on 2 ranks (rank 0's view) with `schedule_json` as the pipeline's schedule file."""
    (tmp_path / "s.json").write_text(schedule_json)
    (tmp_path / "ds.json").write_text(json.dumps({"pipeline": {"schedule": "file:s.json"}}))
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus{ext}").write_bytes(b"")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--num-layers", "4", "--hidden-size",
                           "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
                           "--train-iters", "4", "--lr", "1e-3", "--data-path", str(tmp_path / "corpus"),
                           "--vocab-file", __file__, "--merge-file", __file__, "--pipeline-model-parallel-size", "2",
                           "--deepspeed_config", "ds.json", *flags],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=child_env(ROOT, WORLD_SIZE="2", RANK="0"))
    return proc.returncode, proc.stderr.strip().splitlines()


def test_a_damaged_file_or_one_for_another_run_exits_2_with_one_line(tmp_path):
    s = build_schedule("1f1b", 2, 4)
    s.ranks[0] = s.ranks[0][::-1]  # rank 0 runs its backwards before their forwards
    rc, lines = _pretrain(tmp_path, s.to_json(), "--global-batch-size", "8")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0] == ('pretrain_gpt.py: error: ds.json: ds_config "pipeline.schedule" = "file:s.json": rank 0 runs '
                        'BW(r0,s0,mb3,q0) (op #0) before its dependency F(r0,s0,mb3,q0) (op #2)')
    rc, lines = _pretrain(tmp_path, build_schedule("1f1b", 2, 4).to_json(), "--global-batch-size", "4")
    assert rc == 2 and len(lines) == 1, lines
    assert "file:s.json runs micro_batches=4; this step has 2" in lines[0], lines
    assert "--global-batch-size 4 / (--micro-batch-size 2 x data-parallel 1)" in lines[0], lines
    rc, lines = _pretrain(tmp_path, build_schedule("zbv", 2, 4).to_json(), "--global-batch-size", "8",
                          "--num-layers", "6")
    assert rc == 2 and "cuts the model into 4 virtual stages: --num-layers 6 must be a multiple of 4" in lines[0]


def test_the_file_fixes_the_knobs(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(build_schedule("interleaved", 2, 4, virtual_stages=2).to_json())
    settings = pipeline_settings({"pipeline": {"schedule": f"file:{path}"}})
    assert (settings.file, settings.virtual_stages, settings.seq_splits) == (str(path), 2, 1)
    with pytest.raises(ConfigError, match="the file fixes the op order, chunks and segments; remove virtual_stages"):
        pipeline_settings({"pipeline": {"schedule": f"file:{path}", "virtual_stages": 2}})
