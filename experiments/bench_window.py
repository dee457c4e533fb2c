"""The sliding-window branch on each backend, forward and backward, against cuDNN dense causal
attention in the same run (issue 5, deliverable 3: cuDNN's left window, or a kernel of ours where
it is faster or needed).

Backends (nsa_jax.ops.WINDOW_BACKENDS): "cudnn" (cuDNN's sliding window, forward and backward;
d_v zero-padded to d_k when they differ), "cudnn-fwd" (its forward, the Pallas Triton backward of
pallas_kernels.window_attention), "triton" (the Pallas kernels both ways). With --segments the
inputs are packed documents, which cuDNN's window does not take: "triton" against the plain-JAX
banded path ("xla", what a GPU ran before these kernels).

  python3 -m experiments.bench_window                      (a GPU; writes window_<gpu>.{json,md})
  python3 -m experiments.bench_window --shapes 256:1:4/1:64/64 --iters 1   (CPU: code paths only)

--check first compares every backend's output and gradients with the plain-JAX path at a small
shape, compiled, and stops if one is off. Records: op "window", impl "window-<backend>", pass
"fwd" / "bwd" (the backward read as (forward + backward) - forward), cudnn_ms the dense causal
attention of the same shape, plus vs_cudnn_window (the "cudnn" backend's ms over this row's; with
--segments vs_xla, the plain-JAX path's). tflops counts the window's query-key pairs without
document cuts, so with --segments it is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_common as bc
from experiments.bench_nsa import compiled, mem, with_grad
from nsa_jax import ops

DEFAULT_SHAPES = ("65536:1:64/4:128/128,65536:1:64/4:192/128,32768:1:64/4:128/128,"
                  "16384:1:64/4:128/128,8192:8:16/1:64/64")


def parse_shape(spec):
  """"T:B:H/K:dk/dv" -> (T, B, H, K, dk, dv)."""
  try:
    t, b, hk, dims = spec.split(":")
    h, k = hk.split("/")
    dk, dv = dims.split("/")
    out = tuple(int(x) for x in (t, b, h, k, dk, dv))
  except ValueError:
    raise ValueError(f"shape {spec!r}: expected T:batch:q_heads/kv_heads:d_k/d_v, e.g. "
                     "65536:1:64/4:128/128") from None
  if min(out) < 1 or out[2] % out[3]:
    raise ValueError(f"shape {spec!r}: sizes must be positive and q_heads a multiple of kv_heads")
  return out


def inputs(key, t, b, h, k, dk, dv, segments):
  ks = jax.random.split(key, 5)
  q = jax.random.normal(ks[0], (b, t, h, dk), jnp.bfloat16)
  kk = jax.random.normal(ks[1], (b, t, k, dk), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, k, dv), jnp.bfloat16)
  ct = jax.random.normal(ks[3], (b, t, h, dv), jnp.bfloat16)
  seg = None
  if segments:  # ~T / 4096 cuts at uniformly random places
    cuts = np.sort(np.asarray(jax.random.randint(ks[4], (b, max(1, t // 4096)), 0, t)), axis=-1)
    seg = jnp.asarray((np.arange(t)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)
  return q, kk, v, ct, seg


def window_fn(backend, window, seg, tiling=None):
  if tiling is None:  # what the op runs
    return lambda q, k, v: (ops.window_attention(q, k, v, window, seg, backend=backend),)
  from pallas_kernels import window_attention as wk
  interpret = jax.default_backend() != "gpu"
  return lambda q, k, v: (wk.window_attention(q, k, v, window, seg, tiling=tiling,
                                              backend=backend, interpret=interpret)[0],)


def parse_tilings(spec):
  """"name:field=value;field=value,..." -> {name: CmpTiling} over the window kernels' default
  (pallas_kernels.window_attention.WINDOW_TILING); an unknown field is refused."""
  import dataclasses
  from pallas_kernels import window_attention as wk
  fields = {f.name for f in dataclasses.fields(wk.WINDOW_TILING)}
  out = {}
  for item in (x for x in spec.split(",") if x):
    name, _, body = item.partition(":")
    kw = {}
    for pair in (x for x in body.split(";") if x):
      f, _, v = pair.partition("=")
      if f not in fields:
        raise ValueError(f"tiling {item!r}: unknown field {f!r}; expected some of "
                         f"{sorted(fields)}")
      kw[f] = v.lower() == "true" if v.lower() in ("true", "false") else int(v)
    out[name] = dataclasses.replace(wk.WINDOW_TILING, **kw)
  return out


def check(key, window, backends):
  """Compiled outputs and gradients of each backend against the plain-JAX path (bf16, T = 2048,
  16/4 heads, 128/128 and 64/32); {backend/dims: max relative errors}. Raises when one is off."""
  res = {}
  for dk, dv in ((128, 128), (64, 32)):
    q, k, v, ct, _ = inputs(key, 2048, 1, 16, 4, dk, dv, False)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    ref = jax.jit(with_grad(window_fn("xla", window, None)))((f32(q, k, v)), ct)
    ref_o = jax.jit(window_fn("xla", window, None))(*f32(q, k, v))[0]
    for be in backends:
      o = jax.jit(window_fn(be, window, None))(q, k, v)[0]
      g = jax.jit(with_grad(window_fn(be, window, None)))([q, k, v], ct)
      rel = lambda a, r: float(jnp.max(jnp.abs(a.astype(jnp.float32) - r))  # noqa: E731
                               / (jnp.max(jnp.abs(r)) + 1e-6))
      errs = dict(o=rel(o, ref_o), **{n: rel(a, r) for n, a, r in zip("qkv", g, ref)})
      res[f"{be} {dk}/{dv}"] = {n: round(e, 5) for n, e in errs.items()}
      if max(errs.values()) > 0.03:
        raise SystemExit(f"--check: backend {be} at {dk}/{dv} is off the plain-JAX path: {errs}")
  return res


def comparison(records):
  """Markdown: per shape and pass, each backend's ms side by side (fastest in bold)."""
  backends = list(dict.fromkeys(r["impl"] for r in records))
  rows = {}
  for r in records:
    rows.setdefault((r["T"], r["batch"], r["q_heads"], r["kv_heads"], r["d_k"], r["d_v"],
                     r["pass"]), {})[r["impl"]] = r["ms"]
  lines = ["| T | batch | heads | d_k/d_v | pass | " + " | ".join(backends) + " | dense cuDNN |",
           "|" + "---|" * (len(backends) + 6)]
  dense = {(r["T"], r["batch"], r["q_heads"], r["kv_heads"], r["d_k"], r["d_v"], r["pass"]):
           r["cudnn_ms"] for r in records}
  for key, ms in rows.items():
    best = min((v for v in ms.values() if v > 0), default=None)
    cell = lambda v: "" if v is None else (f"**{v}**" if v == best else str(v))  # noqa: E731
    t, b, h, k, dk, dv, pass_ = key
    lines.append(f"| {t} | {b} | {h}/{k} | {dk}/{dv} | {pass_} | "
                 + " | ".join(cell(ms.get(be)) for be in backends) + f" | {dense[key]} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default=DEFAULT_SHAPES,
                 help="comma-separated T:batch:q_heads/kv_heads:d_k/d_v")
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--backends", default=",".join(ops.WINDOW_BACKENDS))
  p.add_argument("--segments", action="store_true",
                 help="packed documents: the Pallas kernels against the plain-JAX path")
  p.add_argument("--tilings", default="",
                 help="extra Triton tilings, name:field=value;field=value,... (e.g. "
                      "rows128:rows=128); each runs as backend triton-<name>")
  p.add_argument("--check", action="store_true")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--name", default="", help="file name (default window_<gpu>[_segments])")
  p.add_argument("--out", default="benchmarks/results")
  a = p.parse_args(argv)
  try:
    shapes = [parse_shape(s) for s in a.shapes.split(",") if s]
  except ValueError as e:
    p.error(str(e))
  backends = [b for b in a.backends.split(",") if b]
  bad = [b for b in backends if b not in ops.WINDOW_BACKENDS + ("xla",)]
  if bad:
    p.error(f"--backends {bad}: expected some of {ops.WINDOW_BACKENDS + ('xla',)}")
  try:
    tilings = parse_tilings(a.tilings)
  except ValueError as e:
    p.error(str(e))
  if a.segments:
    backends = [b for b in backends if b == "triton"] + ["xla"]
  bc.require_gpu(p, [s[0] for s in shapes], how=" (e.g. --shapes 256:1:4/1:64/64 --iters 1)")
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu:
    backends = [b for b in backends if b in ("triton", "xla")]  # cuDNN needs a GPU
  key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
  out = {}
  if a.check:
    out["check"] = check(key, a.window, [b for b in backends if b != "xla"])
    print("CHECK", json.dumps(out["check"]), flush=True)
  records = []
  for t, b, h, k, dk, dv in shapes:
    q, kk, v, ct, seg = inputs(key, t, b, h, k, dk, dv, a.segments)
    dd = max(dk, dv)
    dq = jax.random.normal(key, (b, t, h, dd), jnp.bfloat16)
    dkk = jax.random.normal(key, (b, t, k, dd), jnp.bfloat16)
    dense_fn = lambda q, k, v: (jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="cudnn" if on_gpu else None),)
    dense = {}
    dense["fwd"] = bc.time_ms(compiled(dense_fn, dq, dkk, dkk), dq, dkk, dkk, iters=a.iters)
    dense["fwd_bwd"] = bc.time_ms(compiled(with_grad(dense_fn), [dq, dkk, dkk], dq),
                                  [dq, dkk, dkk], dq, iters=a.iters)
    del dq, dkk
    times = {}
    runs = [(be, window_fn(be, a.window, seg)) for be in backends]
    runs += [(f"triton-{n}", window_fn("triton", a.window, seg, til)) for n, til in tilings.items()]
    for be, fn in runs:
      try:
        fexe = compiled(fn, q, kk, v)
        bexe = compiled(with_grad(fn), [q, kk, v], ct)
        times[be] = dict(fwd=bc.time_ms(fexe, q, kk, v, iters=a.iters),
                         fwd_bwd=bc.time_ms(bexe, [q, kk, v], ct, iters=a.iters),
                         temp_bytes=mem(bexe).get("temp_bytes"))
      except Exception as e:  # e.g. out of memory on the plain-JAX path: record and go on
        print(f"FAILED {be} T={t}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    pairs = bc.nsa_pairs(t, 32, 16, 64, 16, a.window)["window"]
    for be, r in times.items():
      for pass_ in ("fwd", "bwd"):
        ms = r["fwd"] if pass_ == "fwd" else r["fwd_bwd"] - r["fwd"]
        dms = dense["fwd"] if pass_ == "fwd" else dense["fwd_bwd"] - dense["fwd"]
        ref = times.get("cudnn" if not a.segments else "xla")
        ref_ms = ref and (ref["fwd"] if pass_ == "fwd" else ref["fwd_bwd"] - ref["fwd"])
        flops = b * bc.attn_flops(pairs, h, dk, dv, pass_)
        rec = bc.record(op="window", impl=f"window-{be}", pass_=pass_, t=t, batch=b, q_heads=h,
                        kv_heads=k, d_k=dk, d_v=dv, ms=ms, cudnn_ms=dms, window=a.window,
                        segments=a.segments, tflops=round(flops / (ms * 1e9), 1) if ms > 0
                        else None, fwd_bwd_ms=round(r["fwd_bwd"], 4),
                        temp_bytes=r["temp_bytes"])
        if ref_ms:
          rec["vs_" + ("cudnn_window" if not a.segments else "xla")] = (
              round(ref_ms / ms, 3) if ms > 0 else None)
        records.append(rec)
        print(f"T={t} B={b} {h}/{k} {dk}/{dv} {be:9s} {pass_}: {ms:8.3f} ms "
              f"(dense cuDNN {dms:8.3f} ms)", flush=True)
  name = a.name or f"window_{bc.device_tag()}" + ("_segments" if a.segments else "")
  pre = (f"# Window branch by backend (w = {a.window})\n\n"
         f"Command: `{bc.command_line()}`. {bc.hardware()}, {bc.utc_now()}, code "
         f"{bc.code_commit()}. ms: median of {a.iters}; bwd = (fwd + bwd) - fwd; cudnn_ms: dense "
         f"causal cuDNN of the same shape in the same run; vs_* = that backend's ms over this "
         f"row's." + (f"\n\nCheck (max relative error against the plain-JAX path): "
                      f"`{json.dumps(out['check'])}`" if "check" in out else ""))
  pre += "\n\n" + comparison(records)
  bc.write_results(records, a.out, name, pre)
  print(bc.markdown_table(records, extra_cols=("tflops",)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
