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

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
TARGET_PROGRAMS = 264  # two waves of an H200's 132 SMs: enough splits to fill it at batch 1


def _walk(state, qs, k_ref, v_ref, lo, hi, t, *, block_of, block_size, bk, dk_pieces, dv_pieces,
          scale, lg_ref=None):
  """Online softmax over slots [lo, hi) of a block list: block_of(j) -> (block id, live)."""

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
      m_i, l_i, accs = C.softmax_step((m_i, l_i, accs), s, vs)
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


def _kernel(*refs, contiguous, m_rows, bps, block_size, bk, dk_pieces, dv_pieces, scale):
  """Program (b, k, split): slots [split * bps, ...) of the block list (contiguous: blocks 0, 1, ...
  of the cache, no list read), up to cnt; meta = [cnt, t]."""
  if contiguous:
    meta_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *lg_refs = refs
    block_of = lambda j: (j, True)
  else:
    idx_ref, meta_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *lg_refs = refs
    block_of = _listed(idx_ref)
  split = pl.program_id(2)
  cnt, t = meta_ref[0], meta_ref[1]
  first = split * bps
  last = jnp.minimum(first + bps, cnt)  # slots past cnt are never read (prefix mode)
  qs = [q_ref[:, pl.ds(off, size)] for off, size in dk_pieces]
  state = _walk(_init(m_rows, dv_pieces), qs, k_ref, v_ref, first, last, t,
                block_of=block_of, block_size=block_size, bk=bk, dk_pieces=dk_pieces,
                dv_pieces=dv_pieces, scale=scale, lg_ref=lg_refs[0] if lg_refs else None)
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


def scalars(*xs):
  """int32 scalars (static or traced) as one small array that every program reads whole: no
  per-(sequence, group) broadcast in XLA before the launch."""
  return jnp.stack([jnp.asarray(x, jnp.int32) for x in xs])


def whole(n):
  """BlockSpec of a [n] array that every program reads whole."""
  return pl.BlockSpec((n,), lambda *_: (0,))


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
  acc, m, l, _ = _call(qg, k, v, block_idx.astype(jnp.int32), n, t, block_size, scale, bps,
                       block_k, num_warps, num_stages, interpret, want_logits=False)
  return merge_splits(*real_rows((acc, m, l), g), qg.dtype)


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
  o, lse = merge_splits(*real_rows((acc, m, l), g), qg.dtype)
  if not return_logits:
    return o, lse
  lg = lg[:, :, :, :g].transpose(0, 1, 3, 2, 4).reshape(b, kh, g, -1)
  return o, lse, lg[..., :k.shape[2]]


def prefix_partials(qg, k, v, t, block_size, scale, blocks_per_split, block_k, num_warps,
                    num_stages, interpret, want_logits):
  """prefix_decode's pallas_call over slots 0..t: the per-split partials (acc, m, l) with all M
  padded head rows (see `_call`) and the raw logits blocks [B, K, splits, M, bps * block_size],
  before any merge."""
  b, kh = qg.shape[:2]
  nb = k.shape[2] // block_size
  bps = blocks_per_split or default_blocks_per_split(b, kh, nb)
  cnt = jnp.clip(jnp.asarray(t, jnp.int32) // block_size + 1, 0, nb)
  return _call(qg, k, v, None, cnt, t, block_size, scale, bps, block_k, num_warps, num_stages,
               interpret, want_logits)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "blocks_per_split",
                                             "window_blocks_per_split", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def select_window_decode(qg, k, v, block_idx, t, k_win, v_win, t_win, block_size, scale=None, *,
                         blocks_per_split=None, window_blocks_per_split=None, block_k=None,
                         num_warps=4, num_stages=2, interpret=False, cmp_parts=None, gates=None):
  """The selection branch (as `select_decode` over k, v, block_idx) and the window ring (as
  `prefix_decode` over k_win, v_win slots 0..t_win, W a multiple of block_size) in ONE
  pallas_call: one launch, the two branches' splits side by side on the GPU.
  Returns (o_slc, lse_slc, o_win, lse_win).

  With cmp_parts (the compression branch's per-split partials (acc, m, l) with M head rows, from
  decode_select.compressed_select_decode(merged=False)) and gates [B, K, G, 3] (cmp, slc, win):
  returns the gated NSA output o [B, K, G, Dv] (qg.dtype) instead, every branch's split merge
  and the gated sum done by one small epilogue kernel (`combine_decode`)."""
  for kk, vv, what in ((k, v, "selection"), (k_win, v_win, "window")):
    ok, why = supports(qg.shape, kk.shape, vv.shape, block_size, block_k)
    if not ok:
      raise ValueError(f"pallas select_window_decode does not support the {what} cache: {why}")
  if (cmp_parts is None) != (gates is None):
    raise ValueError("select_window_decode: give cmp_parts and gates together (the gated output) "
                     "or neither (the two branches' outputs)")
  b, kh, g, dk = qg.shape
  dv, n, nbw = v.shape[3], block_idx.shape[-1], k_win.shape[2] // block_size
  bps = blocks_per_split or default_blocks_per_split(b, kh, n)
  wbps = window_blocks_per_split or default_blocks_per_split(b, kh, nbw)
  sel_splits, splits = C.cdiv(n, bps), C.cdiv(n, bps) + C.cdiv(nbw, wbps)
  m_rows, q_rows = pad_rows(qg)
  n_pad = C.next_pow2(n)
  idx = jnp.pad(block_idx.astype(jnp.int32), ((0, 0), (0, 0), (0, n_pad - n)), constant_values=-1)
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
      in_specs=[per_group(n_pad), whole(2), per_group(m_rows, dk),
                per_group(k.shape[2], dk), per_group(k.shape[2], dv),
                per_group(k_win.shape[2], dk), per_group(k_win.shape[2], dv)],
      out_specs=[per_split(m_rows, dv), per_split(m_rows), per_split(m_rows)],
      out_shape=[jax.ShapeDtypeStruct((b, kh, splits, m_rows, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="nsa_decode_select_window",
  )(idx, scalars(t, t_win), q_rows, k, v, k_win, v_win)
  if gates is not None:
    return combine_decode(cmp_parts, (acc, m, l), sel_splits, gates, qg.dtype, interpret=interpret)
  acc, m, l = real_rows((acc, m, l), g)
  o_s, lse_s = merge_splits(acc[:, :, :sel_splits], m[:, :, :sel_splits], l[:, :, :sel_splits],
                            qg.dtype)
  o_w, lse_w = merge_splits(acc[:, :, sel_splits:], m[:, :, sel_splits:], l[:, :, sel_splits:],
                            qg.dtype)
  return o_s, lse_s, o_w, lse_w


def _call(qg, k, v, idx, cnt, t, block_size, scale, bps, block_k, num_warps, num_stages,
          interpret, want_logits):
  """The pallas_call shared by both entry points: idx [B, K, n] block ids (None: the contiguous
  blocks 0, 1, ... of the cache, no list), of which the first cnt (an int32 scalar) are walked.
  Returns per-split partials (acc, m, l) [B, K, splits, M, ...] with all M >= G padded head rows
  (`real_rows` keeps the G real ones) and the logits blocks [B, K, splits, M, bps * block_size]
  (None unless want_logits)."""
  b, kh, g, dk = qg.shape
  s_len, dv = k.shape[2], v.shape[3]
  n = s_len // block_size if idx is None else idx.shape[-1]
  scale = float(dk ** -0.5 if scale is None else scale)
  bk = block_k or min(64, block_size)
  splits = C.cdiv(n, bps)
  m_rows, q_rows = pad_rows(qg)
  ins, in_specs = [], []
  if idx is not None:
    n_pad = C.next_pow2(n)
    ins.append(jnp.pad(idx, ((0, 0), (0, 0), (0, n_pad - n))))
    in_specs.append(per_group(n_pad))
  kernel = functools.partial(
      _kernel, contiguous=idx is None, m_rows=m_rows, bps=bps, block_size=block_size, bk=bk,
      dk_pieces=C.dim_pieces(dk), dv_pieces=C.dim_pieces(dv), scale=scale)
  out_specs = [per_split(m_rows, dv), per_split(m_rows), per_split(m_rows)]
  out_shape = [jax.ShapeDtypeStruct((b, kh, splits, m_rows, dv), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, splits, m_rows), jnp.float32)]
  if want_logits:  # one block per split: programs never write the same output block
    out_specs.append(per_split(m_rows, bps * block_size))
    out_shape.append(jax.ShapeDtypeStruct((b, kh, splits, m_rows, bps * block_size), jnp.float32))
  C.log_once(("decode", qg.shape, k.shape, v.shape, n, block_size, bps, bk, want_logits, interpret),
             "decode attention: qg=%s k=%s v=%s blocks=%d block=%d splits=%d block_k=%d logits=%s "
             "interpret=%s", qg.shape, k.shape, v.shape, n, block_size, splits, bk, want_logits,
             interpret)
  outs = pl.pallas_call(
      kernel,
      grid=(b, kh, splits),
      in_specs=in_specs + [whole(2), per_group(m_rows, dk), per_group(s_len, dk),
                           per_group(s_len, dv)],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="nsa_decode_attention",
  )(*ins, scalars(cnt, t), q_rows, k, v)
  return outs[0], outs[1], outs[2], (outs[3] if want_logits else None)


def real_rows(parts, g):
  """Partials (acc, m, l) with M padded head rows -> the G real rows (no copy when M == G)."""
  acc, m, l = parts
  if acc.shape[3] == g:
    return acc, m, l
  return acc[:, :, :, :g], m[..., :g], l[..., :g]


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


def merged_max_sum(m_ref, l_ref, lo, hi, m_rows):
  """In a kernel: the merged base-2 max (0 where nothing was seen) and sum [M] of splits
  [lo, hi) of one (sequence, group)'s partials, m_ref / l_ref [S, M]."""
  m_all = lax.fori_loop(lo, hi, lambda s, x: jnp.maximum(x, m_ref[s]),
                        jnp.full((m_rows,), -jnp.inf, jnp.float32))
  m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  l_all = lax.fori_loop(lo, hi, lambda s, x: x + jnp.exp2(m_ref[s] - m_safe) * l_ref[s],
                        jnp.zeros((m_rows,), jnp.float32))
  return m_safe, l_all


def _merged(m_ref, l_ref, acc_ref, lo, hi, m_rows, dv_pieces):
  """o [M, Dv] (float32 pieces) of splits [lo, hi): merge_splits inside a kernel (0 if unseen)."""
  m_safe, l_all = merged_max_sum(m_ref, l_ref, lo, hi, m_rows)

  def add(s, accs):
    w = jnp.exp2(m_ref[s] - m_safe)[:, None]  # 0 for empty splits (m = -inf)
    return tuple(a + w * acc_ref[s, :, pl.ds(off, size)] for a, (off, size) in zip(accs, dv_pieces))

  accs = lax.fori_loop(lo, hi, add, tuple(jnp.zeros((m_rows, size), jnp.float32)
                                         for _, size in dv_pieces))
  inv = jnp.where(l_all > 0, 1.0 / jnp.where(l_all > 0, l_all, 1.0), 0.0)[:, None]
  return [a * inv for a in accs]


def _combine_kernel(gates_ref, mc_ref, lc_ref, accc_ref, m_ref, l_ref, acc_ref, o_ref, *, m_rows,
                    cmp_splits, sel_splits, splits, dv_pieces):
  """Program (b, k): o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win over the group's M rows,
  each branch's splits merged here (gates_ref [M * 3] row-major: (cmp, slc, win) per head)."""
  gate = lambda c: gates_ref[pl.ds(c, m_rows, stride=3)][:, None]
  terms = (_merged(mc_ref, lc_ref, accc_ref, 0, cmp_splits, m_rows, dv_pieces),
           _merged(m_ref, l_ref, acc_ref, 0, sel_splits, m_rows, dv_pieces),
           _merged(m_ref, l_ref, acc_ref, sel_splits, splits, m_rows, dv_pieces))
  for i, (off, size) in enumerate(dv_pieces):
    o = sum(gate(c) * t[i] for c, t in enumerate(terms))
    o_ref[:, pl.ds(off, size)] = o.astype(o_ref.dtype)


def combine_decode(cmp_parts, sw_parts, sel_splits, gates, dtype, *, interpret=False):
  """The gated NSA output of one decode step from the branches' split partials, in one launch.

  cmp_parts: (acc [B, K, Sc, M, Dv], m, l [B, K, Sc, M]) of the compression branch;
  sw_parts: the same of select_window_decode's launch, its first sel_splits splits the selection
  branch, the rest the window ring; gates [B, K, G, 3] (cmp, slc, win), G <= M.
  Returns o [B, K, G, Dv] in dtype: merge_splits of each branch, then reference.combine, in float32
  (each branch's output is not rounded to dtype before the sum)."""
  acc_c, m_c, l_c = cmp_parts
  acc, m, l = sw_parts
  b, kh, splits, m_rows, dv = acc.shape
  g = gates.shape[2]
  if gates.shape != (b, kh, g, 3) or g > m_rows or acc_c.shape[3:] != (m_rows, dv):
    raise ValueError(f"combine_decode: gates {gates.shape}, cmp partials {acc_c.shape} and "
                     f"selection/window partials {acc.shape} do not match")
  gates = jnp.pad(gates.astype(jnp.float32), ((0, 0), (0, 0), (0, m_rows - g), (0, 0)))
  kernel = functools.partial(_combine_kernel, m_rows=m_rows, cmp_splits=acc_c.shape[2],
                             sel_splits=sel_splits, splits=splits, dv_pieces=C.dim_pieces(dv))
  o = pl.pallas_call(
      kernel,
      grid=(b, kh),
      in_specs=[per_group(m_rows * 3), per_group(*m_c.shape[2:]), per_group(*l_c.shape[2:]),
                per_group(*acc_c.shape[2:]), per_group(*m.shape[2:]), per_group(*l.shape[2:]),
                per_group(*acc.shape[2:])],
      out_specs=per_group(m_rows, dv),
      out_shape=jax.ShapeDtypeStruct((b, kh, m_rows, dv), dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="nsa_decode_combine",
  )(gates.reshape(b, kh, m_rows * 3), m_c, l_c, acc_c, m, l, acc)
  return o if m_rows == g else o[:, :, :g]
