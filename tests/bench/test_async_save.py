"""bench/async_save.py's arithmetic on a known run: the stall is the time training stopped plus the later
iterations' time over the median step before the save (signed); the write rate is read off the save's log line
as the run prints it (save_stats.line). The launches themselves are the bench's (minutes at its size)."""
import pytest

from bench import async_save
from megatron_ds.training.checkpoint import save_stats


def _line(blocking, seconds, probe):
    records = [save_stats.rank_record(0, 400_000_000, seconds, 400_000_000, probe),
               save_stats.rank_record(1, 1_000_000, 0.5, 1_000_000, probe)]
    return save_stats.line(5, blocking, records, background=True)


def test_stall_and_write_rate_from_a_run():
    times = {1: 9.0, 2: 1.0, 3: 1.2, 4: 0.9, 5: 1.1, 6: 1.6, 7: 1.3, 8: 0.8}
    save = async_save.LINE.search(_line(0.25, 2.0, None))  # the runs' own probe is off: the bench measures it
    r = async_save.measure(times, save, 5, 400.0)
    assert r["step"] == pytest.approx(1.05)  # median of iterations 2-5 (the first warms up)
    assert r["stopped"] == 0.25 and r["after"] == pytest.approx(0.55 + 0.25 - 0.25)  # 6, 7 over the step; 8 under
    assert r["stall"] == pytest.approx(0.8) and (r["mb"], r["mbs"], r["probe"]) == (400.0, 200.0, 400.0)
    out = async_save.table({"sync": {**r, "stall": 1.6}, "async": r}, 124e6, 2)
    assert "PP 2: 2 rank(s); GPT of 124.0M parameters" in out and "async stall / sync stall: 0.500" in out
    assert out.splitlines()[2].split()[-2:] == ["400.0", "0.50"]  # rank 0's MB/s over the plain write's


def test_a_run_without_the_probe_has_no_ratio():
    save = async_save.LINE.search(_line(0.25, 2.0, None))
    r = async_save.measure({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 1.0, 7: 1.0}, save, 5, None)
    assert r["probe"] is None and r["after"] == 0.0
    assert async_save.table({"async": r}, 1e8, 1).splitlines()[-1].split()[-2:] == ["-", "-"]


def test_the_writers_alone(tmp_path):
    assert async_save.lost(2.0, 0.75) == 0.5  # a 2 s write that kept 3/4 of the training rate cost 0.5 s
    costs = async_save.writer_cost(8, 1, str(tmp_path / "state.pt"))
    assert sorted(costs) == ["torch.save", "zip_writer"]
    assert all(seconds > 0 and 0 < kept for seconds, kept in costs.values()), costs
    out = async_save.writer_table(costs, 8).splitlines()
    assert out[0].startswith("8 MB written") and [line.split()[0] for line in out[2:]] == ["torch.save", "zip_writer"]
