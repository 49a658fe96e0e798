"""bench.moe_overlap end to end at toy size: the calibration, the traced plain iterations and the simulator's
prediction, the table. Structure and finiteness only - the timings of a loaded test machine prove nothing."""
import math

import pytest

from bench import moe_overlap

SMALLEST = ["--schedules", "1f1b", "--shares", "0.3", "--gas", "4", "--iterations", "2", "--warmup", "1",
            "--calibrate", "1", "--traced", "1", "--timeout", "500"]


@pytest.mark.timeout(600)
def test_moe_overlap_bench_runs_its_smallest_configuration():
    result, text = moe_overlap.main(SMALLEST)
    (row,) = result["rows"]
    assert row["schedule"] == "1f1b" and row["share"] == 0.3 and result["counts"] > 0  # all-to-alls were counted
    # the knob's ms solve share = n L / (T0 + n L) for the measured plain step T0 and count n
    n, base, latency = result["counts"], result["base"], row["latency"]
    assert n * latency / (base + n * latency) == pytest.approx(0.3)
    for key in ("plain", "over", "ratio", "plain_pred", "over_pred", "sim_ratio", "traced_share", "slept_share"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    # the simulator hides only the knob's sleep, which is inside the traced all-to-alls (gloo's time on top)
    assert row["slept_share"] < row["traced_share"]
    assert row["sim_ratio"] < 1  # the all-to-all the units hide is no small part of this step
    table = [line for line in text.splitlines() if line.startswith("| 1f1b ")]
    assert len(table) == 1 and len(table[0].split("|")) == 12
    cells = [c.strip() for c in table[0].split("|")[1:-1]]
    assert cells[1].startswith("30% / ") and len(cells[1].split(" / ")) == 3  # target / slept / traced
    assert float(cells[3]) == pytest.approx(row["plain"] * 1e3, abs=0.06)
    assert float(cells[5]) == pytest.approx(row["ratio"], abs=6e-4)


@pytest.mark.parametrize("flags, message", [(["--shares", "1.2"], "--shares 1.2: each must be in [0, 1)"),
                                            (["--gas", "2"], "--gas 2: dualpipev needs at least 2 x PP = 4"),
                                            (["--pp", "4"], "--pp 4: this bench runs PP2 x DP2")])
def test_bad_flags_are_one_line_and_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        moe_overlap.main(flags)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith(f"bench.moe_overlap: {message}") and "\n" not in err, err


def test_share_zero_is_a_row_without_latency():
    assert moe_overlap.parse(["--shares", "0", "0.3"]).shares == [0.0, 0.3]
