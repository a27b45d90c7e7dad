# Source on a CUDA machine without internet: installs the wheels carried in .whl/ (what the GPU
# image lacks: bench/gpu_wheels.py builds the folder) and puts them, their commands (dvc, prefect,
# mlflow) and the project on PYTHONPATH and PATH.
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
  echo "gpu_env: PYTHONDONTWRITEBYTECODE was set; bytecode now cached under /tmp/pycache" >&2
  unset PYTHONDONTWRITEBYTECODE
fi
export PYTHONPYCACHEPREFIX=/tmp/pycache
