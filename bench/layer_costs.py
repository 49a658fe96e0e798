"""TF, TB and TW of one transformer layer and of the embedding and the LM head + loss, measured, and
every catalogue schedule simulated with them, each also with vocabulary parallelism.

One TransformerLayer of the model the flags describe (pretrain_gpt.py's names: --hidden-size,
--num-attention-heads, --seq-length, --micro-batch-size, the family flags --swiglu,
--normalization rmsnorm, --position-embedding-type rope, --num-key-value-heads ..., --bf16)
runs on the device at hand (CUDA when available: torch.cuda.Event timing; else CPU, wall
clock), with the model's own B/W split (model/linear.py): TF = forward, TB = backward inside
WeightGradStore.deferring (input gradients, the weight GEMMs queued), TW = draining the queue.
The embedding, the final norm and the LM head with its loss (gpt_loss) over a --vocab-size
vocabulary (tied unless --untie-embeddings-and-output-weights) are timed the same way: the untied
head's weight GEMM defers to W like a layer's; the embedding's weight gradient and the tied head's
come in B, as in the engine. Each is the median of --repeats runs after --warmup ones. What one
micro-batch's forward keeps for its backward (autograd's saved tensors, parameters not counted) gives
the logits' memory in units of one 1F1B stage's activations.

The simulator (megatron_ds.schedules.compare over ModelCosts) then takes TF, TB, TW x (--num-layers
/ --pp) per 1F1B stage, the embedding's (F, B, W) on the first stage and the head's on the last
(rank 0 under the V placements, which hold both ends), and the logits held from the head's forward
to its W (head_memory); the final norm (a few h FLOPs per token) is left out. Every schedule of the
catalogue (each variant: virtual stages, sequence splits with FLOP-balanced segments, B/W split)
for --pp ranks and --micro-batches micro-batches, and its "+vocab" twin (the embedding and the
head sliced over the ranks by vocabulary, their passes placed by generators/vocab.py): iteration
time, bubble (max over ranks of idle / makespan), peak activation memory (micro-batches of one 1F1B
stage, logits included), iteration time / 1F1B's and / the balanced ideal (the same schedule with
the embedding's and head's time spread evenly over the ranks, ModelCosts.balanced), fastest first.
A "+vocab" row can beat that ideal: its passes run beside the pipeline's dependencies, so the head's
time stretches no fill or drain. Communication is not modelled (--p2p-latency-ms adds a fixed
latency per message). The header gives the embedding's and the head's cost in layers.

--costs-out FILE writes {"layer_costs": [ms of F+B+W of each pipeline layer: embedding,
--num-layers transformer layers, final norm, head], ...}: the file "pipeline.partition_method" =
"costs:FILE" balances.

A mixture of experts (pretrain_gpt.py's MoE flags: --num-experts, --moe-router-topk, --moe-layer-freq,
--expert-model-parallel-size, ...; bench/moe_costs.py): the first MoE layer and, when --moe-layer-freq
leaves some dense, the first dense layer are timed apart (router and experts at the routed token count),
and with expert parallelism the all-to-all of one micro-batch's routed rows is timed over gloo on
--expert-model-parallel-size processes. The simulation then gives each layer its own cost, cuts them into
stages as DeepSpeed's count-balanced default does, and charges the all-to-all to the MoE layers' F and B
as communication (ModelCosts.all_to_all): the table's "a2a" column is the most time one rank spends in it,
as a share of the iteration. The --costs-out list marks the MoE layers (their cost includes the
all-to-all, which their ops wait for) and adds "all_to_all_ms" per layer and "moe_layers".

    python -m bench.layer_costs --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \\
        --micro-batch-size 1 --pp 4 --micro-batches 16 --swiglu --normalization rmsnorm \\
        --position-embedding-type rope --num-key-value-heads 4 --bf16
"""
from __future__ import annotations

import argparse
import statistics

from bench.harness import Report, Timer, add_output_args, alternated, medians, table
from bench.moe_costs import layer_names, measure_all_to_all, moe_config, moe_layers, single_process
from megatron_ds.files import write_atomic
from megatron_ds.schedules.costs import ModelCosts
from megatron_ds.training.config.model_args import add_model_args, validate_model_args
from megatron_ds.training.config.moe_args import add_moe_args, validate_moe_args


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = parser.add_argument_group("model (pretrain_gpt.py's flags)")
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--num-layers", type=int, default=None, help="default: one layer per pipeline rank")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    add_model_args(parser)
    add_moe_args(parser)
    g = parser.add_argument_group("pipeline and measurement")
    g.add_argument("--pp", type=int, default=4)
    g.add_argument("--micro-batches", type=int, default=None, help="default 2 x --pp")
    g.add_argument("--virtual-stages", type=int, default=2, help="for the schedules that take a chunk count")
    g.add_argument("--seq-splits", type=int, nargs="+", default=[2, 4], help="Seq1F1B's k values")
    g.add_argument("--p2p-latency-ms", type=float, default=0.0)
    g.add_argument("--repeats", type=int, default=10)
    g.add_argument("--warmup", type=int, default=3)
    g.add_argument("--device", default=None, help="default cuda when available, else cpu")
    g.add_argument("--vocab-size", type=int, default=50304, help="the padded vocabulary of the embedding and head timed")
    g.add_argument("--time-segments", action="store_true",
                   help="also time each Seq1F1B segment (at each --seq-splits) through the K/V cache, beside "
                        "its FLOP share")
    g.add_argument("--costs-out", default=None,
                   help='write the per-layer costs as JSON for "pipeline.partition_method": "costs:FILE"')
    return add_output_args(parser)


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_ds.training.config.arguments import ArgumentsError
    try:
        validate_model_args(args)
    except ArgumentsError as exc:
        parser.error(str(exc))
    from megatron_ds.gpt_config import config_problem
    if config_problem(args):  # the model's own rules (head counts, head size, RoPE), by flag name
        parser.error(config_problem(args))
    args.num_layers = args.num_layers or args.pp
    args.micro_batches = args.micro_batches or 2 * args.pp
    args.tensor_model_parallel_size = 1
    try:
        validate_moe_args(args)
    except ArgumentsError as exc:
        parser.error(str(exc))
    for name in ("hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "num_layers", "pp",
                 "micro_batches", "virtual_stages", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.bf16 and args.fp16:
        parser.error("--bf16 and --fp16: choose one")
    return args


def setup(args, vocab_size=64):
    """(GPTConfig, device, dtype) of the model the flags describe."""
    import torch
    from megatron_ds.model import GPTConfig
    from megatron_ds.training.config.model_args import MODEL_FAMILY_ARGS

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    family = {n: getattr(args, n) for n in MODEL_FAMILY_ARGS if getattr(args, n, None) is not None}
    config = GPTConfig(vocab_size=vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_attention_heads=args.num_attention_heads, max_position_embeddings=args.seq_length,
                       ffn_hidden_size=args.ffn_hidden_size or 0, hidden_dropout=args.hidden_dropout,
                       attention_dropout=args.attention_dropout, moe=moe_config(args), **family)
    return config, device, dtype


def layer_and_inputs(args, layer_idx=1):
    """(TransformerLayer `layer_idx` (1..L: a MoE layer where the flags put experts, all of them on this
    process), input, output gradient, Timer, device, dtype) of the model the flags describe."""
    import torch
    from megatron_ds.model import TransformerLayer

    config, device, dtype = setup(args)
    layer = TransformerLayer(single_process(config), layer_idx).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_length, args.hidden_size)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return layer, x, grad, Timer(device), device, dtype


def time_passes(args, timer, forward, backward, reset):
    """(F, B, W) seconds, medians over args.repeats after args.warmup: F = forward(), B = backward(its
    output) inside WeightGradStore.deferring (input gradients; the weight GEMMs a B/W split defers are
    queued), W = draining the queue; reset() after each run."""
    from megatron_ds.model import WeightGradStore
    out, queue = {}, []

    def backward_input(_):
        with WeightGradStore.deferring(queue):
            backward(out["y"])

    def before(kind, step):  # off the clock
        if kind == "F":
            reset()
            out.clear()
            queue.clear()
    times = alternated({"F": lambda _: out.setdefault("y", forward()), "B": backward_input,
                        "W": lambda _: WeightGradStore.drain(queue)}, args.warmup + args.repeats, swap=False,
                       prepare=before, timer=timer)
    reset()
    return tuple(medians(times, args.warmup)[k] for k in "FBW")


def saved_bytes(forward, params) -> int:
    """Bytes the autograd graph of forward() keeps for its backward: each storage once, parameters
    not counted (what a micro-batch's forward holds until its backward)."""
    import torch
    skip = {p.untyped_storage().data_ptr() for p in params}
    held = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            held[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(held.values())


def measure_layer(args, layer_idx=1):
    """(TF, TB, TW, device name, activation bytes of one micro-batch) of layer `layer_idx`, times in seconds."""
    import torch
    from megatron_ds.model.moe import RouterLossLog

    layer, x, grad, timer, device, dtype = layer_and_inputs(args, layer_idx)
    x.requires_grad_()

    def reset():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        RouterLossLog.take()  # a MoE layer's backward logs its router losses and load, as a step's would
    reset()  # what an earlier model left in the process-wide log (another expert count) goes
    times = time_passes(args, timer, lambda: layer(x), lambda y: torch.autograd.backward(y, grad), reset)
    held = saved_bytes(lambda: layer(x), layer.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return (*times, f"{name} {str(dtype).replace('torch.', '')}", held)


def measure_segments(args, k):
    """[(tokens, F, B, W seconds)] of each of k balanced Seq1F1B segments of one layer, run as the
    engine runs them: forwards in order through the K/V cache, then backwards last first (W deferred)."""
    import torch
    from megatron_ds.model import WeightGradStore
    from megatron_ds.model.kv_cache import SegmentKVCache
    from megatron_ds.schedules.seq_split import balanced_segment_lengths

    layer, x, grad, timer, _, _ = layer_and_inputs(args)
    lengths = balanced_segment_lengths(args.seq_length, k, args.hidden_size, args.ffn_hidden_size)
    starts = [sum(lengths[:i]) for i in range(k)]
    cache = SegmentKVCache()
    times = [[[], [], []] for _ in range(k)]
    for i in range(args.warmup + args.repeats):
        ins, outs = [], []
        for j, (start, n) in enumerate(zip(starts, lengths)):
            ins.append(x[:, start:start + n].detach().clone().requires_grad_())
            with cache.segment(("mb", 0), start, start + n, args.seq_length):
                t = timer(lambda: outs.append(layer(ins[-1])))
            times[j][0].append(t)
        for j in reversed(range(k)):
            start, n, queue = starts[j], lengths[j], []

            def backward_input():
                with cache.segment(("mb", 0), start, start + n, args.seq_length), WeightGradStore.deferring(queue):
                    torch.autograd.backward(outs[j], grad[:, start:start + n])
            times[j][1].append(timer(backward_input))
            times[j][2].append(timer(lambda: WeightGradStore.drain(queue)))
        cache.free(("mb", 0))
        layer.zero_grad(set_to_none=True)
    return [(n, *(statistics.median(t[args.warmup:]) for t in kinds)) for n, kinds in zip(lengths, times)]


def print_segments(out, args, tf, tb, tw):
    """Each Seq1F1B segment's measured share of the whole layer's F + B + W beside its FLOP share
    (what the simulator and "auto" charge it), and the segments' sum over the unsplit layer."""
    from megatron_ds.schedules.seq_split import segment_costs
    whole = tf + tb + tw
    for k in args.seq_splits:
        rows = measure_segments(args, k)
        flops = segment_costs([n for n, *_ in rows], args.hidden_size, args.ffn_hidden_size)
        total = sum(f + b + w for _, f, b, w in rows)
        out("", f"Seq1F1B k={k}: the segments together take {total / whole:.3f} of the unsplit layer's F+B+W",
            *table(["tokens", "F ms", "B ms", "W ms", "share", "FLOPs"], "rrrrrr", [
                [n, f"{f * 1e3:.3f}", f"{b * 1e3:.3f}", f"{w * 1e3:.3f}", f"{(f + b + w) / whole:.3f}",
                 f"{share / k:.3f}"] for (n, f, b, w), share in zip(rows, flops)]))


def measure_ends(args):
    """{"embedding", "norm", "head"}: (F, B, W) seconds of the embedding, the final norm and the LM head
    with its loss, split as time_passes splits a layer (the untied head's weight GEMM defers to W; the
    embedding's weight gradient and the tied head's come in B), and "head bytes": what the head + loss
    forward holds for its backward (the logits and their fp32 softmax)."""
    import torch
    from megatron_ds.model import Embedding, FinalNorm, LMHead, gpt_loss, position_ids_like
    from megatron_ds.model.layers import lm_head

    config, device, dtype = setup(args, args.vocab_size)
    timer = Timer(device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=g).to(device)
    labels = torch.randint(0, args.vocab_size, tokens.shape, generator=g).to(device)
    shape = (args.micro_batch_size, args.seq_length, args.hidden_size)
    hidden = torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    embed = Embedding(config, 0).to(device=device, dtype=dtype)
    norm = FinalNorm(config, 1).to(device=device, dtype=dtype)
    head = (LMHead(config, 2).to(device=device, dtype=dtype) if config.untie_embeddings_and_output_weights
            else lambda x: lm_head(embed, x))
    modules = [embed, norm] + ([head] if config.untie_embeddings_and_output_weights else [])

    def reset():
        hidden.grad = None
        for module in modules:
            module.zero_grad(set_to_none=True)
    with_grad = lambda y: y.backward(grad)  # noqa: E731
    out = {"embedding": time_passes(args, timer, lambda: embed((tokens, position_ids_like(tokens))), with_grad, reset),
           "norm": time_passes(args, timer, lambda: norm(hidden), with_grad, reset),
           "head": time_passes(args, timer, lambda: gpt_loss(head(hidden), labels), lambda y: y.backward(), reset)}
    params = [p for module in modules for p in module.parameters()]
    out["head bytes"] = saved_bytes(lambda: gpt_loss(head(hidden), labels), params)
    return out


def measure_layers(args) -> dict:
    """Each transformer layer's costs: "flags" (0/1 per layer, 1: MoE), "times" ((F, B, W) seconds per layer),
    "bytes" (activations of one micro-batch per layer), "all_to_all" ((F, B) seconds per layer: a MoE layer's
    under expert parallelism, bench/moe_costs.py), "timed" ({"dense"/"MoE": (F, B, W, bytes)}: the one layer
    of each kind timed), "device"."""
    flags, timed, names = moe_layers(args), {}, ("dense", "MoE")
    for name, flag in zip(names, (0, 1)):
        if flag in flags:
            *times, device, held = measure_layer(args, flags.index(flag) + 1)
            timed[name] = (*times, held)
    comm = measure_all_to_all(args, setup(args)[0]) if 1 in flags else (0.0, 0.0)
    return {"flags": flags, "times": [timed[names[f]][:3] for f in flags], "bytes": [timed[names[f]][3] for f in flags],
            "all_to_all": [comm if f else (0.0, 0.0) for f in flags], "timed": timed, "device": device}


def write_costs(args, layers, ends):
    """The per-layer costs file of "pipeline.partition_method": "costs:FILE" (atomically; the line saying so):
    a MoE layer's cost includes its all-to-all, which its F and B wait for."""
    import json
    body = [sum(t) + sum(c) for t, c in zip(layers["times"], layers["all_to_all"])]
    costs = [sum(ends["embedding"])] + body + [sum(ends["norm"]), sum(ends["head"])]
    data = {"layer_costs": [round(c * 1e3, 6) for c in costs], "unit": "ms of forward + backward",
            "layers": ["embedding"] + layer_names(layers["flags"]) + ["final norm", "head + loss"],
            "device": layers["device"], "vocab_size": args.vocab_size}
    if any(layers["flags"]):
        data.update(moe_layers=layers["flags"], all_to_all_ms=[round(sum(c) * 1e3, 6) for c in layers["all_to_all"]])
    write_atomic(args.costs_out, json.dumps(data, indent=1))
    return f"\nwrote {args.costs_out}"


def model_costs(args, layers, ends) -> ModelCosts:
    """The simulator's costs: the layers as one 1F1B stage (--num-layers / --pp of them), the embedding
    on the first stage, the head + loss on the last (rank 0 under the V placements), and one
    micro-batch's logits in units of a 1F1B stage's activations (head_memory). With MoE layers each layer
    has its own (F, B, W) and activations, and the MoE layers their all-to-all (ModelCosts' per-layer fields)."""
    if not any(layers["flags"]):
        tf, tb, tw = layers["times"][0]
        per_stage = args.num_layers / args.pp
        return ModelCosts(tf * per_stage, tb * per_stage, tw * per_stage, embed=ends["embedding"], head=ends["head"],
                          head_memory=ends["head bytes"] / (layers["bytes"][0] * per_stage))
    comm = tuple(tuple(c) for c in layers["all_to_all"])
    return ModelCosts.of_layers(layers["times"], args.pp, embed=ends["embedding"], head=ends["head"],
                                head_memory=ends["head bytes"] * args.pp / sum(layers["bytes"]),
                                all_to_all=comm if any(map(any, comm)) else (), layer_memory=tuple(layers["bytes"]))


def schedule_rows(args, costs: ModelCosts) -> list[dict]:
    """schedules.compare's rows for every catalogue variant, each also "+vocab" (the vocabulary passes
    spread over the ranks) where it can carry them; Seq1F1B's segments cost their FLOP shares."""
    from megatron_ds.schedules.compare import compare_rows
    from megatron_ds.schedules.seq_split import balanced_segment_lengths, segment_costs

    def seq_costs(k):
        lengths = balanced_segment_lengths(args.seq_length, k, args.hidden_size, args.ffn_hidden_size)
        return segment_costs(lengths, args.hidden_size, args.ffn_hidden_size)
    return compare_rows(args.pp, args.micro_batches, costs.tf, costs.tb, costs.tw,
                        p2p_latency=args.p2p_latency_ms / 1e3, virtual_stages=args.virtual_stages,
                        seq_splits=tuple(args.seq_splits), embed=costs.embed, head=costs.head,
                        head_memory=costs.head_memory, vocab_parallel=True, seq_costs=seq_costs,
                        layers=costs.layers, all_to_all=costs.all_to_all, layer_memory=costs.layer_memory)


def label(row: dict) -> str:
    return f"{row['schedule']} {row['setting']}".strip()


def print_layers(out, args, layers):
    """The timed layers' lines: the dense layer's, the MoE layer's and its all-to-all."""
    ms = lambda t: t * 1e3  # noqa: E731
    dense, moe = layers["timed"].get("dense"), layers["timed"].get("MoE")
    out(f"one transformer layer, hidden {args.hidden_size}, heads {args.num_attention_heads}"
          f"{f' (K/V {args.num_key_value_heads})' if args.num_key_value_heads != args.num_attention_heads else ''}, "
          f"seq {args.seq_length}, micro-batch {args.micro_batch_size}, on {layers['device']} "
          f"(median of {args.repeats} after {args.warmup} warm-up):")
    if dense:
        tf, tb, tw, _ = dense
        out(f"  TF {ms(tf):.3f} ms   TB {ms(tb):.3f} ms   TW {ms(tw):.3f} ms   (TB+TW)/TF {(tb + tw) / tf:.2f}")
    if moe:
        m = setup(args)[0].moe  # its expert FFN size resolved
        tf, tb, tw, held = moe
        shared = f", shared expert {m.shared_expert_intermediate_size}" if m.shared_expert_intermediate_size else ""
        versus = (f"  = {sum(moe[:3]) / sum(dense[:3]):.2f} dense layers, activations {held / dense[3]:.2f}x"
                  if dense else "")
        out(f"  MoE layer ({sum(layers['flags'])} of {args.num_layers}: {m.num_experts} experts, "
              f"top-{m.router_topk}, expert FFN {m.ffn_hidden_size}{shared}; router and experts at "
              f"{args.micro_batch_size * args.seq_length * m.router_topk} routed rows)")
        out(f"  TF {ms(tf):.3f} ms   TB {ms(tb):.3f} ms   TW {ms(tw):.3f} ms   "
              f"(TB+TW)/TF {(tb + tw) / tf:.2f}{versus}")
        f, b = next(c for c, flag in zip(layers["all_to_all"], layers["flags"]) if flag)
        ep = m.expert_model_parallel_size
        out(f"  all-to-all per MoE layer, EP {ep} over gloo: F {ms(f):.3f} ms (counts, dispatch, combine)   "
              f"B {ms(b):.3f} ms (their reverse)" if ep > 1 else "  no all-to-all (--expert-model-parallel-size 1)")


def main(argv=None):
    args = parse_args(argv)
    out = Report(args.perf_file, "bench.layer_costs", argv)
    layers = measure_layers(args)
    ends = measure_ends(args)
    costs = model_costs(args, layers, ends)
    layer = sum(map(sum, layers["times"])) / args.num_layers  # the mean layer's F + B + W
    per_stage = args.num_layers / args.pp
    print_layers(out, args, layers)
    for name, what in (("embedding", "embedding"), ("head", "head + loss"), ("norm", "final norm")):
        f, b, w = ends[name]
        out(f"  {what:<12} F {f * 1e3:.3f}  B {b * 1e3:.3f}  W {w * 1e3:.3f} ms  = {(f + b + w) / layer:.2f} layers"
            f"{f' (vocabulary {args.vocab_size})' if name != 'norm' else ' (left out of the simulation)'}")
    out(f"  one micro-batch's logits hold {costs.head_memory:.2f} of a 1F1B stage's activations", "",
        f"pp={args.pp}, {args.micro_batches} micro-batches, {args.num_layers} layers "
        f"({per_stage:g} per 1F1B stage), the embedding on the first stage and the head + loss "
        f"({sum(ends['head']) / layer:.2f} layers) on the last, simulated:")
    rows = schedule_rows(args, costs)
    base = next(r["makespan"] for r in rows if label(r) == "1f1b")
    done = sorted((r for r in rows if "error" not in r), key=lambda r: r["makespan"])
    comm = bool(costs.all_to_all)
    out(*table(["schedule", "iteration ms", "bubble", "peak act", "/ 1F1B", "/ ideal"] + ["a2a"] * comm,
               "lrrrrr" + "r" * comm, [
                   [label(r), f"{r['makespan'] * 1e3:.3f}", f"{r['bubble']:.3f}", f"{r['peak_memory']:.2f}",
                    f"{r['makespan'] / base:.3f}", f"{r['makespan'] / r['ideal']:.3f}"]
                   + [f"{r['all_to_all'] / r['makespan']:.1%}"] * comm for r in done]))
    out('\n"+vocab" rows: vocabulary parallelism ("pipeline": {"vocab_parallel": true}), the embedding and '
        'the head sliced over the ranks; "/ ideal": over the same schedule with their time spread evenly')
    if comm:
        out('"a2a": the all-to-all\'s share of the iteration on the rank that spends the most time in it')
    tf, tb, tw = costs.mean_op_times(args.pp)
    out(f'"costed" rows: ds_config "pipeline": {{"schedule": "zbv-half", "op_costs": '
        f'[{tf * 1e3 / per_stage:.3g}, {tb * 1e3 / per_stage:.3g}, {tw * 1e3 / per_stage:.3g}]}} (or zbv-min) '
        'runs that order')
    out(*(f"{label(r)}: n/a: {r['error']}" for r in rows if "error" in r))
    if args.time_segments:
        print_segments(out, args, *layers["times"][0])
    if args.costs_out:
        out(write_costs(args, layers, ends))
    out.save()
    return costs, rows


if __name__ == "__main__":
    main()
