"""Benchmark one NSA decode attention step (one new query per sequence over a full KV cache)
against dense decode (cuDNN and XLA) in the same run, with the bytes each step reads.

Run (GPU): python -m experiments.bench_decode --out benchmarks/results [--max_seconds 150]
Shapes: 64 query heads, 4 KV heads, (d_k, d_v) in {(192, 128), (128, 128)}, paper NSA settings
(l=32, d=16, l'=64, n=16, w=512), bf16, T cached tokens in 8k..128k, batch 1 and 8.

Timing (--timing loop, the default): one executable runs `--steps` dependent decode steps in a
lax.fori_loop, as generation does (experiments/generate.py scans its steps), each step over R
independent caches in turn (R chosen so the bytes touched exceed the 60 MB L2 several times over).
Step i+1's query is step i's query plus 1e-3 x its output, and the position alternates between
T-1 and T-2, so nothing can be hoisted out of the loop; ms = median(call) / (steps x R). The dense
baselines run in the same harness. `--timing calls` times one call of R steps per host dispatch
(the harness of the first runs: host dispatch then counts in the per-step figure).
Breakdown (--breakdown_T): the pallas_all step with one branch at a time (cfg.branches), in the
same harness: "cmp" (compression), "slc" (compression scores + top-n + selection), "win".
Tokens read per step and KV group: NSA (Nc + n*l' + w) vs the paper's Table 4 estimate
s/16 + 1536, dense s. cuDNN needs d_k == d_v, so the (192, 128) shape is compared with cuDNN at
192/192 (more bytes than a 192/128 dense cache: noted in each record as cudnn_dims).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp

from experiments import bench_common as bc
from nsa_jax import decode_math as dm
from nsa_jax.config import NSAConfig, num_cmp_blocks

H, KH = 64, 4
IMPLS = ("xla", "pallas", "pallas_all")
# Tuning variants of the fused path (--variants): name -> compressed_select_decode keywords.
VARIANTS = {"pallas_all_stages3": dict(cmp_num_stages=3),
            "pallas_all_topn_w1": dict(topn_num_warps=1),
            "pallas_all_topn_w4": dict(topn_num_warps=4),  # default: 2 warps (tuned 2026-11-29)
            # Eq. 9's band sums in the compressed-cache walk, one scores + top-n kernel:
            # two launches instead of three; timed 2026-11-30: slower (decode_walk_h200.md)
            "pallas_all_walkscores": dict(scores_in_walk=True),
            # Eq. 9's band as matmuls after Eq. 8 (the default until 2026-12-03, when the head
            # sum first won: decode_headfirst_h200.md), and the top-n rounds in a loop (opt-in)
            "pallas_all_bandmm": dict(scores_head_first=False),
            "pallas_all_topn_loop": dict(topn_loop=True),
            # the same paths timed a second time in one run (an A/B's repeat; --impls refuses
            # a name given twice)
            "pallas_all_again": dict(),
            "pallas_all_bandmm_again": dict(scores_head_first=False)}
L2_BYTES = 60e6


def paper_cfg(dk, dv):
  return NSAConfig(num_heads=H, num_kv_heads=KH, head_dim=dk, head_dim_v=dv)


def nsa_inputs(key, b, t, cfg, dtype=jnp.bfloat16):
  """Random q [B, H, Dk], gates, and a full NSA cache (head-major) for a query at t - 1."""
  dk, dv = cfg.head_dim, cfg.dim_v
  nc = -(-num_cmp_blocks(t, cfg.cmp_block, cfg.cmp_stride) // 64) * 64  # as nsa_jax.decode pads
  ks = jax.random.split(key, 8)
  n = lambda k, s: jax.random.normal(k, s, dtype)
  caches = {"k_cmp": n(ks[0], (b, KH, nc, dk)), "v_cmp": n(ks[1], (b, KH, nc, dv)),
            "k_slc": n(ks[2], (b, KH, t, dk)), "v_slc": n(ks[3], (b, KH, t, dv)),
            "k_win": n(ks[4], (b, KH, cfg.window, dk)), "v_win": n(ks[5], (b, KH, cfg.window, dv))}
  gates = jax.random.uniform(ks[6], (b, H, 3), jnp.float32)
  return n(ks[7], (b, H, dk)), caches, gates


def nsa_bytes(b, t, cfg, itemsize=2):
  """Bytes an NSA decode step must read: compressed, selected and window keys+values."""
  nc = num_cmp_blocks(t, cfg.cmp_block, cfg.cmp_stride)
  tokens = nc + min(cfg.num_selected * cfg.sel_block, t) + min(cfg.window, t)
  return tokens, b * KH * tokens * (cfg.head_dim + cfg.dim_v) * itemsize


INTERPRET = False  # --interpret: a CPU dry run of this script


def _kernel():
  from pallas_kernels import decode_attention as kern
  return functools.partial(kern.select_decode, interpret=INTERPRET)


def nsa_step_fn(cfg, t, impl):
  """impl: "xla" (plain JAX), "pallas" (selection kernel), "pallas_all" (every Pallas decode kernel,
  nsa_jax.decode.pallas_decode_kernels), or a VARIANTS name (pallas_all with tuning keywords)."""
  del t  # the step takes its position as an argument
  from nsa_jax import decode
  kw = {}
  if impl == "pallas":
    kw["select_fn"] = _kernel()
  elif impl == "pallas_all" or impl in VARIANTS:
    kw = decode.pallas_decode_kernels(interpret=INTERPRET)
    if impl in VARIANTS:
      kw["cmp_select_fn"] = functools.partial(kw["cmp_select_fn"], **VARIANTS[impl])
  def step(q, caches, gates, tt):
    return dm.nsa_decode(q, caches, tt, gates, cfg, **kw)[0]
  return step


def select_only_fn(cfg, t, impl):
  fn = _kernel() if impl == "pallas" else dm.select_decode
  def step(q, caches, idx, tt):
    qg = dm.group_heads(q, KH)
    return fn(qg, caches["k_slc"], caches["v_slc"], idx, tt, cfg.sel_block)[0].reshape(
        q.shape[0], H, -1)
  return step


TIMING = {"mode": "loop", "steps": 16}
RUN = {"impls": list(IMPLS)}  # "xla" first: the other rows are checked against it


def feed_back(q, o):
  """q + 1e-3 * o (o reshaped to q's rows, its last dim zero-padded or cut to q's): the next
  step's query depends on this step's output, as in generation."""
  o = o.reshape(q.shape[:-1] + o.shape[-1:]).astype(jnp.float32)
  dq, do = q.shape[-1], o.shape[-1]
  o = jnp.pad(o, [(0, 0)] * (o.ndim - 1) + [(0, dq - do)]) if do < dq else o[..., :dq]
  return (q.astype(jnp.float32) + 1e-3 * o).astype(q.dtype)


def looped(fn, t, steps):
  """One executable: `steps` dependent steps, each over every copy (q, *rest) in turn."""
  def run(copies):
    def body(i, qs):
      tt = jnp.int32(t - 1) - (i % 2)
      return tuple(feed_back(q, fn(q, *c[1:], tt)) for q, c in zip(qs, copies))
    return jax.lax.fori_loop(0, steps, body, tuple(c[0] for c in copies))
  return jax.jit(run)


def timed(fn, copies, t):
  """(ms per step, the outputs of one plain call at position t - 1)."""
  once = jax.jit(lambda copies: [fn(*c, jnp.int32(t - 1)) for c in copies])
  if TIMING["mode"] == "loop":
    steps = TIMING["steps"]
    ms = bc.time_ms(looped(fn, t, steps), copies, warmup=2, iters=5) / (len(copies) * steps)
  else:
    ms = bc.time_ms(once, copies, warmup=2, iters=7) / len(copies)
  return ms, once(copies)


def copies_for(touched_bytes, full_bytes, budget=24e9):
  """Copies R: enough to touch 4x L2, at most 16, within a memory budget."""
  r = max(1, min(16, int(4 * L2_BYTES // max(touched_bytes, 1)) + 1))
  return max(1, min(r, int(budget // max(full_bytes, 1))))


def bench_shape(dk, dv, t, b, peaks, key, selection_only=False, breakdown=False):
  cfg = paper_cfg(dk, dv)
  tokens, nbytes = nsa_bytes(b, t, cfg)
  full = b * KH * t * (dk + dv) * 2
  r = copies_for(nbytes, full)
  copies = [nsa_inputs(jax.random.fold_in(key, i), b, t, cfg) for i in range(r)]
  out = {"r_nsa": r}
  outs = {}
  for impl in RUN["impls"]:
    try:
      out[f"nsa_{impl}_ms"], outs[impl] = timed(nsa_step_fn(cfg, t, impl), copies, t)
    except Exception as e:  # keep going: the other rows are still worth having
      out[f"nsa_{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
      print(f"ERROR {impl} d={dk} T={t} B={b}: {out[f'nsa_{impl}_error']}", flush=True)
  # Correctness on the GPU: kernel path vs plain-JAX path on the same inputs (bf16 outputs).
  for impl in RUN["impls"][1:]:
    out[f"max_abs_diff_{impl}_vs_xla"] = None if not {impl, "xla"} <= set(outs) else max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b_.astype(jnp.float32))))
        for a, b_ in zip(outs[impl], outs["xla"]))
  if breakdown:  # the fused step with one branch at a time
    for br in ("cmp", "slc", "win"):
      cfg_b = dataclasses.replace(cfg, branches=(br,))
      try:
        out[f"branch_{br}_ms"] = timed(nsa_step_fn(cfg_b, t, "pallas_all"), copies, t)[0]
      except Exception as e:
        print(f"ERROR branch {br}: {type(e).__name__}: {str(e)[:300]}", flush=True)
  if selection_only:
    idx = jax.jit(lambda q, c, g: dm.nsa_decode(q, c, jnp.int32(t - 1), g, cfg)[1]["block_idx"])
    sel_copies = [(q, c, idx(q, c, g)) for q, c, g in copies]
    for impl in ("pallas", "xla"):
      try:
        out[f"select_{impl}_ms"] = timed(select_only_fn(cfg, t, impl), sel_copies, t)[0]
      except Exception as e:
        print(f"ERROR selection-only {impl}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    del sel_copies
  del copies, outs
  # Dense baselines: cuDNN (d_v raised to d_k when they differ) and XLA on the head-major cache.
  dd = max(dk, dv)
  rd = copies_for(b * KH * t * 2 * dd * 2, b * KH * t * 2 * dd * 2)
  ks = jax.random.split(jax.random.fold_in(key, 999), 3 * rd)
  dense = [(jax.random.normal(ks[3 * i], (b, 1, H, dd), jnp.bfloat16),
            jax.random.normal(ks[3 * i + 1], (b, t, KH, dd), jnp.bfloat16),
            jax.random.normal(ks[3 * i + 2], (b, t, KH, dd), jnp.bfloat16)) for i in range(rd)]
  try:
    cudnn = lambda q, k, v, tt: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    out["cudnn_ms"] = timed(cudnn, dense, t)[0]
  except Exception as e:  # report, never hide: the record says why cuDNN is missing
    out["cudnn_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  del dense
  xd = [(jax.random.normal(ks[3 * i], (b, H, dk), jnp.bfloat16),
         jax.random.normal(ks[3 * i + 1], (b, KH, t, dk), jnp.bfloat16),
         jax.random.normal(ks[3 * i + 2], (b, KH, t, dv), jnp.bfloat16))
        for i in range(copies_for(full, full))]
  out["xla_dense_ms"] = timed(lambda q, k, v, tt: dm.dense_decode(dm.group_heads(q, KH), k, v,
                                                                  tt)[0], xd, t)[0]
  out.update(tokens_per_group=tokens, paper_tokens=t // 16 + 1536, bytes=nbytes, dense_bytes=full,
             cudnn_dims=f"{dd}/{dd}")
  return out


def profile_step(t, out_dir, name, b=8, dk=192, dv=128):
  """Per-kernel device time of one looped call of each NSA implementation, printed and saved."""
  cfg = paper_cfg(dk, dv)
  copies = [nsa_inputs(jax.random.key(1), b, t, cfg)]
  res = {}
  for impl in RUN["impls"]:  # xla first, then --impls (variants included)
    rows = bc.kernel_profile(looped(nsa_step_fn(cfg, t, impl), t, TIMING["steps"]), [copies],
                             os.path.join("/tmp", f"trace_{impl}"))
    res[impl] = dict(steps=TIMING["steps"], kernels=rows)
    print(f"PROFILE {impl} T={t} B={b} {dk}/{dv}: {TIMING['steps']} steps", flush=True)
    for k, n, us in rows:
      print(f"  {us:9.1f} us  {n:5d}x  {k[:140]}", flush=True)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, name + "_profile.json"), "w") as f:
    json.dump(dict(T=t, batch=b, d_k=dk, d_v=dv, **bc.provenance(), per_impl=res), f, indent=1)


def plot(path):
  """Speed-up over cuDNN vs cached tokens, one line per (impl, batch, dims), PNG next to the JSON."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  recs = [r for r in json.load(open(path)) if r.get("tokens_read_per_group")]  # whole-step rows
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  for ax, (dk, dv) in zip(axes, ((192, 128), (128, 128))):
    for impl, batch, style in (("pallas_all", 8, "-o"), ("pallas_all", 1, "--o"), ("xla", 8, "-s"),
                               ("xla", 1, "--s")):
      pts = sorted((r["T"], r["speedup"]) for r in recs if r["impl"] == impl and r["batch"] == batch
                   and (r["d_k"], r["d_v"]) == (dk, dv) and r["speedup"])
      if pts:
        ax.plot(*zip(*pts), style, label=f"{impl}, batch {batch}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(8.0, color="red", lw=0.8, ls=":", label="issue target (64k, batch 8)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens")
    ax.set_title(f"d_k/d_v = {dk}/{dv} (cuDNN at {max(dk, dv)}/{max(dk, dv)})")
    ax.legend(fontsize=8)
  axes[0].set_ylabel("speed-up over cuDNN dense decode")
  fig.suptitle("NSA decode step vs cuDNN, H200, bf16, 64 q / 4 KV heads", fontsize=11)
  fig.tight_layout()
  out = os.path.splitext(path)[0] + ".png"
  fig.savefig(out, dpi=120)
  return out


def records_for(dk, dv, t, b, m, peaks):
  common = dict(op="nsa_decode", pass_="decode", t=t, batch=b, q_heads=H, kv_heads=KH, d_k=dk,
                d_v=dv, cudnn_ms=m.get("cudnn_ms"))
  floor = m["bytes"] / peaks[1] * 1e3
  extra = dict(tokens_read_per_group=m["tokens_per_group"], paper_tokens=m["paper_tokens"],
               dense_tokens=t, bytes_read=m["bytes"], dense_bytes=m["dense_bytes"],
               floor_ms=round(floor, 5), hbm_copy_GBps=round(peaks[1] / 1e9, 1),
               cudnn_dims=m["cudnn_dims"], xla_dense_ms=round(m["xla_dense_ms"], 4),
               copies=m["r_nsa"])
  if "cudnn_error" in m:
    extra["cudnn_error"] = m["cudnn_error"]
  recs = []
  for impl in RUN["impls"]:
    if f"nsa_{impl}_ms" not in m:
      continue
    ms = m[f"nsa_{impl}_ms"]
    diff = {} if impl == "xla" else {"max_abs_diff_vs_xla": m[f"max_abs_diff_{impl}_vs_xla"]}
    recs.append(bc.record(impl=impl, ms=ms, **common, **extra, **diff,
                          achieved_GBps=round(m["bytes"] / ms / 1e6, 1),
                          bw_fraction=round(floor / ms, 3), floor_ratio=round(ms / floor, 2),
                          xla_dense_speedup=round(m["xla_dense_ms"] / ms, 2)))
  for br in ("cmp", "slc", "win"):
    if f"branch_{br}_ms" in m:
      recs.append(bc.record(impl=f"pallas_all_{br}_only", ms=m[f"branch_{br}_ms"], **common))
  sel_bytes = b * KH * 16 * 64 * (dk + dv) * 2
  for impl in ("pallas", "xla"):
    if f"select_{impl}_ms" not in m:
      continue
    ms = m[f"select_{impl}_ms"]
    recs.append(bc.record(impl=f"{impl}_selection_only", ms=ms, **common,
                          bytes_read=sel_bytes, achieved_GBps=round(sel_bytes / ms / 1e6, 1),
                          floor_ms=round(sel_bytes / peaks[1] * 1e3, 5)))
  return recs


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--name", default="", help="file name (default decode_<gpu>, e.g. decode_h200)")
  ap.add_argument("--max_seconds", type=float, default=150.0, help="stop starting new shapes after")
  ap.add_argument("--lengths", default="65536,8192,16384,32768,131072")
  ap.add_argument("--batches", default="8,1")
  ap.add_argument("--interpret", action="store_true", help="CPU dry run (Pallas interpreter)")
  ap.add_argument("--plot", default="", help="only draw the speed-up PNG of this results JSON")
  ap.add_argument("--timing", choices=("loop", "calls"), default="loop",
                  help="loop: dependent steps in one executable (default); calls: one host "
                       "dispatch per R steps")
  ap.add_argument("--steps", type=int, default=16, help="decode steps per timed loop")
  ap.add_argument("--profile", action="store_true",
                  help="also save the device kernels of the fused step (jax.profiler) at the "
                       "first length, d_k/d_v = 192/128, batch 8, as <name>_profile.json")
  ap.add_argument("--impls", default=",".join(IMPLS),
                  help=f"NSA paths to time (xla always runs first); tuning variants: {list(VARIANTS)}")
  ap.add_argument("--selection_only_T", default="65536",
                  help="lengths that also time the selection branch alone")
  ap.add_argument("--breakdown_T", default="65536",
                  help="lengths that also time the fused step one branch at a time")
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return
  if not args.interpret:
    bc.require_gpu(ap, [], cpu_ok=False)
  else:
    bc.require_gpu(ap, [int(x) for x in args.lengths.split(",") if x],
                   how=" with --interpret (e.g. --lengths 1024)")
  args.name = args.name or f"decode_{bc.device_tag()}"
  global INTERPRET
  INTERPRET = args.interpret
  TIMING.update(mode=args.timing, steps=args.steps)
  impls = [x for x in args.impls.split(",") if x and x != "xla"]
  unknown = [x for x in impls if x not in IMPLS and x not in VARIANTS]
  if unknown:
    ap.error(f"--impls: unknown {unknown}; choose from {list(IMPLS) + list(VARIANTS)}")
  repeated = sorted({x for x in impls if impls.count(x) > 1})
  if repeated:  # results are keyed by name: a second timing would overwrite the first
    ap.error(f"--impls: {repeated} given twice; to time a path twice in one run use its "
             f"'_again' variant (e.g. pallas_all_again)")
  RUN["impls"] = ["xla"] + impls
  sel_t = {int(x) for x in args.selection_only_T.split(",") if x}
  breakdown_t = {int(x) for x in args.breakdown_T.split(",") if x}
  if args.profile:
    profile_step(int(args.lengths.split(",")[0]), args.out, args.name)
  start = time.time()
  peaks = bc.measure_peaks(n=512, copy_mib=16) if args.interpret else bc.measure_peaks()
  print(f"measured: bf16 matmul {peaks[0] / 1e12:.0f} TFLOP/s, HBM copy {peaks[1] / 1e12:.2f} TB/s",
        flush=True)
  key = jax.random.key(int.from_bytes(os.urandom(4), "little"))
  recs = []
  for t in [int(x) for x in args.lengths.split(",")]:  # most important length first
    for dk, dv in ((192, 128), (128, 128)):
      for b in [int(x) for x in args.batches.split(",")]:
        if time.time() - start > args.max_seconds:
          print(f"time budget reached: skipping d={dk}/{dv} T={t} B={b}", flush=True)
          continue
        try:
          m = bench_shape(dk, dv, t, b, peaks, key, selection_only=(t in sel_t or args.interpret),
                          breakdown=t in breakdown_t)
        except Exception as e:  # e.g. out of memory at 128k: report and go on
          print(f"ERROR d={dk}/{dv} T={t} B={b}: {type(e).__name__}: {str(e)[:300]}", flush=True)
          continue
        new = records_for(dk, dv, t, b, m, peaks)
        recs += new
        for r in new[:len(RUN["impls"])]:
          print(json.dumps({k: r.get(k) for k in ("impl", "d_k", "T", "batch", "ms", "cudnn_ms",
                                                  "speedup", "xla_dense_ms", "bw_fraction")}),
                flush=True)
        bc.write_results(recs, args.out, args.name, preamble=preamble(peaks))
        with open(os.path.join(args.out, args.name + ".md"), "w") as f:
          f.write(preamble(peaks) + "\n\n" + summary(recs) + "\n")
  print(summary(recs))
  if recs:
    plot(os.path.join(args.out, args.name + ".json"))


def preamble(peaks):
  return (f"# NSA decode attention step vs dense decode ({bc.hardware()})\n\n"
          f"Measured HBM copy rate {peaks[1] / 1e12:.2f} TB/s, bf16 matmul "
          f"{peaks[0] / 1e12:.0f} TFLOP/s. One new query per sequence, 64 q / 4 KV heads, paper "
          "NSA settings (l=32, d=16, l'=64, n=16, w=512), bf16. cudnn_ms: "
          "jax.nn.dot_product_attention (cuDNN) over the whole cache, at d_k = d_v = "
          "max(d_k, d_v). tokens_read_per_group vs the paper's Table 4 estimate paper_tokens = "
          f"s/16 + 1536. Timing: {TIMING['mode']}"
          + (f" ({TIMING['steps']} dependent steps per executable)" if TIMING["mode"] == "loop"
             else " (one host dispatch per R steps)")
          + f". Command: `{bc.command_line()}`.")


def summary(recs):
  lines = ["| d_k/d_v | T | batch | impl | ms | cudnn_ms | speedup | xla_dense_ms | tokens/group "
           "(paper) | GB/s | of HBM copy |", "|" + "---|" * 11]
  for r in recs:
    lines.append(f"| {r['d_k']}/{r['d_v']} | {r['T']} | {r['batch']} | {r['impl']} | {r['ms']} | "
                 f"{r['cudnn_ms']} | {r['speedup']} | {r.get('xla_dense_ms', '')} | "
                 f"{r.get('tokens_read_per_group', '')} ({r.get('paper_tokens', '')}) | "
                 f"{r.get('achieved_GBps', '')} | {r.get('bw_fraction', '')} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
