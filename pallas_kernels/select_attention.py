"""NSA selected-block attention (Eq. 12) as Pallas Triton-lowered kernels with a hand-written VJP.

Forward (group-centric, NSA.md section 3): one program per tile of query positions and KV group. The
tile's rows are its tokens x the group's G query heads; the inner loop walks the selected blocks
(for a multi-token tile: the union of its tokens' blocks, rows masked by membership) with online
softmax, causal mask inside each block, segment ids respected. Backward lives in
select_attention_bwd.py (dq: same tiles; dK/dV: inverse selection lists, deterministic by default).

Contract: select_attention(q [B,T,H,Dk], k [B,T,K,Dk], v [B,T,K,Dv], block_idx [B,T,K,n], block_size,
segment_ids=None, scale=None) -> (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32), the semantics of
nsa_jax.reference.select_attention (a query with no visible key gets o = 0, lse = -inf).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C
from pallas_kernels import select_attention_bwd as bwd

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- forward kernel

def _fwd_kernel(ub_ref, bits_ref, cnt_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                tq, g, m, t, h, kh, block_size, bk, dk_pieces, dv_pieces, scale, has_seg):
  tile, kk = pl.program_id(0), pl.program_id(1)
  tok, pos, row = C.tile_rows(tile, kk, tq=tq, g=g, m=m, t=t, h=h)
  qs = C.load_pieces(q_ref, row, dk_pieces)
  seg_q = seg_ref[jnp.minimum(pos, t - 1)] if has_seg else None

  def body(u, carry):
    m_i, l_i, accs = carry
    blk, bits = ub_ref[u], bits_ref[u]
    rows_on = ((bits >> tok) & 1) == 1  # this row's token picked the block
    for sub in range(block_size // bk):
      kpos, krow = C.key_rows(blk, sub, kk, bk=bk, block_size=block_size, t=t, kh=kh)
      ks = C.load_pieces(k_ref, krow, dk_pieces)
      vs = C.load_pieces(v_ref, krow, dv_pieces)
      seg_k = seg_ref[jnp.minimum(kpos, t - 1)] if has_seg else None
      s = C.dot_pieces(qs, ks) * (scale * LOG2E)  # base-2 logits
      s = jnp.where(C.visible(rows_on, pos, kpos, seg_q, seg_k), s, -jnp.inf)
      m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked row so far: avoid inf - inf
      alpha = jnp.exp2(m_i - m_use)
      p = jnp.exp2(s - m_use[:, None])
      l_i = l_i * alpha + jnp.sum(p, axis=1)
      pv = p.astype(vs[0].dtype)
      accs = tuple(a * alpha[:, None] + plgpu.dot(pv, vp) for a, vp in zip(accs, vs))
      m_i = m_new
    return m_i, l_i, accs

  init = (jnp.full((m,), -jnp.inf, jnp.float32), jnp.zeros((m,), jnp.float32),
          tuple(jnp.zeros((m, size), jnp.float32) for _, size in dv_pieces))
  m_i, l_i, accs = lax.fori_loop(0, cnt_ref[0], body, init)
  seen = l_i > 0.0
  l_safe = jnp.where(seen, l_i, 1.0)
  for (off, size), a in zip(dv_pieces, accs):
    C.store_rows(o_ref, row, off, (a / l_safe[:, None]).astype(o_ref.dtype))
  lse = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
  lse_ref[row] = lse


def forward(q, k, v, seg, ub, bits, cnt, *, block_size, scale, tiling, has_seg, interpret):
  """Pallas forward. q [B,T,H,Dk], k/v [B,T,K,D*], seg [B,T], ub/bits [B,nT,K,U], cnt [B,nT,K]."""
  b, t, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  g, tq = h // kh, tiling.tokens_per_tile
  nt, u = ub.shape[1], ub.shape[3]
  m = C.rows_of(g, tq)
  kernel = functools.partial(
      _fwd_kernel, tq=tq, g=g, m=m, t=t, h=h, kh=kh, block_size=block_size, bk=tiling.block_k,
      dk_pieces=C.dim_pieces(dk), dv_pieces=C.dim_pieces(dv), scale=scale, has_seg=has_seg)
  idx_spec = pl.BlockSpec((None, None, None, u), lambda i, j, bb: (bb, i, j, 0))
  whole = lambda *shape: pl.BlockSpec((None, *shape), lambda i, j, bb: (bb,) + (0,) * len(shape))
  o, lse = pl.pallas_call(
      kernel,
      grid=(nt, kh, b),  # tiles fastest: neighbouring tokens (sharing forced blocks) run together
      in_specs=[idx_spec, idx_spec,
                pl.BlockSpec((None, None, None, 1), lambda i, j, bb: (bb, i, j, 0)),
                whole(t), whole(t * h, dk), whole(t * kh, dk), whole(t * kh, dv)],
      out_specs=[whole(t * h, dv), whole(t * h)],
      out_shape=[jax.ShapeDtypeStruct((b, t * h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, t * h), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
      interpret=interpret,
      name=f"nsa_select_fwd_tq{tq}",
  )(ub, bits, cnt[..., None], seg, q.reshape(b, t * h, dk), k.reshape(b, t * kh, dk),
    v.reshape(b, t * kh, dv))
  return o.reshape(b, t, h, dv), lse.reshape(b, t, h)


# ----------------------------------------------------------------------------- custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _select(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret, deterministic):
  return _select_fwd(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret,
                     deterministic)[0]


def _select_fwd(q, k, v, block_idx, seg, block_size, scale, tiling, has_seg, interpret, deterministic):
  del deterministic
  ub, bits, cnt = C.tile_union(block_idx, tiling.tokens_per_tile)
  o, lse = forward(q, k, v, seg, ub, bits, cnt, block_size=block_size, scale=scale, tiling=tiling,
                   has_seg=has_seg, interpret=interpret)
  return (o, lse), (q, k, v, block_idx, seg, ub, bits, cnt, o, lse)


def _select_bwd(block_size, scale, tiling, has_seg, interpret, deterministic, res, cts):
  q, k, v, block_idx, seg, ub, bits, cnt, o, lse = res
  do, dlse = cts
  dq, dk, dv = bwd.backward(q, k, v, block_idx, seg, ub, bits, cnt, o, lse, do, dlse,
                            block_size=block_size, scale=scale, tiling=tiling, has_seg=has_seg,
                            interpret=interpret, deterministic=deterministic)
  return dq, dk, dv, None, None


_select.defvjp(_select_fwd, _select_bwd)


# ----------------------------------------------------------------------------- public API

def supports(q_shape, k_shape, v_shape, n, block_size, backend="triton"):
  """(ok, reason): whether `backend` handles these shapes."""
  if backend not in BACKENDS:
    return False, f"unknown backend {backend!r}; known: {sorted(BACKENDS)}"
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


BACKENDS = {"triton": _select}


def select_attention(q, k, v, block_idx, block_size, segment_ids=None, scale=None, *,
                     interpret=False, deterministic=True, backend="triton", tiling=None):
  """Selected-block attention. See the module docstring for shapes; returns (o, lse)."""
  ok, why = supports(q.shape, k.shape, v.shape, block_idx.shape[-1], block_size, backend)
  if not ok:
    raise ValueError(f"select_attention[{backend}] does not support this call: {why}")
  b, t, h, dk = q.shape
  g = h // k.shape[2]
  tiling = tiling or C.default_tiling(g, block_size)
  if block_size % tiling.block_k:
    raise ValueError(f"tiling.block_k={tiling.block_k} must divide block_size={block_size}")
  scale = float(dk ** -0.5 if scale is None else scale)
  has_seg = segment_ids is not None
  seg = segment_ids.astype(jnp.int32) if has_seg else jnp.zeros((b, t), jnp.int32)
  C.log_once((backend, q.shape, k.shape, v.shape, block_idx.shape, block_size, tiling, interpret),
             "select_attention: backend=%s q=%s k=%s v=%s n=%d block=%d %s interpret=%s",
             backend, q.shape, k.shape, v.shape, block_idx.shape[-1], block_size, tiling, interpret)
  return BACKENDS[backend](q, k, v, block_idx.astype(jnp.int32), seg, block_size, scale, tiling,
                           has_seg, interpret, deterministic)
