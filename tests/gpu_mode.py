"""Where the kernel tests run their kernels: compiled on a GPU, in Pallas' interpreter elsewhere.

`bash scripts/gpu_tests.sh` runs the kernel test files on the H200 (docs/STATUS.md has the last
result). On a GPU, float32 test inputs are multiplied in float32 (IEEE) by the Triton kernels and
by XLA rather than in TF32, so the CPU tolerances keep their meaning there. The bf16
tensor-core path has its own tests (test_select_kernel with ON_GPU, test_mosaic_kernels) and the
compiled checks of `experiments/bench_kernels.py --check` and `bench_nsa --check`.
"""

import jax

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
if ON_GPU:
  jax.config.update("jax_default_matmul_precision", "highest")
