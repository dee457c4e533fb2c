# Trial: what packed documents (segment ids) cost NSA's selection branch at the 8k training layer.
# Without ids that layer's selection runs the Mosaic GPU union tile alone (static_union); the
# Mosaic kernels take no ids, so with ids the call runs the Triton kernels (the lax.cond between
# the union and the per-token tile). The H100 profile of the masked 8k step (2026-12-06,
# benchmarks/results/profdoc_nsa_h100_s41/) put the selection at 67.8 ms a step with ids against
# 50.2 ms without: this trial says how much of that is Triton against Mosaic and how much the id
# tests themselves.
#   python3 benchmarks/select_doc_trial.py --out=DIR [--shapes=8k] [--docs=none,4096,16384]
#       [--variants=auto,auto_no_ids,auto_triton_ids,auto_triton_dkv_ids,mosaic_dkv_ids,triton,
#                   triton_no_ids,triton_union4,triton_union4_no_ids,mosaic_ids]
# docs: "none" (one document a row) or a mean document length in tokens (random cuts, as
# benchmarks/dense_doc_trial.py). The block lists are the whole op's own for those documents
# (compression lse, then the top-n kernel, both with the ids). Variants: auto (what training
# runs: select_attention's backend="auto" with the library's settings; with ids at these shapes on
# Hopper the Mosaic union tile alone taking the ids since select_attention_mgpu.SEGMENT_IDS went
# on, 2026-12-07, and its dK/dV partials too since DKV_SEGMENT_IDS went on the same day),
# auto_triton_dkv_ids ("auto" with DKV_SEGMENT_IDS off: Mosaic forward and dq, the Triton dK/dV
# taking the ids), auto_triton_ids ("auto" with SEGMENT_IDS off: the Triton union tile alone,
# STATIC_UNION_IDS, what "auto" ran with ids before that), triton (backend="triton": the lax.cond
# between the union and the per-token tile, what "auto" ran with ids before STATIC_UNION_IDS),
# triton_union4 (the Triton union tile alone as an explicit tiling), mosaic_ids (backend="mosaic"
# with SEGMENT_IDS on: the Mosaic forward and dq with the ids as document bounds, dK/dV as
# DKV_SEGMENT_IDS says; at these shapes the same kernels as "auto"), mosaic_dkv_ids ("auto" with
# select_attention_mgpu.SEGMENT_IDS and DKV_SEGMENT_IDS both forced on: the library's defaults
# since 2026-12-07, so the same kernels as "auto" now);
# "_no_ids": the same call on the same lists
# without the ids (a different function: only the timing compares). Per row: forward ms, backward
# ms ((fwd + bwd) - fwd, medians), the device kernels of one fwd+bwd call from a profiler trace
# (ms per kernel name) and the largest |difference| of output and gradients from the first
# variant with the same ids setting. Writes DIR/<name>.{json,md} after every row.
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.dense_doc_trial import fwd_bwd_ms, segments
from benchmarks.doc_mask_trial import run_variant, variants_and_docs
from experiments import bench_common as bc
from pallas_kernels import _common as C
from pallas_kernels import select_attention_mgpu as mgpu
from pallas_kernels.compress_attention import compress_attention
from pallas_kernels.select_attention import select_attention
from pallas_kernels.select_topn import select_topn

SHAPES = {  # name: (B, T, H, K, d_k, d_v)
    "8k": (8, 8192, 16, 1, 64, 64),
    "16k": (4, 16384, 16, 1, 64, 64),
    "tiny": (1, 256, 16, 1, 32, 32),  # a CPU smoke test (interpret mode)
    "tiny64": (1, 128, 16, 1, 64, 64),  # the same with head dims the Mosaic kernels take
}
L, D, LP, N = 32, 16, 64, 16  # compression block / stride, selection block, top-n (paper)
VARIANTS = {  # name: (backend, union tile alone, with the ids, select_attention_mgpu flags set)
    "auto": ("auto", False, True, {}),
    "auto_no_ids": ("auto", False, False, {}),
    "auto_triton_ids": ("auto", False, True, {"SEGMENT_IDS": False}),
    "auto_triton_dkv_ids": ("auto", False, True, {"DKV_SEGMENT_IDS": False}),
    "mosaic_dkv_ids": ("auto", False, True, {"SEGMENT_IDS": True, "DKV_SEGMENT_IDS": True}),
    "triton": ("triton", False, True, {}),
    "triton_no_ids": ("triton", False, False, {}),
    "triton_union4": ("triton", True, True, {}),
    "triton_union4_no_ids": ("triton", True, False, {}),
    "mosaic_ids": ("mosaic", False, True, {"SEGMENT_IDS": True}),
}
COLS = ("docs", "documents_per_row", "ids", "kernels_fwd_bwd_ms", "max_abs_diff_vs_first")


def topn_lists(key, q, kh, seg, interpret):
  """The whole op's block lists [B, T, K, n] for these documents: the compression branch's lse on
  N(0, 1) compressed keys (as benchmarks/select_bwd_trial.py), then the top-n kernel (forced
  initial and local blocks), both with the ids."""
  b, t, _, dk = q.shape
  kc = jax.random.normal(key, (b, (t - L) // D + 1, kh, dk), jnp.bfloat16)
  _, lse = jax.jit(lambda q, kc: compress_attention(q, kc, kc, L, D, seg, interpret=interpret))(
      q, kc)
  return jax.jit(lambda q, kc, lse: select_topn(
      q, kc, lse, block=L, stride=D, sel_block=LP, num_selected=N, segment_ids=seg,
      interpret=interpret))(q, kc, lse)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", required=True)
  p.add_argument("--shapes", default="8k")
  p.add_argument("--docs", default="none,4096,16384")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--name", default="select_doc_trial")
  a = p.parse_args(argv)
  variants, docs = variants_and_docs(p, a, VARIANTS)
  for s in a.shapes.split(","):
    if s not in SHAPES:
      p.error(f"--shapes: {s!r} is not one of {tuple(SHAPES)}")
  on_gpu = jax.default_backend() == "gpu"
  interpret = not on_gpu
  recs = []
  for shape in a.shapes.split(","):
    b, t, h, kh, dk, dv = SHAPES[shape]
    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (b, t, h, dk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kh, dk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kh, dv), jnp.bfloat16)
    ct = jax.random.normal(ks[3], (b, t, h, dv), jnp.bfloat16)
    base_f = base_b = None
    if on_gpu:  # cuDNN's causal call without ids: the baseline of every row
      from nsa_jax import ops
      base_f, base_b = fwd_bwd_ms(
          lambda q, k, v: ops.dense_attention(q, k, v, implementation="cudnn"), q, k, v, ct,
          a.iters)[:2]
      print(f"{shape} cudnn causal, no ids: fwd {base_f:.3f} ms, bwd {base_b:.3f} ms", flush=True)
    for doc in docs:
      seg = None if doc == "none" else segments(ks[4], b, t, int(doc))
      docs_per_row = 1.0 if seg is None else round(float((seg[:, -1] - seg[:, 0]).mean()) + 1, 2)
      idx = jax.block_until_ready(topn_lists(ks[5], q, kh, seg, interpret))
      refs = {}
      for name in variants:
        backend, union_alone, with_ids, flags = VARIANTS[name]
        if seg is None and not with_ids:
          continue  # without documents the "_no_ids" variant is its twin
        s = seg if with_ids else None
        til = C.clustered_tiling(h // kh, LP) if union_alone else None  # "auto"'s union tile
        ids = s is not None
        saved = {f: getattr(mgpu, f) for f in flags}  # read when traced; put back after
        for f, value in flags.items():
          setattr(mgpu, f, value)
        try:
          fwd, bwd, kernels, got, diff = run_variant(
              lambda q, k, v, idx, *s, til=til, backend=backend: select_attention(
                  q, k, v, idx, LP, *s, backend=backend, tiling=til, interpret=interpret)[0],
              q, k, v, ct, a.iters, on_gpu, refs.get(ids), keys=None,
              extra=(idx,) + ((s,) if ids else ()))
        finally:
          for f, value in saved.items():
            setattr(mgpu, f, value)
        refs.setdefault(ids, got)
        print(f"{shape} docs={doc} {name}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms, kernels "
              f"{kernels}, max |diff| {diff:.2e}", flush=True)
        for pass_, ms, base in (("fwd", fwd, base_f), ("bwd", bwd, base_b)):
          recs.append(bc.record(op="select_doc", impl=name, pass_=pass_, t=t, batch=b,
                                q_heads=h, kv_heads=kh, d_k=dk, d_v=dv, ms=ms, cudnn_ms=base,
                                docs=doc, documents_per_row=docs_per_row, ids=ids,
                                kernels_fwd_bwd_ms=kernels, max_abs_diff_vs_first=diff))
        bc.write_results(recs, a.out, a.name, preamble=(
            f"# Selection with packed documents ({bc.hardware()}, {bc.utc_now()})\n\n"
            "The whole op's top-n lists for each documents setting; cudnn_ms: cuDNN's causal "
            "call without ids, same run. kernels_fwd_bwd_ms: device kernels of one fwd+bwd call. "
            f"Command: `{bc.command_line()}`."), extra_cols=COLS)
  print(bc.markdown_table(recs, extra_cols=COLS))
  return recs


if __name__ == "__main__":
  main()
