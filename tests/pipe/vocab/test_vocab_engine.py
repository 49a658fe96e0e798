"""Vocabulary parallelism on ScheduleEngine (pipe/vocab/vocab_passes.py) equals the single-process
reference: losses, eval loss, every gradient of the first step (the slices gathered back into whole
embedding and output matrices) and the weights after 3 optimizer steps, 1e-5 fp32, for each schedule
the engine runs it under (pipe/plan/config.VOCAB_PARALLEL_ENGINE), tied (GPT-2: learned positions, the
embedding is the output layer) and untied (LLaMA: rope, RMSNorm, SwiGLU), at PP=4 and PP=2 x DP=2
with ZeRO-1. One launch of 4 ranks runs every case, each schedule once (tied or untied in turn),
--loss-chunk-size (S and T a chunk of tokens at a time), a schedule file that carries the passes
(exported from the catalogue) and a cost partition (which
weighs the layers without the head, every rank holding a slice of it); the whole schedule x tied
matrix at PP=2, PP=4 and PP2xDP2 passes too, run by hand (CI time).
"""
from megatron_ds.pipe.plan.config import VOCAB_PARALLEL_ENGINE
from megatron_ds.schedules import build_schedule
from megatron_ds.testing.launcher import run_ranks
from tests.gpt_harness import assert_matches_reference, engine_rank_run, reference_run, tiny_config

STEPS, WORLD = 3, 4
# The sliced head sums its input gradient over the slices (sum_j alpha_j P_j W_j - W[target]) where the
# reference multiplies the whole softmax: fp32 summation order (~1e-9 on a gradient), which AdamW's
# lr / eps = 1e4 amplification turns into ~1e-5 weights at lr 1e-2 (as Seq1F1B's segments: test_seq1f1b.py).
LR = 1e-3
LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
KNOBS = {"interleaved": {"virtual_stages": 2}, "seq1f1b": {"seq_splits": 2}}


def case(schedule, model, pp, gas, layers):
    return dict(pipeline={"schedule": schedule, "vocab_parallel": True, **KNOBS.get(schedule, {})},
                model=model, pp=pp, gas=gas, layers=layers)


# PP=4: a 1F1B-style, a V-shaped (stage 0 and the loss stage on one rank), Seq1F1B's segments and a
# two-replica schedule; PP=2 x DP=2: the others
CASES = [case("1f1b", LLAMA, 4, 8, 8), case("zbv", {}, 4, 8, 8), case("seq1f1b", LLAMA, 4, 8, 8),
         case("dualpipev", {}, 4, 8, 8),
         case("zb-h1", {}, 2, 4, 4), case("interleaved", LLAMA, 2, 4, 4), case("zbv-half", {}, 2, 4, 4),
         case("gpipe", LLAMA, 2, 4, 4), case("zb-h2", {}, 2, 4, 4), case("zbv-min", LLAMA, 2, 4, 4),
         case("bitpipe", {}, 2, 4, 4),
         case("zb-h1", dict(loss_chunk_size=12), 2, 4, 4)]  # S and T 12 of a micro-batch's 32 tokens at a time


# A cost partition weighs the list without the head (its cost, the list's last, is dropped): embedding 2.5,
# 4 layers, final norm | 2.5 + 1 | 3 (with the head on the loss stage it would be [0, 4, 7]: 5.5 | 5)
COST_CUT = dict(case("1f1b", LLAMA, 2, 4, 4), pipeline={"schedule": "1f1b", "vocab_parallel": True,
                                                         "partition_method": "costs:[2.5, 1, 1, 1, 1, 0, 4]"})
COST_CUT_PARTS = (0, 2, 6)


def vocab_rank_runs(cases):
    return [engine_rank_run(c["pp"], c["gas"], STEPS, c["pipeline"], num_layers=c["layers"], model=c["model"],
                            lr=LR) for c in cases]


def test_vocab_parallel_matches_reference(tmp_path):
    assert {c["pipeline"]["schedule"] for c in CASES} == set(VOCAB_PARALLEL_ENGINE)  # every one admitted is run
    path = tmp_path / "zb-h2-vocab.json"  # a file's op lists, vocabulary passes included, run as they are
    path.write_text(build_schedule("zb-h2", 2, 4, vocab_parallel=True).to_json())
    cases = CASES + [case(f"file:{path}", LLAMA, 2, 4, 4), COST_CUT]
    per_rank = run_ranks(WORLD, vocab_rank_runs, cases, timeout=900)
    assert {tuple(r[-1]["engine"]["parts"]) for r in per_rank} == {COST_CUT_PARTS}
    for i, c in enumerate(cases):
        ref = reference_run(tiny_config(c["layers"], **c["model"]), WORLD // c["pp"], c["gas"], STEPS, lr=LR)
        try:
            assert_matches_reference([r[i] for r in per_rank], ref)
        except AssertionError as exc:
            raise AssertionError(f"{c['pipeline']} pp={c['pp']} untied={bool(c['model'])}: {exc}") from None
