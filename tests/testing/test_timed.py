"""The timed benchmarking layer (megatron_ds/testing/timed.py): it sleeps its costs and, inside a
B op, leaves TW (and the weight gradient) to W. No assertions on speed beyond "a sleep takes at
least its time"."""
import time

import torch

from megatron_ds.model.linear import WeightGradStore
from megatron_ds.testing.timed import TimedCosts, TimedLayer


def test_timed_layer_defers_tw_to_w():
    costs = TimedCosts(tf=0.02, tb=0.03, tw=0.3)
    layer = TimedLayer(4, costs)
    x = torch.randn(2, 3, 4, requires_grad=True)
    start = time.perf_counter()
    y = layer(x)
    assert time.perf_counter() - start >= costs.tf
    queue = []
    start = time.perf_counter()
    with WeightGradStore.deferring(queue):
        y.sum().backward()
    b_time = time.perf_counter() - start
    assert costs.tb <= b_time < costs.tb + costs.tw  # B did not pay TW
    assert x.grad is not None and layer.weight.grad is None and len(queue) == 1
    start = time.perf_counter()
    WeightGradStore.drain(queue)
    assert time.perf_counter() - start >= costs.tw
    assert torch.equal(layer.weight.grad, x.detach().reshape(-1, 4).sum(0))


def test_timed_layer_fused_backward_pays_tb_plus_tw_and_scales_with_segments():
    costs = TimedCosts(tf=0.0, tb=0.02, tw=0.02, seq_length=8)
    layer = TimedLayer(4, costs)
    x = torch.randn(1, 8, 4, requires_grad=True)
    y = layer(x)
    start = time.perf_counter()
    y.sum().backward()
    assert time.perf_counter() - start >= costs.tb + costs.tw
    assert torch.equal(layer.weight.grad, x.detach().reshape(-1, 4).sum(0))
    costs.tf = 0.04
    assert costs.share(x[:, :4]) == 0.5
    start = time.perf_counter()
    layer(x[:, :4])  # half the sequence: half the forward time
    assert time.perf_counter() - start >= 0.02


def test_timed_costs_carry_sleep_overshoot_to_the_next_sleep():
    costs = TimedCosts(carry_overshoot=True)
    costs.late = 0.003
    costs.sleep(0.002)  # already 3 ms late: this sleep is skipped, 1 ms of lateness remains
    assert abs(costs.late - 0.001) < 1e-4
    start = time.perf_counter()
    for _ in range(10):
        costs.sleep(0.005)
    assert time.perf_counter() - start >= 0.05 - 0.001  # the sleeps add up to their costs


def test_timed_costs_past_deadline_sleeps_nothing_and_keeps_the_debt():
    costs = TimedCosts(carry_overshoot=True)
    costs.late = 0.002
    start = time.perf_counter()
    costs.sleep_until(start - 1.0)  # the call's own work overran its cost
    assert time.perf_counter() - start < 0.5 and costs.late == 0.002


def test_timed_layer_scale_multiplies_each_cost_and_takes_the_first_stage_tuple():
    costs = TimedCosts(tf=0.01, tb=0.01, tw=0.01)
    layer = TimedLayer(4, costs, scale=(3.0, 1.0, 20.0))  # a layer that also carries a head's F and W
    x = torch.randn(2, 3, 4, requires_grad=True)
    start = time.perf_counter()
    y = layer((x, torch.arange(3)))  # vocabulary parallelism's first stage: (embedding sum, position ids)
    assert time.perf_counter() - start >= 0.03
    assert torch.equal(y, x)  # w = 1
    queue = []
    start = time.perf_counter()
    with WeightGradStore.deferring(queue):
        y.sum().backward()
    assert 0.01 <= time.perf_counter() - start < 0.21  # B: TB once, the scaled TW left to W
    start = time.perf_counter()
    WeightGradStore.drain(queue)
    assert time.perf_counter() - start >= 0.2
