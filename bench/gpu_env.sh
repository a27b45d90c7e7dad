# Source on a CUDA machine without internet: installs the wheels carried in .whl/ (pure-Python
# deps the GPU image lacks, e.g. pydantic) and puts them and the project on PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
