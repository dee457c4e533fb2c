"""GPU benchmark of the whole NSA op (forward, backward) with a per-branch breakdown, against cuDNN
dense causal attention timed in the same run; peak memory from the compiled executables; optional
layer-level rows (NSAAttention vs DenseAttention, projections included).

Run on the H200 (writes <out>/nsa_<gpu>.json, e.g. nsa_h200.json, + .md as it goes, prints a
table at the end):
  python3 -m experiments.bench_nsa --check --T 8192,16384,32768,65536 --dims 128/128,192/128 \
      --breakdown_T 8192,65536 --long_T 131072 --layer_T 16384,65536 --out $OUT
  python3 -m experiments.bench_nsa --plot benchmarks/results/nsa_h200.json  # Markdown + PNG (CPU)
    (includes benchmarks/results/nsa_h200_notes.md, the hand-written reading, when present)
Paper settings: bf16, B=1, 64 query / 4 KV heads, l=32, d=16, l'=64, n=16, w=512. cuDNN needs
d_k == d_v, so the paper's d_k=192/d_v=128 is compared with dense attention at 192/192.
"bwd" rows are (forward + backward) - forward, for NSA and dense alike (fwd_bwd_ms is kept too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_common as bc
from nsa_jax import ops, xla
from nsa_jax.config import NSAConfig
from pallas_kernels import _common as C
from pallas_kernels import compress_fold as cmp_fold
from pallas_kernels.compress_attention import compress_attention
from pallas_kernels.select_attention import select_attention
from pallas_kernels.select_topn import select_topn

START = time.time()
CMP_TILING = "v2: bwd 128-row tiles, 8 warps"  # v1 (first H200 run): 64-row dq / dK-dV tiles
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU  # lets the script be dry-run on a CPU with tiny shapes
FOLD_IMPL = "cudnn" if ON_GPU else "xla"  # compress_fold: XLA attention stands in off a GPU
BATCH = 1  # --batch: sequences per call (every op, cuDNN and layer call)
IMPL = "pallas"  # --impl: the whole op's implementation ("pallas", "pallas-triton", "pallas-mosaic")
MATMUL_FLOPS = None  # measured bf16 matmul rate (FLOP/s) on a GPU, or --matmul_tflops


def flop_fields(op, pass_, t, cfg, ms, cudnn_ms, batch=None, matmul=None):
  """tflops (achieved), flop_floor_ms (FLOPs / matmul rate) and cudnn_tflops for a record of the
  whole op or a branch (bench_common.nsa_flops); forward "nsa" rows also carry the floor with the
  top-n's QK^T recompute (flop_floor_built_ms). {} for ops without a count (e.g. "layer"); rates
  and ratios only where the time is positive (a "bwd" difference can come out <= 0 on a CPU).
  Ratios come from unrounded values; the stored ones keep 4 significant digits."""
  fl = bc.nsa_flops(t, BATCH if batch is None else batch, cfg.num_heads, cfg.head_dim, cfg.dim_v,
                    block=cfg.cmp_block, stride=cfg.cmp_stride, sel_block=cfg.sel_block,
                    num_selected=cfg.num_selected, window=cfg.window)
  if (op, pass_) not in fl or ms is None:
    return {}
  sig = lambda x: float(f"{x:.4g}")
  flops = fl[(op, pass_)]
  out = dict(tflop=sig(flops / 1e12))
  if ms > 0:
    out["tflops"] = sig(flops / (ms * 1e9))
  if cudnn_ms and cudnn_ms > 0:
    out["cudnn_tflops"] = sig(fl[("dense", pass_)] / (cudnn_ms * 1e9))
  rate = MATMUL_FLOPS if matmul is None else matmul
  if rate:
    floor = flops / rate * 1e3
    out.update(matmul_tflops=sig(rate / 1e12), flop_floor_ms=sig(floor))
    if ms > 0:
      out["ms_over_floor"] = sig(ms / floor)
    if op == "nsa" and pass_ == "fwd":
      out["flop_floor_built_ms"] = sig(fl[("nsa_built", pass_)] / rate * 1e3)
  return out


def paper_cfg(h, kh, dk, dv):
  return NSAConfig(num_heads=h, num_kv_heads=kh, head_dim=dk, head_dim_v=dv,
                   implementation="pallas")


def make_inputs(key, t, cfg):
  """q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win (bf16, N(0,1)) and gates (f32 in (0, 1))."""
  b, h, kh, dk, dv = BATCH, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim_v
  nc = cfg.num_cmp_blocks(t)
  shapes = [(b, t, h, dk), (b, nc, kh, dk), (b, nc, kh, dv), (b, t, kh, dk), (b, t, kh, dv),
            (b, t, kh, dk), (b, t, kh, dv)]
  ks = jax.random.split(key, len(shapes) + 1)
  args = [jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(ks, shapes)]
  return args + [jax.nn.sigmoid(jax.random.normal(ks[-1], (b, t, h, 3), jnp.float32))]


def with_grad(fn):
  """(args, ct) -> grads of <fn(*args)[0], ct> w.r.t. args (float inputs only)."""
  def f(args, ct):
    diff = [i for i, a in enumerate(args)
            if not (hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.integer))]

    def part(*d):
      full = list(args)
      for i, x in zip(diff, d):
        full[i] = x
      return fn(*full)[0]
    out, vjp = jax.vjp(part, *[args[i] for i in diff])
    return vjp(ct.astype(out.dtype))
  return f


def compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def mem(exe):
  """Bytes from the compiled executable: temporaries, arguments, outputs."""
  try:
    m = exe.memory_analysis()
    return dict(temp_bytes=int(m.temp_size_in_bytes), arg_bytes=int(m.argument_size_in_bytes),
                out_bytes=int(m.output_size_in_bytes))
  except Exception as e:  # not every backend reports it
    return dict(mem_error=str(e))


class Bench:
  """Times (fwd, fwd+bwd) pairs and writes records incrementally."""

  def __init__(self, out, iters, budget_s):
    self.out, self.iters, self.budget_s, self.records = out, iters, budget_s, []

  def over_budget(self):
    return time.time() - START > self.budget_s

  def time_pair(self, fn, args, ct, with_bwd=True, iters=None):
    iters = iters or self.iters
    fexe = compiled(fn, *args)
    res = dict(fwd=bc.time_ms(fexe, *args, iters=iters), fwd_mem=mem(fexe))
    if with_bwd:
      g = with_grad(fn)
      bexe = compiled(g, args, ct)
      res["fwd_bwd"] = bc.time_ms(bexe, args, ct, iters=iters)
      res["bwd_mem"] = mem(bexe)
    return res

  def add(self, op, impl, t, cfg, res, dense, **extra):
    base = dict(t=t, batch=BATCH, q_heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, d_k=cfg.head_dim,
                d_v=cfg.dim_v)
    for pass_ in ("fwd", "bwd"):
      if pass_ == "fwd":
        ms, dms = res["fwd"], dense and dense["fwd"]
      elif "fwd_bwd" in res:
        ms = res["fwd_bwd"] - res["fwd"]
        dms = dense and dense["fwd_bwd"] - dense["fwd"]
      else:
        continue
      ex = dict(extra)
      if pass_ == "bwd":
        ex.update(fwd_bwd_ms=round(res["fwd_bwd"], 4), **res.get("bwd_mem", {}))
        if dense:
          ex.update(cudnn_fwd_bwd_ms=round(dense["fwd_bwd"], 4),
                    cudnn_temp_bytes=dense.get("bwd_mem", {}).get("temp_bytes"))
      else:
        ex.update(res.get("fwd_mem", {}))
      ex.update(flop_fields(op, pass_, t, cfg, ms, dms))
      ex["cmp_tiling"] = CMP_TILING
      ex["fold_cudnn_backward"] = ops.FOLD_CUDNN_BACKWARD
      ex["window_backend"] = os.environ.get("NSA_WINDOW_BACKEND") or "rule"
      self.records.append(bc.record(op=op, impl=impl, pass_=pass_, ms=ms, cudnn_ms=dms, **base,
                                    **ex))
    self.flush()

  def flush(self):
    os.makedirs(self.out, exist_ok=True)
    with open(os.path.join(self.out, f"nsa_{bc.device_tag()}.json"), "w") as f:
      json.dump(self.records, f, indent=1)


# ----------------------------------------------------------------------------- measurements

def dense_fn(dd):
  impl = "cudnn" if ON_GPU else None

  def f(q, k, v):
    return (jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl),)
  return f


def bench_dense(bench, key, t, cfg):
  dd = max(cfg.head_dim, cfg.dim_v)
  ks = jax.random.split(key, 4)
  h, kh = cfg.num_heads, cfg.num_kv_heads
  args = [jax.random.normal(ks[0], (BATCH, t, h, dd), jnp.bfloat16),
          jax.random.normal(ks[1], (BATCH, t, kh, dd), jnp.bfloat16),
          jax.random.normal(ks[2], (BATCH, t, kh, dd), jnp.bfloat16)]
  ct = jax.random.normal(ks[3], (BATCH, t, h, dd), jnp.bfloat16)
  res = bench.time_pair(dense_fn(dd), args, ct)
  res["dd"] = dd
  return res


def bench_whole(bench, key, t, cfg, dense):
  args = make_inputs(key, t, cfg)
  ct = jax.random.normal(jax.random.fold_in(key, 7), (BATCH, t, cfg.num_heads, cfg.dim_v), jnp.bfloat16)
  fn = lambda *a: (ops.nsa_attention(*a, cfg, implementation=IMPL),)
  res = bench.time_pair(fn, args, ct)
  bench.add("nsa", IMPL, t, cfg, res, dense, dense_dim=dense["dd"])
  return args


def bench_branches(bench, key, t, cfg, dense, args):
  """compress (fwd, bwd), topn (fwd), select (fwd, bwd), window (fwd, bwd) on the op's inputs."""
  q, kc, vc, ks_, vs_, kw, vw, _ = args
  l, d, lp, w = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.window
  ct = jax.random.normal(jax.random.fold_in(key, 9), (BATCH, t, cfg.num_heads, cfg.dim_v), jnp.bfloat16)
  cmp = lambda q, kc, vc: compress_attention(q, kc, vc, l, d, interpret=INTERPRET)
  bench.add("compress", "pallas", t, cfg, bench.time_pair(cmp, [q, kc, vc], ct), dense)
  if ON_GPU:  # the same branch as one cuDNN call on folded queries (what "pallas" runs)
    fold = lambda q, kc, vc: cmp_fold.compressed_attention(q, kc, vc, l, d)
    bench.add("compress", "cudnn-fold", t, cfg, bench.time_pair(fold, [q, kc, vc], ct), dense)
  _, lse = jax.jit(cmp)(q, kc, vc)
  topn = lambda q, kc, lse: (select_topn(q, kc, lse, block=l, stride=d, sel_block=lp,
                                         num_selected=cfg.num_selected, interpret=INTERPRET),)
  bench.add("topn", "pallas", t, cfg, bench.time_pair(topn, [q, kc, lse], None, with_bwd=False),
            dense)
  idx = jax.jit(topn)(q, kc, lse)[0]  # an argument, not a closure constant (XLA would fold it)
  sel = lambda q, k, v, idx: select_attention(q, k, v, jax.lax.stop_gradient(idx), lp,
                                              interpret=INTERPRET)
  bench.add("select", "pallas", t, cfg, bench.time_pair(sel, [q, ks_, vs_, idx], ct), dense,
            pattern="nsa-topn", mean_union4=round(float(C.mean_union(idx, C.UNION_TOKENS)), 2))
  win = lambda q, k, v: (ops.window_attention(q, k, v, w),)
  be = ops.window_backend(q, vw)
  impl = {"cudnn": "cudnn-window", "xla": "xla"}.get(be, "window-" + be)
  bench.add("window", impl, t, cfg, bench.time_pair(win, [q, kw, vw], ct), dense)


def bench_layer(bench, key, t, d_model=2560):
  """NSAAttention vs DenseAttention (d_k = d_v = 128, projections and phi included)."""
  from flax import nnx
  from nsa_jax.attention import DenseAttention, NSAAttention
  cfg = paper_cfg(64, 4, 128, 128)
  x = jax.random.normal(key, (BATCH, t, d_model), jnp.bfloat16)
  ct = jax.random.normal(jax.random.fold_in(key, 1), (BATCH, t, d_model), jnp.bfloat16)
  res = {}
  for name, make in (("nsa", lambda r: NSAAttention(d_model, cfg, dtype="bfloat16", rngs=r)),
                     ("dense", lambda r: DenseAttention(d_model, 64, 4, 128, dtype="bfloat16",
                                                        rngs=r))):
    gdef, state = nnx.split(make(nnx.Rngs(0)))
    fn = lambda st, x, gdef=gdef: (nnx.merge(gdef, st)(x),)
    res[name] = bench.time_pair(fn, [state, x], ct)
  bench.add("layer", "NSAAttention/pallas", t, cfg, res["nsa"], res["dense"], d_model=d_model,
            dense_impl="DenseAttention/cudnn")


# The top-n launches timed by --sweep_parts topn: (rows, chunk, warps, stages). The 2026-11-29
# sweep found 32-block chunks and 128 rows slower (with the merges in the kernel; the 128-row and
# 32-block launches are here again for TWO_PASS). rows None: select_topn's own rule
# (select_topn.default_rows: 128 rows for long rows at d_k = 128, G = 16, else 64).
TOPN_LAUNCHES = ((None, 16, 4, 2), (64, 16, 4, 2), (64, 16, 2, 2), (64, 16, 8, 2), (64, 16, 4, 1),
                 (64, 16, 4, 3), (32, 16, 2, 2), (128, 16, 4, 2), (128, 16, 8, 2), (64, 32, 4, 2),
                 (128, 32, 8, 2), (128, 16, 4, 3), (256, 16, 8, 2), (128, 16, 2, 2))


def sweep(key, t, cfg, parts=("cmp", "topn")):
  """Tiling variants of the compression and top-n kernels at one shape: [(name, fwd, fwd_bwd)]."""
  from pallas_kernels.compress_attention import CmpTiling
  args = make_inputs(key, t, cfg)
  q, kc, vc = args[:3]
  l, d = cfg.cmp_block, cfg.cmp_stride
  ct = jax.random.normal(key, (BATCH, t, cfg.num_heads, cfg.dim_v), jnp.bfloat16)
  bench = Bench("/tmp", 5, 1e9)
  out = []
  # dK/dV programs per key tile (the 2026-11-29 sweep of rows / block sizes chose the rest).
  cmp_variants = tuple((f"cmp dkv splits {k}", CmpTiling(bwd_splits=k)) for k in (8, 1, 4, 16))
  cmp_variants += (("cmp dkv splits 8, every tile masked", CmpTiling(bwd_unmasked_tiles=False)),)
  cmp_variants = cmp_variants if "cmp" in parts else ()
  if "mosaic" in parts:  # the experimental Mosaic GPU forward against the default Triton one
    cmp_variants = (("cmp triton", CmpTiling()), ("cmp mosaic-gpu fwd", CmpTiling())) + cmp_variants
  for name, til in cmp_variants:
    be = "mosaic" if "mosaic" in name else "triton"
    fn = lambda q, kc, vc, til=til, be=be: compress_attention(q, kc, vc, l, d, tiling=til,
                                                              interpret=INTERPRET, backend=be)
    r = bench.time_pair(fn, [q, kc, vc], ct)
    out.append((name, r["fwd"], r["fwd_bwd"]))
    print("SWEEP", out[-1], flush=True)
  if "topn" not in parts and "topnvar" not in parts:
    return out
  _, lse = jax.jit(lambda q, kc, vc: compress_attention(q, kc, vc, l, d,
                                                        interpret=INTERPRET))(q, kc, vc)
  if "topnvar" in parts:
    out += topn_variants(q, kc, lse, cfg, bench)
  if "topn" not in parts:
    return out
  for rows, chunk, warps, stages in TOPN_LAUNCHES:
    fn = lambda q, kc, lse, rows=rows, chunk=chunk, warps=warps, stages=stages: (select_topn(
        q, kc, lse, block=l, stride=d, sel_block=cfg.sel_block, num_selected=cfg.num_selected,
        rows=rows, sel_chunk=chunk, num_warps=warps, num_stages=stages, interpret=INTERPRET),)
    r = bench.time_pair(fn, [q, kc, lse], None, with_bwd=False)
    out.append((f"topn rows{rows} chunk{chunk} w{warps} s{stages}" if rows else
                "topn default rule", r["fwd"], None))
    print("SWEEP", out[-1], flush=True)
  return out


# The top-n kernel's optional code paths timed by --sweep_parts topnvar: name -> flags of
# pallas_kernels.select_topn set on top of the defaults. Each runs with the tile rows the rule
# gives it (select_topn.default_rows: 128 only with TWO_PASS, so at 32k-64k 128/128 the rows
# without TWO_PASS also differ in tile size from "default").
TOPN_FLAG_SETS = {
    "default": {},
    "loop merge": {"CARRY_VEC": False, "RANK_MERGE": False, "TWO_PASS": False},
    "rank_merge": {"CARRY_VEC": False, "RANK_MERGE": True, "TWO_PASS": False},
    "rank_merge+carry_vec": {"CARRY_VEC": True, "RANK_MERGE": True, "TWO_PASS": False},
    # "default" is TWO_PASS with HEAD_FIRST and the pick's default launch (2026-12-03)
    "two_pass, no head_first": {"TWO_PASS": True, "HEAD_FIRST": False, "CARRY_VEC": True},
    "two_pass, first pick launch": {"TWO_PASS": True, "PICK_ELEMS": 8192, "PICK_LOOP": False},
    "two_pass, pick 2 rows unrolled": {"TWO_PASS": True, "PICK_ELEMS": 2048, "PICK_LOOP": False},
    "head_first, no two_pass": {"TWO_PASS": False, "HEAD_FIRST": True},
}


def topn_variants(q, kc, lse, cfg, bench):
  """The top-n kernel's optional code paths (TOPN_FLAG_SETS) at the default launch parameters,
  each checked against the first's indices (the same blocks expected, up to float-order
  near-ties): [(name, fwd_ms, None, {"same_slots": fraction})]."""
  from pallas_kernels import select_topn as st
  names = {k for flags in TOPN_FLAG_SETS.values() for k in flags}
  saved = {k: getattr(st, k) for k in names}
  out, base = [], None
  try:
    for name, flags in TOPN_FLAG_SETS.items():
      for k, v in saved.items():
        setattr(st, k, flags.get(k, v))
      fn = lambda q, kc, lse: (select_topn(q, kc, lse, block=cfg.cmp_block, stride=cfg.cmp_stride,
                                           sel_block=cfg.sel_block, num_selected=cfg.num_selected,
                                           interpret=INTERPRET),)
      exe = compiled(fn, q, kc, lse)  # flags are read while tracing: one compile per set
      ms = bc.time_ms(exe, q, kc, lse, iters=bench.iters)
      idx = exe(q, kc, lse)[0]
      base = idx if base is None else base
      same = float(jnp.mean((idx == base).astype(jnp.float32)))
      out.append((f"topn {name}", ms, None, {"same_slots": round(same, 6)}))
      print("SWEEP", out[-1], flush=True)
      del idx
  finally:
    for k, v in saved.items():
      setattr(st, k, v)
  return out


def fold_sweep(key, ts, dims_list, heads, out_dir):
  """The compression branch three ways at each T and head dims (--heads, --batch): the Triton
  kernels, the cuDNN fold forward + backward (pallas_kernels.compress_fold) and the cuDNN fold forward with
  the Triton backward (compress_attention(backend="cudnn")). Where ops.FOLD_MIN_BLOCKS comes
  from. Saved as nsa_foldsweep.json: [{T, d_k, d_v, batch, variant, fwd_ms, fwd_bwd_ms}]."""
  bench = Bench("/tmp", 5, 1e9)
  rows = []
  for dims in dims_list:
    dk, dv = (int(x) for x in dims.split("/"))
    for t in ts:
      cfg = paper_cfg(*heads, dk, dv)
      q, kc, vc = make_inputs(key, t, cfg)[:3]
      l, d = cfg.cmp_block, cfg.cmp_stride
      ct = jax.random.normal(key, (BATCH, t, cfg.num_heads, dv), jnp.bfloat16)
      variants = {
          "triton": lambda q, kc, vc: compress_attention(q, kc, vc, l, d, interpret=INTERPRET),
          "cudnn-fold": lambda q, kc, vc: cmp_fold.compressed_attention(
              q, kc, vc, l, d, implementation=FOLD_IMPL),
          "cudnn-fwd+triton-bwd": lambda q, kc, vc: compress_attention(
              q, kc, vc, l, d, interpret=INTERPRET, backend="cudnn")}
      for name, fn in variants.items():
        try:
          r = bench.time_pair(fn, [q, kc, vc], ct)
          rows.append(dict(T=t, d_k=dk, d_v=dv, batch=BATCH, q_heads=cfg.num_heads,
                           kv_heads=cfg.num_kv_heads, num_cmp=cfg.num_cmp_blocks(t), variant=name,
                           fwd_ms=round(r["fwd"], 4), fwd_bwd_ms=round(r["fwd_bwd"], 4)))
        except Exception as e:  # record it, go on
          rows.append(dict(T=t, d_k=dk, d_v=dv, batch=BATCH, variant=name,
                           failed=f"{type(e).__name__}: {str(e)[:300]}"))
        print("FOLD", json.dumps(rows[-1]), flush=True)
      del q, kc, vc
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "nsa_foldsweep.json"), "w") as f:
    json.dump(dict(**bc.provenance(), rows=rows), f, indent=1)
  return rows


def profile(key, t, cfg, out_dir):
  """Device kernels (jax.profiler) of one forward and one forward+backward of the whole op at T=t:
  where the time goes, XLA glue included. Saved as nsa_profile.json."""
  args = make_inputs(key, t, cfg)
  ct = jax.random.normal(jax.random.fold_in(key, 7), (BATCH, t, cfg.num_heads, cfg.dim_v), jnp.bfloat16)
  fn = lambda *a: (ops.nsa_attention(*a, cfg, implementation=IMPL),)
  fwd, fwd_bwd = compiled(fn, *args), compiled(with_grad(fn), args, ct)
  res = dict(T=t, batch=BATCH, impl=IMPL, d_k=cfg.head_dim, d_v=cfg.dim_v, q_heads=cfg.num_heads,
             kv_heads=cfg.num_kv_heads, **bc.provenance(),
             fwd=bc.kernel_profile(fwd, args, os.path.join(out_dir, "trace_fwd")),
             fwd_bwd=bc.kernel_profile(fwd_bwd, [args, ct], os.path.join(out_dir, "trace_fwd_bwd")))
  for name in ("fwd", "fwd_bwd"):
    total = sum(us for _, _, us in res[name])
    print(f"PROFILE {name} T={t}: {total / 1e3:.2f} ms in the top {len(res[name])} kernels", flush=True)
    for k, n, us in res[name][:12]:
      print(f"  {us / 1e3:9.3f} ms  x{n:<4d} {k[:110]}", flush=True)
  with open(os.path.join(out_dir, "nsa_profile.json"), "w") as f:
    json.dump(res, f, indent=1)
  return res


def relerr(a, b):
  """||a - b|| / ||b|| in float32."""
  return float(jnp.linalg.norm((a - b).astype(jnp.float32)) /
               (jnp.linalg.norm(b.astype(jnp.float32)) + 1e-30))


def check(key, t, cfg):
  """Compiled kernels vs the plain-JAX path (bf16 inputs): errors and top-n agreement."""
  args = make_inputs(key, t, cfg)
  q, kc, vc, ks_ = args[:4]
  be = "mosaic" if IMPL == "pallas-mosaic" else "triton"
  o, lse = jax.jit(lambda q, kc, vc: compress_attention(q, kc, vc, cfg.cmp_block, cfg.cmp_stride,
                                                        interpret=INTERPRET, backend=be))(q, kc, vc)
  xo, xlse, xidx = jax.jit(lambda *a: xla.compressed_attention_and_select(*a, cfg))(q, kc, vc, ks_)
  idx = jax.jit(lambda q, kc, lse: select_topn(
      q, kc, lse, block=cfg.cmp_block, stride=cfg.cmp_stride, sel_block=cfg.sel_block,
      num_selected=cfg.num_selected, interpret=INTERPRET))(q, kc, xlse)
  fin = jnp.isfinite(xlse)
  f32 = lambda x: x.astype(jnp.float32)
  out = dict(T=t, batch=BATCH, impl=IMPL, cmp_o_maxerr=float(jnp.max(jnp.abs(f32(o) - f32(xo)))),
             cmp_lse_maxerr=float(jnp.max(jnp.where(fin, jnp.abs(lse - xlse), 0.0))),
             lse_inf_pattern_equal=bool(jnp.all(jnp.isfinite(lse) == fin)),
             topn_slots_equal_frac=float(jnp.mean(idx == xidx)),
             topn_rows_equal_frac=float(jnp.mean(jnp.all(idx == xidx, axis=-1))))
  # The cuDNN fold of the compression branch (XLA attention in its place off a GPU): its o and
  # lse, the top-n fed by that lse, and the gradients of the fold (cuDNN backward), of the fold
  # forward + Triton backward, and of the Triton kernels, each against the plain-JAX branch.
  l, d = cfg.cmp_block, cfg.cmp_stride
  fold = lambda q, kc, vc: cmp_fold.compressed_attention(q, kc, vc, l, d, implementation=FOLD_IMPL)
  fo, flse = jax.jit(fold)(q, kc, vc)
  fidx = jax.jit(lambda q, kc, lse: select_topn(
      q, kc, lse, block=l, stride=d, sel_block=cfg.sel_block, num_selected=cfg.num_selected,
      interpret=INTERPRET))(q, kc, flse)
  out.update(fold_impl=FOLD_IMPL, fold_o_maxerr=float(jnp.max(jnp.abs(f32(fo) - f32(xo)))),
             fold_lse_maxerr=float(jnp.max(jnp.where(fin, jnp.abs(flse - xlse), 0.0))),
             fold_lse_inf_pattern_equal=bool(jnp.all(jnp.isfinite(flse) == fin)),
             fold_topn_rows_equal_frac=float(jnp.mean(jnp.all(fidx == xidx, axis=-1))))
  cto = jax.random.normal(jax.random.fold_in(key, 3), fo.shape, jnp.float32)
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f32(f(*a)[0]) * cto), (0, 1, 2)))(q, kc, vc)
  gx = grads(lambda q, kc, vc: xla.compressed_attention_and_select(q, kc, vc, ks_, cfg))
  for name, f in (("fold", fold),
                  ("fold_fwd_triton_bwd", lambda q, kc, vc: compress_attention(
                      q, kc, vc, l, d, interpret=INTERPRET, backend="cudnn")),
                  ("triton", lambda q, kc, vc: compress_attention(q, kc, vc, l, d,
                                                                  interpret=INTERPRET))):
    out[f"{name}_grad_relerr"] = {n: relerr(a, b) for n, a, b in
                                  zip(("q", "k_cmp", "v_cmp"), grads(f), gx)}
  ct = jax.random.normal(key, (BATCH, t, cfg.num_heads, cfg.dim_v), jnp.bfloat16)
  op = lambda impl: (lambda *a: (ops.nsa_attention(*a, cfg, implementation=impl),))
  for name, impl in (("pallas", IMPL), ("xla", "xla")):
    out[name] = (jax.jit(op(impl))(*args)[0].astype(jnp.float32),
                 jax.jit(with_grad(op(impl)))(args, ct))
  (po, pg), (xo2, xg) = out.pop("pallas"), out.pop("xla")
  out["nsa_o_relerr"] = relerr(po, xo2)
  # which compression path the whole op took at this T (the fold from ops.FOLD_MIN_BLOCKS on)
  out["nsa_cmp_path"] = (ops._auto_cmp_backend(args[0], args[2], None) if IMPL == "pallas"
                         else {"pallas-triton": "triton", "pallas-mosaic": "mosaic"}[IMPL])
  names = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")
  out["nsa_grad_relerr"] = {n: relerr(a, b) for n, a, b in zip(names, pg, xg)}
  return out


# ----------------------------------------------------------------------------- report

TARGETS = (("fwd", 6.0), ("bwd", 5.0))


def summary(records):
  """Markdown lines: where each target of the issue stands (T=65536, 192/128 and 128/128)."""
  lines = []
  for dims in ((192, 128), (128, 128)):
    rows = [r for r in records if r["op"] == "nsa" and (r["d_k"], r["d_v"]) == dims]
    for pass_, goal in TARGETS:
      r64 = [r for r in rows if r["pass"] == pass_ and r["T"] == 65536]
      if r64:
        s = r64[0]["speedup"]
        lines.append(f"- d_k/d_v={dims[0]}/{dims[1]}, {pass_} at T=65536: {s:.2f}x vs cuDNN "
                     f"(target >= {goal}x: {'MET' if s >= goal else 'NOT met'})")
        lines += floor_lines(r64[0], goal)
      pts = sorted((r["T"], r["speedup"]) for r in rows if r["pass"] == pass_)
      if pts:
        lines.append(f"- d_k/d_v={dims[0]}/{dims[1]}, {pass_}: " + crossover_line(pts))
  return lines


def crossover_line(pts):
  """Where the speed-up stays above 1, from sorted (T, speed-up) pairs, and the 16k target's
  verdict; a run that timed no T <= 16384 cannot say the target is missed."""
  above = [t for t, s in pts if s > 1]
  cross = next((t for t, _ in pts if all(s > 1 for t2, s in pts if t2 >= t)), None)
  where = "never" if cross is None else str(cross)
  if cross is not None and cross == pts[0][0]:
    where += " or shorter (the shortest T timed)"
  if cross is not None and cross == pts[0][0] > 16384:  # above 1 everywhere timed, 16k not timed
    verdict = "not measured (no T <= 16384 timed)"
  else:
    verdict = "MET" if cross is not None and cross <= 16384 else "NOT met"
  return (f"speed-up > 1 at T = {above}; crossover (above 1 from here on): {where}; "
          f"16k target {verdict}")


def floor_lines(r, goal):
  """Why a target stands where it does: the time it allows against the FLOP floor (the branches'
  floors added, as they run one after another now), and the FLOP rates of both sides (empty when
  the record has no FLOP fields)."""
  if "tflops" not in r or not r.get("cudnn_ms"):
    return []
  budget = r["cudnn_ms"] / goal
  out = [f"  - {goal}x allows {budget:.2f} ms; the op ran {r['ms']:.2f} ms at {r['tflops']} "
         f"TFLOP/s on its {r['tflop']} TFLOP (compress + select + window matmuls), cuDNN at "
         f"{r.get('cudnn_tflops')} TFLOP/s"]
  if r.get("flop_floor_ms"):
    floor, built = r["flop_floor_ms"], r.get("flop_floor_built_ms")
    line = (f"  - FLOP floor at the {r['matmul_tflops']} TFLOP/s matmul rate: {floor:.2f} ms"
            + (f" ({built:.2f} ms with the top-n's QK^T recompute)" if built else "")
            + f"; {goal}x needs the op's own FLOPs at {floor / budget:.0%} of the matmul rate")
    if built:
      line += f" ({built / budget:.0%} counting the recompute)"
    out.append(line)
  return out


def floor_report(path, matmul_tflops):
  """<stem>_floor.md from a committed results file: every nsa / branch row with its FLOPs, its
  achieved rate and the FLOP floor at a matmul rate given by the caller (say where it was
  measured). The timings are the file's; only the FLOP arithmetic is added."""
  records = json.load(open(path))
  rate = matmul_tflops * 1e12
  rows = []
  for r in records:
    cfg = NSAConfig(num_heads=r["q_heads"], num_kv_heads=r["kv_heads"], head_dim=r["d_k"],
                    head_dim_v=r["d_v"])
    ff = flop_fields(r["op"], r["pass"], r["T"], cfg, r["ms"], r.get("cudnn_ms"), batch=r["batch"],
                     matmul=rate)
    if ff:
      rows.append(dict(r, **ff))
  stem = os.path.splitext(path)[0]
  cols = ["op", "impl", "pass", "T", "d_k", "d_v", "ms", "tflop", "tflops", "flop_floor_ms",
          "ms_over_floor", "cudnn_ms", "cudnn_tflops", "speedup"]
  lines = [f"# FLOP floors of `{os.path.basename(path)}`", "",
           f"Timings from `{os.path.basename(path)}` ({rows[0]['hardware'] if rows else ''}, "
           f"{rows[0]['date'] if rows else ''}); FLOPs counted by `bench_common.nsa_flops` (matmuls "
           f"only: forward QK^T + PV, backward 3 d_k- + 2 d_v-sized products; the top-n row counts "
           f"its QK^T recompute); floor = FLOPs / {matmul_tflops} TFLOP/s (the bf16 matmul rate "
           f"given to `--matmul_tflops`). Command: `python3 -m experiments.bench_nsa --floor "
           f"{path} --matmul_tflops {matmul_tflops}`"]
  best = max((r for r in rows if r.get("cudnn_tflops")), key=lambda r: r["cudnn_tflops"],
             default=None)
  if best:
    lines.append(f"The fastest cuDNN row of the file ran at {best['cudnn_tflops']} TFLOP/s (T = "
                 f"{best['T']}, {best['d_k']}/{best['d_v']}): the given rate is a measurement, "
                 f"not a ceiling. Floors of branches are added as if they run one after another "
                 f"(as they do now); kernels that overlap the L2-bound selection with the "
                 f"compute-bound branches would have a lower bound.")
  lines += ["", "## Targets (T=65536)", "", *summary(rows), "", table(rows, cols)]
  with open(stem + "_floor.md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines[:20]))
  return stem + "_floor.md"


def plot(path):
  """Markdown table + speed-up PNG next to the JSON."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  records = json.load(open(path))
  stem = os.path.splitext(path)[0]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (dk, dv) in sorted({(r["d_k"], r["d_v"]) for r in records if r["op"] == "nsa"}):
    for pass_, style in (("fwd", "-o"), ("bwd", "--s")):
      pts = sorted((r["T"], r["speedup"]) for r in records
                   if r["op"] == "nsa" and r["pass"] == pass_ and (r["d_k"], r["d_v"]) == (dk, dv))
      if pts:
        vs = f" (vs dense {max(dk, dv)}/{max(dk, dv)})" if dk != dv else ""
        ax.plot(*zip(*pts), style, label=f"NSA {pass_}, d_k/d_v={dk}/{dv}{vs}")
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("sequence length T")
  ax.set_ylabel("speed-up over cuDNN dense causal")
  r0 = records[0] if records else {}
  ax.set_title(f"NSA (Pallas) vs cuDNN, H200, bf16, B={r0.get('batch', 1)}, "
               f"{r0.get('q_heads', 64)} q / {r0.get('kv_heads', 4)} KV heads")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=120)
  r0 = records[0] if records else {}
  pre = "\n".join([
      "# NSA whole op and branches vs cuDNN dense causal attention",
      "", f"Hardware: {r0.get('hardware')}. Date: {r0.get('date')}.",
      f"Command: `{r0.get('command')}`",
      "", f"Paper block settings: bf16, B={r0.get('batch', 1)}, {r0.get('q_heads', 64)} query heads, "
      f"{r0.get('kv_heads', 4)} KV heads, l=32, d=16, l'=64, n=16, w=512.",
      "cuDNN needs d_k == d_v: the 192/128 rows are compared with dense attention at 192/192.",
      "`bwd` = (forward + backward) - forward for both sides; `fwd_bwd_ms` holds the sum.",
      "Branch rows (compress, topn, select, window) carry the dense time of the same pass,",
      "for scale.",
      "", "## Targets (T=65536)", "", *summary(records)])
  if os.path.exists(stem + "_notes.md"):  # hand-written reading of the results
    pre += "\n\n" + open(stem + "_notes.md").read().strip()
  cmds = sorted({r["command"] for r in records})
  pre += "\n\nCommands of the runs merged here:\n" + "\n".join(f"- `{c}`" for c in cmds)
  with open(stem + ".md", "w") as f:
    f.write(pre + "\n\n" + table(records) + "\n")


def table(records, cols=None):
  """Markdown table with the base fields plus backward sums and compiled temporary memory (or
  the columns `cols`)."""
  cols = cols or ["op", "impl", "pass", "T", "d_k", "d_v", "ms", "cudnn_ms", "speedup", "tflops",
                  "flop_floor_ms", "fwd_bwd_ms", "cudnn_fwd_bwd_ms", "temp_GB", "cudnn_temp_GB",
                  "cmp_tiling"]
  gb = lambda x: None if x is None else round(x / 2 ** 30, 2)
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in records:
    row = dict(r, temp_GB=gb(r.get("temp_bytes")), cudnn_temp_GB=gb(r.get("cudnn_temp_bytes")),
               cmp_tiling=(r.get("cmp_tiling") or "")[:2])
    lines.append("| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in cols) + " |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--T", default="8192,16384,32768,65536")
  p.add_argument("--dims", default="128/128,192/128")
  p.add_argument("--heads", default="64/4")
  p.add_argument("--impl", default="pallas", choices=["pallas", "pallas-triton", "pallas-mosaic"],
                 help="the whole op's implementation (pallas: selection backend picked per shape; "
                      "pallas-triton: Triton kernels only; pallas-mosaic: Mosaic GPU selection and "
                      "compression kernels wherever they apply)")
  p.add_argument("--batch", type=int, default=1,
                 help="batch size of every op and cuDNN call (e.g. 8 with --heads 16/1 --dims 64/64 "
                      "--T 8192: one layer of configs/small_gpu_nsa.py's training step)")
  p.add_argument("--breakdown_T", default="65536")
  p.add_argument("--long_T", default="")
  p.add_argument("--layer_T", default="")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--budget_s", type=float, default=1e9)
  p.add_argument("--check", action="store_true")
  p.add_argument("--check_T", type=int, default=0,
                 help="length of --check's comparison (default 2048 on a GPU, 256 off one), at "
                      "the last --dims entry. The whole op folds the compression branch into cuDNN "
                      "as in the timed tables from 16384 at d_k == d_v (forward and backward) and "
                      "from 32768 at d_k != d_v (forward only); the record's nsa_cmp_path says "
                      "which path ran")
  p.add_argument("--sweep_T", type=int, default=0)
  p.add_argument("--sweep_parts", default="cmp,topn",
                 help="which kernels --sweep_T varies: cmp, topn (launch parameters), topnvar "
                      "(the top-n kernel's optional code paths), mosaic (Mosaic GPU compression "
                      "forward vs Triton)")
  p.add_argument("--sweep_dims", default="192/128", help="d_k/d_v of the --sweep_T shape")
  p.add_argument("--fold_sweep_T", default="",
                 help="time the compression branch as Triton kernels, the cuDNN fold, and the "
                      "cuDNN fold forward + Triton backward at these T (each --dims entry, "
                      "--heads, --batch); writes nsa_foldsweep.json")
  p.add_argument("--fold_backward", choices=("cudnn", "triton"), default="cudnn",
                 help="backward under the compression fold's forward at d_k == d_v: cuDNN (the "
                      "default, nsa_jax.ops.FOLD_CUDNN_BACKWARD) or the Triton kernels")
  p.add_argument("--plot", default="")
  p.add_argument("--floor", default="",
                 help="write <stem>_floor.md for a results JSON: FLOPs, achieved TFLOP/s and the "
                      "FLOP floor of each row at --matmul_tflops (runs on a CPU)")
  p.add_argument("--matmul_tflops", type=float, default=0.0,
                 help="bf16 matmul rate for the FLOP floors (default: measured at start on a GPU; "
                      "needed with --floor)")
  p.add_argument("--profile_T", type=int, default=0,
                 help="also save the device kernels of the whole op (fwd, fwd+bwd) at this T and "
                      "the last --dims entry as nsa_profile.json (jax.profiler)")
  p.add_argument("--out", default="benchmarks/results")
  a = p.parse_args(argv)
  if a.plot:
    return plot(a.plot)
  if a.floor:
    if a.matmul_tflops <= 0:
      p.error("--floor needs --matmul_tflops (the measured bf16 matmul rate, e.g. from the "
              "run's own log or bench_decode's header)")
    floor_report(a.floor, a.matmul_tflops)
    return 0
  ints = lambda s: [int(x) for x in s.split(",") if x]
  # (--breakdown_T only acts on lengths that --T / --long_T also run)
  bc.require_gpu(p, ints(a.T) + ints(a.long_T) + ints(a.layer_T) + ints(a.fold_sweep_T)
                 + [a.sweep_T, a.profile_T, a.check_T],
                 how=" (e.g. --T 256 --breakdown_T 256)")
  global BATCH, IMPL
  IMPL = a.impl
  ops.FOLD_CUDNN_BACKWARD = a.fold_backward == "cudnn"  # recorded in every row
  if a.batch < 1:
    raise SystemExit(f"--batch={a.batch}: needs a positive batch size")
  BATCH = a.batch
  h, kh = ints(a.heads.replace("/", ","))
  global MATMUL_FLOPS
  if a.matmul_tflops > 0:
    MATMUL_FLOPS = a.matmul_tflops * 1e12
  elif ON_GPU:
    MATMUL_FLOPS = bc.measure_peaks()[0]
  if MATMUL_FLOPS:
    print(f"bf16 matmul rate for the FLOP floors: {MATMUL_FLOPS / 1e12:.0f} TFLOP/s", flush=True)
  bench = Bench(a.out, a.iters, a.budget_s)
  key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
  if a.check:
    dk, dv = ints(a.dims.split(",")[-1].replace("/", ","))
    try:
      res = check(key, a.check_T or (2048 if ON_GPU else 256), paper_cfg(h, kh, dk, dv))
    except Exception as e:  # e.g. a kernel that does not compile: record it, time the rest
      res = dict(impl=IMPL, failed=f"{type(e).__name__}: {str(e)[:600]}")
    print("CHECK", json.dumps(res), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "nsa_check.json"), "w") as f:
      json.dump(res, f, indent=1)
  if a.profile_T:
    dk, dv = ints(a.dims.split(",")[-1].replace("/", ","))
    profile(key, a.profile_T, paper_cfg(h, kh, dk, dv), a.out)
  if a.fold_sweep_T:
    fold_sweep(key, ints(a.fold_sweep_T), a.dims.split(","), (h, kh), a.out)
  if a.sweep_T:
    sdk, sdv = ints(a.sweep_dims.replace("/", ","))
    res = sweep(key, a.sweep_T, paper_cfg(h, kh, sdk, sdv), parts=a.sweep_parts.split(","))
    os.makedirs(a.out, exist_ok=True)
    rows = [dict(variant=r[0], fwd_ms=r[1], fwd_bwd_ms=r[2], **(r[3] if len(r) > 3 else {}))
            for r in res]
    with open(os.path.join(a.out, "nsa_sweep.json"), "w") as f:
      json.dump(dict(**bc.provenance(), T=a.sweep_T, d_k=sdk, d_v=sdv, q_heads=h, kv_heads=kh,
                     batch=BATCH, rows=rows), f, indent=1)
  plan = [(dims, t) for dims in a.dims.split(",") for t in ints(a.T)]
  plan += [(dims, t) for dims in a.dims.split(",") for t in ints(a.long_T)]
  for dims, t in plan:
    if bench.over_budget():
      print(f"budget reached: skipping {dims} T={t}", flush=True)
      continue
    dk, dv = ints(dims.replace("/", ","))
    cfg = paper_cfg(h, kh, dk, dv)
    try:
      dense = bench_dense(bench, key, t, cfg)
      args = bench_whole(bench, key, t, cfg, dense)
      if t in ints(a.breakdown_T) and not bench.over_budget():
        bench_branches(bench, key, t, cfg, dense, args)
      del args
    except Exception as e:  # e.g. out of memory at the longest T: record and go on
      print(f"FAILED {dims} T={t}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"[{time.time() - START:.0f}s] done {dims} T={t}", flush=True)
  for t in ints(a.layer_T):
    if bench.over_budget():
      break
    try:
      bench_layer(bench, key, t)
    except Exception as e:
      print(f"FAILED layer T={t}: {type(e).__name__}: {str(e)[:300]}", flush=True)
  print(table(bench.records))
  print("\n".join(summary(bench.records)))


if __name__ == "__main__":
  sys.exit(main())
