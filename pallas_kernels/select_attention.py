"""NSA selected-block attention (Eq. 12) as Pallas Triton-lowered kernels with a hand-written VJP.

Forward (group-centric, NSA.md section 3): one program per tile of query positions and KV group. The
tile's rows are its tokens x the group's G query heads; the inner loop walks the selected blocks
(for a multi-token tile: the union of its tokens' blocks, rows masked by membership) with online
softmax, causal mask inside each block, segment ids respected. Backward lives in
select_attention_bwd.py (dq: same tiles; dK/dV: inverse selection lists, deterministic by default).

Contract: select_attention(q [B,T,H,Dk], k [B,T,K,Dk], v [B,T,K,Dv], block_idx [B,T,K,n], block_size,
segment_ids=None, scale=None) -> (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32), the semantics of
nsa_jax.reference.select_attention (a query with no visible key gets o = 0, lse = -inf). block_idx
may hold -1 (empty), repeats (counted once) and blocks after the token (invisible), in any order:
_canonical_lists turns the last two into -1 before any map is built.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C
from pallas_kernels import select_attention_bwd as bwd
from pallas_kernels import select_attention_mgpu as mgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- forward kernels

def _init_state(m, dv_pieces):
  """Online-softmax state of an m-row tile: running max (base 2), running sum, accumulators."""
  return (jnp.full((m,), -jnp.inf, jnp.float32), jnp.zeros((m,), jnp.float32),
          tuple(jnp.zeros((m, size), jnp.float32) for _, size in dv_pieces))


def _store_state(state, row, o_ref, lse_ref, dv_pieces):
  """o = acc / l and lse = log(l) + max (o = 0, lse = -inf where no key was visible)."""
  m_i, l_i, accs = state
  seen = l_i > 0.0
  l_safe = jnp.where(seen, l_i, 1.0)
  for (off, _), a in zip(dv_pieces, accs):
    C.store_rows(o_ref, row, off, (a / l_safe[:, None]).astype(o_ref.dtype))
  lse_ref[row] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)


def _fwd_union_kernel(ub_ref, bits_ref, cnt_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                      tq, g, m, t, h, kh, block_size, bk, dk_pieces, dv_pieces, scale, has_seg, bps):
  tile, kk = pl.program_id(0), pl.program_id(1)
  tok, pos, row = C.tile_rows(tile, kk, tq=tq, g=g, m=m, t=t, h=h)
  qs = C.load_pieces(q_ref, row, dk_pieces)
  seg_q = seg_ref[pos] if has_seg else None
  kv = functools.partial(C.kv_steps, kk=kk, k_ref=k_ref, v_ref=v_ref, seg_ref=seg_ref, bk=bk,
                         block_size=block_size, t=t, kh=kh, dk_pieces=dk_pieces,
                         dv_pieces=dv_pieces, has_seg=has_seg)

  cnt = cnt_ref[0]

  def body(i, state):
    steps = []
    for j in range(bps):  # bps blocks per step: one shared rescale, independent loads
      blk, rows_on = C.union_block(ub_ref, bits_ref, cnt, i, j, bps, tok)
      for kpos, ks, vs, seg_k in kv(blk):
        s = C.dot_pieces(qs, ks) * (scale * LOG2E)  # base-2 logits
        steps.append((jnp.where(C.visible(rows_on, pos, kpos, seg_q, seg_k), s, -jnp.inf), vs))
    if bps > 1:
      return C.softmax_steps(state, steps)
    for s, vs in steps:  # one block: its key steps in turn
      state = C.softmax_step(state, s, vs)
    return state

  state = lax.fori_loop(0, (cnt + bps - 1) // bps, body, _init_state(m, dv_pieces))
  _store_state(state, row, o_ref, lse_ref, dv_pieces)


def _fwd_shared_kernel(com_ref, ccnt_ref, priv_ref, pcnt_ref, seg_ref, q_ref, k_ref, v_ref, o_ref,
                       lse_ref, *, tq, g, m, t, h, kh, block_size, bk, dk_pieces, dv_pieces, scale,
                       has_seg):
  tile, kk = pl.program_id(0), pl.program_id(1)
  toks = []  # per token of the tile: (pos, row, q pieces, query segment ids), m rows each
  for i in range(tq):
    _, pos, row = C.tile_rows(tile * tq + i, kk, tq=1, g=g, m=m, t=t, h=h)
    toks.append((pos, row, C.load_pieces(q_ref, row, dk_pieces), seg_ref[pos] if has_seg else None))
  kv = functools.partial(C.kv_steps, kk=kk, k_ref=k_ref, v_ref=v_ref, seg_ref=seg_ref, bk=bk,
                         block_size=block_size, t=t, kh=kh, dk_pieces=dk_pieces,
                         dv_pieces=dv_pieces, has_seg=has_seg)
  on = jnp.ones((m,), jnp.bool_)

  def step(state, tok, kpos, ks, vs, seg_k):
    pos, _, qs, seg_q = tok
    s = C.dot_pieces(qs, ks) * (scale * LOG2E)
    s = jnp.where(C.visible(on, pos, kpos, seg_q, seg_k), s, -jnp.inf)
    return C.softmax_step(state, s, vs)

  def common_body(u, states):  # one K/V load serves every token of the tile
    for kpos, ks, vs, seg_k in kv(com_ref[u]):
      states = tuple(step(st, tok, kpos, ks, vs, seg_k) for st, tok in zip(states, toks))
    return states

  states = lax.fori_loop(0, ccnt_ref[0], common_body, tuple(_init_state(m, dv_pieces) for _ in toks))
  for i, tok in enumerate(toks):
    def private_body(u, st, i=i, tok=tok):
      for kpos, ks, vs, seg_k in kv(priv_ref[i, u]):
        st = step(st, tok, kpos, ks, vs, seg_k)
      return st
    st = lax.fori_loop(0, pcnt_ref[i], private_body, states[i])
    _store_state(st, tok[1], o_ref, lse_ref, dv_pieces)


def forward(q, k, v, seg, maps, *, block_size, scale, tiling, has_seg, interpret):
  """Pallas forward. q [B,T,H,Dk], k/v [B,T,K,D*], seg [B,T], maps = C.tile_maps(block_idx, tiling)."""
  b, t, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  g, tq = h // kh, tiling.tokens_per_tile
  shared = tiling.mode == "shared"
  m = C.rows_of(g, 1 if shared else tq)
  extra = {} if shared else {"bps": tiling.blocks_per_step}
  kernel = functools.partial(
      _fwd_shared_kernel if shared else _fwd_union_kernel, tq=tq, g=g, m=m, t=t, h=h, kh=kh,
      block_size=block_size, bk=tiling.block_k, dk_pieces=C.dim_pieces(dk),
      dv_pieces=C.dim_pieces(dv), scale=scale, has_seg=has_seg, **extra)
  whole = lambda *shape: pl.BlockSpec((None, *shape), lambda i, j, bb: (bb,) + (0,) * len(shape))
  o, lse = pl.pallas_call(
      kernel,
      grid=(maps[0].shape[1], kh, b),  # tiles fastest: neighbouring tokens (sharing blocks) run together
      in_specs=C.map_specs(maps) + [
          whole(t), whole(t * h, dk), whole(t * kh, dk), whole(t * kh, dv)],
      out_specs=[whole(t * h, dv), whole(t * h)],
      out_shape=[jax.ShapeDtypeStruct((b, t * h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, t * h), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
      interpret=interpret,
      name=f"nsa_select_fwd_{tiling.mode}{tq}",
  )(*maps, seg, q.reshape(b, t * h, dk), k.reshape(b, t * kh, dk), v.reshape(b, t * kh, dv))
  return o.reshape(b, t, h, dv), lse.reshape(b, t, h)


# ----------------------------------------------------------------------------- custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _select(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret, deterministic):
  return _select_fwd(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret,
                     deterministic)[0]


def _select_fwd(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret, deterministic):
  del deterministic
  maps = C.tile_maps(block_idx, tiling)
  o, lse = forward(q, k, v, seg, maps, block_size=block_size, scale=scale, tiling=tiling,
                   has_seg=has_seg, interpret=interpret)
  return (o, lse), (q, k, v, block_idx, seg, maps, o, lse)


def _select_bwd(block_size, scale, tiling, has_seg, interpret, deterministic, res, cts):
  q, k, v, block_idx, seg, maps, o, lse = res
  do, dlse = cts
  dq, dk, dv = bwd.backward(q, k, v, block_idx, seg, maps, o, lse, do, dlse,
                            block_size=block_size, scale=scale, tiling=tiling, has_seg=has_seg,
                            interpret=interpret, deterministic=deterministic)
  return dq, dk, dv, None, None


_select.defvjp(_select_fwd, _select_bwd)


# The Mosaic GPU (TMA + wgmma) forward, dq and (G >= 8) dK/dV partials over the inverse
# lists, summed by the Triton reduce kernel in a fixed order (G = 4: the Triton dK/dV)
# (select_attention_mgpu.py; backend="auto" picks it where it was measured faster).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _select_mosaic(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret,
                   deterministic):
  return _select_mosaic_fwd(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret,
                            deterministic)[0]


def _select_mosaic_fwd(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret,
                       deterministic):
  del deterministic  # segment ids: refused before this point unless mgpu.SEGMENT_IDS (and by
  # the two-warpgroup tile always: mgpu.ws_supports)
  g = q.shape[2] // k.shape[2]
  maps = C.tile_maps(block_idx, tiling)
  if tiling.tokens_per_tile == mgpu.WS_ROWS // g:  # 128-row tiles: two consumer warpgroups
    o, lse = mgpu.ws_forward(q, k, v, maps, block_size=block_size, scale=scale,
                             interpret=interpret)
    maps = None  # dq runs 64-row tiles: its maps are built in the backward
  else:
    o, lse = mgpu.forward(q, k, v, maps, block_size=block_size, scale=scale, interpret=interpret,
                          seg=seg if has_seg else None)
  return (o, lse), (q, k, v, block_idx, seg, maps, o, lse)


def _select_mosaic_bwd(block_size, scale, tiling, has_seg, interpret, deterministic, res, cts):
  q, k, v, block_idx, seg, maps, o, lse = res
  return _mosaic_backward(q, k, v, block_idx, seg, maps, o, lse, *cts, block_size=block_size,
                          scale=scale, tiling=tiling, has_seg=has_seg, interpret=interpret,
                          deterministic=deterministic) + (None, None)


def dkv_backend(g, dk, dv, has_seg):
  """("mosaic" or "triton", why): the dK/dV kernels under the Mosaic forward and dq: the Mosaic
  partials where they apply (G >= 8; with segment ids only with mgpu.DKV_SEGMENT_IDS), else
  Triton."""
  ok, why = mgpu.dkv_supports(g, dk, dv)
  if ok and has_seg and not mgpu.DKV_SEGMENT_IDS:
    ok, why = False, "segment ids: select_attention_mgpu.DKV_SEGMENT_IDS is off"
  return ("mosaic", "Mosaic GPU partials") if ok else ("triton", why)


def _mosaic_backward(q, k, v, block_idx, seg, maps, o, lse, do, dlse, *, block_size, scale, tiling,
                     has_seg, interpret, deterministic):
  """(dq, dk, dv): Mosaic GPU dq, and dK/dV from the Mosaic partials (G >= 8; with segment ids
  only with mgpu.DKV_SEGMENT_IDS) or Triton."""
  if maps is None:
    maps = C.tile_maps(block_idx, mgpu.tiling_for(q.shape[2] // k.shape[2], block_size))
  delta = bwd.delta_of(o, do, dlse)
  do = do.astype(q.dtype)
  dq = mgpu.dq(q, k, v, maps, do, lse, delta, block_size=block_size, scale=scale,
               interpret=interpret, seg=seg if has_seg else None)
  if dkv_backend(q.shape[2] // k.shape[2], k.shape[3], v.shape[3], has_seg)[0] == "mosaic":
    dkx, dvx, first, nitems = mgpu.dkv_partials(q, k, v, block_idx, do, lse, delta,
                                                chunk_entries=tiling.chunk_entries, scale=scale,
                                                interpret=interpret, seg=seg if has_seg else None)
    dk, dv = bwd.reduce_partials(first, nitems, dkx, dvx, k, v, block_size=block_size,
                                 interpret=interpret)
  else:
    dk, dv = bwd._dkv(q, k, v, block_idx, seg, do, lse, delta, block_size=block_size, scale=scale,
                      tiling=tiling, has_seg=has_seg, interpret=interpret,
                      deterministic=deterministic)
  return dq, dk, dv


_select_mosaic.defvjp(_select_mosaic_fwd, _select_mosaic_bwd)


# The automatic choice (no tiling given, G >= 16): `tilings` = (per-token, 4-token union). The
# choice is made once in the forward (lax.cond on the lists' mean 4-token union) and saved as a
# residual; the backward takes the same branch, with the union branch's index maps saved from the
# forward (zeros when the other branch ran; that one's cheap maps are rebuilt).
# `union_backend` "mosaic" runs the union branch with the Mosaic GPU kernels (G = 16: their 64-row
# tile is the same 4 tokens; G = 4: the other branch is Triton's 4-token tile and the union branch
# Mosaic's 16-token one, `switch` = (16, MOSAIC_G4_SWITCH); see auto_backend).
# Cost, H200, T=64k, 192/128: the selection's fwd+bwd temporaries are 1.45 GiB against 0.44 GiB
# with a fixed tile (1.47 GiB with the lax.cond around two _select calls instead): the compiled
# program keeps buffers for both branches' kernels.

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11, 12))
def _select_auto(q, k, v, block_idx, seg, block_size, scale, tilings, has_seg, interpret,
                 deterministic, union_backend="triton", switch=None):
  return _select_auto_fwd(q, k, v, block_idx, seg, block_size, scale, tilings, has_seg, interpret,
                          deterministic, union_backend, switch)[0]


def _select_auto_fwd(q, k, v, block_idx, seg, block_size, scale, tilings, has_seg, interpret,
                     deterministic, union_backend="triton", switch=None):
  del deterministic
  use_union = C.use_union(block_idx, switch)
  run = lambda til, maps: forward(q, k, v, seg, maps, block_size=block_size, scale=scale,
                                  tiling=til, has_seg=has_seg, interpret=interpret)

  # The union branch's index maps (sorts, a search and a scatter over every tile's lists) are a
  # residual, so the backward does not rebuild them; the other branch returns zeros in their place
  # (its own maps are rebuilt in the backward).
  def run_union():
    maps = C.tile_maps(block_idx, tilings[1])
    if union_backend == "mosaic":
      return (*mgpu.forward(q, k, v, maps, block_size=block_size, scale=scale,
                            interpret=interpret, seg=seg if has_seg else None), maps)
    return (*run(tilings[1], maps), maps)

  def run_other():
    shapes = jax.eval_shape(lambda: C.tile_maps(block_idx, tilings[1]))
    return (*run(tilings[0], C.tile_maps(block_idx, tilings[0])),
            jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes))

  o, lse, union_maps = lax.cond(use_union, run_union, run_other)
  return (o, lse), (q, k, v, block_idx, seg, o, lse, use_union, union_maps)


def _select_auto_bwd(block_size, scale, tilings, has_seg, interpret, deterministic, union_backend,
                     switch, res, cts):
  del switch  # the forward's choice is a residual
  q, k, v, block_idx, seg, o, lse, use_union, union_maps = res
  do, dlse = cts
  kw = dict(block_size=block_size, scale=scale, has_seg=has_seg, interpret=interpret,
            deterministic=deterministic)
  if union_backend == "mosaic":
    run_union = lambda: _mosaic_backward(q, k, v, block_idx, seg, union_maps, o, lse, do, dlse,
                                         tiling=tilings[1], **kw)
  else:
    run_union = lambda: bwd.backward(q, k, v, block_idx, seg, union_maps, o, lse, do, dlse,
                                     tiling=tilings[1], **kw)
  run_other = lambda: bwd.backward(q, k, v, block_idx, seg, C.tile_maps(block_idx, tilings[0]), o,
                                   lse, do, dlse, tiling=tilings[0], **kw)
  dq, dk, dv = lax.cond(use_union, run_union, run_other)
  return dq, dk, dv, None, None


_select_auto.defvjp(_select_auto_fwd, _select_auto_bwd)


# ----------------------------------------------------------------------------- public API

def supports(q_shape, k_shape, v_shape, n, block_size, backend="triton"):
  """(ok, reason): whether `backend` handles these shapes."""
  if backend not in BACKENDS and backend != "auto":
    return False, f"unknown backend {backend!r}; known: {sorted(BACKENDS) + ['auto']}"
  b, t, h, dk = q_shape
  if k_shape[:2] != (b, t) or v_shape[:3] != k_shape[:3] or k_shape[3] != dk:
    return False, f"k {k_shape} / v {v_shape} do not match q {q_shape}"
  kh = k_shape[2]
  if h % kh:
    return False, f"{h} query heads not a multiple of {kh} KV heads"
  for name, d in (("d_k", dk), ("d_v", v_shape[3])):
    if d < 16 or d % 16:
      return False, f"{name}={d}: needs a multiple of 16 (>= 16) for the matrix unit"
  if block_size < 16 or block_size & (block_size - 1):
    return False, f"block_size={block_size}: needs a power of two >= 16"
  nb = C.cdiv(t, block_size)
  if nb * t >= 2 ** 31 or t * h >= 2 ** 31:
    return False, f"T={t} too long for the int32 index maps"
  if n < 1:
    return False, f"n={n}: need at least one slot"
  return True, "ok"


# Where the automatic choice (backend="auto") runs the Mosaic GPU kernels: measured on the H200
# (benchmarks/results/select_h200_mosaic8k.md, select_h200_mosaic.md, 2026-11-30). Head dims 64
# (the 8k training layer, 16 query heads): G = 16 fwd 1.42 vs 1.63 ms (clustered), 2.48 vs 2.59
# (random), bwd 4.01 vs 4.15 / 4.89 vs 5.33; G = 4 fwd 2.75 vs 3.70 / 4.96 vs 6.43, bwd 5.20 vs
# 6.13 / 7.38 vs 9.01. Head dims 128 (T=64k, 64 query heads), G = 16: Triton was faster on
# 2026-11-30 (fwd 8.68 vs 9.18 ms clustered, bwd 21.7 vs 27.4); after the Mosaic step changes
# (B1) and LEAN_SMEM, Mosaic's union tile is the faster union branch (2026-12-02,
# select_h200_mosaic64.md: clustered fwd 8.37 vs 8.54 ms, bwd 20.01 vs 21.42; random, where the
# lax.cond takes the per-token Triton tile anyway, 20.24 vs 20.12 / 33.08 vs 33.97), so the
# union branch there is Mosaic. This also moves G = 16 calls at other lengths and at head dims
# between 64 and 128 (e.g. 128 / 64) onto that branch, measured only at 64k 128/128 and at the
# 8k training layer (64/64); no training config here has such head dims. G = 4 depends on the
# pattern (below). G = 8 / 32 / 64 and d = 192 or 256 are not measured with Mosaic: Triton.
#
# G = 4 (d <= 128) is decided per call from the block lists: Mosaic's 16-token tile walks the
# union of 16 tokens' lists. H200, 64k: "clustered" (16-token tiles average 30.0 distinct blocks)
# Mosaic 15.86 ms vs Triton 21.49, "random" (157.5) 74.09 vs 52.65; linear in between they cross
# near 79.5 = ~5 n (n = 16): Mosaic when 16-token tiles average <= MOSAIC_G4_SWITCH * n. At d = 64,
# 8k both patterns (25.5 and 59.7 distinct blocks) were Mosaic wins, consistent with that switch.
MOSAIC_AUTO_MAX_DIM = {16: 128, 4: 128}  # G -> largest head dim where the rule applies
MOSAIC_G4_SWITCH = 5.0
# Up to this sequence length, G = 16 with the Mosaic union tile runs that tile without the
# lax.cond: at the 8k training layer (B = 8, 16 heads, d = 64, n = 16) the cond took the union
# branch for clustered and for random lists alike (4-token mean unions 17.5 and 35.4, under the
# 2.25 n = 36 switch; select_h200_registry8k.md), where the union tile was also the faster one
# (select_h200_mosaic8k.md), and the cond itself cost a 12-layer training step 2.9 and 3.5 ms
# (H200, 2026-12-01, benchmarks/compile_time_trial.py flag "union" against the default:
# 214.9 -> 212.0 and 209.2 -> 205.7 ms; compile_time_overhead_h200.json and
# compile_time_union_h200.json). Lists whose 4-token
# unions exceed the switch (not measured at this length) run the union tile too: exact, possibly
# slower. Longer sequences keep the cond, and so do head dims above STATIC_UNION_MAX_DIM (the
# union tile alone was measured at d = 64 only).
STATIC_UNION_MAX_T = 8192
STATIC_UNION_MAX_DIM = 64
# The same shapes with segment ids where the Mosaic kernels do not take them
# (select_attention_mgpu.SEGMENT_IDS off; on by default since 2026-12-07, when "auto" runs the
# Mosaic union tile alone with the ids as above): backend="auto" runs Triton, and
# (STATIC_UNION_IDS) its 4-token union tile alone instead of the lax.cond. In the masked 8k
# training step (H100, 2026-12-06, benchmarks/results/profdoc_nsa_h100_s41/) the cond took the
# union branch in every layer; the cond itself is what the Mosaic case above saved. Exact either
# way; the A/B is benchmarks/select_doc_trial.py ("auto" against "triton", which keeps the cond).
STATIC_UNION_IDS = True


def static_union(g, t, dk, dv):
  """Whether a G = 16 call whose union branch is Mosaic GPU (or, with segment ids and
  STATIC_UNION_IDS, Triton) runs that tile alone, without the lax.cond (STATIC_UNION_MAX_T,
  STATIC_UNION_MAX_DIM)."""
  return g == 16 and t <= STATIC_UNION_MAX_T and max(dk, dv) <= STATIC_UNION_MAX_DIM


def union_alone_with_ids(g, t, dk, dv, has_seg):
  """Whether a backend="auto" call that runs Triton because of its segment ids takes the Triton
  union tile alone, without the lax.cond (STATIC_UNION_IDS; the shapes of static_union)."""
  return STATIC_UNION_IDS and has_seg and static_union(g, t, dk, dv)


def auto_backend(q_shape, k_shape, v_shape, block_size, has_seg, dtype, interpret):
  """(backend, why) for backend="auto": "mosaic" where the Mosaic GPU kernels were measured faster
  on the H200 (compiled only; each keeps a lax.cond to a Triton tile for block lists that
  neighbouring tokens share little, see _select_auto, except G = 16 up to STATIC_UNION_MAX_T
  tokens at head dims <= STATIC_UNION_MAX_DIM: the union tile alone, static_union), else
  "triton" (with segment ids at those shapes its union tile alone: union_alone_with_ids).
  Segment ids reach Mosaic GPU with select_attention_mgpu.SEGMENT_IDS (on by default), and
  "auto" sends them there only at the static_union shapes (G = 16, T <= STATIC_UNION_MAX_T, head
  dims <= STATIC_UNION_MAX_DIM: the one case timed with ids); elsewhere ids run Triton
  (backend="mosaic" takes them at any shape it supports)."""
  if interpret:
    return "triton", "interpreted (no GPU): the Triton kernels"
  ok, why = mgpu.supports(q_shape, k_shape, v_shape, block_size, has_seg, dtype)
  if not ok:
    return "triton", f"Mosaic GPU does not apply: {why}"
  g, dk, dv = q_shape[2] // k_shape[2], q_shape[3], v_shape[3]
  if has_seg and not static_union(g, q_shape[1], dk, dv):
    return "triton", (f"segment ids at G={g}, T={q_shape[1]}, d_k/d_v={dk}/{dv}: Mosaic GPU with "
                      f"ids measured faster only at G=16, T <= STATIC_UNION_MAX_T="
                      f"{STATIC_UNION_MAX_T}, head dims <= STATIC_UNION_MAX_DIM="
                      f"{STATIC_UNION_MAX_DIM} (the 8k training layer, on an H100)")
  if has_seg:
    return "mosaic", (f"G={g}, d_k/d_v={dk}/{dv} with segment ids: Mosaic GPU (SEGMENT_IDS) "
                      "measured faster at the 8k training layer on an H100")
  if max(dk, dv) > MOSAIC_AUTO_MAX_DIM.get(g, 0):
    return "triton", (f"G={g}, d_k/d_v={dk}/{dv}: Mosaic GPU measured faster only for "
                      + ", ".join(f"G={gg} with head dims <= {d}"
                                  for gg, d in MOSAIC_AUTO_MAX_DIM.items()))
  kind = jax.devices()[0].device_kind
  return "mosaic", (f"G={g}, d_k/d_v={dk}/{dv}: Mosaic GPU measured faster on the H200"
                    + ("" if "H200" in kind else f" (this is a {kind}: not re-measured on it)"))


def auto_union(g, block_size, backend):
  """The lax.cond a call without a tiling runs, given the backend auto_backend chose (or
  "triton"): (union tiling or None, the union branch's backend, switch = (tokens, factor) for
  C.use_union). Mosaic: its 64-row union tile (G = 16: the same 4 tokens as Triton's, switched at
  C.UNION_SWITCH; G = 4: 16 tokens, MOSAIC_G4_SWITCH). Triton: G >= 16's 4-token union tile
  (clustered_tiling; None for G < 16, whose default tile already stacks tokens)."""
  if backend == "mosaic":
    union = mgpu.tiling_for(g, block_size)
    ct = C.clustered_tiling(g, block_size)  # G = 16: the same 4-token tile as Mosaic's
    g4 = ct is None or ct.tokens_per_tile != union.tokens_per_tile
    return union, "mosaic", (union.tokens_per_tile, MOSAIC_G4_SWITCH if g4 else C.UNION_SWITCH)
  return C.clustered_tiling(g, block_size), "triton", (C.UNION_TOKENS, C.UNION_SWITCH)


# name -> differentiable implementation. "mosaic": the Mosaic GPU kernels (Hopper), see
# select_attention_mgpu.py; backend="auto" picks between the two (auto_backend).
BACKENDS = {"triton": _select, "mosaic": _select_mosaic}


def _check_tiling(tiling, block_size, interpret):
  if tiling.mode not in ("union", "shared"):
    raise ValueError(f"tiling.mode={tiling.mode!r}: expected 'union' or 'shared'")
  if block_size % tiling.block_k or (tiling.block_k < 16 and not interpret):
    raise ValueError(f"tiling.block_k={tiling.block_k}: must divide block_size={block_size} and be "
                     ">= 16 (the matrix unit's minimum) when compiled")
  if not 1 <= tiling.tokens_per_tile <= 31:
    raise ValueError(f"tiling.tokens_per_tile={tiling.tokens_per_tile}: 1..31 (int32 token bits)")
  for f in ("blocks_per_step", "dq_blocks_per_step"):
    if not 1 <= getattr(tiling, f) <= 8:
      raise ValueError(f"tiling.{f}={getattr(tiling, f)}: expected 1..8")
  if tiling.bwd_tokens < 1 or tiling.chunk_entries < 1:
    raise ValueError(f"tiling.bwd_tokens / chunk_entries must be >= 1, got {tiling}")


def _canonical_lists(idx, block_size):
  """The lists the kernels assume, with the reference's meaning kept: -1 for a block that starts
  after the token (invisible to it; then in every ascending union only the last entry, the tile's
  own block, needs the causal mask, which the Mosaic kernels rely on) and for a repeated block
  (the reference counts it once; the kernels would attend to it twice). One small fusion over
  [B, T, K, n, n]."""
  t, n = idx.shape[1], idx.shape[-1]
  earlier = np.tril(np.ones((n, n), bool), -1)  # [slot, other slot] = other slot comes first
  repeated = jnp.any((idx[..., :, None] == idx[..., None, :]) & earlier, axis=-1)
  # idx > pos // l' is "starts after the token" without idx * l' (which wraps for huge indices)
  future = idx > (jnp.arange(t, dtype=jnp.int32) // block_size)[None, :, None, None]
  return jnp.where(repeated | future | (idx < 0), -1, idx)


def select_attention(q, k, v, block_idx, block_size, segment_ids=None, scale=None, *,
                     interpret=False, deterministic=True, backend="triton", tiling=None):
  """Selected-block attention. See the module docstring for shapes; returns (o, lse)."""
  ok, why = supports(q.shape, k.shape, v.shape, block_idx.shape[-1], block_size, backend)
  if not ok:
    raise ValueError(f"select_attention[{backend}] does not support this call: {why}")
  b, t, h, dk = q.shape
  g = h // k.shape[2]
  if block_idx.shape[:3] != k.shape[:3]:
    raise ValueError(f"block_idx {block_idx.shape} must be [B, T, K, n] = {k.shape[:3]} + (n,)")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}): cast them to one")
  chosen = None  # what backend="auto" chose
  if backend == "auto":
    backend, why = ("triton", "a tiling was given") if tiling is not None else auto_backend(
        q.shape, k.shape, v.shape, block_size, segment_ids is not None, q.dtype, interpret)
    chosen = backend
    C.log_once(("auto", backend, q.shape, k.shape, v.shape), "select_attention: auto backend %s "
               "for q=%s k=%s v=%s (%s)", backend, q.shape, k.shape, v.shape, why)
  # No tiling given: the call picks, from the block lists themselves, a union tile when
  # neighbouring tokens share most blocks and the other tile otherwise (lax.cond; both exact; the
  # switch says where they cross on the H200; see _select_auto and auto_union). A chosen Mosaic
  # backend runs that union branch; the other branch is Triton; G = 16 up to STATIC_UNION_MAX_T
  # tokens at head dims <= STATIC_UNION_MAX_DIM runs the Mosaic union tile alone (static_union),
  # and with segment ids, where "auto" runs Triton, the Triton union tile alone
  # (union_alone_with_ids).
  # (An explicit backend="mosaic" runs Mosaic only.)
  union = union_backend = switch = None
  if tiling is None and (backend == "triton" or chosen == "mosaic"):
    union, union_backend, switch = auto_union(g, block_size, backend)
    backend = "triton"
    if union_backend == "mosaic" and static_union(g, t, q.shape[3], v.shape[3]):
      C.log_once(("static union", q.shape), "select_attention: T=%d <= STATIC_UNION_MAX_T=%d, "
                 "G=16, head dims <= STATIC_UNION_MAX_DIM=%d: Mosaic GPU union tile without the "
                 "lax.cond", t, STATIC_UNION_MAX_T, STATIC_UNION_MAX_DIM)
      backend, tiling, union = "mosaic", union, None
    elif (chosen == "triton" and union is not None
          and union_alone_with_ids(g, t, q.shape[3], v.shape[3], segment_ids is not None)):
      C.log_once(("static union ids", q.shape), "select_attention: segment ids, T=%d <= "
                 "STATIC_UNION_MAX_T=%d, G=16, head dims <= STATIC_UNION_MAX_DIM=%d: the Triton "
                 "union tile without the lax.cond (STATIC_UNION_IDS)", t, STATIC_UNION_MAX_T,
                 STATIC_UNION_MAX_DIM)
      tiling, union = union, None
  if backend == "mosaic":
    ok, why = mgpu.supports(q.shape, k.shape, v.shape, block_size, segment_ids is not None, q.dtype)
    if not ok:
      raise ValueError(f"select_attention[mosaic] does not support this call: {why}")
    want = mgpu.tiling_for(g, block_size)
    ws = mgpu.ws_tiling_for(g, block_size).tokens_per_tile
    if tiling is not None and tiling.tokens_per_tile == ws and tiling.mode == "union":
      ok, why = mgpu.ws_supports(q.shape, k.shape, v.shape, block_size, segment_ids is not None,
                                 q.dtype)
      if not ok:
        raise ValueError(f"select_attention[mosaic] with 128-row tiles (two consumer warpgroups) "
                         f"does not support this call: {why}")
    elif tiling is not None and (tiling.mode, tiling.tokens_per_tile) != ("union", want.tokens_per_tile):
      raise ValueError(f"select_attention[mosaic] runs 64-row union tiles (tokens_per_tile="
                       f"{want.tokens_per_tile}) or, for G >= 8, 128-row tiles with two consumer "
                       f"warpgroups (tokens_per_tile={ws}); tiling must have mode='union' and one "
                       f"of those (got {tiling.mode!r}, {tiling.tokens_per_tile}); pass tiling=None")
    tiling = tiling or want
  tiling = tiling or C.default_tiling(g, block_size)
  for til in (tiling, union) if union else (tiling,):
    _check_tiling(til, block_size, interpret)
  scale = float(dk ** -0.5 if scale is None else scale)
  seg, has_seg = C.segment_ids_int32(segment_ids, b, t, "select_attention")
  C.check_indices(block_idx, "select_attention")
  idx = _canonical_lists(block_idx.astype(jnp.int32), block_size)
  n = block_idx.shape[-1]
  mosaic_fwd = (backend == "mosaic" and tiling.tokens_per_tile == mgpu.tiling_for(g, block_size)
                .tokens_per_tile) or (union is not None and union_backend == "mosaic")
  ring = mosaic_fwd and mgpu.forward_runs_ring(g, dk, v.shape[3], interpret)
  C.log_once((backend, q.shape, k.shape, v.shape, block_idx.shape, block_size, tiling, union,
              interpret, ring),
             "select_attention: backend=%s q=%s k=%s v=%s n=%d block=%d %s%s%s interpret=%s",
             backend, q.shape, k.shape, v.shape, n, block_size, tiling,
             "" if union is None else (f"; when {switch[0]}-token tiles average <= "
                                       f"{switch[1] * n:g} distinct blocks: {union_backend} "
                                       f"{union}"),
             " (Mosaic forward with the K/V ring of 3 buffers)" if ring else "", interpret)
  if union is None:
    return BACKENDS[backend](q, k, v, idx, seg, block_size, scale, tiling, has_seg, interpret,
                             deterministic)
  return _select_auto(q, k, v, idx, seg, block_size, scale, (tiling, union), has_seg, interpret,
                      deterministic, union_backend, switch)
