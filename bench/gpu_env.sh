# Source on a CUDA machine without internet: installs the wheels carried in .whl/ (what the GPU
# image lacks: bench/gpu_wheels.py builds the folder) and puts them, their commands (dvc, prefect,
# mlflow) and the project on PYTHONPATH and PATH.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
