# Trial: dense causal attention with document ids (packed documents), per implementation of
# nsa_jax.ops.dense_attention: "pallas" (our Triton window kernels with w = T: what "auto" runs on a
# GPU with segment ids), "cudnn" (cuDNN with the explicit [B, 1, T, T] document mask), "xla"; and
# cuDNN's causal call without ids (what the same model runs with document masking off) as the
# baseline timed in the same run. Forward and forward+backward (jit, gradient of sum(o * ct)),
# ms medians; the backward is (fwd + bwd) - fwd; each implementation's output is compared with
# the first's (out_rel_diff_vs_first).
#   python3 benchmarks/dense_doc_trial.py --out=DIR [--shapes=8192:8:16/1:64/64] [--impls=...]
# Shapes: T:B:H/K:d_k/d_v. Writes DIR/dense_doc_trial.{json,md} after every implementation.
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from experiments import bench_common as bc
from experiments.bench_window import parse_shape  # "T:B:H/K:dk/dv", checked
from nsa_jax import ops


def inputs(key, t, b, h, k, dk, dv, dtype, mean_doc_len):
  kq, kk, kv, kc, ks = jax.random.split(key, 5)
  q = jax.random.normal(kq, (b, t, h, dk), dtype)
  kk_ = jax.random.normal(kk, (b, t, k, dk), dtype)
  v = jax.random.normal(kv, (b, t, k, dv), dtype)
  ct = jax.random.normal(kc, (b, t, h, dv), dtype)
  # ~T / mean_doc_len document ends at uniformly random places per row (4096: as bench_window
  # --segments)
  return q, kk_, v, ct, segments(ks, b, t, mean_doc_len)


def segments(key, b, t, mean_doc_len):
  """[B, T] int32 ids: document ends at uniformly random places (about T / mean_doc_len a row)."""
  cuts = jax.random.bernoulli(key, 1.0 / mean_doc_len, (b, t))
  return jnp.cumsum(cuts.astype(jnp.int32), axis=1)


def fwd_bwd_ms(attn, q, kk, v, ct, iters, extra=()):
  """(forward ms, backward ms, jitted forward, jitted gradient of sum(o * ct) in q, k, v): medians,
  the backward read as (fwd + bwd) - fwd. attn(q, kk, v, *extra): segment ids, block lists and the
  like go in `extra`, arguments of the jitted functions (both take (q, kk, v, *extra)), so that
  XLA cannot fold their preprocessing (sorts, spans, maps) into constants as it would for arrays
  the function closes over."""
  f = jax.jit(attn)
  fb = jax.jit(jax.grad(lambda q, kk, v, *e: jnp.sum(attn(q, kk, v, *e).astype(jnp.float32) * ct),
                        argnums=(0, 1, 2)))
  fwd = bc.time_ms(f, q, kk, v, *extra, iters=iters)
  return fwd, bc.time_ms(fb, q, kk, v, *extra, iters=iters) - fwd, f, fb


def fwd_bwd_records(ms, cudnn_ms, **fields):
  """The "fwd" and "bwd" result rows of one variant: ms and cudnn_ms are (forward, backward)
  pairs, `fields` the rest of bench_common.record's arguments and the trial's own columns."""
  return [bc.record(pass_=pass_, ms=m, cudnn_ms=ref, **fields)
          for pass_, m, ref in zip(("fwd", "bwd"), ms, cudnn_ms)]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--out", required=True)
  p.add_argument("--shapes", default="8192:8:16/1:64/64")
  p.add_argument("--impls", default="pallas,cudnn,xla")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--name", default="dense_doc_trial")
  p.add_argument("--mean_doc_len", type=int, default=4096,
                 help="documents' mean length in tokens (random cuts)")
  a = p.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  impls = [i for i in a.impls.split(",") if i]
  for i in impls:
    if i not in ops.DENSE_IMPLEMENTATIONS:
      p.error(f"--impls: {i!r} is not one of {ops.DENSE_IMPLEMENTATIONS}")
  recs = []
  for shape in a.shapes.split(","):
    t, b, h, k, dk, dv = parse_shape(shape)
    q, kk, v, ct, seg = inputs(jax.random.key(0), t, b, h, k, dk, dv, dtype, a.mean_doc_len)

    def timed(impl, with_seg):
      return fwd_bwd_ms(lambda q, kk, v, *s: ops.dense_attention(q, kk, v, *s,
                                                                 implementation=impl),
                        q, kk, v, ct, a.iters, (seg,) if with_seg else ())[:2]

    base = "cudnn" if on_gpu else "xla"
    base_f, base_b = timed(base, False)
    print(f"{shape} {base} causal, no ids: fwd {base_f:.3f} ms, bwd {base_b:.3f} ms", flush=True)
    first_out = None
    for impl in impls:
      try:
        fwd, bwd = timed(impl, True)
        out = jax.jit(lambda q, kk, v: ops.dense_attention(q, kk, v, seg, implementation=impl))(
            q, kk, v).astype(jnp.float32)
      except Exception as e:  # e.g. the explicit mask out of memory at long T: say so, go on
        print(f"{shape} {impl} with ids: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      if first_out is None:
        first_out = out
      # the implementations must agree (relative to the first one's largest |o|)
      diff = float(jnp.max(jnp.abs(out - first_out)) / jnp.maximum(jnp.max(jnp.abs(first_out)),
                                                                     1e-30))
      del out
      print(f"{shape} {impl} with ids: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms, output vs "
            f"{impls[0]} {diff:.2e}", flush=True)
      recs += fwd_bwd_records((fwd, bwd), tuple(r if r > 0 else None for r in (base_f, base_b)),
                              op="dense_doc", impl=impl, t=t, batch=b, q_heads=h, kv_heads=k,
                              d_k=dk, d_v=dv, documents_per_row=round(
                                  float((seg[:, -1] - seg[:, 0]).mean()) + 1, 2),
                              out_rel_diff_vs_first=diff)
      bc.write_results(recs, a.out, a.name, preamble=(
          f"# Dense causal attention with document ids ({bc.hardware()}, {bc.utc_now()})\n\n"
          f"cudnn_ms: {base} causal without ids, same run (speedup < 1: the document mask costs "
          f"that much). out_rel_diff_vs_first: max |o - o_first| / max |o_first|. Command: "
          f"`{bc.command_line()}`."))
  print(bc.markdown_table(recs, extra_cols=()))
  return recs


if __name__ == "__main__":
  main()
