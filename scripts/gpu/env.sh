# Source on a CUDA machine without internet, from the project root: installs the wheels carried in .whl/ (what
# the GPU image lacks: scripts/gpu/wheels.py builds the folder), puts them, their commands (dvc, prefect, mlflow)
# and the project on PYTHONPATH and PATH, and gives the scripts beside it copy_project and results_dir.
if compgen -G ".whl/*.whl" >/dev/null; then   # (once per machine: a script that sources this again skips it)
  if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return 1
    touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Bytecode: in the device's image every process compiled ~3,700 modules from source (11-14 s of each
# stage's start; cProfile of the SFT stage, pipeline run 15): cache it where any process can write
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  echo "env.sh: PYTHONDONTWRITEBYTECODE was set; bytecode now cached under /tmp/pycache" >&2
  unset PYTHONDONTWRITEBYTECODE
fi
export PYTHONPYCACHEPREFIX=/tmp/pycache
project=$PWD

copy_project() {  # folder: emptied, then the project as a clone has it (nothing that runs make or carry)
  rm -rf "$1" && mkdir -p "$1"
  (cd "$project" && tar --exclude=./.git --exclude=./.whl --exclude=./data --exclude=./models --exclude=./bench/work \
     --exclude=./bench/results --exclude=./metrics --exclude=./reports --exclude=./plots --exclude=./runs \
     --exclude=./mlflow.db --exclude=./mlartifacts -cf - .) | tar -xf - -C "$1"
}

results_dir() {  # question: bench/results/<question>/<question>-<device>-<date> (bench/results/README.md)
  local device
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-')
  echo "$project/bench/results/$1/$1-${device:-cpu}-$(date -u +%F)"
}
