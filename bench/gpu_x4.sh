#!/usr/bin/env bash
# One 4-GPU machine (nvidia-h200-x4) in device calls of at most 10 minutes, its GPUs shared out so
# none idles (carry .whl). Sequential where a figure is a comparison; side by side on disjoint GPUs
# where it is not (the CUDA tests and the product's runs use GPUs the timed runs do not).
#   bash bench/gpu_x4.sh 1   4 GPUs: FoX (Pro)+ACP at 2,097,152 tokens with Ulysses SP 4, tiled MLP,
#                            block inputs on the host but the last 8 (issue 36); then the FSDP2 64K
#                            scaling rows (3 steps)
#   bash bench/gpu_x4.sh 2   GPUs 0-1: the same scaling rows on 2 GPUs, then FoX (Pro)+ACP at
#                            1,048,576 tokens with SP 2, every block input on the host (issue 34);
#                            GPU 2: the CUDA tests, then again with the FoX tuning cache on; GPU 3:
#                            the product's FoX (Pro)+ACP run of the gpu-64k profile (issue 32)
#   bash bench/gpu_x4.sh 3   GPU 0: FoX (Pro)+ACP at 524,288 tokens on one GPU, FSDP2's CPU offload
#                            too (issue 34); GPU 3: the product's Llama run of the gpu-64k profile;
#                            GPU 2: call 2's FoX run goes on (AGAIN=resume) where the warm machine has it
# Steps of a million tokens take minutes: those rows run two steps (--warmup 0 --steps 1: the first,
# compilation included, then one queued step that holds the optimizer state and is timed).
# What comes back (8 files at most): scale.tar.gz (scale.py's JSON and logs), tests*.log,
# pipeline-*.tar.gz (bench/gpu_pipeline.sh's files), device.log. LIMIT: seconds for the whole script.
set -uo pipefail
call=${1:?give 1, 2 or 3}
limit=${LIMIT:-585}
begin=$(date +%s)
out=$(realpath -m "${OUT:-bench/results/x4}")
mkdir -p "$out/scale"
source bench/gpu_env.sh || exit 1
left() { echo $(( limit - ($(date +%s) - begin) - ${1:-0} )); }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g; nproc; } > "$out/device.log" 2>&1
scale() { OUT=$out/scale bash bench/gpu_scale.sh "$@" >> "$out/device.log" 2>&1; }
gpu_tests() {  # gpu_tests GPU LOG SECONDS: the CUDA tests of the training loop and the FoX kernel
  CUDA_VISIBLE_DEVICES=$1 timeout -k 5 "$3" python3 -m pytest -q -rf -p no:cacheprovider \
    tests/test_gpu_train.py tests/test_fox_kernel.py > "$out/$2" 2>&1
  echo "exit $?" >> "$out/$2"
}
product() {  # product VARIANT GPU SECONDS: bench/gpu_pipeline.sh on one GPU, its files in one archive
  (export CUDA_VISIBLE_DEVICES=$2 LONGCTX_FOX_AUTOTUNE=0 PREFECT_HOME=/tmp/prefect-$1  # (two side by side)
   LIMIT=$3 OUT=$out/pipeline-$1 bash bench/gpu_pipeline.sh "$1" > "$out/pipeline-$1.out" 2>&1
   mv "$out/pipeline-$1.out" "$out/pipeline-$1/"; tar -C "$out" -czf "$out/pipeline-$1.tar.gz" "pipeline-$1" \
     && rm -rf "${out:?}/pipeline-$1")
}
status=0
case $call in
  1) LIMIT=330 LONG_SEQ=2097152 KEEP=8 MODELS=fox-sp scale millions || status=1
     LIMIT=$(left 10) scale scaling || status=1 ;;
  2) { gpu_tests 2 tests.log 270; LONGCTX_FOX_TUNING_CACHE=1 gpu_tests 2 tests-tuning-cache.log "$(left 20)"; } &
     product fox 3 "$(left 30)" &
     GPUS=2 LIMIT=175 scale scaling || status=1
     GPUS=2 LIMIT=$(left 40) LONG_SEQ=1048576 MODELS=fox-sp scale millions || status=1
     wait ;;
  3) product llama 3 "$(left 30)" &
     [ -d /tmp/longctx-ws-fox ] && { AGAIN=resume product fox 2 "$(left 30)" & }
     GPUS=1 ONE=1 LIMIT=$(left 40) LONG_SEQ=524288 MODELS=fox-sp scale millions || status=1
     wait ;;
  *) echo "gpu_x4: give 1, 2 or 3" >&2; exit 2 ;;
esac
tar -C "$out" -czf "$out/scale.tar.gz" scale && rm -rf "$out/scale"
tail -40 "$out/device.log"
exit $status
