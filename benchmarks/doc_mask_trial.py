# Trial: what document ids cost our window kernels run as dense causal attention (w = T, what
# ops.dense_attention's "auto" runs on a GPU with segment ids), per CmpTiling switch of the masked
# paths, against the same kernels without ids and cuDNN's causal call without ids, all in one run.
#   python3 benchmarks/doc_mask_trial.py --out=DIR [--shapes=8192:8:16/1:64/64]
#       [--docs=none,4096,16384] [--variants=default,no_seg_split,...] [--window=W]
# --window=W (W < T): NSA's sliding-window branch instead (op "window_doc"), against cuDNN's
# sliding window without ids (ops.window_attention backend "cudnn") as the baseline.
# docs: "none" (no ids) or a mean document length in tokens (random cuts, as dense_doc_trial).
# variants: default (the tiling's defaults), no_seg_split (CmpTiling.seg_unmasked_steps off: the
# forward and dq kernels compare ids on every key step), dkv_masked_ids (bwd_unmasked_with_ids
# off: the dK/dV kernel compares ids on every query tile), dkv_w4 (the dK/dV kernel with 4 warps,
# the launch without ids), dkv_w8_s2 (8 warps, 2 stages), dkv_masked_ids_w4_s2; dq_w4 / dq_s3 (the
# dq kernel with 4 warps / 3 stages), dq_bk32 / dq_bk128 (keys per dq step), dq_rows64 (64-row dq
# tiles), each with the dK/dV kernel as by default with ids; seg_bounds (the forward and dq kernels
# take each row's run start as its document's first key: one loop, no id compares),
# seg_bounds_dq_w4, dkv_w8_s3, dq_w8 (the window dq's 8 warps of before
# 2026-12-07; since then 4 at w < T and small heads, compress_attention.dq_warps).
# Per row: forward ms, backward ms ((fwd + bwd) - fwd, medians) and the device kernels of one
# fwd+bwd call from a profiler trace (ms per kernel name: nsa_win_fwd / _dq / _dkv and the XLA
# rest), and the largest |difference| of output and gradients from the first variant's (the
# switches change no value). Writes DIR/<name>.{json,md} after every row. The variants' names
# changed on 2026-12-06 as the defaults did: each results folder's table says what ran.
import argparse
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.dense_doc_trial import fwd_bwd_ms, inputs
from experiments import bench_common as bc
from experiments.bench_window import parse_shape
from nsa_jax import ops
from pallas_kernels import window_attention as wk

VARIANTS = {
    "default": {},
    "no_seg_split": dict(seg_unmasked_steps=False),
    "dkv_masked_ids": dict(bwd_unmasked_with_ids=False),
    "dkv_w4": dict(dkv_num_warps=4),
    "dkv_w8_s2": dict(dkv_num_warps=8, dkv_num_stages=2),
    "dkv_masked_ids_w4_s2": dict(bwd_unmasked_with_ids=False, dkv_num_warps=4, dkv_num_stages=2),
    # the dq kernel's launch / tile, the dK/dV kernel's kept at its with-ids default (8 warps,
    # 3 stages) where the variant changes the shared fields (why dq costs +50% with ids at w = 512)
    "dq_w4": dict(bwd_num_warps=4, dkv_num_warps=8, dkv_num_stages=3),
    "dq_s3": dict(bwd_num_stages=3, dkv_num_warps=8, dkv_num_stages=3),
    "dq_bk32": dict(dq_block_k=32),
    "dq_bk128": dict(dq_block_k=128),
    "dq_rows64": dict(bwd_rows=64, dkv_rows=128),
    "seg_bounds": dict(seg_bounds=True),
    "seg_bounds_dq_w4": dict(seg_bounds=True, bwd_num_warps=4, dkv_num_warps=8, dkv_num_stages=3),
    "dkv_w8_s3": dict(dkv_num_warps=8, dkv_num_stages=3),
    "dq_w8": dict(dq_num_warps=8),  # the window dq's launch before 2026-12-07 (now 4 at w < T)
}

COLS = ("window", "docs", "documents_per_row", "kernels_fwd_bwd_ms", "max_abs_diff_vs_first")


def kernel_ms(fn, args, keys=("nsa_win_fwd", "nsa_win_dq", "nsa_win_dkv")):
  """{kernel group: ms} of one call, from a profiler trace (empty without a GPU). keys: the groups
  (a kernel joins the first key its name holds, else "other"); None: each kernel name (its first
  40 characters) on its own."""
  groups = {}
  with tempfile.TemporaryDirectory() as d:
    for name, _, us in bc.kernel_profile(fn, args, d, top=0):
      name = name.split("] ", 1)[-1]
      key = name[:40] if keys is None else next((k for k in keys if k in name), "other")
      groups[key] = round(groups.get(key, 0.0) + us / 1e3, 4)
  return groups


def run_variant(attn, q, kk, v, ct, iters, on_gpu, ref=None, keys=("nsa_win_fwd", "nsa_win_dq",
                                                                   "nsa_win_dkv"), extra=()):
  """Time attn(q, kk, v, *extra) (fwd_bwd_ms: extra are arguments, not constants) and trace its
  fwd+bwd kernels on a GPU: (fwd ms, bwd ms, kernel_ms, (output, gradients), largest |difference|
  of those from ref's; 0.0 without ref)."""
  fwd, bwd, f, fb = fwd_bwd_ms(attn, q, kk, v, ct, iters, extra)
  kernels = kernel_ms(fb, (q, kk, v, *extra), keys) if on_gpu else {}
  got = (f(q, kk, v, *extra),) + tuple(fb(q, kk, v, *extra))
  diff = 0.0 if ref is None else max(
      float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
      for x, y in zip(got, ref))
  return fwd, bwd, kernels, got, diff


def variants_and_docs(p, a, known):
  """a.variants and a.docs as lists, checked: each variant one of `known`, each document setting
  "none" or a positive mean length (else p.error names the bad value)."""
  variants = [v for v in a.variants.split(",") if v]
  for v in variants:
    if v not in known:
      p.error(f"--variants: {v!r} is not one of {tuple(known)}")
  docs = [d for d in a.docs.split(",") if d]
  for d in docs:
    if d != "none" and not (d.isdigit() and int(d) > 0):
      p.error(f"--docs: {d!r} is neither 'none' nor a positive mean document length")
  return variants, docs


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", required=True)
  p.add_argument("--shapes", default="8192:8:16/1:64/64")
  p.add_argument("--docs", default="none,4096,16384")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--name", default="doc_mask_trial")
  p.add_argument("--window", type=int, default=0,
                 help="a window w < T: NSA's window branch (default 0: w = T, dense causal)")
  a = p.parse_args(argv)
  if a.window < 0:
    p.error(f"--window={a.window}: expected 0 (w = T) or a positive window")
  variants, docs = variants_and_docs(p, a, VARIANTS)
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  recs = []
  for shape in a.shapes.split(","):
    t, b, h, k, dk, dv = parse_shape(shape)
    w = a.window if 0 < a.window < t else t
    op = "dense_doc" if w == t else "window_doc"
    base_f = base_b = None
    if on_gpu:  # cuDNN without ids (causal, or its sliding window): the baseline of every row
      q, kk, v, ct, _ = inputs(jax.random.key(0), t, b, h, k, dk, dv, dtype, 4096)
      base_f, base_b = fwd_bwd_ms(
          (lambda q, kk, v: ops.dense_attention(q, kk, v, implementation="cudnn")) if w == t else
          (lambda q, kk, v: ops.window_attention(q, kk, v, w, backend="cudnn")), q, kk, v, ct,
          a.iters)[:2]
      print(f"{shape} cudnn w={w}, no ids: fwd {base_f:.3f} ms, bwd {base_b:.3f} ms", flush=True)
    for doc in docs:
      q, kk, v, ct, seg = inputs(jax.random.key(0), t, b, h, k, dk, dv, dtype,
                                 4096 if doc == "none" else int(doc))
      s = None if doc == "none" else seg
      docs_per_row = 1.0 if s is None else round(float((seg[:, -1] - seg[:, 0]).mean()) + 1, 2)
      ref = None
      for name in variants:
        tiling = dataclasses.replace(wk.WINDOW_TILING, **VARIANTS[name])
        fwd, bwd, kernels, got, diff = run_variant(
            lambda q, kk, v, *s, tiling=tiling: wk.window_attention(
                q, kk, v, w, *s, tiling=tiling, interpret=not on_gpu)[0], q, kk, v, ct, a.iters,
            on_gpu, ref, extra=() if s is None else (s,))
        ref = got if ref is None else ref
        print(f"{shape} docs={doc} {name}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms, kernels "
              f"{kernels}, max |diff| vs {variants[0]} {diff:.2e}", flush=True)
        for pass_, ms, base in (("fwd", fwd, base_f), ("bwd", bwd, base_b)):
          recs.append(bc.record(op=op, impl=f"pallas {name}", pass_=pass_, t=t, batch=b,
                                q_heads=h, kv_heads=k, d_k=dk, d_v=dv, ms=ms, cudnn_ms=base,
                                window=w, docs=doc, documents_per_row=docs_per_row,
                                kernels_fwd_bwd_ms=kernels, max_abs_diff_vs_first=diff))
        bc.write_results(recs, a.out, a.name, preamble=(
            f"# Document ids in the window kernels at w = {'T' if w == t else w} ({bc.hardware()}, "
            f"{bc.utc_now()})\n\ncudnn_ms: cuDNN's {'causal call' if w == t else 'sliding window'} "
            "without ids, same run. kernels_fwd_bwd_ms: device "
            "kernels of one fwd+bwd call. Command: "
            f"`{bc.command_line()}`."), extra_cols=COLS)
  print(bc.markdown_table(recs, extra_cols=COLS))
  return recs


if __name__ == "__main__":
  main()
