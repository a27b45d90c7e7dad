#!/usr/bin/env bash
# On a CUDA machine without internet: the CUDA tests, then the model-step, FoX attention and
# training throughput benchmarks (carry .whl: pydantic, fla-core).
# Logs and JSON go to $OUT (or bench/results).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_attention.py tests/test_fox_kernel.py tests/test_model.py tests/test_decode.py \
  2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
python3 bench/model_step.py --out "$out" 2>&1 | tee "$out/model_step.log"
step=${PIPESTATUS[0]}
python3 bench/attention.py --out "$out" 2>&1 | tee "$out/attention.log"
step=$(( step || PIPESTATUS[0] ))
python3 bench/train_throughput.py --out "$out" 2>&1 | tee "$out/train_throughput.log"
exit $(( tests || step || PIPESTATUS[0] ))
