"""SavedMemory's transient bytes (megatron_ds/testing/saved_memory.py): what a pass holds outside autograd (a ring's
blocks in flight) is added to the kept bytes where sampled, into `peak_all`, and leaves `peak` as it was."""
import torch

from megatron_ds.testing.saved_memory import SavedMemory

N = 1000  # fp32 values: 4000 bytes a tensor


def test_peak_all_adds_the_transient_bytes_at_each_save_and_sample():
    extra = [0]
    meter = SavedMemory(transient=lambda: extra[0])
    x = torch.ones(N, requires_grad=True)
    with meter.recording():
        y = x.exp()  # keeps its output: 4000
        extra[0] = 10_000
        meter.sample()  # 4000 kept + 10000 in flight
        assert (meter.peak, meter.peak_all) == (4 * N, 4 * N + 10_000)
        z = y.exp()  # saved while 10000 are in flight: 8000 + 10000
        assert (meter.peak, meter.peak_all) == (8 * N, 8 * N + 10_000)
        extra[0] = 0
        w = z.exp()  # 12000 kept, nothing in flight: the kept peak rises, the joint one stays
        assert (meter.peak, meter.peak_all) == (12 * N, 8 * N + 10_000)
        assert meter.at_peak_all == {"kv": 0, "mask": 0, "other": 8 * N, "transient": 10_000}
        w.sum().backward()
    del y, z, w
    assert meter.now == 0
    plain = SavedMemory()  # without a transient source the joint peak is the kept one
    with plain.recording():
        x.exp().exp().sum().backward()
    assert plain.peak_all == plain.peak == 8 * N
