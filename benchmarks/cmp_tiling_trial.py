# Trial: launch parameters of the compression branch's Triton kernels (forward, dq and dK/dV,
# pallas_kernels.compress_attention.CmpTiling) at the shapes training runs, where the defaults
# (swept at T = 65536, 64/4 heads, 192/128) had never been re-swept. At the 8k training layer
# (B = 8, 16 query heads in 1 KV group, 64/64) nsa_cmp_dkv took 10.0 ms of a 12-layer step against
# nsa_cmp_dq's 4.3 ms for 4/3 of its FLOPs (benchmarks/results/step_profile_8k_*.md).
#   python3 benchmarks/cmp_tiling_trial.py --out=DIR [--shapes=8k,16k] [--iters=20] [--docs=4096]
# --docs: packed documents (segment ids, random cuts with that mean length in tokens, as
# benchmarks/dense_doc_trial.py) instead of one document a row; with them the variants
# "no seg split" and "dkv masked ids" switch off the id paths' shortcuts (CmpTiling).
# Each variant: forward ms, forward+backward ms (jit, bf16, gradient of sum(o * ct)), and its
# gradients' largest relative difference from the default tiling's (the kernels must agree).
# Writes DIR/cmp_tiling_trial.{json,md}.
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.dense_doc_trial import segments
from experiments import bench_common as bc
from pallas_kernels.compress_attention import CmpTiling, compress_attention, dkv_launch

SHAPES = {  # name: (B, T, H, K, d_k, d_v)
    "8k": (8, 8192, 16, 1, 64, 64),
    "16k": (4, 16384, 16, 1, 64, 64),
    "32k": (2, 32768, 16, 1, 64, 64),
    "64k-paper": (1, 65536, 64, 4, 192, 128),
    "tiny": (1, 512, 4, 1, 32, 32),  # a CPU smoke test (interpret mode)
}
VARIANTS = {  # name: CmpTiling overrides ("default" is the committed CmpTiling() of the run's code)
    "default": {},
    "dkv warps 8 stages 2 (before 2026-12-01)": {"dkv_num_warps": 8, "dkv_num_stages": 2},
    "dkv rows 64": {"dkv_rows": 64},
    "dkv rows 256": {"dkv_rows": 256},
    "dkv warps 4": {"dkv_num_warps": 4},
    "dkv stages 1": {"dkv_num_stages": 1},
    "dkv stages 3": {"dkv_num_stages": 3},
    "dkv keys 32": {"bwd_block_k": 32},
    "dkv keys 128": {"bwd_block_k": 128},
    "dkv keys 128 rows 64": {"bwd_block_k": 128, "dkv_rows": 64},
    "dkv keys 128 warps 4": {"bwd_block_k": 128, "dkv_num_warps": 4},
    "dkv keys 32 rows 256": {"bwd_block_k": 32, "dkv_rows": 256},
    "dkv splits 4": {"bwd_splits": 4},
    "dkv splits 16": {"bwd_splits": 16},
    "dq rows 64": {"bwd_rows": 64, "dkv_rows": 128},
    "dq rows 256": {"bwd_rows": 256, "dkv_rows": 128},
    "dq keys 32": {"dq_block_k": 32},
    "dq keys 128": {"dq_block_k": 128},
    "dq warps 4": {"bwd_num_warps": 4},
    "dq stages 3": {"bwd_num_stages": 3},
    "fwd rows 128": {"rows": 128},
    "fwd rows 128 warps 8": {"rows": 128, "num_warps": 8},
    "fwd warps 8": {"num_warps": 8},
    "fwd stages 3": {"num_stages": 3},
    "fwd keys 128": {"block_k": 128, "dq_block_k": 64},
    "fwd rows 32": {"rows": 32},
    "no seg split": {"seg_unmasked_steps": False},  # with --docs: ids compared on every key step
    "dkv masked ids": {"bwd_unmasked_with_ids": False},  # with --docs: every dK/dV tile masked
}
ID_VARIANTS = ("no seg split", "dkv masked ids")  # run with --docs only


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/cmp_tiling")
  ap.add_argument("--shapes", default="8k")
  ap.add_argument("--variants", default="",
                  help="comma-separated subset of VARIANTS (default all; 'default' alone: none)")
  ap.add_argument("--extra", default="", help="JSON {name: overrides} of more variants")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--docs", type=int, default=0,
                  help="mean document length in tokens for packed-document segment ids (0: none)")
  a = ap.parse_args(argv)
  if a.docs < 0:
    ap.error(f"--docs={a.docs}: give a positive mean document length, or 0 for no ids")
  variants = ({k: VARIANTS[k] for k in a.variants.split(",")} if a.variants
              else dict(VARIANTS))
  if a.extra:  # always run, with or without --variants
    variants.update(json.loads(a.extra))
  variants = {"default": {}, **variants}
  if not a.docs:  # the id paths' switches change nothing without ids
    variants = {k: v for k, v in variants.items() if k not in ID_VARIANTS}
  interpret = jax.default_backend() != "gpu"
  rows = []
  for shape in a.shapes.split(","):
    b, t, h, kh, dk, dv = SHAPES[shape]
    l, d = 32, 16
    nc = (t - l) // d + 1
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, dk), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (b, nc, kh, dk), jnp.bfloat16)
    vc = jax.random.normal(ks[2], (b, nc, kh, dv), jnp.bfloat16)
    ct = jax.random.normal(ks[3], (b, t, h, dv), jnp.bfloat16)
    seg, docs_per_row = None, 1.0
    if a.docs:  # document ends at uniformly random places per row
      seg = segments(jax.random.key(1), b, t, a.docs)
      docs_per_row = round(float((seg[:, -1] - seg[:, 0]).mean()) + 1, 2)
    base = None
    for name, over in variants.items():
      if name.startswith("dq "):  # change dq only: pin dK/dV to the default's launch here
        w, st = dkv_launch(CmpTiling(), h // kh, dk, dv, 2)
        over = {"dkv_num_warps": w, "dkv_num_stages": st, **over}
      til = CmpTiling(**over)
      # the ids are an argument (a constant would let XLA fold their preprocessing away)
      fwd = jax.jit(lambda q, kc, vc, *s, til=til: compress_attention(
          q, kc, vc, l, d, *s, tiling=til, interpret=interpret)[0])
      loss = lambda q, kc, vc, *s, til=til: jnp.sum(compress_attention(
          q, kc, vc, l, d, *s, tiling=til, interpret=interpret)[0].astype(jnp.float32) * ct)
      grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      args = (q, kc, vc) + (() if seg is None else (seg,))
      t0 = time.perf_counter()
      try:
        gs = jax.block_until_ready(grad(*args))
      except Exception as e:  # a launch configuration the compiler refuses (e.g. shared memory)
        print(f"{shape} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        rows.append(dict(shape=shape, variant=name, tiling=over, error=str(e)[:300]))
        continue
      compile_s = time.perf_counter() - t0
      if base is None:
        base = gs
      err = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                      / (jnp.max(jnp.abs(y.astype(jnp.float32))) + 1e-30))
                for x, y in zip(gs, base))
      f_ms = bc.time_ms(fwd, *args, iters=a.iters)
      fb_ms = bc.time_ms(grad, *args, iters=a.iters)
      rows.append(dict(shape=shape, variant=name, tiling=over, B=b, T=t, q_heads=h, kv_heads=kh,
                       d_k=dk, d_v=dv, docs=a.docs or None, documents_per_row=docs_per_row,
                       fwd_ms=round(f_ms, 3), fwd_bwd_ms=round(fb_ms, 3),
                       bwd_ms=round(fb_ms - f_ms, 3), grad_rel_diff_vs_default=err,
                       compile_s=round(compile_s, 1)))
      print(json.dumps(rows[-1]), flush=True)
  os.makedirs(a.out, exist_ok=True)
  prov = bc.provenance()
  prov["command"] = " ".join(["python3", "benchmarks/cmp_tiling_trial.py",
                              *(sys.argv[1:] if argv is None else argv)])
  with open(os.path.join(a.out, "cmp_tiling_trial.json"), "w") as f:
    json.dump({"provenance": prov, "rows": rows}, f, indent=1)
  lines = [f"# Compression backward tiling trial\n",
           f"Command: `{prov.get('command')}`  ", f"Hardware: {prov.get('hardware')}. "
           f"Date: {prov.get('date')}. Code: {prov.get('code_commit')}. Segment ids: "
           + (f"packed documents, mean {a.docs} tokens "
              f"({', '.join(sorted({str(r['documents_per_row']) for r in rows if 'error' not in r}))}"
              " documents a row)" if a.docs else "none (one document a row)") + ".\n",
           "| shape | variant | fwd ms | fwd+bwd ms | bwd ms | vs default bwd | grad rel diff |",
           "|---|---|---|---|---|---|---|"]
  base_bwd = {r["shape"]: r["bwd_ms"] for r in rows if r["variant"] == "default" and "error" not in r}
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['shape']} | {r['variant']} | failed: {r['error'][:80]} | | | | |")
      continue
    rel = (f"{r['bwd_ms'] / base_bwd[r['shape']]:.3f}" if r["shape"] in base_bwd
           else "n/a (default failed)")
    lines.append(f"| {r['shape']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                 f"{r['bwd_ms']:.3f} | {rel} | {r['grad_rel_diff_vs_default']:.1e} |")
  with open(os.path.join(a.out, "cmp_tiling_trial.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))
  return rows


if __name__ == "__main__":
  main()
