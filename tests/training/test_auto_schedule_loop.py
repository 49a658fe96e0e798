"""pretrain_gpt.py with "schedule": "auto": the loop times two iterations, logs the choice (and the
runner-up), switches (rebuilding the engine through a checkpoint when the choice places the chunks
differently), and every iteration's loss equals a run on a fixed schedule, with vocabulary parallelism
too (fp32; no dropout: under another chunk placement each rank draws other dropout masks, as on a
resume under another schedule)."""
import json

from megatron_ds.testing.corpus import write_corpus
from tests.training.test_resume import launch

NO_DROPOUT = ("--train-iters", "5", "--num-layers", "4", "--hidden-dropout", "0", "--attention-dropout", "0")


def config(tmp_path, name, pipeline):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "pipeline": pipeline}))
    return path


def test_auto_in_the_loop_keeps_the_losses(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    fixed, _ = launch(tmp_path, "fixed", ds_config=config(tmp_path, "fixed", {"schedule": "1f1b"}), hard=NO_DROPOUT,
                      launcher="forked")
    auto, out = launch(tmp_path, "auto", ds_config=config(tmp_path, "auto", {
        "schedule": "auto", "memory_budget": 2, "timers_start_iter": 0, "timers_end_iter": 2}), hard=NO_DROPOUT,
        launcher="forked")
    line = next(l for l in out.splitlines() if l.startswith("auto schedule: "))
    assert "runner-up" in line and "peak memory" in line
    assert [r["iteration"] for r in auto] == [1, 2, 3, 4, 5]
    for a, b in zip(auto, fixed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (line, auto, fixed)
    print(line)
    # with vocabulary parallelism (the GPT-2 vocabulary of 50304 rows over the two ranks): the candidates carry
    # the passes, whose measured times are the head's, and the losses are still those of the fixed schedule
    vocab, out = launch(tmp_path, "vocab", ds_config=config(tmp_path, "vocab", {
        "schedule": "auto", "vocab_parallel": True, "memory_budget": 3, "timers_start_iter": 0,
        "timers_end_iter": 2}), hard=NO_DROPOUT, launcher="forked")
    line = next(l for l in out.splitlines() if l.startswith("auto schedule: "))
    assert " with vocabulary parallelism " in line and "vocabulary passes per slice EF/S/T/EW=" in line
    for a, b in zip(vocab, fixed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (line, vocab, fixed)
