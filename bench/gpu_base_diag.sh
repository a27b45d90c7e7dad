#!/usr/bin/env bash
# What gpu-64k's base needs to retrieve at 4K (issue 32): the profile's corpora and tokenize once, then for
# each base_short mix its own pack stage, and bench/tiny_retrieval.py's training (the stage's GPU path)
# on those splits, variants side by side on one GPU, scored at 512 and 4,096 tokens at steps 250 and 500.
#   OUT=... bash bench/gpu_base_diag.sh [name:mix:fields ...]     (carry .whl)
# mix: domain=share,... for base_short (the rest of the profile as it is); fields: the bench's Variant
# fields joined by + (short_first: the share of the 500 steps on base_short; seed). Default: the stdlib's
# short text instead of code, and code again with another seed (how far one run's scores are noise).
# A variant with `splits=` among its fields trains on the bench's generated sequences (text: modules) instead.
# SPLIT_DIGITS=1: every variant with the tokenizer trained to one token a digit.
# EVALS: scorings over each variant's run (default 2: half-way and at the end).
# Earlier runs (bench/results/base-diag-nvidia-h100-2026-11-27/, bench/tiny_retrieval_notes.md):
#   run 1: the base stage itself = the bench's loop on the same splits (no fault in the stage's path);
#   run 2: base_short's code 20% -> 5%: passkey / NIAH-single @4K 0.00 -> 0.62 / 0.00 (300 short steps: 0.38).
set -uo pipefail
out=$(realpath -m "${OUT:-bench/results/base-diag}")
mkdir -p "$out"
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(modules5:modules=0.05,retrieval_short=0.95:short_first=0.5
                                        modules5_seed1:modules=0.05,retrieval_short=0.95:short_first=0.5+seed=1
                                        code5_seed1:code_repos=0.05,retrieval_short=0.95:short_first=0.5+seed=1)
source bench/gpu_env.sh || exit 1
source bench/gpu_diag_lib.sh
t0=$(date +%s)
workspace() {  # folder, base_short mix ("" = the profile's)
  copy_project "$1"
  (cd "$1" && MIX=$2 python3 -c "
import os
import yaml
p = yaml.safe_load(open('params.yaml'))
p['profile'] = 'gpu-64k'
p['tracking'] = {'enabled': False}
if os.environ.get('SPLIT_DIGITS'):
    p['tokenize'] = {'tokenizer': {'train': {'split_digits': True}}}
if os.environ['MIX']:
    mix = {d: float(s) for d, s in (kv.split('=') for kv in os.environ['MIX'].split(','))}
    profile = yaml.safe_load(open('src/longctx/profiles/gpu-64k.yaml'))['pack']['splits']['base_short']['mix']
    p['pack'] = {'splits': {'base_short': {'mix': dict.fromkeys(profile) | mix}}}  # null drops the profile's
yaml.safe_dump(p, open('params.yaml', 'w'), sort_keys=False)")
}
data=/tmp/longctx-diag-data
workspace $data "" && stage $data corpora corpora && stage $data tokenize tokenize || exit 1
declare -A packed
for v in "${variants[@]}"; do
  IFS=: read -r name mix fields <<< "$v"
  ws=/tmp/longctx-diag-${mix//[=,]/_}
  if [ -z "${packed[$ws]:-}" ]; then
    workspace "$ws" "$mix" && mkdir -p "$ws/data" && cp -al $data/data/corpora $data/data/tokens "$ws/data/" || exit 1
    packed[$ws]=1
    stage "$ws" pack "pack-${mix//[=,]/_}" || exit 1
  fi
done
echo "data stages: $(( $(date +%s) - t0 )) s" | tee "$out/times.txt"
for v in "${variants[@]}"; do
  IFS=: read -r name mix fields <<< "$v"
  ws=/tmp/longctx-diag-${mix//[=,]/_}
  (cd "$ws" && PYTHONPATH=$ws/src:$PYTHONPATH python3 bench/tiny_retrieval.py --tokens data/tokens --packed data/packed \
     --text modules --evals "${EVALS:-2}" --lengths 512 4096 --prompts 8 --variants base100m_packed --set ${fields//+/ } \
     > "$out/$name.log" 2>&1) &
done
wait
echo "all: $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
for v in "${variants[@]}"; do echo "== ${v%%:*}"; grep -h "nll_" "$out/${v%%:*}.log"; done
