"""The LM head and its loss for one micro-batch, forward and backward, in each of the forms a run can
pick: eager (the head's GEMM, then layers.gpt_loss), the loss compiled (model/compile.compile_loss,
what "pipeline.compile_layers" runs), chunked (--loss-chunk-size: the logits never whole; eager, and
with the arithmetic between its GEMMs compiled, as "pipeline.compile_layers" runs it) and, on CUDA
with liger-kernel installed, Liger's fused linear cross-entropy (--use-liger-kernel). Prints per form
the median ms (CUDA events, else the wall clock) and its ratio to eager, measured side by side in one
run; the bytes autograd keeps from forward to backward (each storage once; the weight and the hidden
states, which the run holds anyway, left out); the peak memory above what was allocated before (CUDA);
the loss and how far its gradients are from eager's. --loss-only times the loss alone on given logits.

    python -m bench.head_loss                                   # the reference model's head: 8192 tokens, bf16 on CUDA
    python -m bench.head_loss --tokens 2048 --hidden-size 128    # on CPU (its bf16 GEMMs are slow)
    python -m bench.head_loss --tokens 2048 --loss-only --dtype bfloat16
"""
from __future__ import annotations

import statistics

from bench import harness

FORMS = ("eager", "compiled", "chunked", "chunked-compiled", "liger")


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, default=8192,
                   help="tokens of one micro-batch (the reference model's: seq 2048 x 4)")
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--loss-chunk-size", type=int, default=4096, help="tokens per chunk of the chunked form")
    p.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of {', '.join(FORMS)}")
    p.add_argument("--loss-only", action="store_true",
                   help="time the loss alone on given logits (eager and compiled: what compiling changes)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    return p


def head_and_loss(form, chunk, loss_only=False):
    """A function (hidden, weight, labels) -> loss for `form`; `loss_only`: (logits, weight unused, labels).
    The compiled forms are what "pipeline.compile_layers" makes of the loss (layers.compiled_loss)."""
    import functools
    import torch.nn.functional as F
    from megatron_ds.model.layers import chunked_head_loss, compiled_loss, gpt_loss, liger_head_loss
    if form == "liger":
        return lambda h, w, y: liger_head_loss((h, w), y)
    compile_ = compiled_loss if form.endswith("compiled") else (lambda fn: fn)
    if form.startswith("chunked"):
        loss = compile_(functools.partial(chunked_head_loss, chunk=chunk, group=None))
        return lambda h, w, y: loss((h, w), y)
    loss = compile_(gpt_loss)
    return (lambda h, w, y: loss(h, y) + 0 * w.sum()) if loss_only else (lambda h, w, y: loss(F.linear(h, w), y))


def run_once(fn, hidden, weight, labels, count_input=False):
    """(loss, hidden's gradient, weight's gradient, bytes kept for backward; the hidden states counted
    only when `count_input`: logits, which a run would not hold otherwise)."""
    import torch
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    held = {w.untyped_storage().data_ptr()} | (set() if count_input else {h.untyped_storage().data_ptr()})
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad, sum(saved.values())


def measure(fn, hidden, weight, labels, warmup, repeats, count_input=False):
    import torch
    cuda = hidden.is_cuda
    for _ in range(warmup):
        run_once(fn, hidden, weight, labels)
    timer = harness.Timer(hidden.device)
    times = [1000 * timer(lambda: run_once(fn, hidden, weight, labels)) for _ in range(repeats)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    result = run_once(fn, hidden, weight, labels, count_input)
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 30 if cuda else None
    return statistics.median(times), result, peak


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch
    forms = [f for f in args.forms.split(",") if f]
    unknown = [f for f in forms if f not in FORMS]
    if unknown or not forms:
        raise SystemExit(f"--forms: unknown {unknown}; choose from {', '.join(FORMS)}")
    cuda = torch.cuda.is_available()
    if "liger" in forms and not cuda:
        forms.remove("liger")  # Triton kernels: CUDA only
    if args.loss_only:
        forms = [f for f in forms if f in ("eager", "compiled")]
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    g = torch.Generator().manual_seed(0)
    if args.loss_only:  # the "hidden states" are logits; a scalar stands for the head's weight
        hidden = (3 * torch.randn(args.tokens, args.vocab_size, generator=g)).to(device, dtype)
        weight = torch.zeros((), device=device, dtype=dtype)
    else:
        hidden = torch.randn(args.tokens, args.hidden_size, generator=g).to(device, dtype)
        weight = (0.02 * torch.randn(args.vocab_size, args.hidden_size, generator=g)).to(device, dtype)
    labels = torch.randint(0, args.vocab_size, (args.tokens,), generator=g).to(device)
    shape = f"loss of {args.tokens} tokens x" if args.loss_only else \
        f"head + loss: {args.tokens} tokens x hidden {args.hidden_size} ->"
    out = harness.Report(args.perf_file, "bench.head_loss", argv)
    out(f"{shape} vocabulary {args.vocab_size}, {dtype}, {torch.cuda.get_device_name() if cuda else 'CPU'}; "
        f"logits {args.tokens * args.vocab_size * dtype.itemsize / 2 ** 30:.2f} GiB")
    rows = {}
    for form in forms:
        try:
            rows[form] = measure(head_and_loss(form, args.loss_chunk_size, args.loss_only), hidden, weight, labels,
                                 args.warmup, args.repeats, count_input=args.loss_only)
        except Exception as exc:  # noqa: BLE001 - a bench row: the table says what failed
            rows[form] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    out(*table(rows))
    out.save()
    return rows


def table(rows):
    base = rows.get("eager")
    base = None if isinstance(base, str) else base
    cells = []
    for form, row in rows.items():
        if isinstance(row, str):
            cells.append([form, f"failed: {row}"] + [""] * 6)
            continue
        ms, (loss, dh, dw, kept), peak = row
        gaps = [f"{(g.float() - e.float()).abs().max().item():.2e}" if base else "-"
                for g, e in ((dh, base and base[1][1]), (dw, base and base[1][2]))]
        cells.append([form, f"{ms:.2f}", f"{ms / base[0]:.3f}" if base else "-", f"{kept / 2 ** 20:.1f}",
                      "-" if peak is None else f"{peak:.2f}", f"{loss.item():.6f}", *gaps])
    return harness.table(["form", "ms", "/ eager", "kept MiB", "peak GiB", "loss", r"\|dh - eager\|",
                          r"\|dw - eager\|"], "lrrrrrrr", cells)  # a cell's own bars escaped


if __name__ == "__main__":
    main()
