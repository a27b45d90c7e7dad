#!/usr/bin/env bash
# Recipe variants of the long stages, each paired with the first on the same prompts (issue 62). One
# workspace of the profile runs corpora -> base; then each variant, in its own copy sharing that base (its own
# pack where it changes pack's params), runs pretrain, sft and eval, and every variant's scored prompts are
# paired with the first variant's (python -m longctx.eval.compare: a sign test, 95%, per checkpoint and
# length). The stages run as `python -m stages.<name>` (no DVC, Prefect or MLflow: tracking off).
#   OUT=... bash scripts/gpu/recipe.sh name:key=value,... ...      (carry .whl)
# name@parent: a variant of sft and eval alone, on its parent's pretrained checkpoints (linked once the parent's
# pretrain finished: no second pretrain), its overrides merged over the parent's and paired with the parent's.
# A variant that changes train.base or the model trains its own base on the shared data (a base of its own), beside
# the shared base: list such variants first, as the shared base takes one of the JOBS slots while it trains, and
# name the reference variant in REF (default the first).
# key: stageN.field for the Nth pretrain stage (stage2.steps=120), or a dotted params path merged over the
# profile (pack.splits.stage2.mix.retrieval=0.1). COMMON: overrides for every workspace, the shared one
# included (corpora domains, the eval's tasks and lengths). JOBS: variants side by side (default 2).
# LIMIT: seconds, then the variants stop and what finished is reported. PROFILE: another profile (tiny: a CPU check of the script). REV: the commit named (where the copy has no .git). WORK: the workspaces (default bench/work/recipe).
# Resumes: a step whose output exists is skipped, so the same command in the next call of a warm machine goes
# on where a call's limit stopped it (a variant whose overrides changed starts again). $OUT gets summary.md
# (each variant's tables and its verdicts against the first), times.txt and recipe.tar.gz (every variant's
# params, logs, metrics/eval.json, comparison.md and scored prompts).
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: recipe.sh name:key=value,... ..." >&2; exit 2; }
source scripts/gpu/env.sh || exit 1   # (and copy_project, results_dir)
out=$(realpath -m "${OUT:-$(results_dir recipe)}")
work=$(realpath -m "${WORK:-bench/work/recipe}")
logs=$work/logs
mkdir -p "$out" "$logs"
profile=${PROFILE:-gpu-64k}
t0=$(date +%s)
killtree() { local c; for c in $(pgrep -P "$1"); do killtree "$c"; done; kill -TERM "$1" 2>/dev/null; }
stop() { trap "" TERM INT; local j; for j in $(jobs -p); do killtree "$j"; done; wait; report; exit 143; }
trap stop TERM INT   # LIMIT seconds (a call's limit), or Ctrl-C: the variants stop, what finished is reported
watchdog=
[ -n "${LIMIT:-}" ] && { (sleep "$LIMIT"; kill -TERM $$) & watchdog=$!; disown; }
log() { echo "$*  (at $(( $(date +%s) - t0 )) s)" | tee -a "$out/times.txt"; }

workspace() {  # folder, overrides: made (or kept, when made with the same overrides)
  local want="$profile ${COMMON:-} $2"
  [ -f "$1/.recipe" ] && [ "$(cat "$1/.recipe")" = "$want" ] && return 0
  copy_project "$1"
  (cd "$1" && PROFILE=$profile SET=${COMMON:+$COMMON,}$2 python3 -c "
import os
import re
import yaml
p = yaml.safe_load(open('params.yaml'))
p['profile'] = os.environ['PROFILE']
p['tracking'] = {'enabled': False}
from longctx.config.loading import load, resolve
stages = [s.model_dump(mode='json') for s in resolve({'profile': p['profile']}).train.pretrain.stages]   # (with extends)
for kv in filter(None, re.split(r',(?=[\w.]+=)', os.environ['SET'].strip(','))):   # (a value may hold commas: [a, b])
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
yaml.safe_dump(p, open('params.yaml', 'w'), sort_keys=False)
load('params.yaml')   # a bad override stops here, before any GPU time
") || return 1
  echo "$want" > "$1/.recipe"
}
run_stage() {  # folder, stage, log name: skipped when it finished before
  [ -f "$1/.done-$2" ] && return 0
  local s=$(date +%s)
  (cd "$1" && PYTHONPATH=$1/src:$PYTHONPATH python3 -m stages.$2 > "$logs/$3.log" 2>&1) \
    || { tail -20 "$logs/$3.log"; return 1; }
  touch "$1/.done-$2"
  log "$3: $(( $(date +%s) - s )) s"
}

variants=("$@") names=(); declare -A sets parents
for v in "$@"; do
  IFS=: read -r name set <<< "$v"
  [[ $name == *@* ]] && { parents[${name%@*}]=${name#*@}; name=${name%@*}; }
  names+=("$name"); sets[$name]=$set
done
[ -z "${REF:-}" ] || [[ " ${names[*]} " == *" $REF "* ]] || { echo "recipe.sh: REF=$REF names no variant" >&2; exit 2; }
shared=$work/shared
workspace "$shared" "" || exit 1
for s in corpora tokenize pack; do run_stage "$shared" $s $s || exit 1; done
# the shared base trains beside the variants with a base of their own (one job slot); the others wait for it
rm -f "$shared/.failed"
(run_stage "$shared" base base || touch "$shared/.failed") &
variant() {  # name, overrides, parent (or empty)
  local ws=$work/$1 set=$2 parent=$3 own=
  [[ ",$2" == *,train.base* || ",$2" == *,model.* ]] && own=base   # its own base, not the shared one
  if [ -n "$parent" ]; then   # sft and eval on the parent's pretrained checkpoints
    [[ -n "$own" || ",$2" == *,train.pretrain* || ",$2" == *,stage[0-9]* ]] \
      && { echo "$1: a variant of $parent changes sft or eval, not pretrain or the base" >&2; return 1; }
    set=${sets[$parent]}${sets[$parent]:+,}$2
    until [ -f "$work/$parent/.done-pretrain" ]; do
      [ -f "$work/$parent/.failed" ] && { echo "$1: its parent $parent failed" >&2; return 1; }
      sleep 5
    done
  fi
  workspace "$ws" "$set" || return 1
  local from=${parent:+$work/$parent}; from=${from:-$shared}
  until [ -n "$own" ] || [ -f "$shared/.done-base" ]; do
    [ -f "$shared/.failed" ] && { echo "$1: the shared base failed" >&2; return 1; }
    sleep 5
  done
  if [ ! -d "$ws/data/tokens" ]; then
    mkdir -p "$ws/data" "$ws/models" && cp -al "$from/data/corpora" "$from/data/tokens" "$ws/data/" || return 1
    for m in "$from"/models/*; do
      [ ! -e "$m" ] || [ "${m##*/}" = sft ] || [ "${m##*/}" = "$own" ] || cp -al "$m" "$ws/models/" || return 1
    done
  fi
  if [[ ",$2" == *,pack.* ]]; then run_stage "$ws" pack "$1-pack" || return 1
  elif [ ! -d "$ws/data/packed" ]; then cp -al "$from/data/packed" "$ws/data/"; fi
  [ -z "$own" ] || run_stage "$ws" base "$1-base" || return 1
  [ -z "$parent" ] || touch "$ws/.done-pretrain"
  for s in pretrain sft eval; do run_stage "$ws" $s "$1-$s" || return 1; done
}

report() {  # summary.md and recipe.tar.gz from the variants that finished
first=${REF:-${names[0]}}
{
  echo "# scripts/gpu/recipe.sh: $profile, $(date -u +%F), ${REV:-$(git -C "$project" rev-parse --short HEAD 2>/dev/null || echo "?")}"
  echo; echo "COMMON: ${COMMON:-none}"; echo
  for v in "${variants[@]}"; do echo "- ${v%%:*}: ${v#*:}"; done
  echo; echo '```'; cat "$out/times.txt"; echo '```'
  for name in "${names[@]}"; do
    echo; echo "## $name"; echo
    cat "$work/$name/reports/eval/comparison.md" 2>/dev/null || echo "(no eval: see logs/$name-*.log in recipe.tar.gz)"
    local ref=${parents[$name]:-$first}
    if [ "$name" != "$ref" ] && [ -f "$work/$name/reports/eval/prompts.jsonl" ]; then
      echo; python3 -m longctx.eval.compare "$work/$name/reports/eval/prompts.jsonl" \
        "$work/$ref/reports/eval/prompts.jsonl" 2>&1 | sed "1s|^.*against.*, the same|$name against $ref, the same|"
    fi
  done
} > "$out/summary.md"
(cd "$work" && tar -czf "$out/recipe.tar.gz" logs $(for n in "${names[@]}"; do
   for f in params.yaml metrics reports/eval plots/eval; do [ -e "$n/$f" ] && echo "$n/$f"; done; done))
cat "$out/summary.md"
}
for name in "${names[@]}"; do
  rm -f "$work/$name/.failed"
  (variant "$name" "${sets[$name]}" "${parents[$name]:-}" || { mkdir -p "$work/$name" && touch "$work/$name/.failed"; exit 1; }) &
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-2}" ]; do wait -n; done
done
wait
log "all variants"
[ -z "$watchdog" ] || kill "$watchdog" 2>/dev/null
report
