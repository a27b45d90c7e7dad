#!/usr/bin/env bash
# What keeps stage 1's retrieval through stage 2 (issue 32: pipeline run 11's stage 1 found NIAH-single needles
# at 16K and 32K, its stage 2 answered filler at every length). One gpu-64k workspace runs corpora -> base;
# then each variant runs the pretrain stage (both stages) in its own copy, side by side on one GPU, and
# bench/tiny_retrieval.py --score scores its stage-1 and stage-2 models at 4K, 16K and 64K.
#   OUT=... bash bench/gpu_stage_diag.sh name:key=value,... ...      (carry .whl)
# key: stageN.field for the Nth pretrain stage (stage2.lr=1e-4, stage2.rope_theta=160000), or a dotted params
# path merged over the profile (pack.splits.stage2.mix.retrieval_64k=0.1: the variant packs its own splits).
# COMMON: overrides for every workspace, the shared one included. PROFILE: another profile (tiny: a CPU check of
# the script). LENGTHS: the scored lengths (default 4096 16384 65536). PROMPTS: per task and length (default 4).
set -uo pipefail
out=$(realpath -m "${OUT:-bench/results/stage-diag}")
mkdir -p "$out"
[ $# -gt 0 ] || { echo "usage: gpu_stage_diag.sh name:key=value,... ..." >&2; exit 2; }
source bench/gpu_env.sh || exit 1
source bench/gpu_diag_lib.sh
profile=${PROFILE:-gpu-64k}
t0=$(date +%s)
workspace() {  # folder, overrides
  copy_project "$1"
  (cd "$1" && PROFILE=$profile SET=${COMMON:+$COMMON,}$2 python3 -c "
import os
import yaml
p = yaml.safe_load(open('params.yaml'))
p['profile'] = os.environ['PROFILE']
p['tracking'] = {'enabled': False}
stages = yaml.safe_load(open(f'src/longctx/profiles/{p[\"profile\"]}.yaml'))['train']['pretrain']['stages']
for kv in filter(None, os.environ['SET'].split(',')):
    key, value = kv.split('=', 1)
    path = key.split('.')
    if path[0].startswith('stage') and path[0][5:].isdigit():   # the pretrain stages are a list: set it whole
        stages[int(path[0][5:]) - 1][path[1]] = yaml.safe_load(value)
        p['train']['pretrain'] = {'stages': stages}
        continue
    node = p
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = yaml.safe_load(value)
yaml.safe_dump(p, open('params.yaml', 'w'), sort_keys=False)")
}
data=/tmp/longctx-stage-diag
workspace $data "" || exit 1
for s in corpora tokenize pack base; do stage $data $s $s || exit 1; done
echo "corpora -> base: $(( $(date +%s) - t0 )) s" | tee "$out/times.txt"
for v in "$@"; do
  IFS=: read -r name set <<< "$v"
  (ws=/tmp/longctx-stage-diag-$name
   workspace "$ws" "$set" && mkdir -p "$ws/data" "$ws/models" && cp -al $data/data/corpora $data/data/tokens "$ws/data/" \
     && cp -al $data/models/base "$ws/models/" || exit 1
   if [[ ",$set" == *,pack.* ]]; then stage "$ws" pack "$name-pack" || exit 1; else cp -al $data/data/packed "$ws/data/"; fi
   stage "$ws" pretrain "$name-pretrain" || exit 1
   echo "$name pretrained: $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
   (cd "$ws" && PYTHONPATH=$ws/src:$PYTHONPATH python3 bench/tiny_retrieval.py --tokens data/tokens --score \
      models/pretrain/stage1 models/pretrain/stage2 --lengths ${LENGTHS:-4096 16384 65536} --prompts "${PROMPTS:-4}" \
      > "$out/$name.log" 2>&1) || tail -20 "$out/$name.log") &
done
wait
echo "all: $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
for v in "$@"; do echo "== ${v%%:*}"; grep -h "^ *models/" "$out/${v%%:*}.log"; done
