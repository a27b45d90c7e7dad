#!/usr/bin/env bash
# The eval's speed on one GPU in one device call (issue 61; carry .whl for the CUDA tests' imports):
# bench/eval_throughput.py at 16 prompts a task at every gpu-64k length, batches of 1M prompt tokens,
# transformers' generate beside at 16K (batches of 8); then tests/test_decode.py on CUDA.
#   bash bench/gpu_eval_speed.sh      # results under $OUT/full
set -uo pipefail
out=${OUT:-bench/results/eval-speed}
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 bench/eval_throughput.py --tokenizer checkpoints/tiny-base --per-task 16 --models transformer \
  --no-alone --batch-tokens 1048576 --peer-lengths 16384 --peer-batch 8 --out "$out/full" 2>&1 | tail -7
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3
