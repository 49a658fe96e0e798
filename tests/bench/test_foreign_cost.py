"""bench.foreign_cost end to end at toy size: both engines side by side, the traced split schedules and the
simulator's prediction, the tables. Structure only - the timings of a loaded test machine prove nothing."""
import re

import pytest

from bench import foreign_cost


@pytest.mark.timeout(600)
def test_foreign_cost_bench_runs_both_comparisons():
    text = foreign_cost.main(["--iterations", "2", "--warmup", "1", "--width", "16", "--layers",
                              "4", "--mbs", "2", "--gas", "4", "--timeout", "500"])
    engines, split = ({line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                       for line in table.splitlines()[2:]} for table in text.split("\n\n")[1:3])
    assert engines["deepspeed"][0] == "PipelineEngine" and engines["1f1b"][0] == "ForeignScheduleEngine"
    assert engines["deepspeed"][2] == "1.000" and float(engines["1f1b"][2]) > 0
    assert list(split) == ["1f1b", "zbv", "dualpipev"]
    assert len(split["1f1b"][0].split(" / ")) == 2  # F and BW: 1f1b does not split
    for name in ("zbv", "dualpipev"):  # the split: F, B and W ops were traced (dualpipev's last ones are BW)
        costs = [float(x) for x in split[name][0].split(" / ")]
        assert len(costs) >= 3 and min(costs) > 0
    for name, row in split.items():
        assert min(float(x) for x in row[1].split(" / ")) >= 0  # the runtime's time per op, by kind
        sim, full = (float(x) for x in row[2].split(" / "))
        assert full >= sim > 0  # the runtime's time per op and the messages' latency only add
        predicted, measured = float(row[4]), float(row[5])
        ratio = float(row[6].split(" / ")[1])
        assert predicted > 0 and measured > 0 and ratio == pytest.approx(measured / predicted, rel=0.02)  # rounded
        assert float(row[7]) > 0 and float(row[8]) > 0
    assert split["1f1b"][10] == "1.000"
    assert re.search(r"p=2, dp=1, m=4", text)
