"""bench/partitions.py: the cost cuts beat DeepSpeed's default in the simulator when the head is heavy."""
import re

from bench import partitions


def test_flops_cut_shortens_the_simulated_iteration(capsys):
    assert partitions.main(["--hidden-size", "256", "--num-attention-heads", "4", "--num-layers", "8",
                            "--seq-length", "256", "--vocab-size", "8192", "--pp", "2", "--micro-batches", "4",
                            "--schedules", "1f1b", "zbv"]) == 0
    rows = re.findall(r"\| (\S+) \| (\S+) \| ([\d ]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", capsys.readouterr().out)
    assert [(r[0], r[1]) for r in rows] == [("1f1b", "type:transformer"), ("1f1b", "flops"),
                                            ("zbv", "type:transformer"), ("zbv", "flops")]
    for default, flops in (rows[0:2], rows[2:4]):
        assert float(default[5]) == 1.0 and float(flops[5]) < 0.95   # head = 8 layers' FLOPs here
        assert float(flops[3]) < float(default[3])
        assert sum(map(int, flops[2].split())) == 8
