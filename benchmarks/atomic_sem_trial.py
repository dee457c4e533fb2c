"""Trial: the memory semantics of the Triton atomic adds behind `CmpTiling.bwd_fused_dq`.

jax 0.11.2's Pallas Triton lowering emits every atomic (`plgpu.atomic_add`) with acquire-release
semantics at GPU scope (`jax._src.pallas.triton.lowering._atomic_rmw`'s default), which orders
each add against the thread's other memory traffic. Accumulating dq needs no ordering: the kernel's
end publishes the sums. This script sets that default to relaxed (or leaves it) for this process
only, then runs another benchmark's main with the remaining arguments, so one build of the same
kernels can be timed under both semantics:

  python3 benchmarks/atomic_sem_trial.py --sem relaxed window --backends triton --tilings ...
  python3 benchmarks/atomic_sem_trial.py --sem relaxed cmp --shapes=8k --variants default ...

It patches a private function's defaults (a trial, not a code path of the library).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax._src.pallas.triton import lowering as tl  # noqa: E402
from jax._src.lib.triton import dialect as tt_dialect  # noqa: E402

SEMS = {"relaxed": tt_dialect.MemSemantic.RELAXED,
        "acq_rel": tt_dialect.MemSemantic.ACQUIRE_RELEASE}


def main(argv):
  if len(argv) < 3 or argv[0] != "--sem" or argv[1] not in SEMS or argv[2] not in ("window", "cmp"):
    sys.exit(f"usage: atomic_sem_trial.py --sem {{{','.join(SEMS)}}} {{window,cmp}} [args]")
  mask, _, scope = tl._atomic_rmw.__defaults__
  tl._atomic_rmw.__defaults__ = (mask, SEMS[argv[1]], scope)
  print(f"atomic semantics: {argv[1]} (patched {tl._atomic_rmw.__defaults__})", flush=True)
  if argv[2] == "window":
    from experiments import bench_window
    return bench_window.main(argv[3:])
  import cmp_tiling_trial
  sys.argv = ["cmp_tiling_trial.py", *argv[3:]]
  return cmp_tiling_trial.main()


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
