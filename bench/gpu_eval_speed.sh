#!/usr/bin/env bash
# The eval's speed on one GPU in one device call (issue 61; carry .whl for the CUDA tests' imports):
# tests/test_decode.py and tests/test_fused.py on CUDA; then bench/eval_throughput.py at 16 prompts a task at every gpu-64k length
# (the profile's tasks and depths), batches of 1M prompt tokens, each length as the eval runs it and with
# each of WITHOUT off (default: draft, the decode steps' guessed tokens; or shared-prefix,
# alike-order, bf16-weights, fused); transformers'
# generate beside at PEER lengths; EXTRA: more options (e.g. --lengths 16384 65536).
#   bash bench/gpu_eval_speed.sh      # results under $OUT/full
set -uo pipefail
out=${OUT:-bench/results/eval-speed}
source bench/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode.py tests/test_fused.py 2>&1 | tail -3
# shellcheck disable=SC2086
timeout ${LIMIT:-400} python3 bench/eval_throughput.py --tokenizer checkpoints/tiny-base --per-task 16 \
  --models transformer --no-alone --batch-tokens 1048576 --peer-lengths ${PEER:-} --peer-batch 8 \
  --without ${WITHOUT:-draft} ${EXTRA:-} --out "$out/full" 2>&1 | grep -v "^{'model'" | tail -12
