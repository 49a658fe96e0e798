"""bf16 with ZeRO-1: our 1f1b reproduces DeepSpeed's stock engine bit for bit, and the
zero-bubble V schedule trains to the fp32 reference's losses within bf16 precision."""
from tests.gpt_harness import engine_rank_runs, reference_run, tiny_config
from megatron_ds.testing.launcher import run_ranks

STEPS, GAS = 3, 4


def test_bf16_1f1b_equals_deepspeed_bit_for_bit_and_zbv_follows_fp32():
    pipelines = [None, {"schedule": "1f1b"}, {"schedule": "zbv"}]
    per_rank = run_ranks(2, engine_rank_runs, 2, GAS, STEPS, pipelines, bf16=True)
    stock, ours, zbv = ([r[i] for r in per_rank] for i in range(3))
    assert ours[0]["losses"] == stock[0]["losses"]
    ref = reference_run(tiny_config(), 1, GAS, STEPS)["losses"]
    for loss, ref_loss in zip(zbv[0]["losses"], ref):
        assert abs(loss - ref_loss) <= 0.01 * ref_loss, (zbv[0]["losses"], ref)
