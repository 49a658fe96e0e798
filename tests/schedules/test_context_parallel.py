"""Context parallelism's cost model (schedules/context_parallel.py) worked by hand on small shapes, and the compare
command's CP table."""
from types import SimpleNamespace

import pytest
from megatron_ds.schedules import build_schedule
from megatron_ds.schedules import auto
from megatron_ds.schedules.auto_recompute import Knobs
from megatron_ds.schedules.cli import main
from megatron_ds.schedules.context_parallel import (ContextRun, cp_layer_memory, cp_problem, layer_bytes, messages,
                                                    rank_attention_flops, ring_times)
from megatron_ds.schedules.costs import ModelCosts
from megatron_ds.schedules.flops import attention_flops, linear_flops_per_token
from megatron_ds.schedules.recompute import layer_memory

# q width 4 x 16 = 64, K/V width 2 x 16 = 32: one token's K and V are 2 x 32 x 2 bytes = 128 bytes at bf16
SHAPE = SimpleNamespace(num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        ffn_hidden_size=128, swiglu=True, vocab_size=256, normalization="rmsnorm",
                        position_embedding_type="rope")


def test_attention_flops_are_equal_on_every_rank_and_sum_to_the_causal_count():
    # by hand, S=16, C=2, q=64: chunks of 4; rank 0 [0,4) and [12,16): 2*64*(16 + 256-144); rank 1 [4,8), [8,12)
    assert rank_attention_flops(SHAPE, 16, 2, 0) == rank_attention_flops(SHAPE, 16, 2, 1) == 2 * 64 * 128
    assert 2 * rank_attention_flops(SHAPE, 16, 2, 0) == attention_flops(0, 16, 64) == 2 * 64 * 256
    for cp in (1, 2, 4, 8):
        for start, n in ((0, 256), (192, 64)):  # a whole sequence, and a Seq1F1B segment after 192 tokens
            per_rank = [rank_attention_flops(SHAPE, n, cp, r, start, batch=3) for r in range(cp)]
            assert len(set(per_rank)) == 1
            assert sum(per_rank) == 3 * attention_flops(start, start + n, 64)


def test_memory_at_two_ranks_is_half_plus_the_named_kv_terms():
    one = layer_memory(SHAPE, 64, 2, 2, cuda=True)
    assert layer_memory(SHAPE, 32, 2, 2, cuda=True).kept * 2 == one.kept  # the layer's own: per token
    token = 2 * 32 * 2 * 2  # K and V of one token, micro-batch 2, bf16
    for comm, kept in (("p2p", 0), ("allgather", 64 * token), ("a2a", (2 * 64 + 2 * 32) * 32 * 2 * 2)):
        assert layer_bytes(SHAPE, 64, 1, comm, 2).held == one.kept  # C=1: no communication at all
        two = layer_bytes(SHAPE, 64, 2, comm, 2)
        assert (two.kept, two.comm, two.cache) == (one.kept / 2, kept, 0)
    p2p = layer_bytes(SHAPE, 64, 2, "p2p", 2)  # two K/V blocks of 32 tokens in flight; backward three fp32 grads
    assert p2p.in_flight == (2 * 32 * token, 32 * token + 3 * 32 * token * 2)  # and one K/V block at C = 2
    four = layer_bytes(SHAPE, 64, 4, "p2p", 2)  # beside two K/V blocks of 16 tokens at C > 2
    assert four.in_flight == (2 * 16 * token, 2 * 16 * token + 3 * 16 * token * 2)
    assert layer_bytes(SHAPE, 64, 2, "allgather", 2).in_flight == (0, 2 * 64 * token)
    # Seq1F1B: the K/V cache, 2 x K/V width per held token: local for p2p, gathered whole for allgather
    seg = layer_bytes(SHAPE, 32, 2, "p2p", 2, start=32, segmented=True)
    assert seg.cache == 16 * token and seg.in_flight[0] == 2 * 32 * token  # the ring passes [0, 64) / 2
    assert layer_bytes(SHAPE, 32, 2, "allgather", 2, start=32, segmented=True).held == \
        layer_memory(SHAPE, 16, 2, 2, cuda=True).kept + 32 * token


def test_message_bytes_per_comm_type():
    token = 2 * 32 * 2  # micro-batch 1
    p2p = messages(SHAPE, 64, 4, "p2p")  # blocks of 16 tokens; their gradients in fp32, C of them
    assert (p2p.forward_bytes, p2p.backward_bytes) == (3 * 16 * token, 3 * 16 * token + 4 * 16 * token * 2)
    gather = messages(SHAPE, 64, 4, "allgather")
    assert (gather.forward_bytes, gather.backward_bytes) == (3 * 16 * token, 3 * 16 * token)
    a2a = messages(SHAPE, 64, 4, "a2a")  # (C-1)/C of q, k, v, output (64 + 32 + 32 + 64 wide) of 16 tokens
    assert [m.what for m in a2a.forward] == ["all-to-all q", "all-to-all k", "all-to-all v", "all-to-all output"]
    assert a2a.forward_bytes == a2a.backward_bytes == 0.75 * 16 * 2 * 192
    assert messages(SHAPE, 32, 4, "p2p", start=32).forward[0].size == 16 * token  # the local cache [0, 64) / 4
    assert messages(SHAPE, 64, 1, "p2p").forward_bytes == 0


def test_a2a_p2p_sends_the_a2a_over_a_and_the_ring_over_p():
    token, local = 2 * 32 * 2, 16 * 2  # C = 4: 16 tokens a rank (bytes per width unit: 16 x 2)
    tree = SimpleNamespace(**vars(SHAPE), hierarchical_context_parallel_sizes=(2, 2))
    msgs = messages(tree, 64, 4, "a2a+p2p")
    # the a2a over A = 2: half of q, k, v, output (64 + 32 + 32 + 64 wide); the ring over P = 2: one block of the
    # rank's K/V (32 positions at 1 of the 2 K/V heads = 16 tokens' bytes) forward, it and 2 fp32 gradients back
    assert [m.what for m in msgs.forward] == ["all-to-all q", "all-to-all k", "all-to-all v", "all-to-all output",
                                              "K/V block"]
    assert msgs.forward_bytes == 0.5 * local * 192 + 16 * token
    assert msgs.backward_bytes == 0.5 * local * 192 + 16 * token + 2 * 16 * token * 2
    assert messages(tree, 32, 4, "a2a+p2p", start=32).forward[-1].size == 16 * token  # the cache [0, 64) / 4
    # the compare table's CP 2 with A = 2: the a2a alone (a ring of one sends nothing)
    assert messages(tree, 64, 2, "a2a+p2p").forward_bytes == messages(SHAPE, 64, 2, "a2a").forward_bytes
    bytes_ = layer_bytes(tree, 64, 4, "a2a+p2p", 2)  # a2a's head layout kept, the ring's blocks in flight at P = 2
    assert bytes_.comm == layer_bytes(SHAPE, 64, 4, "a2a", 2).comm
    assert bytes_.in_flight == \
        (2 * 16 * 2 * token, 16 * 2 * token + 3 * 16 * 2 * token * 2)
    assert cp_problem(64, 4, "a2a+p2p", kv_heads=2, sizes=(2, 2)) == ""
    assert "needs --hierarchical-context-parallel-sizes" in cp_problem(64, 4, "a2a+p2p", kv_heads=2)
    assert "the 2 K/V heads must be divisible by 4" in cp_problem(64, 8, "a2a+p2p", kv_heads=2, sizes=(4, 2))


def test_a2a_p2p_waits_for_its_all_to_alls_and_hides_its_ring_over_p():
    tree = SimpleNamespace(**vars(SHAPE), hierarchical_context_parallel_sizes=(2, 2))
    msgs, bw = messages(tree, 64, 4, "a2a+p2p"), 1e6
    a2a = (sum(m.size for m in msgs.forward[:4]) / bw, sum(m.size for m in msgs.backward[:4]) / bw)
    block, grad = msgs.backward[-2].size / bw, msgs.backward[-1].size / bw
    # attention far slower than the link: the ring's steps hide all but backward's last gradient block home
    slow = ring_times(tree, 64, 4, "a2a+p2p", bandwidth=bw, flops=1.0)
    assert slow.exposed == pytest.approx((a2a[0], a2a[1] + grad), rel=1e-12)
    assert slow.transfer == pytest.approx((a2a[0] + block, a2a[1] + block + 2 * grad), rel=1e-12)
    # attention free: every byte waited for, as allgather's and a2a's are
    fast = ring_times(tree, 64, 4, "a2a+p2p", bandwidth=bw, flops=1e30)
    assert fast.exposed == pytest.approx(fast.transfer, rel=1e-12)
    # between: a ring step of P = 2 attends half the rank's attention (not a quarter, as p2p's at C = 4 would)
    att = rank_attention_flops(tree, 64, 4, 0)
    flops = att / 2 / (block / 2)  # a forward step's compute = half a block's transfer
    mid = ring_times(tree, 64, 4, "a2a+p2p", bandwidth=bw, flops=flops)
    assert mid.exposed[0] == pytest.approx(a2a[0] + block / 2, rel=1e-12)


def test_the_ring_hides_what_a_block_pairs_attention_covers():
    att = rank_attention_flops(SHAPE, 64, 4, 0)
    lin = linear_flops_per_token(64, 128, 4, 2, True) * 16
    block = 16 * 2 * 32 * 2
    for bandwidth in (block / (att / 4) * 2, block / (att / 4) / 2):  # a step's compute half, then twice, its transfer
        ring = ring_times(SHAPE, 64, 4, "p2p", flops=1.0, bandwidth=bandwidth)
        t, c = block / bandwidth, att / 4
        assert ring.compute == (lin + att, lin + 2 * att, lin)
        assert ring.step_hidden[0] == pytest.approx(min(1.0, c / t))
        assert ring.exposed[0] == pytest.approx(3 * max(0.0, t - c))
        # backward's 4 steps (each 2c) carry: a K/V block (t); it and a gradient block (2t), twice; a gradient
        # block; then the last gradient block travels alone
        left = max(0.0, t - 2 * c) + 2 * max(0.0, 3 * t - 2 * c) + max(0.0, 2 * t - 2 * c)
        assert ring.exposed[1] == pytest.approx(left + 2 * t)
        assert ring.step_hidden[1] == pytest.approx(1 - left / (9 * t))
    # a K/V block's transfer t twice a forward step's compute, by hand: forward 3 x 0.5t; backward (steps of t)
    # 0 + 2 x 2t + t, then the last gradient block's 2t; the steps hide 4t of the 9t under them
    ring = ring_times(SHAPE, 64, 4, "p2p", flops=1.0, bandwidth=block / (att / 4) / 2)
    t = att / 4 * 2
    assert ring.exposed == pytest.approx((1.5 * t, 7 * t)) and ring.step_hidden == pytest.approx((0.5, 4 / 9))
    gather = ring_times(SHAPE, 64, 4, "allgather", flops=1.0, bandwidth=1.0)
    assert gather.exposed == gather.transfer and gather.hidden == 0.0


def test_the_simulation_at_two_ranks():
    """1F1B p=2, m=4: rank 0 peaks in its first B, two micro-batches of its 2 layers held (the ring's buffers fit in
    what the B frees before its first attention backward: test_cp_attention_memory); the costs are the compute at S/2 plus what the ring leaves unhidden, charged to F and B."""
    schedule = build_schedule("1f1b", 2, 4)
    runs = {cp: ContextRun(SHAPE, 64, cp, "p2p", logits=False, bandwidth=1e6) for cp in (1, 2)}
    (_, one), (_, two) = (runs[c].simulate(schedule) for c in (1, 2))
    held, _ = runs[2].layer()
    assert one == 2 * 2 * runs[1].layer()[0].held and two == pytest.approx(2 * 2 * held.held, rel=1e-12)
    assert two == pytest.approx(one / 2, rel=1e-12) and held.in_flight[1] > 0
    ring = runs[2].layer()[1]
    costs = runs[2].model_costs(2)
    assert (costs.tf, costs.tb, costs.context) == (2 * ring.compute[0], 2 * ring.compute[1],
                                                   (2 * ring.exposed[0], 2 * ring.exposed[1]))
    f, b, w = costs.per_stage(schedule)
    assert f[0] == costs.tf + costs.context[0] and b[0] == costs.tb + costs.context[1] and w[0] == costs.tw
    assert ModelCosts(1, 1, 1, context=(0.5, 0.25)).mean_op_times(2) == (1.5, 1.25, 1)


def test_seq1f1b_segments_are_cut_2cp_ways():
    run = ContextRun(SHAPE, 256, 4)
    lengths = run.segment_lengths(2)
    assert sum(lengths) == 256 and all(n % 8 == 0 for n in lengths) and lengths[0] > lengths[1]
    assert run.segment_lengths(4, "even") == [64] * 4
    res, peak = run.simulate(build_schedule("seq1f1b", 2, 4, seq_splits=2, segment_lengths=lengths))
    assert peak > 0 and res.makespan > 0
    assert "segment lengths [24, 40]" in cp_problem(64, 8, lengths=[24, 40])


def test_auto_counts_a_ranks_tokens():
    unit = auto.unit_bytes(8, 1024, 1, 64, 4, 2, context_parallel=4)
    assert unit == 8 * 256 * 64 * (34 + 5 * 4 * 1024 / 64)  # 256 local queries score all 1024 keys
    assert auto.logits_units(1024, 1, 256, unit, 4) == auto.logits_units(256, 1, 256, unit)
    knobs = Knobs.of(SHAPE, 256, 1, 2, 2, context_parallel=2, cp_comm_type="allgather")
    memory = cp_layer_memory(SHAPE, 256, 1, 2, 2, "allgather")
    assert knobs.memories == (memory, memory)
    assert memory.kept == layer_memory(SHAPE, 128, 1, 2, cuda=True).kept + 256 * 2 * 32 * 2


ARGS = ["compare", "--pp", "2", "--micro-batches", "4"]
SHAPE_ARGS = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--num-key-value-heads", "2",
              "--ffn-hidden-size", "1024", "--swiglu", "--normalization", "rmsnorm", "--vocab-size", "256"]
CLI_SHAPE = SimpleNamespace(**{**vars(SHAPE), "hidden_size": 512, "num_attention_heads": 8, "ffn_hidden_size": 1024})


def test_compare_prints_each_cp_size(capsys):
    assert main(ARGS) == 0
    plain = capsys.readouterr().out
    assert "context" not in plain and "CP=" not in plain  # the table without the new flags, as before
    assert main([*ARGS, "--seq-length", "32768", "--context-parallel-size", "4", *SHAPE_ARGS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("context parallelism: seq 32768, micro-batch 1, p=2 m=4; L=4 h=512 heads 8/2")
    sizes = {int(line.split()[0]): line.split() for line in out[3:6]}
    assert list(sizes) == [1, 2, 4] and [int(s[1]) for s in sizes.values()] == [32768, 16384, 8192]
    run = ContextRun(CLI_SHAPE, 32768, 4)
    assert sizes[4][3] == f"{run.messages().forward_bytes / 2 ** 20:.1f}/{run.messages().backward_bytes / 2 ** 20:.1f}"
    header = next(i for i, line in enumerate(out) if line.startswith("schedule"))
    assert out[header].split()[2:] == ["CP=1", "GiB", "step", "s", "CP=2", "GiB", "step", "s", "CP=4", "GiB", "step",
                                       "s"]
    rows = {(line[:12].strip(), line[13:23].strip()): line[23:].split() for line in out[header + 2:]}
    one_f = [float(x) for x in rows[("1f1b", "")]]
    _, peak = run.simulate(build_schedule("1f1b", 2, 4))
    assert one_f[4] == round(peak / 2 ** 30, 2)
    # half the memory (the ring fits in what a B frees before it), and a shorter step
    assert abs(one_f[2] - one_f[0] / 2) <= 0.01 and one_f[3] < one_f[1]
    assert ("seq1f1b", "k=2") in rows


def test_compare_at_one_cp_size_beside_one(capsys):
    assert main([*ARGS, "--seq-length", "3072", "--context-parallel-size", "3", "--cp-comm-type", "allgather",
                 *SHAPE_ARGS]) == 0
    out = capsys.readouterr().out
    assert "allgather at 300 GB/s" in out and [line.split()[0] for line in out.splitlines()[3:5]] == ["1", "3"]


def test_compare_takes_a2a_p2p_with_its_sizes(capsys):
    assert main([*ARGS, "--seq-length", "4096", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                 "--hierarchical-context-parallel-sizes", "2", "2", *SHAPE_ARGS]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "a2a+p2p (A 2 x P 2) at 300 GB/s" in out[0]
    tree = SimpleNamespace(**vars(CLI_SHAPE), hierarchical_context_parallel_sizes=(2, 2))
    run = ContextRun(tree, 4096, 4, "a2a+p2p")
    sizes = {int(line.split()[0]): line.split() for line in out[3:6]}
    assert sizes[4][3] == f"{run.messages().forward_bytes / 2 ** 20:.1f}/{run.messages().backward_bytes / 2 ** 20:.1f}"


@pytest.mark.parametrize("extra,message", [
    (["--seq-length", "4100", "--context-parallel-size", "4", *SHAPE_ARGS],
     "error: --seq-length (4100) must be divisible by 2 x --context-parallel-size (8): the sequence is cut into "
     "2 x CP equal chunks, rank r holding chunks r and 2CP-1-r\n"),
    (["--seq-length", "4096", "--context-parallel-size", "4", "--cp-comm-type", "a2a", *SHAPE_ARGS],
     "error: --cp-comm-type a2a shares the heads out over the context-parallel ranks: the 2 K/V heads must be "
     "divisible by --context-parallel-size (4); use --cp-comm-type p2p or allgather\n"),
    (["--seq-length", "4096", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", *SHAPE_ARGS],
     "error: --cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the all-to-all over A ranks, "
     "the ring over P groups)\n"),
    (["--seq-length", "4096", "--context-parallel-size", "8", "--cp-comm-type", "a2a+p2p",
      "--hierarchical-context-parallel-sizes", "4", "2", *SHAPE_ARGS],
     "error: --cp-comm-type a2a+p2p shares the heads out over the first of --hierarchical-context-parallel-sizes: "
     "the 2 K/V heads must be divisible by 4\n"),
    (["--seq-length", "4096", "--context-parallel-size", "2"],
     "error: the context-parallel table needs the model's shape and sequence: give --num-layers, --hidden-size, "
     "--num-attention-heads\n"),
])
def test_compare_refuses_in_one_line(capsys, extra, message):
    assert main([*ARGS, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err == message and captured.out == ""


def test_compare_marks_a_segment_count_one_cp_size_cannot_cut(capsys):
    assert main([*ARGS, "--seq-length", "64", "--context-parallel-size", "8", "--seq-splits", "8", *SHAPE_ARGS]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("seq1f1b")]
    assert len(rows) == 2 and all(row.split()[2:8] != ["n/a"] for row in rows)  # C = 1, 2, 4 cut 8 segments
    assert all(row.endswith("n/a: CP=8: seq_length=64 is too short for seq_splits=8 segments in multiples of 16")
               for row in rows)
