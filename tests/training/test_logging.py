"""The iteration line keeps Megatron's field names and formats, so existing log parsers work."""
import json
import re

from megatron_ds.training.logging_utils import MetricsFile, iteration_line, validation_block


def test_megatron_iteration_line():
    line = iteration_line(iteration=7, train_iters=300, consumed_samples=112, consumed_tokens=7168,
                          ms_per_iteration=123.45, learning_rate=3e-4, global_batch_size=16,
                          losses={"lm loss": 1.2345678}, loss_scale=None, grad_norm=0.5, skipped=0, nan=0,
                          samples_per_second=129.6, tflops_value=0.01)
    assert line.startswith(" iteration        7/     300 | consumed samples:          112 |")
    for field in ("elapsed time per iteration (ms): 123.5", "learning rate: 3.000E-04", "global batch size:    16",
                  "lm loss: 1.234568E+00", "grad norm: 0.500", "number of skipped iterations:   0",
                  "samples per second: 129.600", "TFLOPs: 0.01"):
        assert f"| {field} |" in line
    # the regex BigScience's log tools use
    m = re.search(r"iteration\s+(\d+)/\s*(\d+).*lm loss: ([\d.E+-]+)", line)
    assert m.groups() == ("7", "300", "1.234568E+00")


def test_validation_block_prints_loss_and_perplexity_in_megatrons_format():
    text = validation_block("iteration 10", 2.0)
    assert "validation loss at iteration 10 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |" in text


def _records(path):
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines()]


def test_metrics_file_is_cut_back_to_the_resumed_iteration(tmp_path, capsys):
    """A restart from iteration 4 drops the killed attempt's records of 5 and 6 (and its torn last line),
    rewriting the file atomically, then appends; without a resume nothing is dropped."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "loss": 1.0 / i}) + "\n" for i in range(1, 7))
                    + '{"iteration": 7, "lo')
    fresh = MetricsFile(str(path))
    fresh.close()
    assert path.read_text().endswith('{"iteration": 7, "lo')
    metrics = MetricsFile(str(path), resumed_at=4)
    assert _records(path) == [1, 2, 3, 4]
    metrics.write(iteration=5, loss=0.5)
    metrics.close()
    assert _records(path) == [1, 2, 3, 4, 5] and sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]
    said = capsys.readouterr().out.splitlines()
    assert said == [f"{path}: dropped 3 lines of an earlier attempt (iterations after 4, which the checkpoint this "
                    "run resumed from does not hold)"]
    MetricsFile(str(path), resumed_at=5).close()
    assert _records(path) == [1, 2, 3, 4, 5] and capsys.readouterr().out == ""
    MetricsFile(str(tmp_path / "new" / "m.jsonl"), resumed_at=2).close()  # nothing there yet
    assert (tmp_path / "new" / "m.jsonl").read_text() == ""


def test_evaluate_time_is_logged_at_the_evaluation_and_no_timer_logs_zeros():
    """timers/evaluate-time was written at the next log interval, then as 0 at every interval after it."""
    import types

    from megatron_ds.training.logging_utils import TensorBoard, Timers
    from megatron_ds.training.loop import Trainer
    written = []
    tb = TensorBoard.__new__(TensorBoard)
    tb.args = types.SimpleNamespace(log_timers_to_tensorboard=True)
    tb.writer = types.SimpleNamespace(add_scalar=lambda tag, value, step: written.append((tag, step, value)))
    tb.validation = lambda *a, **k: None
    trainer = Trainer.__new__(Trainer)  # only what evaluate_and_print touches
    trainer.args = types.SimpleNamespace(batch_schedule=None, eval_iters=1)
    trainer.engine = types.SimpleNamespace(eval_batch=lambda it: 2.5)
    trainer.timers, trainer.tb, trainer.current_gbs, trainer.consumed_train, trainer.bar = Timers(), tb, 8, 16, None
    for iteration in (1, 2, 3, 4):  # an evaluation after iteration 2, a log line after each
        trainer.iteration = iteration
        trainer.timers.start("train-step")
        trainer.timers.stop("train-step")
        tb.timers(trainer.timers, iteration)
        if iteration == 2:
            trainer.evaluate_and_print("iteration 2", None, 1)
    assert [(tag, step) for tag, step, _ in written] == [
        ("timers/train-step-time", 1), ("timers/train-step-time", 2), ("timers/evaluate-time", 2),
        ("timers/train-step-time", 3), ("timers/train-step-time", 4)]
    assert all(value > 0 for _, _, value in written)
