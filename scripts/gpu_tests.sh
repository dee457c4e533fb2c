#!/usr/bin/env bash
# The kernel tests on a GPU: the same pytest files as CI, with the Pallas kernels compiled
# (tests/gpu_mode.py: INTERPRET is False there) instead of interpreted.
#
#   bash scripts/gpu_tests.sh [pytest args]      (repository root; on the device tool pass
#                                                  carry [".whl"] and OUT=$OUT)
#
# What the machine lacks comes from wheels in .whl/ (no network there): pytest, pytest-xdist and
# their dependencies (pip download --no-deps --only-binary=:all: -d .whl pytest==9.2.0
# pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pytest-xdist==3.8.0 execnet==2.1.2) and
# ml-collections==1.1.0 for the training tests (as for scripts/h200_runs.sh). Four workers share
# the GPU, each allocating memory as it goes.
# GPU_TEST_FILES="tests/test_decode.py" runs other files instead of the five kernel files and the cuDNN packed-layout file (e.g.
# the module, aux-selector, fold, XLA-path, reference and sharding files: 179 tests in 235 s on
# the H200, 2026-11-30). Writes $OUT/gpu_tests.log and $OUT/gpu_tests.xml (JUnit, per-test times).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_tests_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
wheels=""
python3 -c "import pytest" 2> /dev/null || wheels="$wheels pytest-* pluggy-* iniconfig-* packaging-*"
python3 -c "import xdist" 2> /dev/null || wheels="$wheels pytest_xdist-* execnet-*"
export PYTHONPATH=$PWD
files=""
for w in $wheels; do
  f=$(ls .whl/$w.whl 2> /dev/null) || { echo "missing $w and no .whl/$w.whl (see the header)"; exit 2; }
  files="$files $f"
done
if ! python3 -c "import ml_collections" 2> /dev/null; then  # only the training tests need it
  f=$(ls .whl/ml_collections-*.whl 2> /dev/null) && files="$files $f" \
    || echo "note: ml_collections missing and not in .whl/: the training tests will fail"
fi
if [ -n "$files" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pytest_site $files || exit 1
  export PYTHONPATH=$PWD:/tmp/pytest_site
fi
FILES=${GPU_TEST_FILES:-"tests/test_select_kernel.py tests/test_mosaic_kernels.py
  tests/test_compress_kernels.py tests/test_window_kernel.py tests/test_decode.py
  tests/test_cudnn_packed.py"}
nvidia-smi -L | tee "$OUT/gpu_tests.log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu_tests.log"
# shellcheck disable=SC2086
python3 -m pytest -q -rfE -n 4 --durations=15 --junitxml="$OUT/gpu_tests.xml" -p no:cacheprovider \
  $FILES "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
exit "${PIPESTATUS[0]}"
