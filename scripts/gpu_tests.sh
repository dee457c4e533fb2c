#!/usr/bin/env bash
# The kernel tests on a GPU: the same pytest files as CI, with the Pallas kernels compiled
# (tests/gpu_mode.py: INTERPRET is False there) instead of interpreted.
#
#   bash scripts/gpu_tests.sh [pytest args]      (repository root; on the device tool pass
#                                                  carry [".whl"] and OUT=$OUT)
#
# The device machine has jax but not pytest and no network: pytest, pytest-xdist and their
# dependencies come from wheels in .whl/ (pip download --no-deps --only-binary=:all: -d .whl
# pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pytest-xdist==3.8.0
# execnet==2.1.2). Four workers share the GPU, each allocating memory as it goes.
# GPU_TEST_FILES="tests/test_decode.py" runs a subset. Writes $OUT/gpu_tests.log and $OUT/gpu_tests.xml (JUnit, per-test times).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_tests_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ! python3 -c "import pytest, xdist" 2> /dev/null; then
  wheels=$(ls .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl .whl/packaging-*.whl \
    .whl/pytest_xdist-*.whl .whl/execnet-*.whl 2> /dev/null)
  [ -n "$wheels" ] || { echo "pytest is missing and .whl/ has no pytest wheels (see the header)"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pytest_site $wheels || exit 1
  export PYTHONPATH=$PWD:/tmp/pytest_site
else
  export PYTHONPATH=$PWD
fi
FILES=${GPU_TEST_FILES:-"tests/test_select_kernel.py tests/test_mosaic_kernels.py
  tests/test_compress_kernels.py tests/test_decode.py"}
nvidia-smi -L | tee "$OUT/gpu_tests.log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu_tests.log"
# shellcheck disable=SC2086
python3 -m pytest -q -rfE -n 4 --durations=15 --junitxml="$OUT/gpu_tests.xml" -p no:cacheprovider \
  $FILES "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
exit "${PIPESTATUS[0]}"
