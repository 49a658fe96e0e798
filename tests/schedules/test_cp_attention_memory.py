"""What an op holds while one of its layers attends under context parallelism (ContextRun.attention_bytes, the
simulator's `transient`), worked by hand on a tiny LLaMA-style layer, and the peaks the simulation reaches with it.

The layer (SHAPE: h 64, 4 query heads and 2 K/V heads of 16, SwiGLU ffn 128, RMSNorm, RoPE; bf16, micro-batch 1)
at t local tokens keeps, in bytes (recompute.layer_memory, fused core):
- before its attention: ln_1's input, statistic and normalised input (64 + 64 values and 4 bytes a token),
  c_attn's input (64) and output (128), the rotated q and k (96): 416 x 2t + 4t = 836 t;
- the core's output (64 x 2t = 128 t) and softmax statistics (4 heads x 4 = 16 t);
- after it: ln_2's input, statistic and normalised input, c_fc's input, the MLP's [gate; up], silu(gate) and
  their product (64 + 64 + 64 + 512 values, 4 bytes): 704 x 2t + 4t = 1412 t, of which a split B keeps for W
  (c_fc's and the MLP c_proj's inputs, their output gradients: 128 + 192 + 256 values) 1152 t;
- in all 2392 t. One token's K and V: 2 x 32 x 2 = 128 bytes; the ring's gradient blocks are fp32 (twice that).
"""
from types import SimpleNamespace

import pytest

from megatron_ds.schedules import build_schedule
from megatron_ds.schedules.context_parallel import ContextRun, layer_bytes
from megatron_ds.schedules.kinds import Kind
from megatron_ds.schedules.recompute import Recompute

SHAPE = SimpleNamespace(num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        ffn_hidden_size=128, swiglu=True, vocab_size=256, normalization="rmsnorm",
                        position_embedding_type="rope")
T = 32  # a rank's tokens: 64 at CP 2 (the whole sequence, or one Seq1F1B segment of 64)
KEPT, BEFORE, AFTER, AFTER_W = 2392 * T, 836 * T, 1412 * T, 1152 * T
TOKEN = 128  # K and V of one token


def _op(schedule, kind, stage, seq=0, mb=0):
    return next(op for ops in schedule.ranks for op in ops
                if (op.kind, op.stage, op.seq, op.mb) == (kind, stage, seq, mb))


def test_the_layers_parts_by_hand():
    mem = layer_bytes(SHAPE, 64, 2, "p2p")
    assert (mem.kept, mem.before_core, mem.after_core, mem.after_core_w) == (KEPT, BEFORE, AFTER, AFTER_W)
    # kept = before + the core's output and statistics + after
    assert mem.kept == mem.before_core + 128 * T + 16 * T + mem.after_core
    gathered = layer_bytes(SHAPE, 64, 2, "allgather")  # the gathered K/V of 64 tokens are there before the core
    assert gathered.before_core == BEFORE + 64 * TOKEN
    heads = layer_bytes(SHAPE, 64, 2, "a2a")  # q, k, v in the head layout (64 + 32 + 32 wide, 32 tokens)
    assert heads.before_core == BEFORE + 128 * T * 2


def test_f_and_b_of_a_middle_and_the_loss_stage():
    """1F1B, PP 2 (two layers a stage), seq 64 at CP 2: blocks of 32 tokens' K/V, 4096 bytes."""
    run = ContextRun(SHAPE, 64, 2)
    schedule = build_schedule("1f1b", 2, 4)
    at = run.attention_bytes(schedule)
    block = 32 * TOKEN
    # F: the first layer kept, the second's part before its core, two K/V blocks; alike on both stages (the
    # logits come after the last layer)
    for stage in (0, 1):
        assert at(_op(schedule, Kind.F, stage)) == KEPT + BEFORE + 2 * block == 111488
    # BW: a K/V block and three fp32 gradient blocks (28672) fit in the MLP's part freed before them (45184)
    assert at(_op(schedule, Kind.BW, 0)) == at(_op(schedule, Kind.BW, 1)) == 0.0
    assert run.layer()[0].in_flight[1] == block + 3 * 2 * block == 28672
    _, peak = run.simulate(schedule)
    # rank 0's peak is two micro-batches of its two layers; the F's largest moment is below its whole kept
    assert peak == pytest.approx(2 * 2 * KEPT, rel=1e-12)


def test_split_b_keeps_for_w_and_a_v_stage_holds_one_layer():
    """ZBV at PP 2: four stages of one layer each, split B/W; seq 64 at CP 2."""
    run = ContextRun(SHAPE, 64, 2)
    schedule = build_schedule("zbv", 2, 4)
    at = run.attention_bytes(schedule)
    block = 32 * TOKEN
    for stage in range(4):  # one layer: nothing earlier, its part before the core and two blocks
        assert at(_op(schedule, Kind.F, stage)) == BEFORE + 2 * block == 34944
        # B frees the MLP's part but what W keeps (8320); the logits stay for W on the loss stage
        assert at(_op(schedule, Kind.B, stage)) == 28672 - (AFTER - AFTER_W) == 20352
        assert at(_op(schedule, Kind.W, stage)) == 0.0


def test_seq1f1b_segments_hold_the_cache_so_far():
    """Seq1F1B PP 2, one micro-batch of 256 tokens in 4 segments of 64 at CP 2: segment j's blocks are its rank's
    K/V cache [0, 64 (j + 1)) / 2, 4096 (j + 1) bytes; each layer caches the segment's 32 tokens (4096 bytes)."""
    run = ContextRun(SHAPE, 256, 2)
    schedule = build_schedule("seq1f1b", 2, 1, seq_splits=4, segment_lengths=(64,) * 4)
    at = run.attention_bytes(schedule)
    logits = 4 * 128 * 256 // 4  # fp32 logits of a rank's 128 tokens over 256 words, a segment's quarter
    for j in range(4):
        block = 4096 * (j + 1)
        # F: layer 1 kept, both layers' cache of the segment (opened with the op), layer 2 before its core
        assert at(_op(schedule, Kind.F, 0, j)) == KEPT + 2 * 4096 + BEFORE + 2 * block
        ring = block + 3 * 2 * block  # B: one K/V block (CP 2) and three fp32 gradient blocks
        assert at(_op(schedule, Kind.BW, 0, j)) == max(0.0, ring - AFTER)
        assert at(_op(schedule, Kind.BW, 1, j)) == max(0.0, ring - AFTER - logits)
    assert at(_op(schedule, Kind.F, 1, 3)) == 144256
    assert at(_op(schedule, Kind.BW, 0, 3)) == 114688 - 45184 == 69504
    assert at(_op(schedule, Kind.BW, 1, 3)) == 69504 - 32768 == 36736
    assert at(_op(schedule, Kind.BW, 1, 1)) == 0.0  # 57344 - 45184 - 32768 < 0: nothing above the level
    # the last stage peaks in its first BW: four segments of two layers and their cache (161280 each) and the
    # logits (32768 each), plus segment 3's 36736 while its last layer's attention runs backward
    _, peak = run.simulate(schedule)
    assert peak == pytest.approx(4 * (2 * (KEPT + 4096) + logits) + 36736, rel=1e-12) and 36736 + 776192 == 812928


def test_recompute_combines_its_rise_with_the_rings_blocks():
    """The same Seq1F1B run (segment 3, stage 0) under recompute: the B's rise while it recomputes, plus the
    blocks beyond what the op has freed; F holds the earlier layers as recompute keeps them."""
    run = ContextRun(SHAPE, 256, 2)
    schedule = build_schedule("seq1f1b", 2, 1, seq_splits=4, segment_lengths=(64,) * 4)
    f, bw = _op(schedule, Kind.F, 0, 3), _op(schedule, Kind.BW, 0, 3)
    full = run.attention_bytes(schedule, recompute=Recompute("full", "uniform", 1))
    layer_input = 64 * 2 * T
    assert full(f) == layer_input + 2 * 4096 + BEFORE + 2 * 16384  # layer 1 keeps its input only
    # recomputing layer 2 rises by its whole layer less what the group stored (its input); then the blocks
    assert full(bw) == (KEPT - layer_input) + (114688 - AFTER) == 72448 + 69504
    selective = run.attention_bytes(schedule, recompute=Recompute("selective"))
    assert selective(f) == (KEPT - 16 * T) + 2 * 4096 + BEFORE + 2 * 16384  # without layer 1's statistics
    assert selective(bw) == 69504  # the fused core's statistics are less than the MLP's part: no rise
    plain, _ = run.simulate(schedule)
    again, peak = run.simulate(schedule, recompute=Recompute("full", "uniform", 1))
    assert again.makespan > plain.makespan  # each B runs its layers' forward again
    # stage 0 under full recompute: four segments' layer inputs and cache, then segment 3's BW rises to 141952
    assert peak == pytest.approx(max(4 * 2 * (layer_input + 4096) + 141952,
                                     4 * (2 * (layer_input + 4096) + 32768) + 72448 + 36736), rel=1e-12)
