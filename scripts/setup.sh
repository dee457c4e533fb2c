#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs nsa-jax (editable) with its pinned requirements.
# Idempotent: a second run only checks. Set NSA_PYTHON=/path/to/python3.12+ to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

ok_python() {  # prints the path if $1 is Python >= 3.12
  "$1" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 && command -v "$1"
}

find_python() {
  local c
  if [ -n "${NSA_PYTHON:-}" ]; then  # the user's choice: used, or refused with the reason
    if ok_python "$NSA_PYTHON"; then return 0; fi
    local found="not found"
    if command -v "$NSA_PYTHON" >/dev/null 2>&1; then found=$("$NSA_PYTHON" --version 2>&1); fi
    echo "setup: NSA_PYTHON=$NSA_PYTHON is not a Python >= 3.12 ($found)." >&2
    echo "setup: point it at Python 3.12 or newer, or unset it to search the usual places." >&2
    return 2
  fi
  for c in python3.12 python3.13 /root/.pyenv/versions/3.12*/bin/python3 \
           /root/.pyenv/versions/3.13*/bin/python3 /usr/local/bin/python3.1[2-9] python3 python; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    if ok_python "$c"; then return 0; fi
  done
  return 1
}

if [ -x .venv/bin/python ] && ok_python .venv/bin/python >/dev/null; then
  PY=.venv/bin/python
else
  SYS_PY=$(find_python) || rc=$?
  if [ "${rc:-0}" = 2 ]; then exit 1; fi
  if [ "${rc:-0}" != 0 ]; then
    echo "setup: no Python >= 3.12 found (jax 0.11.2 needs it)." >&2
    echo "setup: tried NSA_PYTHON, python3.13, python3.12, ~/.pyenv versions, python3." >&2
    echo "setup: install Python 3.12 or newer (e.g. 'pyenv install 3.12', 'apt-get install python3.12-venv')," >&2
    echo "setup: or point NSA_PYTHON at one: NSA_PYTHON=/path/to/python3.12 bash scripts/setup.sh" >&2
    exit 1
  fi
  echo "setup: creating .venv with $SYS_PY ($("$SYS_PY" --version 2>&1))"
  rm -rf .venv
  "$SYS_PY" -m venv .venv
  PY=.venv/bin/python
fi

stamp=.venv/.installed-$(cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)
if [ ! -f "$stamp" ]; then
  echo "setup: installing pinned requirements into .venv (first run takes a minute or two)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -r requirements.txt
  "$PY" -m pip install -q --no-deps -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
"$PY" - <<'PYEOF'
import sys
import flax
import jax
import nsa_jax, pallas_kernels  # noqa: F401  (the packages must import)
print(f"setup: ok (python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, "
      f"backend {jax.default_backend()})")
PYEOF
