# Trial: launch parameters of the selection backward (pallas_kernels.select_attention_bwd: the dq
# kernel and the dK/dV kernel over the inverse lists) on the lists the whole NSA op selects.
# Issue 5's 128/128 backward at 64k (H200) is ~1% short of 5x, and its selection backward is the
# largest branch (30.95 ms at 171 TFLOP/s on top-n lists whose 4-token unions average ~50 blocks,
# so the automatic lax.cond runs the per-token Triton tile, `_common.default_tiling(16, 64)`).
#   python3 benchmarks/select_bwd_trial.py --out=DIR [--shapes=64k-128] [--lists=nsa-topn,random]
# Per variant (a SelectTiling override of the per-token tile; "auto" is what a call without a
# tiling runs): forward ms, forward+backward ms (jit, bf16, gradient of sum(o * ct)), the dq and
# dK/dV parts timed alone (dK/dV includes the inverse lists' sort and the deterministic reduce),
# and the gradients' largest relative difference from the default tiling's (they must agree).
# Writes DIR/select_bwd_trial.{json,md} after every variant.
import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from experiments import bench_common as bc
from pallas_kernels import _common as C
from pallas_kernels import select_attention_bwd as bwd
from pallas_kernels.compress_attention import compress_attention
from pallas_kernels.select_attention import select_attention
from pallas_kernels.select_topn import select_topn

SHAPES = {  # name: (B, T, H, K, d_k, d_v)
    "64k-128": (1, 65536, 64, 4, 128, 128),
    "64k-192": (1, 65536, 64, 4, 192, 128),
    "tiny": (1, 256, 16, 1, 32, 32),  # a CPU smoke test (interpret mode)
}
L, D, LP, N = 32, 16, 64, 16  # the paper's compression block / stride, selection block, top-n
VARIANTS = {  # name: SelectTiling overrides of the per-token tile (None: no tiling, the auto path)
    "default": {},
    "auto": None,
    "atomic dK/dV (deterministic=False)": {"_deterministic": False},
    "dkv tokens 2": {"bwd_tokens": 2},
    "dkv tokens 8": {"bwd_tokens": 8},
    "dkv tokens 8 warps 8": {"bwd_tokens": 8, "bwd_num_warps": 8},
    "dkv warps 8": {"bwd_num_warps": 8},
    "dkv stages 1": {"bwd_num_stages": 1},
    "dkv stages 3": {"bwd_num_stages": 3},
    "chunk 256": {"chunk_entries": 256},
    "chunk 1024": {"chunk_entries": 1024},
    "chunk 2048": {"chunk_entries": 2048},
    "dq+fwd warps 8": {"num_warps": 8},
    "dq+fwd stages 3": {"num_stages": 3},
    "dq+fwd keys 32": {"block_k": 32},
    "dq+fwd warps 4 (G = 16 before 2026-12-06)": {"num_warps": 4},
    "dq 2 blocks a step": {"dq_blocks_per_step": 2},
    "dq 2 blocks a step warps 4": {"dq_blocks_per_step": 2, "num_warps": 4},
}


def lists(kind, key, b, t, h, kh, dk, interpret):
  """block_idx [B, T, K, n]: "nsa-topn" = the whole op's own (compression lse, then the top-n
  kernel on N(0,1) q and compressed keys, as experiments/bench_nsa.py's breakdown); "random" =
  experiments/bench_kernels.py's worst case (forced + local + random earlier blocks)."""
  if kind == "random":
    from experiments.bench_kernels import index_pattern
    return index_pattern(key, b, t, kh, N, LP, "random")
  nc = (t - L) // D + 1
  k1, k2, k3 = jax.random.split(key, 3)
  q = jax.random.normal(k1, (b, t, h, dk), jnp.bfloat16)
  kc = jax.random.normal(k2, (b, nc, kh, dk), jnp.bfloat16)
  vc = jax.random.normal(k3, (b, nc, kh, dk), jnp.bfloat16)
  _, lse = jax.jit(lambda q, kc, vc: compress_attention(q, kc, vc, L, D, interpret=interpret))(
      q, kc, vc)
  return jax.jit(lambda q, kc, lse: select_topn(q, kc, lse, block=L, stride=D, sel_block=LP,
                                                num_selected=N, interpret=interpret))(q, kc, lse)


def parts(q, k, v, idx, ct, til, det, interpret):
  """Jitted (dq, dK/dV) of the backward alone, from the forward's saved o and lse."""
  scale = q.shape[-1] ** -0.5
  o, lse = jax.jit(lambda q, k, v, idx: select_attention(q, k, v, idx, LP, tiling=til,
                                                         interpret=interpret))(q, k, v, idx)
  kw = dict(block_size=LP, scale=scale, tiling=til, has_seg=False, interpret=interpret)
  seg = jnp.zeros((q.shape[0], q.shape[1]), jnp.int32)

  @jax.jit
  def dq(q, k, v, idx, o, lse, do):
    delta = bwd.delta_of(o, do, jnp.zeros_like(lse))
    return bwd._dq(q, k, v, seg, C.tile_maps(idx, til), do, lse, delta, **kw)

  @jax.jit
  def dkv(q, k, v, idx, o, lse, do):
    delta = bwd.delta_of(o, do, jnp.zeros_like(lse))
    return bwd._dkv(q, k, v, idx, seg, do, lse, delta, deterministic=det, **kw)

  return (dq, dkv), (q, k, v, idx, o, lse, ct)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/select_bwd")
  ap.add_argument("--shapes", default="64k-128")
  ap.add_argument("--lists", default="nsa-topn")
  ap.add_argument("--variants", default="",
                  help="comma-separated subset of VARIANTS (default all; the default tiling always runs)")
  ap.add_argument("--extra", default="", help="JSON {name: overrides} of more variants")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--budget_s", type=float, default=1e9, help="stop starting variants after this")
  a = ap.parse_args(argv)
  start = time.time()
  variants = ({k: VARIANTS[k] for k in a.variants.split(",")} if a.variants else dict(VARIANTS))
  if a.extra:
    variants.update(json.loads(a.extra))
  variants = {"default": {}, **variants}
  interpret = jax.default_backend() != "gpu"
  prov = bc.provenance()
  prov["command"] = " ".join(["python3", "benchmarks/select_bwd_trial.py", *(argv or sys.argv[1:])])
  rows = []
  for shape in a.shapes.split(","):
    b, t, h, kh, dk, dv = SHAPES[shape]
    key = jax.random.key(0)
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (b, t, h, dk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kh, dk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kh, dv), jnp.bfloat16)
    ct = jax.random.normal(ks[3], (b, t, h, dv), jnp.bfloat16)
    per_token = C.default_tiling(h // kh, LP)
    for kind in a.lists.split(","):
      idx = jax.block_until_ready(lists(kind, ks[4], b, t, h, kh, dk, interpret))
      mu4 = round(float(C.mean_union(idx, C.UNION_TOKENS)), 2)
      base = None
      for name, over in variants.items():
        if time.time() - start > a.budget_s:
          print(f"budget {a.budget_s} s spent: {name} and later variants not run", flush=True)
          break
        over = None if over is None else dict(over)
        det = True if over is None else over.pop("_deterministic", True)
        til = None if over is None else dataclasses.replace(per_token, **over)
        call = lambda q, k, v, idx, til=til, det=det: select_attention(
            q, k, v, idx, LP, tiling=til, deterministic=det, interpret=interpret)[0]
        fwd = jax.jit(call)
        loss = lambda q, k, v, idx, call=call: jnp.sum(call(q, k, v, idx).astype(jnp.float32) * ct)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        row = dict(shape=shape, lists=kind, mean_union4=mu4, variant=name,
                   tiling=None if til is None else dataclasses.asdict(til), deterministic=det,
                   B=b, T=t, q_heads=h, kv_heads=kh, d_k=dk, d_v=dv)
        t0 = time.perf_counter()
        try:
          gs = jax.block_until_ready(grad(q, k, v, idx))
          compile_s = time.perf_counter() - t0
          f_ms = bc.time_ms(fwd, q, k, v, idx, iters=a.iters)
          fb_ms = bc.time_ms(grad, q, k, v, idx, iters=a.iters)
          row.update(fwd_ms=round(f_ms, 3), fwd_bwd_ms=round(fb_ms, 3), bwd_ms=round(fb_ms - f_ms, 3),
                     compile_s=round(compile_s, 1))
          if til is not None:
            (dq, dkv), args = parts(q, k, v, idx, ct, til, det, interpret)
            row.update(dq_ms=round(bc.time_ms(dq, *args, iters=a.iters), 3),
                       dkv_ms=round(bc.time_ms(dkv, *args, iters=a.iters), 3))
        except Exception as e:  # a launch configuration the compiler refuses (e.g. shared memory)
          print(f"{shape} {kind} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
          rows.append({**row, "error": str(e)[:300]})
          continue
        if base is None:
          base = gs
        row["grad_rel_diff_vs_default"] = max(
            float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                  / (jnp.max(jnp.abs(y.astype(jnp.float32))) + 1e-30)) for x, y in zip(gs, base))
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(a.out, prov, rows)
  print(write(a.out, prov, rows))
  return rows


def write(out, prov, rows):
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "select_bwd_trial.json"), "w") as f:
    json.dump({"provenance": prov, "rows": rows}, f, indent=1)
  lines = ["# Selection backward launch trial\n",
           f"Command: `{prov['command']}`  ", f"Hardware: {prov['hardware']}. "
           f"Date: {prov['date']}. Code: {prov['code_commit']}.\n",
           "bwd = (fwd+bwd) - fwd; dq and dK/dV timed alone (dK/dV with the inverse lists' sort "
           "and the reduce). mu4: mean distinct blocks of 4-token tiles.\n",
           "| shape | lists (mu4) | variant | fwd ms | bwd ms | vs default bwd | dq ms | dK/dV ms "
           "| grad rel diff |", "|---|---|---|---|---|---|---|---|---|"]
  base = {(r["shape"], r["lists"]): r["bwd_ms"] for r in rows
          if r["variant"] == "default" and "error" not in r}
  for r in rows:
    lab = f"| {r['shape']} | {r['lists']} ({r['mean_union4']}) | {r['variant']} |"
    if "error" in r:
      lines.append(f"{lab} failed: {r['error'][:80]} | | | | | |")
      continue
    b0 = base.get((r["shape"], r["lists"]))
    rel = f"{r['bwd_ms'] / b0:.3f}" if b0 else "n/a"
    lines.append(f"{lab} {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {rel} | {r.get('dq_ms', '')} | "
                 f"{r.get('dkv_ms', '')} | {r['grad_rel_diff_vs_default']:.1e} |")
  with open(os.path.join(out, "select_bwd_trial.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
