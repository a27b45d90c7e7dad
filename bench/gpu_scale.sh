#!/usr/bin/env bash
# On a machine of several GPUs without internet: bench/scale.py under torchrun, one process per
# GPU, at the Llama-3-8B shape (carry .whl: pydantic). JSON (written after every setting) and one
# log per run go to $OUT (or bench/results). Each run is cut at $LIMIT seconds (default 300) so
# one that hangs cannot take the others' time.
#   bash bench/gpu_scale.sh [fsdp] [unsorted] [sp] [longest] [steady] [fit] [scaling] [millions] [nooffload]
#   (default: fsdp unsorted sp; GPUS=N: the first N GPUs only, so one machine gives both ends of a
#   scaling ratio)
# fsdp:    64K tokens per sequence, FSDP2 over all GPUs, 2 sequences per rank per step dealt by
#          attention cost: full recomputation; attention recomputation (profiled); FoX (Pro) + ACP
# unsorted: attention recomputation with the sequences dealt as generated
# sp:      Ulysses over all GPUs at $SP_SEQ tokens (default 262144), full recomputation:
#          Transformer and FoX (Pro) + ACP
# steady:  fsdp's attention row over 3 steps queued and 3 isolated (a step's cost follows its
#          documents: one step is a sample of one draw)
# longest: sp's two rows at $LONG_SEQ tokens (default 393216, the longest that trains without
#          offload), one step after the first (--warmup 0: at this length a step takes minutes)
# fit:     two steps each (--fit; the second holds the optimizer state): the Transformer with
#          sequence parallelism at $FIT_SEQ tokens (default 393216) and, with FSDP2 CPU offload, at
#          $OFFLOAD_SEQ (default 589824)
# scaling: FSDP2 at 64K, full recomputation, 2 sequences per rank, 3 isolated steps (the first
#          compiles) then 3 queued and timed: run at two GPU counts, `scale.py --compare` prints
#          tokens/s/GPU of one over the other
# millions: $MODELS (default: fox-sp sp) at $LONG_SEQ tokens (default 1048576), Ulysses over all GPUs,
#          two steps (the first compiles; the second, timed, holds the optimizer state), the MLP in
#          65,536-token tiles, $RECOMPUTE recomputation (default halves: a block's backward in two
#          parts), the block inputs in host memory but for the last $KEEP blocks (default 0);
#          STATES=host: FSDP2's CPU offload of the weights and optimizer state too (one GPU's must)
# ATTENTION: the Transformer's backend (default auto: cuDNN on Hopper since 2026-11-28; the rows
#          before ran FlashAttention-2's varlen, ATTENTION=varlen; one layer's attention at a rank's 1M
#          tokens peaks up to ~13 GiB higher on cuDNN, bench/attention_draws.py's peak_gib)
# nooffload: $MODELS at $LONG_SEQ as millions, nothing in host memory (a step of the bisection for the
#          longest that trains without offload: FoX (Pro)+ACP on 2 x H200 trained 507,904, not 524,288)
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
source bench/gpu_env.sh || exit 1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
[ -n "${GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}
status=0

scale() {  # scale TAG SETTING [scale.py args]
  local tag=$1 setting=$2
  shift 2
  echo "== scale$tag: $setting $*"
  timeout "${LIMIT:-300}" torchrun --standalone --nproc-per-node "$gpus" bench/scale.py --settings "$setting" \
    --steps 1 --warmup 1 --tag="$tag" --attention "${ATTENTION:-auto}" --out "$out" "$@" 2>&1 | grep --line-buffered -v "Warning\|_warn_once" | tee "$out/scale$tag.log"
  status=$(( status || PIPESTATUS[0] ))
}

long_rows() {  # long_rows LENGTH TAG [scale.py args]: millions' and nooffload's rows, one per model of $MODELS
  local long=$1 tag=$2 m
  shift 2
  for m in ${MODELS:-fox-sp sp}; do
    scale -${m%sp}sp-$((long / 1024))k-$tag "$m" --sp-seq "$long" --recompute "${RECOMPUTE:-halves}" --mlp-tile 65536 \
      --warmup 0 "$@"
  done
}

for part in ${*:-fsdp unsorted sp}; do
  case $part in
    fsdp) scale -64k-full fsdp --accum 2 --recompute full
          scale -64k-attention fsdp --accum 2 --recompute attention --profile
          scale -64k-fox fox-fsdp --accum 2 --recompute attention ;;
    unsorted) scale -64k-attention-unsorted fsdp --accum 2 --recompute attention --no-reorder ;;
    sp) scale -sp sp --sp-seq "${SP_SEQ:-262144}" --recompute full
        scale -sp-fox fox-sp --sp-seq "${SP_SEQ:-262144}" --recompute full ;;
    longest) long=${LONG_SEQ:-393216}
             scale -sp-$((long / 1024))k sp --sp-seq "$long" --recompute full --warmup 0
             scale -sp-fox-$((long / 1024))k fox-sp --sp-seq "$long" --recompute full --warmup 0 ;;
    steady) scale -64k-attention-steady fsdp --accum 2 --recompute attention --steps 3 ;;
    fit) fit=${FIT_SEQ:-393216} off=${OFFLOAD_SEQ:-589824}
         scale -sp-fit-$((fit / 1024))k sp --sp-seq "$fit" --recompute full --fit
         scale -sp-fit-offload-$((off / 1024))k sp --sp-seq "$off" --recompute full --offload --fit ;;
    scaling) scale -64k-full-steady-${gpus}gpu fsdp --accum 2 --recompute full --steps 3 --warmup 0 ;;
    millions) long_rows "${LONG_SEQ:-1048576}" offload-"${RECOMPUTE:-halves}"-keep${KEEP:-0}${STATES:+-states} \
                --offload-activations --offload-keep-last "${KEEP:-0}" ${STATES:+--offload} ;;
    nooffload) long_rows "${LONG_SEQ:-507904}" "${RECOMPUTE:-halves}"-nooffload ;;
    *) echo "unknown part $part (fsdp, unsorted, sp, longest, steady, fit, scaling, millions, nooffload)"; status=1 ;;
  esac
done
exit $status
