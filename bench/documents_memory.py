"""Peak memory of packed documents' attention (--reset-attention-mask) against plain causal attention, on CPU.

The bar: document masking at seq 8192 costs at most 5 % more peak memory than causal attention on the same
run. Each configuration runs in a fresh process (spawn; large tensors mapped on their own, so the resident set
follows the live tensors): the single-process GPT (megatron_ds.model.GPTModel), one sequence of --seq-length
tokens, fp32, no dropout (torch's fused CPU kernel, as causal attention's), a warm-up step, then one forward +
backward measured:
- saved: the peak of what autograd keeps for backward (megatron_ds.testing.saved_memory.SavedMemory: saved
  tensors and checkpoint inputs, each storage once, parameters not at all);
- step peak: the resident set's rise over the step (PeakRSS: the high-water mark above where it stood), which also
  sees every transient tensor: masks, attention outputs of a group, gradients, the logits;
- time: the step's wall time.
"causal" is the model without the flags; the document rows take the three flags (--reset-position-ids,
--reset-attention-mask, --eod-mask-loss) with documents whose lengths are drawn (seeded) from an exponential
distribution of the given mean, ending with the EOD token: short ones (mean 64) run entirely under the grouped
masks of at most 512 x 512, long ones (mean 4096) mostly as causal attention per document without a mask. The
last row (--dense-mean) shows what the bench would see of an (s x s) mask: the same documents under one dense
boolean mask of the whole sequence (documents.DENSE_SIDE raised to the sequence length), what the long path avoids.

    python -m bench.documents_memory                      # seq 8192, the table of docs/perf/documents_cpu.md
    python -m bench.documents_memory --seq-length 2048 --means 64
"""
from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp

from bench import harness

MB = 2 ** 20
EOD = 0


def packed_tokens(seq: int, vocab: int, mean: float | None, seed: int = 0) -> torch.Tensor:
    """(1, seq + 1) random tokens; with `mean`, an EOD after each document of an exponential length of that mean
    (at least 1 token)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (1, seq + 1), generator=g)
    if mean is not None:
        at = -1
        while True:
            at += max(1, int(torch.empty(1).exponential_(1 / mean, generator=g).item()))
            if at >= seq + 1:
                break
            tokens[0, at] = EOD
    return tokens


def measure(args, mean, dense, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron_ds.model import GPTConfig, GPTModel, documents, gpt_loss
    from megatron_ds.model.documents import Packing
    if dense:
        documents.DENSE_SIDE = args.seq_length
    from megatron_ds.testing.saved_memory import PeakRSS, SavedMemory
    flags = {} if mean is None else dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
                                         eod_token=EOD)
    config = GPTConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
                       num_attention_heads=args.num_attention_heads, max_position_embeddings=args.seq_length,
                       seed=1, **flags)
    torch.manual_seed(0)
    model = GPTModel(config)
    text = packed_tokens(args.seq_length, args.vocab_size, mean)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    (x, pos), y = Packing(config).batch(tokens, labels) if flags else ((tokens, None), labels)

    def step():
        loss = gpt_loss(model(x, pos) if pos is not None else model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=False)  # the gradients' memory stays allocated: not the step's
        return loss.item()

    step()  # warm-up: gradient buffers, the allocator, lazy imports
    meter = SavedMemory(exclude=list(model.parameters()))
    t0 = time.perf_counter()
    with PeakRSS() as rss, meter.recording():
        loss = step()
    seconds = time.perf_counter() - t0
    documents = 1 if mean is None else int((tokens == EOD).sum()) + 1
    queue.put(dict(saved=meter.peak, step=rss.growth, seconds=seconds, loss=loss, documents=documents))


def run(args, mean, dense=False):
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # large tensors returned to the system when freed
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=measure, args=(args, mean, dense, queue))
    proc.start()
    proc.join()
    if proc.exitcode:
        raise SystemExit(f"mean {mean}: the measuring process failed (exit code {proc.exitcode})")
    return queue.get()


def main(argv=None):
    parser = harness.parser(__doc__, seq_length=8192, hidden_size=256, num_layers=2, num_attention_heads=4,
                            vocab_size=512)
    parser.add_argument("--means", type=float, nargs="+", default=[64, 512, 4096],
                        help="mean document lengths (tokens), one row each")
    parser.add_argument("--dense-mean", type=float, default=512,
                        help="the mean document length of the row under one (s x s) mask (0: no such row)")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per row (the lowest step peak kept)")
    args = parser.parse_args(argv)
    rows = [("causal", None, False)] + [(f"documents, mean {m:g}", m, False) for m in args.means]
    if args.dense_mean:
        rows.append((f"documents, mean {args.dense_mean:g}, one (s x s) mask", args.dense_mean, True))
    results = {}
    for name, mean, dense in rows:
        runs = [run(args, mean, dense) for _ in range(args.rounds)]
        results[name] = min(runs, key=lambda r: r["step"])
    base, out = results["causal"], harness.Report(args.perf_file, "bench.documents_memory", argv)
    out("", f"seq={args.seq_length} hidden={args.hidden_size} heads={args.num_attention_heads} "
        f"layers={args.num_layers} vocab={args.vocab_size}, mbs 1, fp32 on CPU, no dropout; one forward + backward "
        f"after a warm-up, lowest step peak of {args.rounds} fresh processes", "")
    out(*harness.table(["attention", "documents", "saved MB", "x causal", "step peak MB", "x causal", "step s"],
                       "lrrrrrr", [[name, r["documents"], f"{r['saved'] / MB:.1f}", f"{r['saved'] / base['saved']:.3f}",
                                    f"{r['step'] / MB:.1f}", f"{r['step'] / base['step']:.3f}", f"{r['seconds']:.2f}"]
                                   for name, r in results.items()]))
    out.save()


if __name__ == "__main__":
    main()
