"""One device, one pipeline stage: a training iteration of DeepSpeed's engine, ours under each
schedule (compiled layers on and off), and transformers' LlamaForCausalLM (eager and compiled) as the
anchor, on the same LLaMA-style model and tokens. Prints, per sequence shape, ms per iteration (median
after warm-up) and its ratio to DeepSpeed's engine, the process's CPU time of its fastest iteration (on
a CPU the steadier measure of a noisy machine; on CUDA it counts waiting for the device too), model
TFLOP/s (schedules/flops.py) and MFU where the card's bf16 peak is known, peak memory, the first and
last loss, and with --count-ops the aten operators, the host synchronisations (on CUDA torch's sync
debug mode, on CPU the tensor-to-Python reads), and on CUDA the kernel launches, of one iteration
(torch.profiler). Rows with CUDA graphs count the compiled graphs inductor ran without one (it logs why:
"skipping cudagraphs due to ...").

The LLaMA-style reference model by default: 16 layers, hidden 2048, 16 heads / 4 K/V heads, SwiGLU 5440, RMSNorm,
RoPE, untied head, vocabulary 50304; bf16 weights on CUDA, ZeRO-1 for the engines, fused AdamW for
transformers. --toy: a small fp32 model that runs on CPU in seconds (what CI runs).

    python -m bench.gpu_step                      # on one GPU: seq 2048 x mb 4, 8192 x 1, 16384 x 1
    python -m bench.gpu_step --toy --count-ops    # on CPU
    python -m bench.gpu_step --cases 1f1b,seq1f1b-k4-bw --compile off,on,graphs --shapes 2048x4

--compile takes a comma-separated list of off (eager), on (compiled layers; torch.compile for
transformers) and graphs (compiled layers replayed as CUDA graphs, "pipeline.cuda_graphs"; transformers
with mode "reduce-overhead"); "both" is off,on. A case that fails prints its error as its row and the
bench goes on; --json PATH writes every row as it is measured. A case may name its own variants:
--cases deepspeed@off,1f1b@off+on+graphs.

Liger-Kernel (CUDA, when installed): "transformers-liger" patches LlamaForCausalLM with its kernels
(RMSNorm, SwiGLU, RoPE, fused linear cross-entropy; the patch stays for the process, so it runs last),
"1f1b-liger" is ours with --use-liger-kernel (its fused linear cross-entropy as the head + loss).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time

from bench import harness
from megatron_ds.files import write_atomic

ENGINE_CASES = {  # name -> ds_config "pipeline" section (None: DeepSpeed's own engine)
    "deepspeed": None,
    "1f1b": {"schedule": "1f1b"},
    "zb-h1": {"schedule": "zb-h1"},
    "seq1f1b-k2": {"schedule": "seq1f1b", "seq_splits": 2},
    "seq1f1b-k2-bw": {"schedule": "seq1f1b", "seq_splits": 2, "split_backward": True},
    "seq1f1b-k4": {"schedule": "seq1f1b", "seq_splits": 4},
    "seq1f1b-k4-bw": {"schedule": "seq1f1b", "seq_splits": 4, "split_backward": True},
    "1f1b-loss-chunks": {"schedule": "1f1b"},
    "1f1b-liger": {"schedule": "1f1b"},
}
# name -> GPTConfig fields of the case: the head and loss over LOSS_CHUNK tokens at a time (--loss-chunk-size)
LOSS_CHUNK = {False: 4096, True: 32}  # toy -> tokens per chunk
CONFIG_CASES = {"1f1b-loss-chunks": lambda toy: {"loss_chunk_size": LOSS_CHUNK[toy]},
                "1f1b-liger": lambda toy: {"liger_kernel": True}}  # Liger's fused linear cross-entropy (CUDA)
HF_CASES = ("transformers", "transformers-liger")  # -liger: patched with Liger-Kernel's kernels (CUDA)
ISSUE_MODEL = dict(num_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                   ffn_hidden_size=5440, vocab_size=50304)
TOY_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128,
                 vocab_size=256)


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--toy", action="store_true", help="a small fp32 model, shape 64x2, 3 timed iterations (CPU)")
    p.add_argument("--cases", default=",".join([*ENGINE_CASES, *HF_CASES]),
                   help=f"comma-separated, of {', '.join([*ENGINE_CASES, *HF_CASES])}")
    p.add_argument("--compile", default="both",
                   help="comma-separated of off, on, graphs (or both = off,on): eager, compiled layers (ours, "
                        "DeepSpeed's) / torch.compile (transformers), and those replayed as CUDA graphs")
    p.add_argument("--json", default=None, help="write the rows here (rewritten after each case)")
    p.add_argument("--shapes", default=None, help="SEQxMB,... (default 2048x4,8192x1,16384x1; --toy 64x2)")
    p.add_argument("--global-batch-sequences", type=int, default=None,
                   help="sequences per iteration (default: 16 at seq 2048, else 4 micro-batches)")
    p.add_argument("--iterations", type=int, default=None, help="timed iterations (default 20; --toy 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 5; --toy 1)")
    p.add_argument("--count-ops", action="store_true", help="profile one more iteration: aten ops, kernel launches")
    return p


def model_config(toy, seq):
    from megatron_ds.model import GPTConfig
    sizes = TOY_MODEL if toy else ISSUE_MODEL
    return GPTConfig(**sizes, max_position_embeddings=seq, normalization="rmsnorm", swiglu=True,
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False,
                     layernorm_epsilon=1e-5, seed=1234)


def tokens(config, seq, mb, step, index):
    import torch
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randint(0, config.vocab_size, (mb, seq + 1), generator=g)


def init_process_group():
    import deepspeed
    import torch
    import torch.distributed as dist
    from megatron_ds.training.initialize import free_port
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


class Shape:
    def __init__(self, seq, mb, sequences):
        self.seq, self.mb, self.gas = seq, mb, max(1, sequences // mb)

    def __str__(self):
        return f"seq {self.seq}, micro-batch {self.mb}, {self.gas} micro-batches"


VARIANTS = {"off": "", "on": " compiled", "graphs": " graphs"}  # --compile value -> row label suffix


def engine_step(pipeline, variant, config, shape, bf16):
    """A train_batch closure of our (or DeepSpeed's) engine at PP=1."""
    from megatron_ds.model import position_ids_like
    from megatron_ds.pipe.build import build_pipeline_module, initialize_engine
    ds_config = {"train_micro_batch_size_per_gpu": shape.mb, "gradient_accumulation_steps": shape.gas,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
                 "pipeline": {**(pipeline or {}), "compile_layers": variant != "off",
                              "cuda_graphs": variant == "graphs"}}
    if bf16:
        ds_config["bf16"] = {"enabled": True}
    module = build_pipeline_module(config, ds_config, 1, seq_length=shape.seq)
    engine = initialize_engine(module, ds_config, optimizer=adamw(module.parameters()))

    def step(i):
        def batches():
            for j in range(shape.gas):
                t = tokens(config, shape.seq, shape.mb, i, j)
                x = t[:, :-1].contiguous()
                yield (x, position_ids_like(x)), t[:, 1:].contiguous()
        return float(engine.train_batch(batches()))
    return step, engine


def hf_step(variant, config, shape, bf16, liger=False):
    """The same model as transformers' LlamaForCausalLM (bf16 weights on CUDA), AdamW, one closure per step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    hf = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                     intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
                     num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                     max_position_embeddings=shape.seq, rms_norm_eps=config.layernorm_epsilon,
                     rope_theta=config.rope_theta, tie_word_embeddings=False, attention_bias=False,
                     mlp_bias=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(hf).to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    opt = adamw(model.parameters())
    forward = model if variant == "off" else torch.compile(model, mode="reduce-overhead" if variant == "graphs" else None)

    def step(i):
        total = 0.0
        for j in range(shape.gas):
            t = tokens(config, shape.seq, shape.mb, i, j).to(device)
            loss = forward(input_ids=t[:, :-1], labels=t[:, :-1]).loss / shape.gas
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)
    if variant == "graphs":  # cudagraph trees: each step a new generation of the graphs' outputs
        plain = step

        def step(i):
            torch.compiler.cudagraph_mark_step_begin()
            return plain(i)
    return step, model


def adamw(params):
    """The optimizer of every case: torch's AdamW, its one-kernel (fused) form on CUDA."""
    import torch
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=torch.cuda.is_available())


def count_ops(step, i):
    """(aten operators, kernel launches, host synchronisations) of one call of step(i): torch.profiler's
    events; on CUDA the launches, and the synchronising calls torch's sync debug mode reports; on CPU
    (no launches: None) the tensor-to-Python reads (.item(), float(t), bool(t): aten::_local_scalar_dense),
    each of which waits for the device on CUDA."""
    import warnings
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as prof:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step(i)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    names = [e.name for e in prof.events()]
    aten = sum(1 for n in names if n.startswith("aten::"))
    if not cuda:
        return aten, None, sum(1 for n in names if n == "aten::_local_scalar_dense")
    launches = sum(1 for n in names if n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
    return aten, launches, syncs


def measure(make, shape, config, warmup, iterations, ops):
    """ms per iteration (median), CPU ms (the fastest iteration's), losses, peak memory (GB above what was allocated before the case, with its
parameters and optimizer state: CUDA), ops and compile seconds of one case."""
    import torch
    from megatron_ds.model.compile import compile_seconds
    from torch._dynamo.utils import counters
    cuda = torch.cuda.is_available()
    compile_before, skips_before = compile_seconds(), counters["inductor"]["cudagraph_skips"]
    if cuda:  # the case's own memory: what earlier cases' engines still hold (DeepSpeed keeps some) is left out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held_before = torch.cuda.memory_allocated()
    step, owner = make()
    losses, times, cpu_times = [], [], []
    for i in range(warmup + iterations):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step(i))  # float(loss): the step has finished on the device
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    counted = count_ops(step, warmup + iterations) if ops else (None, None, None)
    row = dict(ms=1000.0 * statistics.median(times[warmup:]), cpu_ms=1000.0 * min(cpu_times[warmup:]), losses=losses, ops=counted[0], launches=counted[1],
               syncs=counted[2],
               peak_gb=(torch.cuda.max_memory_allocated() - held_before) / 2 ** 30 if cuda else None,
               compile_s=compile_seconds() - compile_before,
               graph_skips=counters["inductor"]["cudagraph_skips"] - skips_before if cuda else None)
    del step, owner
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def table(shape, rows, flops_per_iteration, peak):
    ok = [(name, r) for name, r in rows if "error" not in r]
    base = next((r["ms"] for name, r in ok if name == "deepspeed"), None)
    anchor = next((r["ms"] for name, r in ok if name == "transformers compiled"), None)
    cells = []
    for name, r in rows:
        if "error" in r:
            cells.append([name, f"failed: {r['error']}"] + [""] * 12)
            continue
        tflops = flops_per_iteration / (r["ms"] / 1000.0) / 1e12
        cells.append([name, f"{r['ms']:.1f}", f"{r['cpu_ms']:.1f}", f"{r['ms'] / base:.3f}" if base else "-",
                      f"{r['ms'] / anchor:.3f}" if anchor else "-", f"{tflops:.2f}",
                      f"{100 * tflops / peak:.1f} %" if peak else "-",
                      f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-",
                      f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                      *(str(r[k]) if r[k] is not None else "-" for k in ("ops", "launches", "syncs")),
                      f"{r['compile_s']:.1f}",
                      str(r["graph_skips"]) if name.endswith(VARIANTS["graphs"]) and r["graph_skips"] is not None else "-"])
    return [f"## {shape}", ""] + harness.table(
        ["run", "ms / iteration", "CPU ms", "vs DeepSpeed", "vs transformers compiled", "TFLOP/s", "MFU", "peak GB",
         "loss first -> last", "aten ops", "launches", "syncs", "compile s", "graphs not captured"], "l" * 14, cells)


def shapes_of(args):
    text = args.shapes or ("64x2" if args.toy else "2048x4,8192x1,16384x1")
    out = []
    for item in text.split(","):
        seq, mb = (int(v) for v in item.lower().split("x"))
        sequences = args.global_batch_sequences or (16 if seq == 2048 and not args.toy else 4 * mb)
        out.append(Shape(seq, mb, sequences))
    return out


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch
    from megatron_ds.schedules.flops import model_flops_per_sequence
    from megatron_ds.training.device_peak import this_device_peak
    modes = variants_of(args.compile.split(","), "--compile")
    cases = []  # (case, its variants): "NAME@off+graphs" picks a case's own, else --compile's
    for item in (c for c in args.cases.split(",") if c):
        name, _, own = item.partition("@")
        if name not in ENGINE_CASES and name not in HF_CASES:
            raise SystemExit(f"--cases: unknown {name!r}; choose from {[*ENGINE_CASES, *HF_CASES]}")
        cases.append((name, variants_of(own.split("+"), f"--cases {item}") if own else modes))
    warmup = args.warmup if args.warmup is not None else (1 if args.toy else 5)
    iterations = args.iterations if args.iterations is not None else (3 if args.toy else 20)
    cuda = torch.cuda.is_available()
    bf16 = cuda and not args.toy
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_process_group()
    peak = this_device_peak()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    out = harness.Report(args.perf_file, "bench.gpu_step", argv)
    out(f"device: {device}; bf16 peak {peak or '-'} TFLOP/s; torch {torch.__version__}")
    results = {}
    for shape in shapes_of(args):
        config = model_config(args.toy, shape.seq)
        rows = []
        runs = []
        for case, variants in cases:
            for variant in variants:
                if case in HF_CASES:
                    make = lambda v=variant, c=case: hf_step(v, config, shape, bf16, c == "transformers-liger")  # noqa: E731
                else:
                    c = dataclasses.replace(config, **CONFIG_CASES[case](args.toy)) if case in CONFIG_CASES else config
                    make = lambda p=ENGINE_CASES[case], v=variant, c=c: engine_step(p, v, c, shape, bf16)  # noqa: E731
                runs.append((case + VARIANTS[variant], make))
        for label, make in runs:
            rows.append((label, measured_or_error(make, shape, config, warmup, iterations, args.count_ops)))
            out(f"  {label}: " + (f"failed: {rows[-1][1]['error']}" if "error" in rows[-1][1] else
                                  f"{rows[-1][1]['ms']:.1f} ms, compile {rows[-1][1]['compile_s']:.1f} s"))
            results[f"{shape.seq}x{shape.mb}"] = dict(rows)
            if args.json:
                write_json(args.json, device, results)
        flops = model_flops_per_sequence(config, shape.seq) * shape.mb * shape.gas
        out(*table(shape, rows, flops, peak), "")
    out.save()
    return results


def variants_of(values, where):
    out = [m for v in values for m in (["off", "on"] if v == "both" else [v])]
    if not out or any(m not in VARIANTS for m in out):
        raise SystemExit(f"{where}: a list of {', '.join(VARIANTS)} (or both)")
    return out


def measured_or_error(make, shape, config, warmup, iterations, ops):
    """measure(), or {"error": the exception's first line} so one failing case leaves the others their rows."""
    import torch
    try:
        return measure(make, shape, config, warmup, iterations, ops)
    except Exception as exc:  # noqa: BLE001 - a bench row, not control flow: the table says what failed
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}


def write_json(path, device, results):
    write_atomic(path, json.dumps({"device": device, "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
