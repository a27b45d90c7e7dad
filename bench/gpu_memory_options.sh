#!/usr/bin/env bash
# What the memory options cost and save on one GPU (issue 34, item 1), with bench/scale.py's own harness:
# the tiled MLP (--mlp-tile), full recomputation's block inputs in host memory (--offload-activations) and
# `halves` recomputation (a block's backward in two parts), each alone, tiles and offload together, and all
# three, against none; at SEQ tokens (64K: their cost, 3 steps each) and at LONG tokens (two steps: the peak
# GPU and host memory they leave). One process per variant (the options are per process); JSON per variant
# under $OUT, every table in $OUT/memory_options.log.
#   OUT=$OUT bash bench/gpu_memory_options.sh        # SHAPE (fox-760m), SEQ (65536), LONG (262144; empty:
#                                                    # none), TILE (8192), ONLY (the 64K variants to run)
set -uo pipefail
out=$(realpath -m "${OUT:-bench/results}")
shape=${SHAPE:-fox-760m} seq=${SEQ:-65536} long=${LONG-262144} tile=${TILE:-8192}
mkdir -p "$out"
source bench/gpu_env.sh || exit 1
log=$out/memory_options.log
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || nproc; } | tee "$log"
variant() {  # name, then scale.py's arguments
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$log"
  timeout -k 5 "${EACH:-200}" python3 bench/scale.py --shape "$shape" --settings fsdp --recompute full \
    --tag="-$shape-$name" --out "$out" "$@" >"$out/$name.out" 2>&1
  local status=$?
  grep -v '^{' "$out/$name.out" | tail -n 5 | tee -a "$log"
  rm -f "$out/$name.out"
  if [ "$status" != 0 ]; then echo "== $name: exit $status" | tee -a "$log"; failed=1; fi
}
failed=0
options=(plain "" tiled "--mlp-tile $tile" offloaded "--offload-activations" both "--mlp-tile $tile --offload-activations"
         halves "--recompute halves" all "--recompute halves --mlp-tile $tile --offload-activations")
only=" ${ONLY:-plain tiled offloaded both halves all} "
for ((i = 0; i < ${#options[@]}; i += 2)); do
  [[ $only == *" ${options[i]} "* ]] || continue
  # shellcheck disable=SC2086  # (the options split into arguments)
  variant "${options[i]}-$seq" --fsdp-seq "$seq" --steps 3 ${options[i + 1]}
done
if [ -n "$long" ]; then
  variant "plain-$long" --fsdp-seq "$long" --fit
  # shellcheck disable=SC2086
  variant "both-$long" --fsdp-seq "$long" --fit --mlp-tile "$tile" --offload-activations
fi
ls "$out"
exit "$failed"
