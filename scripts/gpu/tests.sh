#!/usr/bin/env bash
# The CUDA tests on one GPU machine without internet (carry .whl): the attention backends and the FoX kernel
# against float64 (its launch options, tuned first calls, gate regimes and layouts), compiled against eager
# training, offload, the model and decoding on the GPU. The kernels' compilation, not the GPU, is what the
# matrix waits on, so the tests run over WORKERS pytest-xdist workers (default 8), then those marked gpu_alone
# (most of the GPU's memory) one at a time; LIMIT seconds in all (default 540). The log, with the GPU's name
# first: $OUT/tests.log (default bench/results/gpu-tests/gpu-tests-<device>-<date>/).
#   bash scripts/gpu/tests.sh                                  # the files below
#   bash scripts/gpu/tests.sh tests/test_fox_kernel.py -k wide # any pytest arguments instead
set -uo pipefail
source scripts/gpu/env.sh || exit 1
out=$(realpath -m "${OUT:-$(results_dir gpu-tests)}")
mkdir -p "$out"
tests=("$@")
# (the ACP training test runs the data stages: mlflow, not on the image)
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_gpu_attention.py tests/test_gpu_train.py tests/test_fox_kernel.py
  tests/test_model.py tests/test_decode.py
  --deselect tests/test_fox_kernel.py::test_training_with_acp_logs_the_pruned_fraction)
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  timeout "${LIMIT:-540}" bash -c 'python3 -m pytest -q -p no:cacheprovider -n "$1" -m "not gpu_alone" "${@:2}"; r=$?
    python3 -m pytest -q -p no:cacheprovider -m gpu_alone "${@:2}" && exit $r' _ "${WORKERS:-8}" "${tests[@]}"
} 2>&1 | tee "$out/tests.log"
exit "${PIPESTATUS[0]}"
