#!/usr/bin/env bash
# What gpu-64k's base needs to retrieve at 4K (issue 32). Run 1 (2026-11-27) found the base stage and
# bench/tiny_retrieval.py's loop on the pack stage's splits alike (passkey 0.50-0.75 at 512, 0.00 at
# 4K after 500 steps) and the bench's generated data with the profile's text (code, 20%) as slow: the
# data, not the stage. This run: the profile's corpora once, then per variant its own tokenize and pack
# (params overrides) and the bench's training on those splits, side by side on one GPU:
#   mix95:       base_short {code_repos 0.05, retrieval_short 0.95}
#   mix95_split: the same with one token a digit (tokenizer.train.split_digits)
#   mix95_300:   mix95's data, 300 of the 500 steps on base_short (250 elsewhere)
# Logs and JSON under $OUT.   OUT=... bash bench/gpu_base_diag.sh   (carry .whl)
set -uo pipefail
out=$(realpath -m "${OUT:-bench/results/base-diag}")
mkdir -p "$out"
source bench/gpu_env.sh || exit 1
root=$PWD
t0=$(date +%s)
workspace() {  # name, then Python statements editing the params dict p
  local ws=/tmp/longctx-diag-$1
  rm -rf "$ws" && mkdir -p "$ws"
  (cd "$root" && tar --exclude=./.git --exclude=./.whl --exclude=./data --exclude=./bench/work \
     --exclude=./bench/results -cf - .) | tar -xf - -C "$ws"
  (cd "$ws" && python3 -c "
import yaml
p = yaml.safe_load(open('params.yaml'))
p['profile'] = 'gpu-64k'
p['tracking'] = {'enabled': False}
$2
yaml.safe_dump(p, open('params.yaml', 'w'), sort_keys=False)")
}
stage() {  # workspace name, stage
  (cd /tmp/longctx-diag-$1 && PYTHONPATH=/tmp/longctx-diag-$1/src:$PYTHONPATH python3 -m stages.$2 > "$out/$1-$2.log" 2>&1) \
    || { tail -20 "$out/$1-$2.log"; return 1; }
}
mix="p['pack']['splits'] = {'base_short': {'mix': {'code_repos': 0.05, 'retrieval_short': 0.95}}}"
workspace mix95 "$mix"
workspace mix95_split "$mix
p['tokenize']['tokenizer'] = {'train': {'split_digits': True}}"
stage mix95 corpora || exit 1
cp -al /tmp/longctx-diag-mix95/data /tmp/longctx-diag-mix95_split/
for w in mix95 mix95_split; do (stage $w tokenize && stage $w pack) & done
wait
echo "data stages: $(( $(date +%s) - t0 )) s" | tee "$out/times.txt"
train() {  # name, workspace, bench --set fields...
  local name=$1 ws=/tmp/longctx-diag-$2; shift 2
  (cd "$ws" && PYTHONPATH=$ws/src:$PYTHONPATH python3 bench/tiny_retrieval.py --tokens data/tokens --packed data/packed \
     --evals 2 --lengths 512 4096 --prompts 8 --variants base100m_packed --set "$@" --out "$out/$name" \
     > "$out/$name.log" 2>&1)
}
train mix95 mix95 seed=0 &
train mix95_split mix95_split seed=0 &
train mix95_300 mix95 short_first=0.6 &
wait
echo "all: $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
grep -h "nll_" "$out"/*.log
