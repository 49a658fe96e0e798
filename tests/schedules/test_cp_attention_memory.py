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
- in all 2392 t; a Seq1F1B segment's 2072 t: its ring saves k and v as views of the K/V cache, so nothing keeps
  c_attn's output or the rotated k (128 + 32 values).
One token's K and V: 2 x 32 x 2 = 128 bytes; the ring's gradient blocks are fp32 (twice that).
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
SEG = 2072 * T  # a segment's layer (its K/V in the cache)
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
    segment = layer_bytes(SHAPE, 64, 2, "p2p", start=64, segmented=True)  # its before_core is all there still
    assert (segment.kept, segment.before_core, segment.cache) == (SEG, BEFORE, 32 * TOKEN)
    assert layer_bytes(SHAPE, 64, 2, "allgather", start=64, segmented=True).kept == KEPT  # not measured: as whole


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
        assert at(_op(schedule, Kind.F, 0, j)) == SEG + 2 * 4096 + BEFORE + 2 * block
        ring = block + 3 * 2 * block  # B: one K/V block (CP 2) and three fp32 gradient blocks
        # opening segment j's backward shrinks the cache to its stop: both layers' segment j + 1 freed first
        opened = 2 * 4096 if j < 3 else 0
        assert at(_op(schedule, Kind.BW, 0, j)) == max(0.0, ring - opened - AFTER)
        assert at(_op(schedule, Kind.BW, 1, j)) == max(0.0, ring - opened - AFTER - logits)
    assert at(_op(schedule, Kind.F, 1, 3)) == 134016
    assert at(_op(schedule, Kind.BW, 0, 3)) == 114688 - 45184 == 69504
    assert at(_op(schedule, Kind.BW, 1, 3)) == 69504 - 32768 == 36736
    assert at(_op(schedule, Kind.BW, 0, 1)) == 57344 - 8192 - 45184 == 3968
    assert at(_op(schedule, Kind.BW, 1, 1)) == 0.0  # 57344 - 8192 - 45184 - 32768 < 0: nothing above the level
    # the last stage peaks in its first BW: four segments of two layers and their cache (140800 each) and the
    # logits (32768 each), plus segment 3's 36736 while its last layer's attention runs backward
    _, peak = run.simulate(schedule)
    assert peak == pytest.approx(4 * (2 * (SEG + 4096) + logits) + 36736, rel=1e-12) and 36736 + 694272 == 731008


def test_seq1f1b_frees_a_segments_cache_when_the_one_before_opens_backward():
    """Seq1F1B at PP 2, m = 2, 2 segments of 64 (CP 1: no ring, so the peak is the kept one): the kv_cache frees
    segment 1's positions when segment 0's backward opens and segment 0's after it, so between micro-batch 0's two
    BWs the stage still holds segment 1's cache (2 layers x 64 tokens x 128 bytes) under micro-batch 1's F."""
    run = ContextRun(SHAPE, 128, 1, logits=False)
    schedule = build_schedule("seq1f1b", 2, 2, seq_splits=2, segment_lengths=(64, 64))
    held = run.chunks(schedule)[0]
    f0, f1, b1, b0 = (_op(schedule, kind, 0, seq) for kind, seq in ((Kind.F, 0), (Kind.F, 1), (Kind.BW, 1),
                                                                    (Kind.BW, 0)))
    cache = 64 * TOKEN
    assert [run.cache_change(held, op) for op in (f0, f1, b1, b0)] == [cache, cache, 0.0, 2 * cache]
    order = [op for op in schedule.ranks[0] if op.stage == 0]
    assert order[:5] == [f0, f1, _op(schedule, Kind.F, 0, 0, mb=1), b1, _op(schedule, Kind.F, 0, 1, mb=1)]
    # rank 0 peaks in micro-batch 1's F of segment 1, after micro-batch 0's BW of segment 1: three segments of
    # two layers kept (2392 x 64 bytes each) and four segments' cache (micro-batch 0's segment 1 not yet freed);
    # before the BW it held three of each, 967680
    _, peak = run.simulate(schedule)
    assert peak == pytest.approx(3 * 2 * 2392 * 64 + 4 * 2 * cache, rel=1e-12) and peak == pytest.approx(984064)


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
    assert full(bw) == (SEG - layer_input) + (114688 - AFTER) == 62208 + 69504
    selective = run.attention_bytes(schedule, recompute=Recompute("selective"))
    assert selective(f) == (SEG - 16 * T) + 2 * 4096 + BEFORE + 2 * 16384  # without layer 1's statistics
    assert selective(bw) == 69504  # the fused core's statistics are less than the MLP's part: no rise
    plain, _ = run.simulate(schedule)
    again, peak = run.simulate(schedule, recompute=Recompute("full", "uniform", 1))
    assert again.makespan > plain.makespan  # each B runs its layers' forward again
    # stage 0 under full recompute: four segments' layer inputs and cache, then segment 3's BW rises to 131712;
    # stage 1 the same and the logits, its BW 32768 less
    assert peak == pytest.approx(max(4 * 2 * (layer_input + 4096) + 131712,
                                     4 * (2 * (layer_input + 4096) + 32768) + 62208 + 36736), rel=1e-12)
