# Trial: cuDNN's packed-sequence layout for attention with document ids, against what the library
# runs with ids today (our Triton window kernels; w = T for dense layers, w = 512 for NSA's window
# branch) and against cuDNN's causal / sliding-window call without ids (timed in the same run).
#
# cuDNN's flash attention takes packed documents as per-row segment offsets and lengths (jax's
# private jax._src.cudnn.fused_attention_stablehlo.dot_product_attention, q_offsets / kv_offsets,
# Hopper only); the public jax.nn.dot_product_attention does not pass them. A win here would let
# dense layers and NSA's window branch keep cuDNN with packed documents (docs/STATUS.md, Known
# gaps: masked dense steps cost ~27% more, NSA's window branch ~+8 ms a step at the 8k layer).
# This trial decided (with the masked training runs of 2026-12-07) that dense layers with ids run it
# by default (data.cudnn_packed_cap="auto", nsa_jax/cudnn_packed.py); NSA's window branch runs it
# only with NSA_CUDNN_PACKED=M.
#
#   python3 benchmarks/cudnn_packed_trial.py --out=DIR [--shapes=8192:8:16/1:64/64]
#       [--docs=4096,512] [--windows=0,512] [--max_docs=0,64]
# --windows: 0 = causal over the whole row (dense layers), w > 0 = sliding window of w tokens.
# --max_docs: the static segment cap M of the packed call (0: the inputs' own maximum, rounded up
# to a multiple of 8); a row with more documents than M is refused, never cut.
# Each packed variant's output and gradients (q, k, v) are compared with our kernels'
# (max |diff| / max |ours|), and each variant's forward + backward temporaries (XLA's
# memory_analysis) recorded. Writes DIR/cudnn_packed_trial.{json,md} after every variant.
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import jax
import jax.numpy as jnp

from benchmarks.dense_doc_trial import fwd_bwd_ms, fwd_bwd_records, segments
from experiments import bench_common as bc
from experiments.bench_window import parse_shape  # "T:B:H/K:dk/dv", checked
from nsa_jax import cudnn_packed, ops


def count_docs(seg):
  """Host-side: the largest number of documents (contiguous runs) in one row."""
  return int(np.asarray(cudnn_packed.documents_per_row(seg)).max())


def packed(q, k, v, seg, window, max_docs):
  """What the library runs with NSA_CUDNN_PACKED=max_docs: cuDNN's packed layout, our Triton
  kernels for a batch with more documents a row than the cap (chosen inside the graph)."""
  return cudnn_packed.packed_attention(
      q, k, v, seg, window or None, max_docs,
      fallback=lambda q, k, v, s: ours(q, k, v, s, window))


def temp_bytes(jitted, *args):
  """XLA's temporary memory for one call of a jitted function (the packed backward's workspace
  lands here); 0 where the backend does not say."""
  stats = jitted.lower(*args).compile().memory_analysis()
  return int(getattr(stats, "temp_size_in_bytes", 0) or 0) if stats is not None else 0


def ours(q, k, v, seg, window):
  """What the library runs with ids on a GPU: the Triton window kernels (w = T for dense)."""
  if window > 0:
    return ops.window_attention(q, k, v, window, seg, backend="triton")
  return ops.dense_attention(q, k, v, seg, implementation="pallas")


def cudnn_no_ids(q, k, v, window):
  """The same call without document ids (what runs with document masking off)."""
  if window > 0:
    return ops.window_attention(q, k, v, window, None, backend="cudnn")
  return ops.dense_attention(q, k, v, None, implementation="cudnn")


def rel_diffs(fn, ref_fn, q, k, v, ct, seg):
  """max |a - b| / max |b| for the output and the gradients of sum(o * ct) in q, k, v."""
  def grads(f):
    return jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(f(q, k, v, s).astype(jnp.float32) * ct),
                            argnums=(0, 1, 2)))(q, k, v, seg)
  out = {}
  a = jax.jit(fn)(q, k, v, seg).astype(jnp.float32)
  b = jax.jit(ref_fn)(q, k, v, seg).astype(jnp.float32)
  out["out"] = a, b
  for name, x, y in zip(("dq", "dk", "dv"), grads(fn), grads(ref_fn)):
    out[name] = x.astype(jnp.float32), y.astype(jnp.float32)
  return {name: round(float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30)), 6)
          for name, (x, y) in out.items()}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", required=True)
  p.add_argument("--shapes", default="8192:8:16/1:64/64")
  p.add_argument("--docs", default="4096,512", help="documents' mean lengths (random cuts)")
  p.add_argument("--windows", default="0,512")
  p.add_argument("--max_docs", default="0,64")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--name", default="cudnn_packed_trial")
  a = p.parse_args(argv)
  if jax.default_backend() != "gpu":
    p.error("cuDNN's packed layout needs a Hopper GPU; this machine has none")
  dtype = jnp.bfloat16
  recs = []
  for shape in a.shapes.split(","):
    t, b, h, kh, dk, dv = parse_shape(shape)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, dk), dtype)
    k = jax.random.normal(keys[1], (b, t, kh, dk), dtype)
    v = jax.random.normal(keys[2], (b, t, kh, dv), dtype)
    ct = jax.random.normal(keys[3], (b, t, h, dv), dtype)
    for window in (int(w) for w in a.windows.split(",")):
      base_f, base_b = fwd_bwd_ms(lambda q, k, v: cudnn_no_ids(q, k, v, window),
                                  q, k, v, ct, a.iters)[:2]
      print(f"{shape} w={window or 'T'} cuDNN without ids: fwd {base_f:.3f} bwd {base_b:.3f} ms",
            flush=True)
      for mean_len in (int(d) for d in a.docs.split(",")):
        seg = segments(jax.random.key(mean_len), b, t, mean_len)
        n_docs = count_docs(seg)
        variants = [("ours (Triton, ids)", lambda q, k, v, s: ours(q, k, v, s, window), None)]
        for m in (int(x) for x in a.max_docs.split(",")):
          m = m or -(-n_docs // 8) * 8
          if m < n_docs:
            print(f"  max_docs={m} < {n_docs} documents in a row: skipped", flush=True)
            continue
          variants.append((f"cuDNN packed M={m}",
                           lambda q, k, v, s, m=m: packed(q, k, v, s, window, m), m))
        for name, fn, m in variants:
          try:
            fwd, bwd, _, fb = fwd_bwd_ms(fn, q, k, v, ct, a.iters, (seg,))
            diffs = (rel_diffs(fn, variants[0][1], q, k, v, ct, seg) if m is not None else {})
            temp_gb = temp_bytes(fb, q, k, v, seg) / 2**30
          except Exception as e:  # e.g. cuDNN refusing the graph: say so, go on
            print(f"  docs~{mean_len} {name}: failed: {type(e).__name__}: {str(e)[:300]}",
                  flush=True)
            continue
          print(f"  docs~{mean_len} (max {n_docs} a row) {name}: fwd {fwd:.3f} bwd {bwd:.3f} ms "
                f"(fwd + bwd temporaries {temp_gb:.2f} GiB) {diffs}", flush=True)
          recs += fwd_bwd_records(
              (fwd, bwd), (base_f, base_b), op="dense_doc" if window == 0 else "window_doc",
              impl=name, t=t, batch=b, q_heads=h, kv_heads=kh, d_k=dk, d_v=dv,
              window=window or t, mean_doc_len=mean_len, max_docs_in_a_row=n_docs,
              fwd_bwd_temp_gib=round(temp_gb, 3),
              **{f"rel_diff_{n}_vs_ours": x for n, x in diffs.items()})
          bc.write_results(recs, a.out, a.name, preamble=(
              f"# cuDNN's packed layout with document ids ({bc.hardware()}, {bc.utc_now()})\n\n"
              f"cudnn_ms: cuDNN's causal (window = T) or sliding-window call without ids, same "
              f"run; speedup = cudnn_ms / ms. rel_diff_*_vs_ours: max |x - x_ours| / max "
              f"|x_ours| (output, gradients). Command: `{bc.command_line()}`."))
  print(bc.markdown_table(recs, extra_cols=()))
  return recs


if __name__ == "__main__":
  main()
