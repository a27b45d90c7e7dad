#!/usr/bin/env bash
# The product on one GPU, as a user runs it (issue 32): a fresh workspace holding the project's files
# and nothing it made (no data, metrics, checkpoints or MLflow store), the gpu-64k profile, then the
# main command `LONGCTX_GPUS=0 python3 -m pipelines` (Prefect -> dvc repro -> stages -> MLflow; another GPU:
# LONGCTX_GPUS=1, not CUDA_VISIBLE_DEVICES, which the flow's GPU slot sets for each stage).
# Then, while time is left: `dvc status` (nothing to do) and one eval param changed, the main command
# again (eval alone reruns); then bench/train_throughput.py --workspace (each training stage's steps timed
# by the benchmark's harness, against the tokens/s the stage logged). What the run made is copied to
# $OUT in at most 7 files (the device returns 8): pipeline.log (the device, then the main command's output
# with the final table), mlflow.db, outputs.tar.gz (dvc.lock, params.yaml, and metrics/, plots/, reports/
# and mlartifacts/ without checkpoints), dvc_status.log, pipeline_eval_changed.log, stage_bench.log and the
# stage bench's JSON (AGAIN=resume: pipeline_resumed.log too).
#   bash scripts/gpu/pipeline.sh [llama|fox]      # fox: the FoX (Pro) + ACP variant, same data and tokens
# SET="train.pretrain.factors=search ...": params changed over the profile's (dotted keys, YAML values).
# AGAIN=1: only what follows the main command, in the workspace the last call left (a second device call made
# while the machine is still warm, when the first had no time left for it); AGAIN=resume: the main command
# again first (DVC skips the finished stages, a training stage goes on from its last checkpoint).
# MAIN_ONLY=1: the main command alone (two variants' runs in the calls of one session's device time).
# PROFILE: another profile (tiny: the same steps on a CPU). LIMIT: seconds for the whole script (default
# 594, what run 13 ran under in a 600 s call; the main command gets what is left, then 10 s to stop).
# Carry .whl (scripts/gpu/wheels.py) where the image lacks DVC, Prefect and MLflow.
set -uo pipefail
variant=${1:-llama}
limit=${LIMIT:-594}
begin=$(date +%s)
source scripts/gpu/env.sh || exit 1
out=$(realpath -m "${OUT:-$(results_dir pipeline-gpu)}")
mkdir -p "$out"
SITE=$([ -d /tmp/site ] && echo /tmp/site)   # where env.sh installed the carried wheels
command -v git dvc >/dev/null || { echo "pipeline.sh: git and dvc are needed on PATH" >&2; exit 1; }
ws=/tmp/longctx-ws-${NAME:-$variant}   # NAME: another workspace for the same variant
[ "$variant" = fox ] && export TRITON_PRINT_AUTOTUNING=1   # what each FoX kernel tuning costs, in the stages' logs
left() { echo $(( limit - ($(date +%s) - begin) )); }
collect() {  # (the device returns a limited number of files: the folders travel as one archive)
  cp mlflow.db "$out"/ 2>/dev/null
  tar --exclude="*.safetensors" -czf "$out/outputs.tar.gz" dvc.lock params.yaml metrics plots reports mlartifacts \
    2>/dev/null
  du -sh "$out"/mlflow.db "$out"/outputs.tar.gz 2>/dev/null
}
run_main() {  # the main command in what is left of the time, its output appended to $1 ($2 names the run); $status
  local started=$(date +%s)
  LONGCTX_GPUS=${LONGCTX_GPUS:-0} timeout -k 10 "$(left)" python3 -m pipelines 2>&1 | tee -a "$1"
  status=${PIPESTATUS[0]}
  echo "main command$2: exit $status after $(( $(date +%s) - started )) s (script at $(( $(date +%s) - begin )) s)" | tee -a "$1"
  collect
}
if [ -n "${AGAIN:-}" ]; then   # a second call on the still-warm machine, in the first call's workspace
  case $AGAIN in 1|resume) ;; *) echo "pipeline.sh: AGAIN=$AGAIN: give 1 or resume" >&2; exit 2 ;; esac
  [ -f "$ws/dvc.yaml" ] || { echo "pipeline.sh: AGAIN: no workspace at $ws (the machine was released)" >&2; exit 1; }
  [ "$AGAIN" = resume ] || [ -f "$ws/dvc.lock" ] || { echo "pipeline.sh: AGAIN=1: $ws has no finished run" >&2; exit 1; }
  cd "$ws" && export PYTHONPATH=$ws/src:$ws${SITE:+:$SITE} && status=0
  if [ "$AGAIN" = resume ]; then   # the first call's main command ran out of time: the same command goes on
    run_main "$out/pipeline_resumed.log" " (resumed)"
    [ "$status" = 0 ] || exit "$status"
  fi
else
copy_project "$ws"   # (made a new repository below)
cd "$ws" || exit 1
export PYTHONPATH=$ws/src:$ws${SITE:+:$SITE}   # the workspace's code, not the carried tree's
sed -i "s/^profile: .*/profile: ${PROFILE:-gpu-64k}/" params.yaml
# the variant and SET's overrides ("a.b.c=value ...", YAML values, as `dvc exp run -S`) written into params.yaml
VARIANT=$variant ACP=${ACP-4.54e-5} SET=${SET:-} python3 - <<'EOF' || exit 2
import os
import yaml
p = yaml.safe_load(open("params.yaml"))
if os.environ["VARIANT"] == "fox":   # FoX (Pro) + ACP: the same data, splits and steps (ACP='': FoX alone)
    p["model"] = {"arch": "fox"}
    # SFT at a third of the profile's rate: better than 3e-5 at 64K (11-1 prompts), no difference at 4K (1-4), and no
    # longer worse than stage 2 at 64K (5-13; 3e-5: 4-21; bench/results/recipe/recipe-fox-sft-nvidia-h100-2026-12-07)
    p["train"]["sft"] = {"lr": 1.0e-5, "lr_min": 1.0e-6}
    if os.environ["ACP"]:   # ACP where base and SFT train, and in every checkpoint's eval prefill
        p["train"]["base"] = {"acp_eps": float(os.environ["ACP"])}
        p["train"]["sft"]["acp_eps"] = float(os.environ["ACP"])
        p["eval"] = {**(p.get("eval") or {}), "acp_eps": float(os.environ["ACP"])}
for item in os.environ["SET"].split():
    key, value = item.split("=", 1)
    *path, last = key.split(".")
    node = p
    for k in path:
        node = node.setdefault(k, {})
    node[last] = yaml.safe_load(value)
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
EOF
git init -q && git add -A && git -c user.name=longctx -c user.email=longctx@localhost commit -qm workspace
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || nproc; } | tee "$out/pipeline.log"
run_main "$out/pipeline.log" ""
[ "$status" = 0 ] || exit "$status"
fi
[ -n "${MAIN_ONLY:-}" ] && exit "$status"
dvc status 2>&1 | tee "$out/dvc_status.log"   # right after a finished run: nothing to do
# one eval param changed: eval alone reruns, only with time for the whole eval stage (~370 s on gpu-64k): cut
# off, DVC would have removed the finished run's eval outputs, and collect() would archive the run without them
if [ "$(left)" -gt "${EVAL_S:-420}" ] && ! grep -q retention_sequences params.yaml; then
  python3 -c "import yaml; p = yaml.safe_load(open('params.yaml')); p['eval'] = {**(p.get('eval') or {}),
'retention_sequences': 4}; yaml.safe_dump(p, open('params.yaml', 'w'), sort_keys=False)"
  { echo "== eval.retention_sequences changed"; dvc status 2>&1; } | tee -a "$out/dvc_status.log"
  run_main "$out/pipeline_eval_changed.log" " (eval changed)"
fi
if [ "$(left)" -gt 60 ]; then                  # the training stages' own steps timed by the benchmark's harness
  timeout -k 5 "$(left)" python3 bench/train_throughput.py --workspace . --steps 3 --out "$out" 2>&1 \
    | tail -8 | tee "$out/stage_bench.log"
fi
exit "$status"
