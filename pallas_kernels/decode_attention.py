"""NSA selection attention for ONE new query per sequence (decoding), a Pallas Triton-lowered
kernel split across the context (flash-decoding style).

A decode step has a single query, so one program per (sequence, KV group) would leave most of a
GPU idle at batch 1. Here the n selected blocks of a KV group are cut into splits of
`blocks_per_split` blocks; program (b, k, s) loads the group's G query heads (padded to >= 16 rows
for the matrix unit), walks only its split's selected blocks (contiguous [block_k, D] slabs of a
head-major cache) with online softmax, and writes an unnormalised partial (acc, max, sum). A small
XLA epilogue merges the splits. Only the selected keys are read: n * l' tokens per group (an empty
slot, -1, reads block 0 and masks it whole).

Contract (the semantics of nsa_jax.decode_math.select_decode):
  select_decode(qg [B, K, G, Dk], k [B, K, S, Dk], v [B, K, S, Dv], block_idx [B, K, n] int32
  (-1 = empty slot), t (int32 scalar: the query's position; keys <= t are visible), block_size)
  -> (o [B, K, G, Dv] in qg.dtype, lse [B, K, G] float32); o = 0, lse = -inf when nothing is seen.
The same kernel in contiguous mode, `prefix_decode(qg, k, v, t)`, attends to slots 0..t of a short
cache split across its length (the compressed cache, optionally returning the logits of the same
pass for the selection scores, and the window ring), so a whole NSA decode step reads each cached
token it needs exactly once. `select_window_decode` runs the selection and the window ring in one
launch (splits of both side by side).
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
from pallas_kernels import select_topn as st

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
TARGET_PROGRAMS = 264  # two waves of an H200's 132 SMs: enough splits to fill it at batch 1


def _walk(state, qs, k_ref, v_ref, lo, hi, t, *, block_of, block_size, bk, dk_pieces, dv_pieces,
          scale, lg_ref=None, band=None):
  """Online softmax over slots [lo, hi) of a block list: block_of(j) -> (block id, live).

  band (contiguous mode, one 64-slot step per block): (w_own, w_next, own_ref, mref_ref, nxt_ref,
  mnx_ref). After step j, p = exp2(logit - m_j) of its slots (m_j: the running max after the step,
  the reference max) goes through Eq. 9's band: own_ref[j] = p @ w_own (this step's selection
  blocks), nxt_ref[j + 1] = p @ w_next (the next step's blocks, which the band reaches), and
  mref_ref[j] = mnx_ref[j + 1] = m_j; decode_select's top-n kernel rescales them by
  exp2(m_j - lse) once lse is known. Float32-exact through three bfloat16 terms, as select_topn.
  """

  def body(j, carry):
    m_i, l_i, accs = carry
    blk, live = block_of(j)  # an empty slot (-1) reads block 0 and masks it whole
    for sub in range(block_size // bk):
      start = blk * block_size + sub * bk
      ks = [k_ref[pl.ds(start, bk), pl.ds(off, size)] for off, size in dk_pieces]
      vs = [v_ref[pl.ds(start, bk), pl.ds(off, size)] for off, size in dv_pieces]
      s = C.dot_pieces(qs, ks) * scale  # [m_rows, bk]
      if lg_ref is not None:  # contiguous mode: slot j of this split's output block holds lo + j
        lg_ref[:, pl.ds((j - lo) * block_size + sub * bk, bk)] = s
      s = s * LOG2E  # base-2 logits for exp2
      kpos = start + lax.iota(jnp.int32, bk)
      s = jnp.where(((kpos <= t) & live)[None, :], s, -jnp.inf)
      (m_i, l_i, accs), (p,) = C.softmax_steps((m_i, l_i, accs), [(s, vs)], return_p=True)
      if band is not None:  # p = exp2(s - m_j) of this step (masked slots: 0)
        w_own, w_next, own_ref, mref_ref, nxt_ref, mnx_ref = band
        parts = st._split3(p)
        own_ref[j] = st._exact_dot(parts, w_own)
        nxt_ref[j + 1] = st._exact_dot(parts, w_next)
        mref_ref[j] = m_i
        mnx_ref[j + 1] = m_i
    return m_i, l_i, accs

  return lax.fori_loop(lo, jnp.maximum(lo, hi), body, state)


def _init(m_rows, dv_pieces):
  return (jnp.full((m_rows,), -jnp.inf, jnp.float32), jnp.zeros((m_rows,), jnp.float32),
          tuple(jnp.zeros((m_rows, size), jnp.float32) for _, size in dv_pieces))


def _store(state, acc_ref, m_ref, l_ref, dv_pieces):
  m_i, l_i, accs = state
  for (off, size), a in zip(dv_pieces, accs):
    acc_ref[:, pl.ds(off, size)] = a
  m_ref[...] = m_i
  l_ref[...] = l_i


def _listed(idx_ref):
  def block_of(j):
    blk = idx_ref[j]
    return jnp.maximum(blk, 0), blk >= 0
  return block_of


def _kernel(idx_ref, meta_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *out_refs, m_rows, bps,
            block_size, bk, dk_pieces, dv_pieces, scale, band=None):
  split = pl.program_id(2)
  cnt, t = meta_ref[0], meta_ref[1]
  first = split * bps
  last = jnp.minimum(first + bps, cnt)  # slots past cnt are never read (prefix mode)
  qs = [q_ref[:, pl.ds(off, size)] for off, size in dk_pieces]
  lg_ref, band_refs = None, None
  if band is not None:  # (r, c, off, nsj_pad): Eq. 9's band matrices, constant per step
    r, c, off, nsj_pad = band
    u = lax.broadcasted_iota(jnp.int32, (block_size, nsj_pad), 0)
    v = lax.broadcasted_iota(jnp.int32, (block_size, nsj_pad), 1)
    real = v < block_size // r  # padded columns (fewer than 16 blocks a step) stay 0
    w_own = jnp.where(real, st._band(u, r * v + off, r, c), 0.0).astype(jnp.bfloat16)
    w_next = jnp.where(real, st._band(u, r * (block_size // r + v) + off, r, c),
                       0.0).astype(jnp.bfloat16)
    band_refs = (w_own, w_next, *out_refs)
  elif out_refs:
    lg_ref = out_refs[0]
  state = _walk(_init(m_rows, dv_pieces), qs, k_ref, v_ref, first, last, t,
                block_of=_listed(idx_ref), block_size=block_size, bk=bk, dk_pieces=dk_pieces,
                dv_pieces=dv_pieces, scale=scale, lg_ref=lg_ref, band=band_refs)
  _store(state, acc_ref, m_ref, l_ref, dv_pieces)


def _sel_win_kernel(idx_ref, meta_ref, q_ref, k_ref, v_ref, kw_ref, vw_ref, acc_ref, m_ref, l_ref,
                    *, m_rows, bps, wbps, sel_splits, n, block_size, bk, dk_pieces, dv_pieces,
                    scale):
  """Splits [0, sel_splits) walk the selected blocks of k/v; the rest walk the window ring kw/vw
  (contiguous, slots <= t_win). One loop of each kind per program, the other one empty."""
  split = pl.program_id(2)
  t, t_win = meta_ref[0], meta_ref[1]
  is_win = split >= sel_splits
  lo = jnp.where(is_win, 0, split * bps)
  hi = jnp.where(is_win, 0, jnp.minimum(split * bps + bps, n))
  w_lo = jnp.where(is_win, (split - sel_splits) * wbps, 0)
  w_hi = jnp.where(is_win, jnp.minimum(w_lo + wbps, t_win // block_size + 1), 0)
  qs = [q_ref[:, pl.ds(off, size)] for off, size in dk_pieces]
  kw = dict(block_size=block_size, bk=bk, dk_pieces=dk_pieces, dv_pieces=dv_pieces, scale=scale)
  state = _walk(_init(m_rows, dv_pieces), qs, k_ref, v_ref, lo, hi, t, block_of=_listed(idx_ref),
                **kw)
  state = _walk(state, qs, kw_ref, vw_ref, w_lo, w_hi, t_win, block_of=lambda j: (j, True), **kw)
  _store(state, acc_ref, m_ref, l_ref, dv_pieces)


def per_group(*shape):
  """BlockSpec of a [B, K, *shape] array: every program (b, k, ...) of the grid reads slab (b, k)."""
  return pl.BlockSpec((None, None, *shape), lambda bb, kk, *_: (bb, kk) + (0,) * len(shape))


def per_split(*shape):
  """BlockSpec of a [B, K, splits, *shape] output: program (b, k, s) writes its own slab."""
  return pl.BlockSpec((None, None, None, *shape),
                      lambda bb, kk, ss: (bb, kk, ss) + (0,) * len(shape))


def pad_rows(qg):
  """(M, qg padded to M >= 16 head rows, the matrix unit's minimum): [B, K, M, Dk]."""
  m_rows = C.rows_of(qg.shape[2], 1)
  return m_rows, jnp.pad(qg, ((0, 0), (0, 0), (0, m_rows - qg.shape[2]), (0, 0)))


def default_blocks_per_split(batch, kv_heads, n):
  """Enough splits that batch * kv_heads * splits reaches TARGET_PROGRAMS, at most one per block."""
  splits = max(1, min(n, C.cdiv(TARGET_PROGRAMS, batch * kv_heads)))
  return C.cdiv(n, splits)


def supports(qg_shape, k_shape, v_shape, block_size, block_k=None):
  """(ok, reason) for these shapes."""
  b, kh, g, dk = qg_shape
  if tuple(k_shape[:2]) != (b, kh) or tuple(v_shape[:3]) != tuple(k_shape[:3]) or k_shape[3] != dk:
    return False, f"k {k_shape} / v {v_shape} do not match qg {qg_shape}"
  for name, d in (("d_k", dk), ("d_v", v_shape[3])):
    if d < 16 or d % 16:
      return False, f"{name}={d}: needs a multiple of 16 for the matrix unit"
  bk = block_k or min(64, block_size)
  if bk < 16 or bk & (bk - 1) or block_size % bk:
    return False, f"block_k={bk} must be a power of two >= 16 dividing block_size={block_size}"
  if k_shape[2] % block_size:
    return False, f"cache length {k_shape[2]} is not a whole number of {block_size}-token blocks"
  return True, "ok"


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "blocks_per_split", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def select_decode(qg, k, v, block_idx, t, block_size, scale=None, *, blocks_per_split=None,
                  block_k=None, num_warps=4, num_stages=2, interpret=False):
  """Selected-block attention of one query per sequence; see the module docstring."""
  ok, why = supports(qg.shape, k.shape, v.shape, block_size, block_k)
  if not ok:
    raise ValueError(f"pallas select_decode does not support this call: {why}")
  b, kh, g, dk = qg.shape
  n = block_idx.shape[-1]
  bps = blocks_per_split or default_blocks_per_split(b, kh, n)
  # Every slot is walked; the kernel masks empty ones (-1), so no XLA compaction pass is needed.
  idx = block_idx.astype(jnp.int32)
  cnt = jnp.full((b, kh), n, jnp.int32)
  acc, m, l, _ = _call(qg, k, v, idx, cnt, t, block_size, scale, bps, block_k, num_warps,
                       num_stages, interpret, want_logits=False)
  return merge_splits(acc, m, l, qg.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_size", "blocks_per_split", "block_k",
                                             "num_warps", "num_stages", "interpret",
                                             "return_logits"))
def prefix_decode(qg, k, v, t, scale=None, *, block_size=64, blocks_per_split=None, block_k=None,
                  num_warps=4, num_stages=2, interpret=False, return_logits=False):
  """Attention of one query per sequence over the cache slots 0..t of a contiguous cache
  k [B, K, S, Dk], v [B, K, S, Dv] (S a multiple of block_size), split across S.

  Used for the compressed cache (t = visible blocks - 1) and the window ring (t = min(t, W - 1):
  a ring of W <= w slots written at p % W holds only in-window positions, slots <= t when t < W).
  Returns (o, lse) like select_decode, plus logits [B, K, G, S] float32 (q.k * scale; only slots
  <= t are meaningful) with return_logits, read in the same pass (the compression scores need them).
  """
  ok, why = supports(qg.shape, k.shape, v.shape, block_size, block_k)
  if not ok:
    raise ValueError(f"pallas prefix_decode does not support this call: {why}")
  b, kh, g, _ = qg.shape
  acc, m, l, lg = prefix_partials(qg, k, v, t, block_size, scale, blocks_per_split, block_k,
                                  num_warps, num_stages, interpret, want_logits=return_logits)
  o, lse = merge_splits(acc, m, l, qg.dtype)
  if not return_logits:
    return o, lse
  lg = lg[:, :, :, :g].transpose(0, 1, 3, 2, 4).reshape(b, kh, g, -1)
  return o, lse, lg[..., :k.shape[2]]


def prefix_partials(qg, k, v, t, block_size, scale, blocks_per_split, block_k, num_warps,
                    num_stages, interpret, want_logits, band=None):
  """prefix_decode's pallas_call over slots 0..t: the per-split partials (acc, m, l) and the raw
  logits blocks [B, K, splits, M, bps * block_size] (see `_call`), before any merge; with band =
  (r, c, off, nsj_pad), Eq. 9's per-step band sums instead of the logits (see `_walk`)."""
  b, kh = qg.shape[:2]
  nb = k.shape[2] // block_size
  bps = blocks_per_split or default_blocks_per_split(b, kh, nb)
  idx = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (b, kh, nb))
  t = jnp.asarray(t, jnp.int32)
  cnt = jnp.broadcast_to(jnp.clip(t // block_size + 1, 0, nb), (b, kh)).astype(jnp.int32)
  return _call(qg, k, v, idx, cnt, t, block_size, scale, bps, block_k, num_warps, num_stages,
               interpret, want_logits, band)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "blocks_per_split",
                                             "window_blocks_per_split", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def select_window_decode(qg, k, v, block_idx, t, k_win, v_win, t_win, block_size, scale=None, *,
                         blocks_per_split=None, window_blocks_per_split=None, block_k=None,
                         num_warps=4, num_stages=2, interpret=False):
  """The selection branch (as `select_decode` over k, v, block_idx) and the window ring (as
  `prefix_decode` over k_win, v_win slots 0..t_win, W a multiple of block_size) in ONE
  pallas_call: one launch, the two branches' splits side by side on the GPU.
  Returns (o_slc, lse_slc, o_win, lse_win)."""
  for kk, vv, what in ((k, v, "selection"), (k_win, v_win, "window")):
    ok, why = supports(qg.shape, kk.shape, vv.shape, block_size, block_k)
    if not ok:
      raise ValueError(f"pallas select_window_decode does not support the {what} cache: {why}")
  b, kh, g, dk = qg.shape
  dv, n, nbw = v.shape[3], block_idx.shape[-1], k_win.shape[2] // block_size
  bps = blocks_per_split or default_blocks_per_split(b, kh, n)
  wbps = window_blocks_per_split or default_blocks_per_split(b, kh, nbw)
  sel_splits, splits = C.cdiv(n, bps), C.cdiv(n, bps) + C.cdiv(nbw, wbps)
  m_rows, q_rows = pad_rows(qg)
  n_pad = C.next_pow2(n)
  idx = jnp.pad(block_idx.astype(jnp.int32), ((0, 0), (0, 0), (0, n_pad - n)), constant_values=-1)
  meta = jnp.broadcast_to(jnp.stack([jnp.asarray(t, jnp.int32), jnp.asarray(t_win, jnp.int32)]),
                          (b, kh, 2))
  kernel = functools.partial(
      _sel_win_kernel, m_rows=m_rows, bps=bps, wbps=wbps, sel_splits=sel_splits, n=n,
      block_size=block_size, bk=block_k or min(64, block_size), dk_pieces=C.dim_pieces(dk),
      dv_pieces=C.dim_pieces(dv), scale=float(dk ** -0.5 if scale is None else scale))
  C.log_once(("decode_sel_win", qg.shape, k.shape, k_win.shape, n, block_size, interpret),
             "decode selection + window: qg=%s k=%s k_win=%s blocks=%d splits=%d+%d interpret=%s",
             qg.shape, k.shape, k_win.shape, n, sel_splits, splits - sel_splits, interpret)
  acc, m, l = pl.pallas_call(
      kernel,
      grid=(b, kh, splits),
      in_specs=[per_group(n_pad), per_group(2), per_group(m_rows, dk),
                per_group(k.shape[2], dk), per_group(k.shape[2], dv),
                per_group(k_win.shape[2], dk), per_group(k_win.shape[2], dv)],
      out_specs=[per_split(m_rows, dv), per_split(m_rows), per_split(m_rows)],
      out_shape=[jax.ShapeDtypeStruct((b, kh, splits, m_rows, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="nsa_decode_select_window",
  )(idx, meta, q_rows, k, v, k_win, v_win)
  acc, m, l = acc[:, :, :, :g], m[..., :g], l[..., :g]
  o_s, lse_s = merge_splits(acc[:, :, :sel_splits], m[:, :, :sel_splits], l[:, :, :sel_splits],
                            qg.dtype)
  o_w, lse_w = merge_splits(acc[:, :, sel_splits:], m[:, :, sel_splits:], l[:, :, sel_splits:],
                            qg.dtype)
  return o_s, lse_s, o_w, lse_w


def _call(qg, k, v, idx, cnt, t, block_size, scale, bps, block_k, num_warps, num_stages,
          interpret, want_logits, band=None):
  """The pallas_call shared by both entry points: idx [B, K, n] block ids with the cnt [B, K]
  valid ones first. Returns per-split partials (acc, m, l) [B, K, splits, G, ...] and the logits
  blocks [B, K, splits, M, bps * block_size] (None unless want_logits)."""
  b, kh, g, dk = qg.shape
  s_len, dv, n = k.shape[2], v.shape[3], idx.shape[-1]
  scale = float(dk ** -0.5 if scale is None else scale)
  bk = block_k or min(64, block_size)
  splits = C.cdiv(n, bps)
  m_rows, q_rows = pad_rows(qg)
  n_pad = C.next_pow2(n)
  idx = jnp.pad(idx, ((0, 0), (0, 0), (0, n_pad - n)))
  meta = jnp.stack([cnt, jnp.broadcast_to(jnp.asarray(t, jnp.int32), cnt.shape)], axis=-1)
  kernel = functools.partial(
      _kernel, m_rows=m_rows, bps=bps, block_size=block_size, bk=bk,
      dk_pieces=C.dim_pieces(dk), dv_pieces=C.dim_pieces(dv), scale=scale, band=band)
  out_specs = [per_split(m_rows, dv), per_split(m_rows), per_split(m_rows)]
  out_shape = [jax.ShapeDtypeStruct((b, kh, splits, m_rows, dv), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32)]
  if band is not None:  # whole per (sequence, group): each program writes its own steps' rows
    if bk != block_size:
      raise ValueError("band sums need one walk step per block (block_k = block_size)")
    nsj_pad = band[3]
    for steps in (band_steps(n), band_steps(n) + 1):  # own sums; next-step sums (one later)
      out_specs += [per_group(steps, m_rows, nsj_pad), per_group(steps, m_rows)]
      out_shape += [jax.ShapeDtypeStruct((b, kh, steps, m_rows, nsj_pad), jnp.float32),
                    jax.ShapeDtypeStruct((b, kh, steps, m_rows), jnp.float32)]
  elif want_logits:  # one block per split: programs never write the same output block
    out_specs.append(per_split(m_rows, bps * block_size))
    out_shape.append(jax.ShapeDtypeStruct((b, kh, splits, m_rows, bps * block_size), jnp.float32))
  C.log_once(("decode", qg.shape, k.shape, v.shape, n, block_size, bps, bk, want_logits, interpret),
             "decode attention: qg=%s k=%s v=%s blocks=%d block=%d splits=%d block_k=%d logits=%s "
             "interpret=%s", qg.shape, k.shape, v.shape, n, block_size, splits, bk, want_logits,
             interpret)
  outs = pl.pallas_call(
      kernel,
      grid=(b, kh, splits),
      in_specs=[per_group(n_pad), per_group(2), per_group(m_rows, dk), per_group(s_len, dk),
                per_group(s_len, dv)],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="nsa_decode_attention",
  )(idx, meta, q_rows, k, v)
  acc, m, l = outs[0][:, :, :, :g], outs[1][..., :g], outs[2][..., :g]
  if band is not None:
    return acc, m, l, tuple(outs[3:])
  return acc, m, l, (outs[3] if want_logits else None)


def band_steps(n):
  """Rows the top-n kernel reads of the band-sum outputs of n walk steps: a power of two >= n
  (the next-step sums have one row more: step j writes row j + 1)."""
  return C.next_pow2(n)


def merge_splits(acc, m, l, dtype):
  """Flash-decoding epilogue: partials acc [B, K, S, G, Dv], base-2 max m and sum l [B, K, S, G]
  -> o [B, K, G, Dv] (dtype), lse [B, K, G] float32 (natural log)."""
  m_all = jnp.max(m, axis=2)
  m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  w = jnp.exp2(m - m_safe[:, :, None])  # 0 for empty splits (m = -inf)
  l_all = jnp.sum(w * l, axis=2)
  seen = l_all > 0
  l_safe = jnp.where(seen, l_all, 1.0)
  o = jnp.sum(w[..., None] * acc, axis=2) / l_safe[..., None]
  lse = jnp.where(seen, (m_safe + jnp.log2(l_safe)) * LN2, -jnp.inf)
  return o.astype(dtype), lse
