#!/usr/bin/env bash
# One call on a borrowed GPU (minutes are scarce): install the carried wheels (.whl/: DeepSpeed built from
# its sdist and the pure-Python packages the image lacks), run the CUDA tests for at most TESTS_SECONDS
# (GPU_TESTS names more test files: tests/training/test_cuda_training.py), bench/head_loss.py (HEAD_LOSS:
# its flags, or off), bench/moe_overlap.py on the host's CPUs (MOE_OVERLAP: its flags; unset, not run: it needs
# a core per rank, which the 2-core development machine lacks), then bench/gpu_step.py once per quoted
# argument list. Everything goes under $OUT as
# it happens, so a call cut off at its limit still brings back what ran; the tables are printed at the end.
#
#   bash bench/gpu_session.sh 150 "--shapes 2048x4 --cases deepspeed,1f1b --compile off,on --count-ops"
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl > "$OUT/setup.log" 2>&1 \
    || { cat "$OUT/setup.log"; exit 1; }
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"
} >> "$OUT/setup.log" 2>&1
cat "$OUT/setup.log"
tests_seconds=$1
shift
if [ "$tests_seconds" -gt 0 ]; then
  timeout "$tests_seconds" python3 -m pytest -q -p no:cacheprovider tests/model/test_cuda.py \
    tests/model/test_compile.py tests/pipe/test_cuda_compile.py ${GPU_TESTS:-} > "$OUT/tests.log" 2>&1
  echo "tests: exit $?" >> "$OUT/tests.log"
  tail -n 25 "$OUT/tests.log"
fi
if [ "${HEAD_LOSS:-}" != "off" ]; then  # the head + loss forms, seconds: HEAD_LOSS=off leaves it out
  # shellcheck disable=SC2086 - a list of bench flags
  timeout 180 python3 -m bench.head_loss ${HEAD_LOSS:-} > "$OUT/head_loss.log" 2>&1
  echo "head_loss: exit $?" >> "$OUT/head_loss.log"
  grep -vi warn "$OUT/head_loss.log" | tail -n 8
fi
if [ -n "${MOE_OVERLAP:-}" ]; then  # e.g. MOE_OVERLAP="--iterations 10": 4 gloo ranks, about 3 minutes
  # shellcheck disable=SC2086 - a list of bench flags
  CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu timeout 420 python3 -m bench.moe_overlap $MOE_OVERLAP > "$OUT/moe_overlap.log" 2>&1
  echo "moe_overlap: exit $?" >> "$OUT/moe_overlap.log"
  grep -vi warn "$OUT/moe_overlap.log" | tail -n 14
fi
run=0
for bench_args in "$@"; do
  run=$((run + 1))
  # shellcheck disable=SC2086 - each argument is a list of bench flags
  python3 -m bench.gpu_step $bench_args --json "$OUT/bench$run.json" > "$OUT/bench$run.log" 2>&1
  echo "bench $run: exit $?" >> "$OUT/bench$run.log"
  grep -E '^(device|##|\||  [a-z0-9]|bench [0-9]+: exit)|Error' "$OUT/bench$run.log" | cut -c1-400
  # why inductor ran a compiled graph without its CUDA graph, once per reason
  grep -o 'skipping cudagraphs due to [^.]*' "$OUT/bench$run.log" | sort | uniq -c | head -n 8
done
