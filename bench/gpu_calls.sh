#!/usr/bin/env bash
# The long-sequence runs of one multi-GPU machine, each in one device call of at most 10 minutes,
# its GPUs shared out so none idles (carry .whl). Sequential where a figure is a comparison; side by
# side on disjoint GPUs where it is not (the CUDA tests and the product's runs use GPUs the timed
# runs do not use). Steps of a million tokens take minutes: those rows run two steps (--warmup 0
# --steps 1: the first, compilation included, then one queued step that holds the optimizer state
# and is timed), and every step is logged as it ends.
# On 2 x H200 (nvidia-h200-x2, 256 GiB of host memory: 8 block inputs stay on each GPU):
#   bash bench/gpu_calls.sh fox-one    GPU 0: the product's FoX (Pro)+ACP run of the gpu-64k profile
#                                      (issue 32); GPU 1: FoX at 524,288 tokens on one GPU, FSDP2's
#                                      CPU offload too (issue 34), then the CUDA tests
#   bash bench/gpu_calls.sh one-512k   GPU 0: the same 524,288-token run alone, `halves` recomputation,
#                                      all but the last 16 block inputs on the host (under full
#                                      recomputation 16 kept ran out of GPU memory: a block's backward
#                                      over 512K tokens needed ~70 GiB, ~40 in halves, block_memory.py;
#                                      6 kept was killed for host memory beside the CUDA tests' 6
#                                      processes: the host holds the offloaded optimizer state, 119 GiB,
#                                      and 4 GiB an input); then, if 200 s are left, GPU 1: the CUDA tests
#   bash bench/gpu_calls.sh fox-1m     GPUs 0-1: FoX (Pro)+ACP at 1,048,576 tokens, Ulysses SP 2,
#                                      `halves`, the optimizer state on the GPUs (60 GiB each), 6 block
#                                      inputs kept on each (208 GiB of inputs on the host); failing, with
#                                      330 s left: the state on the host (119 GiB), 20 inputs kept
#                                      (issue 34); then GPU 0: the CUDA tests
#   bash bench/gpu_calls.sh products   the product's gpu-64k runs side by side: GPU 0 FoX (Pro)+ACP,
#                                      GPU 1 Llama (issue 32)
#   bash bench/gpu_calls.sh llamas     the product's gpu-64k Llama run twice side by side: GPU 0 as the
#                                      profile says (ProLong's theta x16 per stage), GPU 1 with
#                                      `train.pretrain.factors: search` (LongRoPE2's factors in both stages)
#   bash bench/gpu_calls.sh llama-1m   GPUs 0-1: the Transformer at 1,048,576 tokens, SP 2 (issue 34): 16
#                                      minutes (steps of 680 s and 248 s), longer than a device command, so
#                                      started detached, where later calls (each within the machine's 30 s
#                                      of idle) wait for it; the last copies the results out:
#     setsid nohup bash -c 'LIMIT=1560 OUT=/tmp/l1m bash bench/gpu_calls.sh llama-1m; echo $? > /tmp/l1m.done' &
#     for i in $(seq 112); do [ -f /tmp/l1m.done ] && break; sleep 5; done    # (each call, until done)
#     cp /tmp/l1m/scale.tar.gz /tmp/l1m/device.log $OUT/
#                                      (the next call must follow a reply at once: after 30 s idle the machine
#                                      goes, and the detached run with it; llama-one's first run was lost so)
#   bash bench/gpu_calls.sh llama-one  (detached, as llama-1m: ~13 minutes) GPU 0: the Transformer at 524,288
#                                      tokens on one GPU (one-512k's settings, 14 inputs kept: its block's
#                                      backward holds ~2 inputs more than FoX's; its first step took 445.9 s
#                                      at 120.7 GiB, 204 GiB of the host in use). GPU 1 meanwhile, in the
#                                      first call, its files straight to $OUT (kept if the machine goes):
#                                      CUDA_VISIBLE_DEVICES=1 bash bench/gpu_run.sh cudnn_grads attention_tests
#                                      (source bench/gpu_env.sh before starting either: two first installs
#                                      of the wheels into one folder at once would clash)
#   bash bench/gpu_calls.sh fox-beyond GPUs 0-1: FoX (Pro)+ACP at 1,114,112 with host offload (beyond 1M;
#                                      1M's steps took 240 s and 91 s: one call). Needs what 2,359,296 on 4
#                                      GPUs needed: 64-bit kernel offsets (16 heads x 1,114,112 x 128 > 2**31)
#                                      and host copies in pieces (4.25 GiB inputs: 26 of them, 110 GiB a process)
# On 4 x H200 (nvidia-h200-x4, 512 GiB of host memory, issue 36), one call each, each within a device
# command's 10 minutes and writing straight to $OUT (a detached run is lost with the machine when a
# reply is late: 30 s idle; on 2026-11-28 one was lost after a transient API error, 540 s of waiting):
#   bash bench/gpu_calls.sh x4         FoX (Pro)+ACP at 2,097,152 tokens, SP 4 (512K tokens a GPU, as
#                                      fox-1m's: halves, the optimizer state on the GPUs, inputs on the
#                                      host but the last 10): trained, steps of 274 s and 96 s, 430 s in
#                                      all, 115 GiB a GPU, 90 GiB of host a rank
#   bash bench/gpu_calls.sh x4-2       the FSDP2 64K scaling rows on all 4 GPUs, then on 2 of them: both
#                                      ends of the ratio from one machine (the 4-GPU row's isolated steps
#                                      took 44.5, 34.6 and 26.8 s)
#   bash bench/gpu_calls.sh x4-3       the bisection's next step: FoX (Pro)+ACP at 2,359,296, 10 inputs
#                                      kept (4.5 GiB each: 404 GiB of host in all); the first try stopped at
#                                      the kernels' 32-bit offsets (now 64-bit past 2**31 elements), and would
#                                      have met the pinned allocator's rounding (4.5 GiB taking 8; now pieces).
#                                      Before it, the CUDA tests of both (~1-2 minutes)
# The Transformer's rows take ATTENTION (default auto: cuDNN on Hopper since 2026-11-28, a layer's attention at a
# rank's 1M tokens up to ~13 GiB higher at its peak; ATTENTION=varlen: FlashAttention-2, as every row before).
# What comes back (8 files at most): scale.tar.gz (scale.py's JSON and logs), tests*.log,
# pipeline-*.tar.gz (bench/gpu_pipeline.sh's files), device.log. LIMIT: seconds for the whole script.
set -uo pipefail
call=${1:?give fox-one, one-512k, fox-1m, products, llamas, llama-1m, llama-one, fox-beyond, x4, x4-2 or x4-3}
limit=${LIMIT:-585}
begin=$(date +%s)
out=$(realpath -m "${OUT:-bench/results/x4}")
mkdir -p "$out/scale"
source bench/gpu_env.sh || exit 1
left() { echo $(( limit - ($(date +%s) - begin) - ${1:-0} )); }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g; nproc; } > "$out/device.log" 2>&1
scale() { OUT=$out/scale bash bench/gpu_scale.sh "$@" >> "$out/device.log" 2>&1; }
gpu_tests() {  # gpu_tests GPU LOG SECONDS: the CUDA tests of the training loop and the FoX kernel, over 6
  # pytest-xdist workers on the one GPU (in one process the kernel file alone ran past 400 s)
  CUDA_VISIBLE_DEVICES=$1 timeout -k 5 "$3" python3 -m pytest -q -rf -p no:cacheprovider -n 6 \
    tests/test_gpu_train.py tests/test_fox_kernel.py > "$out/$2" 2>&1
  echo "exit $?" >> "$out/$2"
}
product() {  # product VARIANT GPU SECONDS [NAME]: bench/gpu_pipeline.sh on one GPU, its files in one archive
  local name=${4:-$1}
  (export NAME=$name LONGCTX_GPUS=$2 LONGCTX_FOX_AUTOTUNE=0 PREFECT_HOME=/tmp/prefect-$name  # (the flow's GPU slot: its stages
   # get CUDA_VISIBLE_DEVICES=$2 and a lock of that GPU; the first call set CUDA_VISIBLE_DEVICES here instead, and
   # both runs' stages took GPU 0's slot in turn)
   LIMIT=$3 OUT=$out/pipeline-$name bash bench/gpu_pipeline.sh "$1" > "$out/pipeline-$name.out" 2>&1
   mv "$out/pipeline-$name.out" "$out/pipeline-$name/"
   tar -C "$out" -czf "$out/pipeline-$name.tar.gz" "pipeline-$name" && rm -rf "${out:?}/pipeline-$name")
}
status=0
case $call in
  fox-one) product fox 0 "$(left 20)" &
           CUDA_VISIBLE_DEVICES=1 GPUS=1 STATES=host LIMIT=330 LONG_SEQ=524288 KEEP=16 MODELS=fox-sp scale millions \
             || status=1
           gpu_tests 1 tests.log "$(left 25)"
           wait ;;
  one-512k) CUDA_VISIBLE_DEVICES=0 GPUS=1 STATES=host LIMIT=$(left 15) LONG_SEQ=524288 KEEP=16 MODELS=fox-sp scale millions \
              || status=1
            [ "$(left)" -gt 200 ] && gpu_tests 1 tests.log "$(left 10)" ;;
  fox-1m) # 6 inputs kept with the optimizer state on the GPUs; out of memory, 20 kept with the state on the host
          GPUS=2 LIMIT=$(left 60) LONG_SEQ=1048576 KEEP=6 MODELS=fox-sp scale millions; first=$?
          if { [ $first -ne 0 ] || grep -q "out of memory" "$out"/scale/scale-fox-sp-1024k-*-keep6.log; } \
             && [ "$(left)" -gt 330 ]; then
            GPUS=2 LIMIT=$(left 60) LONG_SEQ=1048576 KEEP=20 STATES=host MODELS=fox-sp scale millions || status=1
          elif [ $first -ne 0 ]; then status=1; fi
          [ "$(left)" -gt 60 ] && gpu_tests 0 tests.log "$(left 10)" ;;
  products) product fox 0 "$(left 20)" &
            product llama 1 "$(left 20)" &
            wait ;;
  llamas) product llama 0 "$(left 20)" &
          SET=train.pretrain.factors=search product llama 1 "$(left 20)" llama-factors &
          wait ;;
  llama-1m) GPUS=2 LIMIT=$(left 15) LONG_SEQ=1048576 KEEP=6 MODELS=sp scale millions || status=1 ;;
  llama-one) CUDA_VISIBLE_DEVICES=0 GPUS=1 STATES=host LIMIT=$(left 15) LONG_SEQ=524288 KEEP=14 MODELS=sp \
               scale millions || status=1 ;;
  fox-beyond) GPUS=2 LIMIT=$(left 15) LONG_SEQ=1114112 KEEP=6 MODELS=fox-sp scale millions || status=1 ;;
  x4) LIMIT=$(left 15) LONG_SEQ=2097152 KEEP=10 MODELS=fox-sp scale millions || status=1 ;;
  x4-2) LIMIT=$(( $(left) / 2 )) scale scaling || status=1
        GPUS=2 LIMIT=$(left 10) scale scaling || status=1 ;;
  x4-3) # first the CUDA tests of what 2,359,296 tokens takes: the kernels' 64-bit offsets (GPU 0) and the
        # offload's host copies in pieces (GPU 1), side by side
        (CUDA_VISIBLE_DEVICES=0 LONGCTX_FOX_AUTOTUNE=0 timeout -k 5 150 python3 -m pytest -q -rf -p no:cacheprovider \
           tests/test_fox_kernel.py -k "millions or 64_bit or offsets" > "$out/tests-wide.log" 2>&1
         echo "exit $?" >> "$out/tests-wide.log") &
        CUDA_VISIBLE_DEVICES=1 timeout -k 5 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_train.py \
          -k offload > "$out/tests-offload.log" 2>&1; echo "exit $?" >> "$out/tests-offload.log"
        wait
        LIMIT=$(left 15) LONG_SEQ=2359296 KEEP=10 MODELS=fox-sp scale millions || status=1 ;;
  *) echo "gpu_calls: give fox-one, one-512k, fox-1m, products, llamas, llama-1m, llama-one, fox-beyond, x4, x4-2 or x4-3" >&2; exit 2 ;;
esac
tar -C "$out" -czf "$out/scale.tar.gz" scale && rm -rf "$out/scale"
tail -40 "$out/device.log"
exit $status
