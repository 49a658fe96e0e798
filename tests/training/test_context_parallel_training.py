"""pretrain_gpt.py at CP=2 x PP=2 (4 gloo ranks, ZB-V, --cp-comm-type p2p) gives the per-iteration losses and
gradient norms of one process: the loop reads each replica's samples once for its CP ranks (data-axis rank // CP),
tells DeepSpeed the batch as it counts it (x CP), and the embedding adds the learned positions of each rank's tokens
(GPT-2's learned absolute positions: the global ones, from the position ids the batch carries)."""
import os

import pytest

from tests.training.test_tensor_parallel_training import ROOT, _launch
from megatron_ds.testing.corpus import write_corpus


@pytest.mark.timeout(1800)
def test_cp2_pp2_zbv_equals_one_process(tmp_path):
    write_corpus(str(tmp_path / "corpus"))
    ref, _ = _launch(tmp_path, "reference", 1)
    split, out = _launch(tmp_path, "cp2_pp2", 4, "--context-parallel-size", "2", "--pipeline-model-parallel-size",
                         "2", "--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "ds_config_zbv.json"))
    assert "ScheduleEngine, schedule zbv" in out
    assert [r["iteration"] for r in split] == [1, 2, 3, 4] == [r["iteration"] for r in ref]
    print("reference", [r["loss"] for r in ref], "\nCP2xPP2  ", [r["loss"] for r in split])
    for a, b in zip(ref, split):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (ref, split)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (ref, split)
    assert split[-1]["loss"] < split[0]["loss"]


def test_rank_coordinates_put_the_context_parallel_ranks_inner(tmp_path):
    from megatron_ds.training.config.arguments import parse_args
    from megatron_ds.training.config.parallel_args import rank_coordinates
    from tests.training.test_tensor_parallel_training import MODEL
    write_corpus(str(tmp_path / "corpus"))
    args = parse_args([*MODEL, "--data-path", str(tmp_path / "corpus"), "--vocab-file", __file__, "--merge-file",
                       __file__, "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                       "--pipeline-model-parallel-size", "2"], env={"WORLD_SIZE": "16", "RANK": "0"})
    assert (args.data_parallel_size, args.gradient_accumulation_steps) == (2, 2)  # 8 = 2 micro x 2 x DP 2
    # global rank = tp + TP x (cp + CP x (dp + DP x pp)): (stage, replica, TP rank) of each
    assert [rank_coordinates(args, r) for r in range(16)] == [
        (pp, dp, tp) for pp in range(2) for dp in range(2) for _cp in range(2) for tp in range(2)]
