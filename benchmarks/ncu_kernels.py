"""Hardware-counter profile (Nsight Compute) of the NSA kernels that bound the 64k targets.

Runs each case ONCE (one launch of each of its kernels), so that `ncu` profiles exactly one launch
per kernel. Meant to be run under ncu on the H200 (Firecracker machines read the counters):

  ncu --clock-control none --set full -k regex:'nsa_|mosaic' -o $OUT/prof \
      python3 benchmarks/ncu_kernels.py --cases topn,random_fwd,clustered_fwd
  python3 benchmarks/ncu_report.py $OUT/prof.ncu-rep ...   (on the machine: CSV -> table)

Cases (paper shape: B=1, 64 query / 4 KV heads, l=32, d=16, l'=64, n=16; --dims 128/128):
  (always, first)  the Triton compression forward (nsa_cmp_fwd), which gives the top-n's lse
  topn           block scores + top-n as shipped (nsa_select_topn_scores / _pick: TWO_PASS)
  topn_head_first  the same with select_topn.HEAD_FIRST forced on (head sum before the band;
                 the default with TWO_PASS since 2026-12-03, off when ncu_h200.md was taken)
  random_fwd     selection forward, "random" lists (backend="auto": the per-token Triton tile)
  clustered_fwd  selection forward, "clustered" lists (backend="auto": Mosaic GPU union tile)
  random_bwd     selection backward, random lists (dq, dK/dV, reduce)
  window_bwd     NSA's window branch (w = 512) forward + backward at the 8k training layer
                 (B = 8, T = 8192, 16 / 1 heads, 64/64; not the flags' shape): nsa_win_fwd / _dq
                 / _dkv without document ids
  window_bwd_ids the same with document ids (mean 16384 tokens, as benchmarks/doc_mask_trial.py):
                 with ids the dq kernel took 0.85 vs 0.57 ms on an H100 (windoc_h100_s45)
Off a GPU (interpret mode, T <= 4096) it only checks that the cases run; nothing is profiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import dense_doc_trial  # noqa: E402
from experiments.bench_kernels import index_pattern, make_qkv  # noqa: E402
from pallas_kernels.compress_attention import compress_attention  # noqa: E402
from pallas_kernels.select_attention import select_attention  # noqa: E402
from pallas_kernels import select_topn as st  # noqa: E402
from pallas_kernels.select_topn import select_topn  # noqa: E402
from pallas_kernels.window_attention import window_attention  # noqa: E402

CASES = ("topn", "topn_head_first", "random_fwd", "clustered_fwd", "random_bwd", "window_bwd",
         "window_bwd_ids")
L, D, LP, N = 32, 16, 64, 16


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--T", type=int, default=65536)
  p.add_argument("--dims", default="128/128", help="d_k/d_v")
  p.add_argument("--heads", default="64/4", help="query heads / KV heads")
  p.add_argument("--cases", default="topn,random_fwd,clustered_fwd", help=f"comma list of {CASES}")
  a = p.parse_args(argv)
  cases = [c for c in a.cases.split(",") if c]
  bad = [c for c in cases if c not in CASES]
  if bad:
    p.error(f"unknown case(s) {bad}; known: {list(CASES)}")
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and a.T > 4096:
    p.error(f"T={a.T} off a GPU: the kernels run in the Pallas interpreter here; use --T <= 4096 "
            "for a dry run, or run on the GPU under ncu (see the module docstring)")
  interp = not on_gpu
  dk, dv = (int(x) for x in a.dims.split("/"))
  h, kh = (int(x) for x in a.heads.split("/"))
  t, b = a.T, 1
  nc = (t - L) // D + 1
  q, k, v, do = make_qkv(jax.random.key(2), b, t, h, kh, dk, dv)
  kc = jax.random.normal(jax.random.key(5), (b, nc, kh, dk), jnp.bfloat16)
  vc = jax.random.normal(jax.random.key(6), (b, nc, kh, dv), jnp.bfloat16)
  cmp = jax.jit(lambda q, kc, vc: compress_attention(q, kc, vc, L, D, interpret=interp))
  # one jitted function per top-n case: jit's trace cache would otherwise ignore the flag
  topn, topn_hf = (jax.jit(lambda q, kc, lse: select_topn(
      q, kc, lse, block=L, stride=D, sel_block=LP, num_selected=N, interpret=interp))
      for _ in range(2))
  sel = jax.jit(lambda q, k, v, idx: select_attention(q, k, v, idx, LP, backend="auto",
                                                      interpret=interp)[0])
  sel_vjp = jax.jit(lambda q, k, v, idx, do: jax.vjp(
      lambda q, k, v: select_attention(q, k, v, idx, LP, backend="auto", interpret=interp)[0],
      q, k, v)[1](do))
  # Everything the cases need that is not profiled (inputs, lse, block lists) is computed first.
  lse = jax.block_until_ready(cmp(q, kc, vc)[1])  # nsa_cmp_fwd: profiled once here
  idx = {pat: jax.block_until_ready(index_pattern(jax.random.key(3), b, t, kh, N, LP, pat))
         for pat in ("random", "clustered")}
  # Compile every case before any runs (compiling launches no kernels of ours).
  run = {"topn": (topn, (q, kc, lse)), "topn_head_first": (topn_hf, (q, kc, lse)),
         "random_fwd": (sel, (q, k, v, idx["random"])),
         "clustered_fwd": (sel, (q, k, v, idx["clustered"])),
         "random_bwd": (sel_vjp, (q, k, v, idx["random"], do))}
  if any(c.startswith("window") for c in cases):  # their own inputs, built only when asked for
    # The window cases' shape: the 8k training layer on a GPU, a small one for the dry run.
    wb, wt, wh, wd = (8, 8192, 16, 64) if on_gpu else (1, min(t, 256), 4, 16)
    wq, wk_, wv, wct, wseg = dense_doc_trial.inputs(jax.random.key(7), wt, wb, wh, 1, wd, wd,
                                                    q.dtype, 16384 if on_gpu else 64)
    win_vjp = jax.jit(lambda q, k, v, ct, *s: jax.vjp(
        lambda q, k, v: window_attention(q, k, v, 512 if on_gpu else 32, *s,
                                         interpret=interp)[0], q, k, v)[1](ct))
    run.update(window_bwd=(win_vjp, (wq, wk_, wv, wct)),
               window_bwd_ids=(win_vjp, (wq, wk_, wv, wct, wseg)))
  exes, default = {}, st.HEAD_FIRST
  try:
    for c in cases:  # select_topn reads HEAD_FIRST while tracing
      st.HEAD_FIRST = True if c == "topn_head_first" else default
      exes[c] = run[c][0].trace(*run[c][1]).lower().compile()
  finally:
    st.HEAD_FIRST = default
  for c in cases:
    t0 = time.perf_counter()
    jax.block_until_ready(exes[c](*run[c][1]))
    print(f"ncu_kernels: {c} T={t} heads={h}/{kh} dims={dk}/{dv} ran in "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms (one call; under ncu this includes replay)",
          flush=True)


if __name__ == "__main__":
  main()
