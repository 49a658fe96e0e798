"""bench.hf_cost's arithmetic on made-up times (no launch): the paired ratios step by step, the medians, the CPU
ratio over the ranks, and the goals (hf / gpt at most 1.10; hf on our 1f1b at most 3 % dearer than DeepSpeed's
engine); --profile's parts at toy size."""
import argparse

import pytest

from bench import hf_cost


def result(hf, gpt, ds, cpu_hf=(0.2, 0.3), cpu_gpt=(0.2, 0.2)):
    times = {"hf 1f1b": hf, "gpt 1f1b": gpt, "hf zbv": hf, "gpt zbv": gpt, "hf deepspeed": ds}
    rank = lambda i: {"hf 1f1b": [cpu_hf[i]], "gpt 1f1b": [cpu_gpt[i]], "hf zbv": [cpu_hf[i]],  # noqa: E731
                      "gpt zbv": [cpu_gpt[i]], "hf deepspeed": [cpu_hf[i]]}
    return {"times": times, "cpu": [rank(0), rank(1)], "classes": {n: "E" for n in times}}


def test_paired_ratios_medians_and_goals():
    # step by step: 1.2/1.0, 2.2/2.0, 1.05/1.0 -> ratios 1.2, 1.1, 1.05: median 1.1 (the medians' ratio: 1.2/1.0)
    res = result(hf=[1.2, 2.2, 1.05], gpt=[1.0, 2.0, 1.0], ds=[1.2, 2.2, 1.05])
    contestants, comparisons = hf_cost.rows(res)
    assert contestants[0] == ["hf 1f1b", "E", "1200.0", "200 / 300 ms"]
    by = {row[0]: row for row in comparisons}
    assert by["hf 1f1b / gpt 1f1b"][1:] == ["1.100", "1.200", "1.250", "<= 1.10", "yes"]  # CPU: 0.5 / 0.4
    assert by["hf zbv / gpt zbv"][1] == "1.100"
    assert by["hf 1f1b / hf deepspeed"][1:] == ["1.000", "1.000", "1.000", "<= 1.03", "yes"]


@pytest.mark.parametrize("ds_scale,met", [(1.0 / 1.04, "no"), (1.0 / 0.90, "yes"), (1.0 / 1.02, "yes")])
def test_the_deepspeed_goal(ds_scale, met):
    hf = [1.0, 1.0, 1.0]
    _, comparisons = hf_cost.rows(result(hf=hf, gpt=[0.95] * 3, ds=[t * ds_scale for t in hf]))
    assert {row[0]: row[-1] for row in comparisons}["hf 1f1b / hf deepspeed"] == met


def test_report_names_the_shape_and_missing_contestants_drop_their_ratio():
    args = argparse.Namespace(pp=2, gas=4, mbs=2, seq=16, layers=4, hidden=32, ffn=64, heads=4, kv_heads=2, vocab=64,
                              iterations=3, warmup=1)
    res = result(hf=[1.0, 1.0, 1.0], gpt=[1.0, 1.0, 1.0], ds=[1.0, 1.0, 1.0])
    for key in ("times",):
        del res[key]["gpt zbv"]
    text = hf_cost.report(res, args)
    assert "p=2, dp=1, m=4" in text and "LLaMA shape: 4 layers, hidden 32" in text
    assert "hf zbv / gpt zbv" not in text and "hf 1f1b / gpt 1f1b" in text


def test_profile_parts_at_toy_size():
    args = argparse.Namespace(vocab=64, hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, seq=16, mbs=2)
    rows = hf_cost.profile_parts(args, repeats=2)
    assert [r[0].split()[0] for r in rows] == ["model", "attention", "loss", "2"]
    assert all(a > 0 and b > 0 for _, a, b, _ in rows)
    hf_ops, gpt_ops = (int(x) for x in rows[0][3].split()[-3::2])
    assert hf_ops > 0 and gpt_ops > 0
    assert "weight groups" in rows[3][3]
    assert hf_cost.profile_table(rows)[0].startswith("| part |")
