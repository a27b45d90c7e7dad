#!/usr/bin/env bash
# On a machine of several GPUs without internet: bench/scale.py under torchrun, one process per
# GPU, at the Llama-3-8B shape (carry .whl: pydantic). JSON (written after every setting) and the
# log go to $OUT (or bench/results).
#   SETTINGS="fsdp sp fox-fsdp fox-sp" SP_SEQ=262144 bash bench/gpu_scale.sh [more scale.py args]
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
source bench/gpu_env.sh || exit 1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gpus=$(nvidia-smi -L | wc -l)
torchrun --standalone --nproc-per-node "$gpus" bench/scale.py --settings ${SETTINGS:-fsdp sp fox-fsdp fox-sp} \
  --sp-seq "${SP_SEQ:-262144}" --steps 2 --warmup 1 --out "$out" "$@" 2>&1 | grep -v "Warning\|_warn_once" \
  | tee "$out/scale.log"
exit "${PIPESTATUS[0]}"
