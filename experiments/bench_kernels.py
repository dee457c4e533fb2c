"""GPU benchmark of the Pallas selection kernel (forward, backward) against cuDNN dense causal attention.

Run on the H200 (writes <out>/select_<tag>.json + .md and prints the Markdown table):
  python3 -m experiments.bench_kernels --T 8192,16384,32768,65536 --groups 16,4 --out benchmarks/results
  python3 -m experiments.bench_kernels --check            # compiled kernels vs the reference first
  python3 -m experiments.bench_kernels --plan sweep --T 65536  # tiling variants (tuning)
  python3 -m experiments.bench_kernels --check --plan final --iters 5  # 64k targets, defaults first
  python3 -m experiments.bench_kernels --plot benchmarks/results/select_h200_mosaic.json  # PNG (CPU)
Index patterns (issue 4): "random" = forced initial block + 2 local blocks + (n-3) random earlier
blocks per token; "clustered" = the tokens of one l'-block share n-4 random blocks, 1 drawn per token.
Each op is one bench_* function returning records; the timer and record writer are in bench_common.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_common as bc
from pallas_kernels import _common as kc
from pallas_kernels import select_attention as sk
from pallas_kernels import select_attention_mgpu
from pallas_kernels.select_attention import select_attention

BIG = 2 ** 30


# ----------------------------------------------------------------------------- index patterns

def _floyd(key, m, count):
  """`count` distinct ints in [0, m) for every element of m (any shape); -1 pads when m < count."""
  picks = []
  for i, k in enumerate(jax.random.split(key, count)):
    j = m - count + i  # Floyd's sampler: draw from [0, j], take j itself on a repeat
    r = jnp.floor(jax.random.uniform(k, m.shape) * (j + 1)).astype(jnp.int32)
    dup = functools.reduce(jnp.logical_or, [p == r for p in picks], jnp.zeros(m.shape, bool))
    picks.append(jnp.where(j < 0, -1, jnp.where(dup, j, r)))
  return jnp.stack(picks, -1)


def _finish(parts):
  """Sort slots ascending with -1 (empty) at the end."""
  x = jnp.concatenate(parts, -1)
  x = jnp.sort(jnp.where(x < 0, BIG, x), -1)
  return jnp.where(x == BIG, -1, x).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def index_pattern(key, b, t, kh, n, bs, pattern):
  """block_idx [B, T, K, n] for the benchmark patterns (see module docstring)."""
  cur = jnp.broadcast_to((jnp.arange(t, dtype=jnp.int32) // bs)[None, :, None], (b, t, kh))
  forced = jnp.stack([jnp.zeros_like(cur), jnp.where(cur >= 2, cur - 1, -1),
                      jnp.where(cur >= 1, cur, -1)], -1)
  m = jnp.maximum(cur - 2, 0)  # candidates 1 .. cur-2
  k1, k2 = jax.random.split(key)
  if pattern == "random":
    rnd = _floyd(k1, m, n - 3)
    return _finish([forced, jnp.where(rnd >= 0, rnd + 1, -1)])
  if pattern != "clustered":
    raise ValueError(f"pattern={pattern!r}")
  nb = -(-t // bs)
  mb = jnp.maximum(jnp.arange(nb, dtype=jnp.int32) - 2, 0)[None, :, None]
  shared = _floyd(k1, jnp.broadcast_to(mb, (b, nb, kh)), n - 4)  # per (block, group)
  shared = jnp.where(shared >= 0, shared + 1, -1)
  shared = jnp.repeat(shared, bs, axis=1)[:, :t]
  own = jnp.full((b, t, kh), -1, jnp.int32)
  for k in jax.random.split(k2, 4):  # one own block per token, redrawn on a clash with the shared ones
    r = 1 + jnp.floor(jax.random.uniform(k, m.shape) * m).astype(jnp.int32)
    ok = (m > 0) & ~jnp.any(shared == r[..., None], -1) & (own < 0)
    own = jnp.where(ok, r, own)
  return _finish([forced, shared, own[..., None]])


# ----------------------------------------------------------------------------- inputs and counts

def make_qkv(key, b, t, h, kh, dk, dv, dtype=jnp.bfloat16):
  kq, kk, kv, ko = jax.random.split(key, 4)
  return (jax.random.normal(kq, (b, t, h, dk), dtype), jax.random.normal(kk, (b, t, kh, dk), dtype),
          jax.random.normal(kv, (b, t, kh, dv), dtype), jax.random.normal(ko, (b, t, h, dv), dtype))


def select_flops(block_idx, bs, g, dk, dv):
  """Forward FLOPs: 2 matmuls over every selected key (all l' keys of each selected block)."""
  pairs = int(jnp.sum(block_idx >= 0))
  return 2.0 * pairs * bs * g * (dk + dv)


def dense_flops(b, t, h, dk, dv):
  return 2.0 * b * h * t * (t + 1) / 2 * (dk + dv)


def unique_bytes(b, t, h, kh, dk, dv, n, pass_):
  """Bytes that must move at least once (bf16 tensors, f32 lse/delta, int32 indices)."""
  q, kv, o, lse, idx = b * t * h * dk * 2, b * t * kh * (dk + dv) * 2, b * t * h * dv * 2, b * t * h * 4, b * t * kh * n * 4
  if pass_ == "fwd":
    return q + kv + o + lse + idx
  return 2 * q + 2 * kv + 2 * o + 2 * lse + idx  # read q,k,v,o,do,lse; write dq,dk,dv (+delta)


# ----------------------------------------------------------------------------- timed ops

def time_fwd_bwd(f, q, k, v, do, *extra, iters=10):
  """(fwd ms, bwd ms) of o = f(q, k, v, *extra); bwd = the VJP in q, k, v alone (residuals
  precomputed). `extra` (block indices) are arguments, not closure constants: XLA would constant-fold
  the index preprocessing (a sort over [T/tq, K, union] took 2 minutes to fold on 2026-11-30)."""
  fwd = jax.jit(f)
  fwd_ms = bc.time_ms(fwd, q, k, v, *extra, iters=iters)
  vjp = jax.jit(lambda q, k, v, *e: jax.vjp(lambda q, k, v: f(q, k, v, *e), q, k, v)[1])(
      q, k, v, *extra)  # residuals computed once
  bwd = jax.jit(lambda fn, ct: fn(ct))
  bwd_ms = bc.time_ms(bwd, vjp, do, iters=iters)
  return fwd_ms, bwd_ms


def bench_cudnn(t, h, kh, d, b=1, iters=10):
  q, k, v, do = make_qkv(jax.random.key(1), b, t, h, kh, d, d)
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  return time_fwd_bwd(f, q, k, v, do, iters=iters)


# Tiling names of the Mosaic forward with its step changes off: (FAST_MASK, REG_P)
MOSAIC_STEP_VARIANTS = {"mosaic-b1off": (False, False), "mosaic-maskonly": (True, False),
                        "mosaic-regponly": (False, True)}


def bench_select(t, h, kh, dk, dv, n, bs, pattern, *, tiling=None, deterministic=True, b=1,
                 cudnn=None, peaks=None, impl_note="", iters=10):
  """Forward and backward records of the Pallas selection kernel at one shape and pattern."""
  q, k, v, do = make_qkv(jax.random.key(2), b, t, h, kh, dk, dv)
  idx = index_pattern(jax.random.key(3), b, t, kh, n, bs, pattern)
  g = h // kh
  backend, call_backend, pingpong = "triton", None, True  # call_backend: None = backend
  fast_mask, reg_p = True, True  # the Mosaic forward step's switches (SELECTION_SPEED_PLAN B1)
  slots = (select_attention_mgpu.FWD_SLOTS, select_attention_mgpu.DKV_SLOTS)
  overlap = select_attention_mgpu.OVERLAP
  lean = select_attention_mgpu.LEAN_SMEM
  if tiling == "mosaic-fat":  # every buffer its own shared memory (LEAN_SMEM off)
    lean, tiling = False, "mosaic"
    impl_note += " (separate shared-memory buffers, as before 2026-12-02)"
  ring, ring_min = select_attention_mgpu.KV_RING, select_attention_mgpu.RING_MIN_DIM
  if tiling in ("mosaic-ring", "mosaic-noring"):  # the forward's K/V ring (KV_RING) on / off;
    # on: wherever d_k = d_v (RING_MIN_DIM 0), so that the 8k layer's 64/64 A/B still has one
    ring, ring_min, tiling = tiling == "mosaic-ring", 0, "mosaic"
  if tiling == "mosaic-ovl":  # the forward with FA3's intra-warpgroup overlap (OVERLAP)
    overlap, tiling = True, "mosaic"
    impl_note += " (forward: S(j+1) overlapped with P(j)V(j), 3 K/V slots)"
  if isinstance(tiling, str) and tiling.startswith("mosaic-s"):  # "mosaic-s<fwd>[-<dkv>]"
    depth = tiling[len("mosaic-s"):].split("-")
    slots = (int(depth[0]), int(depth[-1]))
    impl_note += (f" (pipeline depth asked: fwd/dq {slots[0]}, dK/dV {slots[1]}; shared memory "
                  "caps it)")
    tiling = "mosaic"
  if tiling in MOSAIC_STEP_VARIANTS:  # the Mosaic forward with B1's changes switched off
    fast_mask, reg_p = MOSAIC_STEP_VARIANTS[tiling]
    impl_note += f" (fast mask {'on' if fast_mask else 'off'}, P from {'registers' if reg_p else 'SMEM'})"
    tiling = "mosaic"
  if tiling == "mosaic":  # the Mosaic GPU kernels, 64-row union tiles
    backend, tiling = "mosaic", select_attention_mgpu.tiling_for(g, bs)
    with mgpu_settings(KV_RING=ring, RING_MIN_DIM=ring_min, OVERLAP=overlap):  # what will run
      if select_attention_mgpu.forward_runs_ring(g, dk, dv):
        impl_note += " (forward: K/V ring of 3 buffers)"
  elif tiling in ("mosaic-ws", "mosaic-ws-nopp"):  # 128-row tiles, producer + 2 consumers
    pingpong = tiling == "mosaic-ws"
    backend, tiling = "mosaic", select_attention_mgpu.ws_tiling_for(g, bs)
    impl_note += " 2 consumer warpgroups" + ("" if pingpong else ", no ping-pong")
  elif tiling == "registry":  # backend="auto": what implementation="pallas" runs
    call_backend, tiling = "auto", None
    chosen, _ = sk.auto_backend(q.shape, k.shape, v.shape, bs, False, q.dtype, False)
    if chosen == "mosaic":  # its lax.cond: Mosaic's union tile vs a Triton tile (the label)
      union, _, switch = sk.auto_union(g, bs, chosen)
      took = bool(kc.use_union(idx, switch))
      tiling = union if took else kc.default_tiling(g, bs)
      backend = "mosaic" if took else "triton"
      impl_note += (f" (registry: {backend} branch, mean union "
                    f"{float(kc.mean_union(idx, switch[0])):.1f})")
  auto, union = tiling is None, kc.clustered_tiling(g, bs)
  mean_union = float(kc.mean_union(idx, kc.UNION_TOKENS))
  if auto and union is not None and bool(kc.use_union(idx)):  # what the call will run
    tiling, impl_note = union, impl_note + f" (auto: mean union {mean_union:.1f})"
  elif auto:
    tiling = kc.default_tiling(g, bs)
    impl_note += f" (auto: mean union {mean_union:.1f})" if union is not None else ""
  call_tiling = None if auto or call_backend else tiling
  f = lambda q, k, v, idx: select_attention(q, k, v, idx, bs, tiling=call_tiling,
                                            deterministic=deterministic,
                                            backend=call_backend or backend)[0]
  with mgpu_settings(WS_PINGPONG=pingpong, FAST_MASK=fast_mask, REG_P=reg_p,
                     FWD_SLOTS=slots[0], DKV_SLOTS=slots[1], OVERLAP=overlap,
                     LEAN_SMEM=lean, KV_RING=ring, RING_MIN_DIM=ring_min):
    fwd_ms, bwd_ms = time_fwd_bwd(f, q, k, v, do, idx, iters=iters)
  flops = select_flops(idx, bs, g, dk, dv)
  impl = (f"pallas-{'mosaic-gpu' if backend == 'mosaic' else 'triton'} {tiling.mode} tq{tiling.tokens_per_tile} bk{tiling.block_k} w{tiling.num_warps}"
          f"s{tiling.num_stages}; bwd tok{tiling.bwd_tokens} ch{tiling.chunk_entries} "
          f"w{tiling.bwd_num_warps}s{tiling.bwd_num_stages} {'det' if deterministic else 'atomic'}"
          + (f" fwd {tiling.blocks_per_step} blocks/step"
             if tiling.blocks_per_step > 1 and tiling.mode == "union" else "")
          + impl_note)
  recs = []
  for pass_, ms, fl, base in (("fwd", fwd_ms, flops, cudnn and cudnn[0]),
                              ("bwd", bwd_ms, 2.5 * flops, cudnn and cudnn[1])):
    floor = bc.floor_ms(fl, unique_bytes(b, t, h, kh, dk, dv, n, pass_), peaks) if peaks else None
    recs.append(bc.record(op="select", impl=impl, pass_=pass_, t=t, batch=b, q_heads=h, kv_heads=kh,
                          d_k=dk, d_v=dv, ms=ms, cudnn_ms=base, pattern=pattern, n=n, block=bs,
                          auto=auto, mean_union4=round(mean_union, 2),
                          tflops=round(fl / ms / 1e9, 1),
                          floor_ms=None if floor is None else round(floor, 3),
                          floor_ratio=None if floor is None else round(ms / floor, 2)))
  return recs


def bench_prep(t, kh, n, bs, pattern, tq, chunk, b=1):
  """ms of the XLA index maps alone (tile union for tq > 1, inverse lists)."""
  idx = index_pattern(jax.random.key(3), b, t, kh, n, bs, pattern)
  nb = -(-t // bs)
  u = bc.time_ms(jax.jit(lambda i: kc.tile_union(i, tq)), idx)
  inv = bc.time_ms(jax.jit(lambda i: kc.inverse_lists(i, nb, chunk)), idx)
  return u, inv


# ----------------------------------------------------------------------------- correctness on device

def check_compiled(cases=((1, 1001, 16, 1, 192, 128, 16), (2, 777, 16, 4, 128, 128, 16))):
  """Compiled kernels (bf16) vs the f32 reference: forward, grads, and bitwise-repeatable grads."""
  from nsa_jax import reference as ref
  ok_all = True
  default_switch = kc.UNION_SWITCH
  try:
    for b, t, h, kh, dk, dv, n in cases:
      # The explicit per-token default, then no tiling: G=16 picks from the lists. At these short T
      # both patterns select nearly every block (few distinct blocks a 4-token tile), so the second
      # automatic case lowers the switch to 0 to compile and check the per-token branch too.
      for pattern, auto, switch in (("random", False, default_switch),
                                    ("clustered", True, default_switch), ("random", True, 0.0)):
        kc.UNION_SWITCH = switch
        g = h // kh
        tiling = None if auto else dataclasses.replace(kc.default_tiling(g, 64), chunk_entries=256)
        key = jax.random.key(t + h)
        q, k, v, do = make_qkv(key, b, t, h, kh, dk, dv)
        idx = index_pattern(jax.random.key(5), b, t, kh, min(n, 16), 64, pattern)
        if kc.clustered_tiling(g, 64) is None:
          picked = "G<16 default"
        else:
          picked = "union tile" if bool(kc.use_union(idx)) else "per-token tile"
        tq_mode = f"{pattern} " + (f"auto ({picked})" if auto else "default")
        seg = jnp.asarray(np.sort(np.random.default_rng(t).integers(0, 3, (b, t)), 1), jnp.int32)

        def loss(fn):
          def inner(q, k, v):
            o, lse = fn(q, k, v)
            return jnp.sum(o.astype(jnp.float32) * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
          return inner
        f32 = lambda x: x.astype(jnp.float32)
        rf = lambda q, k, v: ref.select_attention(f32(q), f32(k), f32(v), idx, 64, seg)
        kf = lambda q, k, v: select_attention(q, k, v, idx, 64, seg, tiling=tiling)
        (o1, l1), (o2, l2) = rf(q, k, v), jax.jit(kf)(q, k, v)
        g1 = jax.grad(loss(rf), (0, 1, 2))(q, k, v)
        gk = jax.jit(jax.grad(loss(kf), (0, 1, 2)))
        g2, g3 = gk(q, k, v), gk(q, k, v)
        errs = [float(jnp.max(jnp.abs(f32(o2) - o1)))]
        errs += [float(jnp.max(jnp.abs(f32(a) - c)) / (jnp.max(jnp.abs(c)) + 1e-6)) for a, c in zip(g2, g1)]
        fin = bool(jnp.all(jnp.isfinite(l1) == jnp.isfinite(l2)))
        lerr = float(jnp.max(jnp.where(jnp.isfinite(l1), jnp.abs(l2 - l1), 0)))
        same = all(bool(jnp.array_equal(a, c)) for a, c in zip(g2, g3))
        ok = errs[0] < 3e-2 and max(errs[1:]) < 3e-2 and fin and lerr < 1e-2 and same
        ok_all &= ok
        print(f"check b{b} t{t} h{h} kv{kh} dk{dk} dv{dv} n{n} {tq_mode}: o_err={errs[0]:.2e} "
              f"lse_err={lerr:.2e} grad_rel_err={max(errs[1:]):.2e} bitwise_repeat={same} "
              f"{'OK' if ok else 'FAIL'}", flush=True)
  finally:
    kc.UNION_SWITCH = default_switch
  return ok_all


@contextlib.contextmanager
def mgpu_settings(**values):
  """select_attention_mgpu's module switches (read when traced) set to `values`, then restored."""
  saved = {name: getattr(select_attention_mgpu, name) for name in values}
  for name, value in values.items():
    setattr(select_attention_mgpu, name, value)
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(select_attention_mgpu, name, value)


def check_mosaic_overlap():
  """check_mosaic with OVERLAP on (P_j V_j in flight during the next softmax), compiled."""
  with mgpu_settings(OVERLAP=True):
    return check_mosaic(backend="mosaic")


def check_mosaic_ring():
  """check_mosaic with KV_RING on (the forward's K and V in one ring of 3 buffers), compiled."""
  with mgpu_settings(KV_RING=True):
    return check_mosaic(backend="mosaic")


def check_mosaic_slots(slots=4):
  """check_mosaic with FWD_SLOTS = DKV_SLOTS = slots (capped by shared memory), compiled."""
  with mgpu_settings(FWD_SLOTS=slots, DKV_SLOTS=slots):
    return check_mosaic(backend="mosaic")


def check_mosaic(cases=((1, 1001, 16, 1, 192, 128, 16), (2, 777, 16, 4, 128, 128, 16),
                        (1, 900, 16, 2, 64, 64, 16), (1, 700, 64, 1, 64, 64, 16)),
                 backend="mosaic", ws=False):
  """The compiled Mosaic GPU kernels (forward, dq, and dK/dV at G >= 8) vs the f32 reference, no
  segment ids; G = 16, 4 (Triton dK/dV) and 8. A case that fails to compile is reported, not
  raised: the timings after it still run. backend="auto": the registry's choice instead; ws: the
  128-row two-warpgroup forward."""
  from nsa_jax import reference as ref
  f32 = lambda x: x.astype(jnp.float32)
  ok_all = True
  for b, t, h, kh, dk, dv, n in cases:
    for pattern in ("random", "clustered"):
      label = f"check {backend}{' 2wg' if ws else ''} b{b} t{t} h{h} kv{kh} dk{dk} dv{dv} n{n} {pattern}"
      til = select_attention_mgpu.ws_tiling_for(h // kh, 64) if ws else None
      q, k, v, do = make_qkv(jax.random.key(t + h), b, t, h, kh, dk, dv)
      idx = index_pattern(jax.random.key(5), b, t, kh, n, 64, pattern)

      def loss(fn):
        def inner(q, k, v):
          o, lse = fn(q, k, v)
          return jnp.sum(f32(o) * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
        return inner
      rf = lambda q, k, v: ref.select_attention(f32(q), f32(k), f32(v), idx, 64)
      kf = lambda q, k, v: select_attention(q, k, v, idx, 64, backend=backend, tiling=til)
      try:
        (o1, l1), (o2, l2) = rf(q, k, v), jax.jit(kf)(q, k, v)
        g1 = jax.grad(loss(rf), (0, 1, 2))(q, k, v)
        g2 = jax.jit(jax.grad(loss(kf), (0, 1, 2)))(q, k, v)
      except Exception as e:  # a compile or launch failure is a finding
        ok_all = False
        print(f"{label}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
        continue
      o_err = float(jnp.max(jnp.abs(f32(o2) - o1)))
      g_err = max(float(jnp.max(jnp.abs(f32(a) - c)) / (jnp.max(jnp.abs(c)) + 1e-6))
                  for a, c in zip(g2, g1))
      fin = bool(jnp.all(jnp.isfinite(l1) == jnp.isfinite(l2)))
      lerr = float(jnp.max(jnp.where(jnp.isfinite(l1), jnp.abs(l2 - l1), 0)))
      ok = o_err < 3e-2 and g_err < 3e-2 and fin and lerr < 1e-2
      ok_all &= ok
      print(f"{label}: o_err={o_err:.2e} lse_err={lerr:.2e} grad_rel_err={g_err:.2e} "
            f"{'OK' if ok else 'FAIL'}", flush=True)
  return ok_all


# ----------------------------------------------------------------------------- main

def sweep_variants(g, pattern):
  """(tiling, deterministic) pairs for tuning: the default first. Multi-token tiles built from
  G = 16's per-token default pin 4 warps (its 2 are for 16-row tiles; the recorded tables ran 4)."""
  d = kc.default_tiling(g, 64)
  r = dataclasses.replace
  out = [(d, True)]
  if g >= 16 and pattern == "random":
    out += [(d, False), (r(d, num_stages=3), True), (r(d, bwd_tokens=8, bwd_num_warps=8), True),
            (r(d, chunk_entries=2048), True), (r(d, tokens_per_tile=4, num_warps=4), True)]
  elif g >= 16:
    out += [(r(d, tokens_per_tile=4, num_warps=4), True),
            (r(d, tokens_per_tile=4, num_warps=8), True)]
  elif pattern == "random":
    out += [(r(d, tokens_per_tile=1), True), (r(d, tokens_per_tile=64 // g), True), (d, False)]
  else:
    out += [(r(d, tokens_per_tile=64 // g), True)]
  return out


def _show(recs):
  for x in recs:
    print({k: x[k] for k in ("pass", "pattern", "T", "kv_heads", "ms", "speedup", "tflops",
                             "floor_ratio", "impl")}, flush=True)


def plan_jobs(name, ts, groups, patterns, block):
  """[(T, G, pattern, tiling, deterministic)] in run order (most important first)."""
  if name == "default":  # what a call without a tiling runs (G >= 16 picks its tile from the lists)
    return [(t, g, p, None, True) for t in ts for g in groups for p in patterns]
  if name == "sweep":
    return [(t, g, p, tl, det) for t in ts for g in groups for p in patterns
            for tl, det in sweep_variants(g, p)]
  if name == "final":  # the issue's target shapes with the defaults, the tiling candidates, other T
    r, d16, d4 = dataclasses.replace, kc.default_tiling(16, block), kc.default_tiling(4, block)
    jobs = [(65536, g, p, None, True) for g in (16, 4) for p in patterns]
    jobs += [(65536, 16, "clustered", r(d16, tokens_per_tile=4, mode="shared", num_warps=4), True),
             (65536, 16, "clustered", r(d16, tokens_per_tile=4, num_warps=4), True),
             (65536, 4, "clustered", r(d4, tokens_per_tile=16), True)]
    return jobs + [(t, 16, p, None, True) for t in (8192, 16384, 32768, 131072) for p in patterns]
  if name == "unroll":  # blocks folded per forward step, 64k, G=16 and G=4
    r, d16, d4 = dataclasses.replace, kc.default_tiling(16, block), kc.default_tiling(4, block)
    return ([(65536, 16, p, r(d16, blocks_per_step=k), True) for p in patterns for k in (1, 2, 4)]
            + [(65536, 4, "random", r(d4, blocks_per_step=k), True) for k in (1, 2)])
  if name == "train8k":  # the 8k training model's layer (run with --heads 16 --d 64 --batch 8)
    r, d16 = dataclasses.replace, kc.default_tiling(16, block)
    u4 = kc.clustered_tiling(16, block)
    variants = [None, d16, u4, r(u4, blocks_per_step=2), r(u4, tokens_per_tile=8),
                r(u4, num_stages=3), r(u4, num_warps=8), r(u4, bwd_tokens=8),
                r(u4, bwd_num_warps=8), r(u4, bwd_num_stages=3)]
    return [(t, g, p, tl, True) for t in ts for g in groups for p in patterns for tl in variants]
  if name == "mosaic":  # the Mosaic GPU forward against the Triton tiles it would replace
    u4 = kc.clustered_tiling(16, block)
    return ([(t, 16, p, tl, True) for t in ts for p in patterns for tl in ("mosaic", u4, None)]
            + [(t, 4, p, tl, True) for t in ts for p in patterns for tl in ("mosaic", None)])
  if name == "mosaicab16":  # G = 16: the Mosaic union tile vs Triton's, twice (which the
    # registry's union branch should be)
    u4 = kc.clustered_tiling(16, block)
    return [(t, 16, p, tl, True) for t in ts for p in patterns for tl in ("mosaic", u4) * 2]
  if name == "mosaicb1":  # the Mosaic forward step with B1's changes on / off (A/B, repeated)
    u4 = kc.clustered_tiling(16, block)
    var = ("mosaic", "mosaic-b1off", "mosaic")
    return ([(t, g, p, tl, True) for t in ts for g in groups for p in patterns for tl in var]
            + [(t, 16, p, u4, True) for t in ts for p in patterns])
  if name == "mosaicslots":  # the Mosaic kernels' pipeline depth (FWD_SLOTS / DKV_SLOTS), A/B
    var = ("mosaic", "mosaic-s3", "mosaic-s4", "mosaic-s2-3", "mosaic-s2-4", "mosaic")
    return [(t, g, p, tl, True) for t in ts for g in groups if g >= 8 for p in patterns
            for tl in var]
  if name == "mosaiclean":  # shared buffers (LEAN_SMEM, the default) vs separate ones, A/B twice
    return [(t, g, p, tl, True) for t in ts for g in groups if g >= 4 for p in patterns
            for tl in ("mosaic", "mosaic-fat", "mosaic", "mosaic-fat")]
  if name == "mosaicring":  # the forward's K/V ring (KV_RING) on / off, A/B twice
    return [(t, g, p, tl, True) for t in ts for g in groups if g >= 4 for p in patterns
            for tl in ("mosaic-noring", "mosaic-ring", "mosaic-noring", "mosaic-ring")]
  if name == "mosaicovl":  # the forward's intra-warpgroup overlap (OVERLAP) on / off, A/B twice
    return [(t, g, p, tl, True) for t in ts for g in groups if g >= 4 for p in patterns
            for tl in ("mosaic", "mosaic-ovl", "mosaic", "mosaic-ovl")]
  if name == "mosaicws":  # the two-warpgroup Mosaic forward against the 64-row one and Triton
    return [(t, g, p, tl, True) for t in ts for g in groups if g >= 8 for p in patterns
            for tl in ("mosaic-ws", "mosaic-ws-nopp", "mosaic", None)]
  if name == "registry":  # what implementation="pallas" runs (backend="auto"), G=16 and 4
    return [(t, g, p, "registry", True) for t in ts for g in groups for p in patterns]
  if name == "union4":  # G=16 "clustered": 4 tokens x 16 heads = 64-row tiles over the union
    r, d16 = dataclasses.replace, kc.default_tiling(16, block)
    return [(65536, 16, p, r(d16, tokens_per_tile=4, blocks_per_step=k, num_warps=4), True)
            for p in patterns for k in (1, 2)]
  raise ValueError(f"--plan {name!r}")


def _bar_jobs(rows):
  """[(impl, {pass: ms})]: one bar pair per measurement in run order (a variant timed twice gets
  two pairs; a record's bwd joins the fwd just before it when their impls match)."""
  jobs = []
  for r in rows:
    if r["pass"] == "fwd" or not jobs or r["impl"] != jobs[-1][0] or "bwd" in jobs[-1][1]:
      jobs.append((r["impl"], {}))
    jobs[-1][1][r["pass"]] = r["ms"]
  return jobs


def _bar_label(impl):
  """Short x label of a record's impl: backend, tile, and the variant notes that tell bars apart."""
  head = impl.split(";")[0].replace("pallas-", "").replace("mosaic-gpu", "mosaic")
  head = head.replace(" union ", "\nunion ").split(" bk")[0]
  notes = []
  if "2 consumer" in impl:
    notes.append("2 WG" + ("\nno ping-pong" if "no ping-pong" in impl else ""))
  if "(fast mask" in impl:
    variant = impl[impl.index("(fast mask") + 1:].split(")")[0]
    notes.append({"fast mask off, P from SMEM": "B1 off", "fast mask on, P from SMEM": "mask only",
                  "fast mask off, P from registers": "regs only"}.get(variant, variant))
  if "K/V ring" in impl:
    notes.append("K/V ring")
  if "(registry:" in impl:
    notes.append("registry")
  elif "auto" in impl:
    notes.append("auto")
  return "\n".join([head] + notes)


def plot(path):
  """Bar chart next to a results JSON: ms of every implementation, forward and backward, one
  panel per (T, G, pattern), cuDNN's time as a line."""
  import json
  import os
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  recs = [r for r in json.load(open(path)) if r.get("op") == "select"]
  if not recs:
    raise SystemExit(f"{path}: no selection records to plot")
  keys = sorted({(r["T"], r["kv_heads"], r["pattern"]) for r in recs})
  bars = max(sum(r["pass"] == "fwd" for r in recs if (r["T"], r["kv_heads"], r["pattern"]) == k)
             for k in keys)
  fig, axes = plt.subplots(1, len(keys), figsize=(max(6.2, max(4.2, 0.9 * bars) * len(keys)), 4.6),
                           squeeze=False)
  for ax, (t, kh, pat) in zip(axes[0], keys):
    rows = [r for r in recs if (r["T"], r["kv_heads"], r["pattern"]) == (t, kh, pat)]
    jobs = _bar_jobs(rows)
    impls = [im for im, _ in jobs]
    top = max(r["ms"] for r in rows)
    dense = []
    for i, pass_ in enumerate(("fwd", "bwd")):
      ms = [m.get(pass_, 0.0) for _, m in jobs]
      bars = ax.bar([j + 0.4 * i for j in range(len(impls))], ms, 0.4, label=pass_)
      ax.bar_label(bars, fmt="%.2f", fontsize=6)
      base = next((r["cudnn_ms"] for r in rows if r["pass"] == pass_ and r.get("cudnn_ms")), None)
      if base:
        dense.append(f"{pass_} {base:.1f}")
        if base < 1.4 * top:  # off the chart otherwise (named in the title)
          ax.axhline(base, ls=":" if pass_ == "fwd" else "--", color="grey",
                     label=f"cuDNN dense {pass_}")
    ax.set_xticks([j + 0.2 for j in range(len(impls))])
    ax.set_xticklabels([_bar_label(im) for im in impls], fontsize=7)
    r0 = rows[0]
    ax.set_title(f"T={t}, G={r0['q_heads'] // kh}, {pat}\n{r0['q_heads']} q heads, "
                 f"{r0['d_k']}/{r0['d_v']}, B={r0.get('batch', 1)}; cuDNN dense ms: "
                 + ", ".join(dense), fontsize=8)
    ax.set_ylabel("ms")
    ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=2)
  fig.suptitle(f"NSA selection kernels, {recs[0].get('hardware')}, {recs[0].get('date')}", fontsize=10)
  fig.tight_layout()
  out = os.path.splitext(path)[0] + ".png"
  fig.savefig(out, dpi=110)
  print(f"wrote {out}")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--T", default="8192,16384,32768,65536")
  p.add_argument("--groups", default="16,4", help="G = q heads / kv heads")
  p.add_argument("--heads", type=int, default=64, help="query heads")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--patterns", default="random,clustered")
  p.add_argument("--plan", default="default", help="default | sweep | final | unroll | union4 | train8k | mosaic | mosaicab16 | mosaicb1 | mosaicslots | mosaicovl | mosaicring | mosaiclean | mosaicws | registry "
                 "(registry: backend='auto', what implementation='pallas' runs)")
  p.add_argument("--n", type=int, default=16)
  p.add_argument("--block", type=int, default=64)
  p.add_argument("--d", type=int, default=128)
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--tag", default="",
                 help="file name part: <out>/select_<tag>.json (default: the GPU, e.g. h200)")
  p.add_argument("--check", action="store_true")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--no-bench", action="store_true")
  p.add_argument("--plot", default="", help="a results JSON: draw its bar chart (PNG) and exit")
  a = p.parse_args(argv)
  if a.plot:
    return plot(a.plot)
  bc.require_gpu(p, [], cpu_ok=False)
  logging.basicConfig(level=logging.WARNING)
  logging.getLogger("pallas_kernels").setLevel(logging.INFO)
  checks = {"mosaic": check_mosaic, "mosaicb1": check_mosaic, "mosaicslots": check_mosaic_slots,
            "mosaicovl": check_mosaic_overlap, "mosaicring": check_mosaic_ring, "mosaiclean": check_mosaic,
            "mosaicws": functools.partial(check_mosaic, ws=True, cases=(
                (1, 1001, 16, 1, 192, 128, 16), (1, 900, 16, 2, 64, 64, 16))),
            "mosaicab16": check_mosaic,
            "registry": functools.partial(check_mosaic, backend="auto", cases=(
                (1, 1001, 16, 1, 64, 64, 16), (2, 777, 16, 4, 128, 128, 16),
                (1, 1001, 16, 1, 128, 128, 16),
                # long enough that random 4-token unions pass the switch: the cond's Triton branch
                (1, 4096, 16, 1, 128, 128, 16)))}
  if a.check and not checks.get(a.plan, check_compiled)():
    print("CHECK FAILED", flush=True)
  if a.no_bench:
    return
  peaks = bc.measure_peaks()
  print(f"peaks: matmul {peaks[0] / 1e12:.0f} TFLOP/s, copy {peaks[1] / 1e12:.2f} TB/s", flush=True)
  name = f"select_{a.tag or bc.device_tag()}"
  pre = (f"# Selection kernel vs cuDNN dense causal ({bc.hardware()})\n\nCommand: `{bc.command_line()}`\n"
         f"Measured peaks: bf16 matmul {peaks[0] / 1e12:.0f} TFLOP/s, HBM copy {peaks[1] / 1e12:.2f} TB/s.")
  recs, h, b, cudnn = [], a.heads, a.batch, {}
  jobs = plan_jobs(a.plan, [int(x) for x in a.T.split(",")], [int(x) for x in a.groups.split(",")],
                   a.patterns.split(","), a.block)
  for t, g, pat, tiling, det in jobs:
    if (t, g) not in cudnn:
      cudnn[t, g] = bench_cudnn(t, h, h // g, a.d, b=b, iters=a.iters)
      print(f"T={t} G={g} cudnn fwd {cudnn[t, g][0]:.2f} ms bwd {cudnn[t, g][1]:.2f} ms", flush=True)
    try:
      r = bench_select(t, h, h // g, a.d, a.d, a.n, a.block, pat, tiling=tiling, deterministic=det,
                       b=b, cudnn=cudnn[t, g], peaks=peaks, iters=a.iters)
    except Exception as e:  # keep going: one tiling failing to compile is a finding, not a crash
      print(f"FAILED T={t} G={g} {pat} {tiling} det={det}: {type(e).__name__}: {str(e)[:400]}", flush=True)
      continue
    _show(r)
    recs += r
    bc.write_results(recs, a.out, name, pre + "\n\n(partial: written after every job)")
  bc.write_results(recs, a.out, name, pre)
  print(bc.markdown_table(recs))


if __name__ == "__main__":
  sys.exit(main())
