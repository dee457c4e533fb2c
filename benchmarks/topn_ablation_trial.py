# Diagnostic trial (2026-12-01): where the top-n kernel's time goes. The kernel
# (pallas_kernels/select_topn.py) is timed with parts of its chunk step replaced by cheaper stand-ins
# (monkeypatched module functions, so the kernel source is untouched), and at several T to split
# per-program from per-chunk cost. Stand-ins give WRONG indices: timing only, never a result.
#   python3 benchmarks/topn_ablation_trial.py        (on a GPU; prints one line per variant)
# Results: benchmarks/results/topn_paths_h200.md (section 1) and topn_paths_h200.json.
# Timing: the mean of 5 back-to-back calls after one warm-up (not bench_common.time_ms's median of
# synchronised calls), as the recorded rows were measured.
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compress_attention as ca
from pallas_kernels import select_topn as st


def timeit(f, *a, iters=5):
  jax.block_until_ready(f(*a))
  t0 = time.perf_counter()
  for _ in range(iters):
    r = f(*a)
  jax.block_until_ready(r)
  return (time.perf_counter() - t0) / iters * 1e3


def merge_elementwise(a_val, a_idx, cand, jv, *, n):  # keeps the data flow, no while loop
  del n
  take = cand > a_val
  return jnp.where(take, cand, a_val), jnp.where(take, jv, a_idx)


def band_hi_only(parts, w):  # one matmul per band instead of three
  return plgpu.dot(parts[0], w)


def ascending_cheap(a_val, a_idx, *, n):
  del a_val, n
  return a_idx


LOOP = {"RANK_MERGE": False, "CARRY_VEC": False}  # select_topn's paths when first timed
VARIANTS = {
    "base": LOOP,  # the loop merge, as when first timed
    "merge elementwise": {**LOOP, "_merge": merge_elementwise},
    "band 1 dot": {**LOOP, "_exact_dot": band_hi_only},
    "merge elementwise + band 1 dot": {**LOOP, "_merge": merge_elementwise,
                                       "_exact_dot": band_hi_only},
    "merge elementwise + band 1 dot + no final sort": {
        **LOOP, "_merge": merge_elementwise, "_exact_dot": band_hi_only,
        "_ascending": ascending_cheap},
    # exact alternatives (select_topn's flags; these give the right indices). Rows measured
    # 2026-12-01 with flags since removed (RANK_MERGE_SKIP, Q_RELOAD) are in the results file.
    "loop merge": {"RANK_MERGE": False, "CARRY_VEC": False},
    "rank merge": {"RANK_MERGE": True, "CARRY_VEC": False},
    "rank merge + carry_vec": {"RANK_MERGE": True, "CARRY_VEC": True},
}
EXACT = ["loop merge", "rank merge", "rank merge + carry_vec"]


def run(t, dk, variants, rows=64, warps=4):
  h, kh, l, d, lp, n = 64, 4, 32, 16, 64, 16
  nc = (t - l) // d + 1
  k = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k[0], (1, t, h, dk), jnp.bfloat16)
  kc = jax.random.normal(k[1], (1, nc, kh, dk), jnp.bfloat16)
  vc = jax.random.normal(k[2], (1, nc, kh, 128), jnp.bfloat16)
  _, lse = jax.jit(lambda q, kc, vc: ca.compress_attention(q, kc, vc, l, d))(q, kc, vc)
  out = []
  for name in variants:
    saved = {a: getattr(st, a) for a in VARIANTS[name]}
    try:
      for a, f in VARIANTS[name].items():
        setattr(st, a, f)
      fn = jax.jit(lambda q, kc, lse: st.select_topn(q, kc, lse, block=l, stride=d, sel_block=lp,
                                                     num_selected=n, rows=rows, num_warps=warps))
      ms = timeit(fn, q, kc, lse)
    finally:
      for a, f in saved.items():
        setattr(st, a, f)
    out.append(dict(T=t, d_k=dk, rows=rows, warps=warps, variant=name, ms=round(ms, 3)))
    print(json.dumps(out[-1]), flush=True)
  return out


if __name__ == "__main__":
  res = []
  if sys.argv[2:] == ["exact"]:  # the exact alternatives only, 64k both head dims, 16k, 32k
    for t, dk in ((65536, 192), (65536, 128), (32768, 192), (16384, 192)):
      res += run(t, dk, EXACT)
    with open(sys.argv[1], "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=res), f, indent=1)
    sys.exit(0)
  res += run(65536, 192, list(VARIANTS))
  res += run(65536, 128, ["base", "merge elementwise", "merge elementwise + band 1 dot"])
  for t in (16384, 32768):  # base only: per-program vs per-chunk cost (chunks ~ T, programs ~ T)
    res += run(t, 192, ["base", "merge elementwise + band 1 dot"])
  res += run(65536, 192, ["base"], rows=128, warps=4)
  res += run(65536, 192, ["base"], rows=64, warps=4)  # repeat of the first row
  if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                            time.gmtime()),
                     rows=res), f, indent=1)
