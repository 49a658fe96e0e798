"""The iteration line keeps Megatron's field names and formats, so existing log parsers work."""
import re

from megatron_ds.training.logging_utils import iteration_line, validation_block


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


def test_validation_block():
    text = validation_block("iteration 10", 2.0)
    assert "validation loss at iteration 10 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 |" in text
