"""Loaded by pytest before any test file: on a GPU, float32 matmuls in every test file run in IEEE
float32 instead of TF32 (tests/gpu_mode.py), so the float32 tolerances mean what they mean on the
CPU whichever files `scripts/gpu_tests.sh` is given. On a CPU it changes nothing."""

try:
  import tests.gpu_mode  # noqa: F401
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  import gpu_mode  # noqa: F401
