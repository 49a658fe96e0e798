"""One MoE layer's forward and backward with the experts' GEMMs as a loop (the default) and grouped
(--moe-grouped-gemm, model/grouped_linear.py), measured side by side in one run: per case the median ms of the
whole layer (router, permutation, experts, combine) and of the experts alone on the same routed rows, each
grouped/loop ratio, and the ms of the weight stacks the grouped path makes per forward and backward (the local
experts' fc1 and fc2 weights, stacked once in the forward and once again in the backward), which stored 3-D
weights would save. Loop and grouped alternate within each repeat, so a noisy machine slows both alike. Whether
the grouped kernel ran is printed per case (grouped_linear.grouped_mm_fits: on CUDA bf16 on compute capability
9.0+, on CPU torch's own loop in C++, so there the ratio measures the path's overhead, not a kernel).

    python -m bench.moe_grouped                                 # CPU, fp32: the small cases
    python -m bench.moe_grouped --cases mixtral,qwen3-moe       # one GPU, bf16: the models' layer shapes
"""
from __future__ import annotations

from bench import harness

# name: (hidden, expert FFN, experts, top-k, tokens of a micro-batch)
CASES = {"cpu-8": (256, 512, 8, 2, 1024), "cpu-64": (256, 128, 64, 8, 512),
         "mixtral": (4096, 14336, 8, 2, 4096),  # Mixtral 8x7B's layer, a micro-batch of 4096 tokens
         "mixtral-16k": (4096, 14336, 8, 2, 16384),
         "qwen3-moe": (2048, 768, 128, 8, 4096),  # Qwen3-30B-A3B's layer
         "qwen3-moe-16k": (2048, 768, 128, 8, 16384)}


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--cases", default="cpu-8,cpu-64", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--device", default=None, help="default cuda when there is one, else cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    return p


def moe_layer(case, device, dtype, grouped):
    import torch
    from megatron_ds.model import GPTConfig
    from megatron_ds.model.moe import MoE
    from megatron_ds.moe_config import MoEConfig
    hidden, ffn, experts, topk, _ = CASES[case]
    config = GPTConfig(vocab_size=64, hidden_size=hidden, num_layers=1, num_attention_heads=hidden // 128 or 1,
                       max_position_embeddings=64, swiglu=True, normalization="rmsnorm", add_bias_linear=False,
                       position_embedding_type="rope",
                       moe=MoEConfig(num_experts=experts, router_topk=topk, ffn_hidden_size=ffn, grouped_gemm=grouped))
    torch.manual_seed(0)
    init = lambda w: w.normal_(0.0, 0.02)
    return MoE(config, init, init, layer_idx=1).to(device, dtype)


def measure(case, device, dtype, repeats, warmup):
    import torch
    from megatron_ds.model import grouped_linear
    from megatron_ds.model.moe import RouterLossLog, expert_loop, grouped_experts
    layers = {g: moe_layer(case, device, dtype, g) for g in (False, True)}
    tokens = CASES[case][4]
    torch.manual_seed(1)
    x = torch.randn(tokens, CASES[case][0], device=device, dtype=dtype)
    with torch.no_grad():  # the routed rows and counts of the experts-alone rows, as the layer makes them
        _, _, chosen, _ = layers[False].router(x)
        order = torch.argsort(chosen.flatten(), stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(layers[False].experts)).tolist()
        rows = x[order // chosen.shape[1]]
    experts = {g: list(layers[g].experts.values()) for g in (False, True)}

    def layer_step(g):
        xi = x.detach().requires_grad_()
        layers[g](xi).float().sum().backward()
        RouterLossLog.take()  # the log the runtime empties after each step

    def experts_step(g):
        r = rows.detach().requires_grad_()
        (grouped_experts if g else expert_loop)(experts[g], r, counts).float().sum().backward()

    weights = [[e.fc1.weight for e in experts[True]], [e.fc2.weight for e in experts[True]]]

    def stacks():
        for _ in range(2):  # forward and backward
            for w in weights:
                torch.stack(w)

    def reset(key, step):  # off the clock
        for layer in layers.values():
            layer.zero_grad(set_to_none=True)
    runs = {(name, g): (lambda fn, g: lambda _: fn(g))(fn, g)
            for name, fn in (("layer", layer_step), ("experts", experts_step)) for g in (False, True)}
    times = harness.alternated({**runs, "stacks": lambda _: stacks()}, warmup + repeats, swap=False,
                               prepare=reset, timer=harness.Timer(device))
    ran = all(grouped_linear.grouped_mm_fits(x.device, dtype, w) for w in weights)
    median = {k: v * 1e3 for k, v in harness.medians(times, warmup).items()}
    return median, ran


def main(argv=None):
    import torch
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = harness.Report(args.perf_file, "bench.moe_grouped", argv)
    out(f"# {name}, {str(dtype).split('.')[-1]}, torch {torch.__version__}, median of {args.repeats} (ms, forward + "
        "backward)", *harness.table(["case (hidden, FFN, experts, top-k, tokens)", "grouped kernel", "layer: loop",
                                     "grouped", "grouped / loop", "experts: loop", "grouped", "grouped / loop",
                                     "weight stacks"], "llrrrrrrr", []))
    for case in args.cases.split(","):
        t, ran = measure(case, device, dtype, args.repeats, args.warmup)
        out(harness.row([f"{case} {CASES[case]}", "yes" if ran else "no: the loop", f"{t['layer', False]:.2f}",
                         f"{t['layer', True]:.2f}", f"{t['layer', True] / t['layer', False]:.3f}",
                         f"{t['experts', False]:.2f}", f"{t['experts', True]:.2f}",
                         f"{t['experts', True] / t['experts', False]:.3f}", f"{t['stacks']:.2f}"]))
    out.save()


if __name__ == "__main__":
    main()
