"""The compression branch and NSA's block selection for ONE new query per sequence (decoding), in
three Pallas Triton-lowered kernels and no XLA pass over the compressed logits.

1. The split-K decode kernel (decode_attention, contiguous mode) attends the query to the visible
   compressed slots and writes, per split, the logits of the same pass (raw layout
   [B, K, splits, M, L]: M >= 16 padded head rows, L = blocks_per_split * 64 slots).
2. `_scores_kernel`, one program per (sequence, KV group, chunk of nsj selection blocks), reads the
   chunk's r * nsj slots and the previous chunk's (Eq. 9's band reaches back): p = exp(logit -
   lse) on visible slots (Eq. 8, lse from the merged splits), by default Eq. 10's sum over the
   group's heads first and then Eq. 9's band as a float32 multiply-sum (scores_head_first=True;
   False: Eq. 9 as the band matmul of pallas_kernels.select_topn, float32-exact via three bfloat16
   terms, then the head sum), and Eq. 11's forced (+inf) / ineligible (-inf) rules. It writes only the
   [B, K, Ns] block scores (4 bytes per 64 cached tokens).
3. `_topn_kernel`, one program per (sequence, KV group): n rounds of (max, lowest block holding
   it) over the scores, then ascending: block_idx [B, K, n] int32, -1 in empty slots.
   (lax.top_k here cost 62 us per step at 64k, batch 8 on the H200: XLA's TopK kernel, profiled,
   more than the whole compression branch.)
   (A first version merged a running top-n in one program per (sequence, KV group): measured on
   the H200 it was slower than the plain-JAX scoring, its 64 chunks walked one after another.)

Ties and order as nsa_jax.reference.select_blocks (equal scores go to the lower block index);
sums run in a different order than the plain-JAX decode path, so two block scores within ~1e-7
relative may rank differently. The query is one document (decode has no packed segments).
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
from pallas_kernels import decode_attention as da
from pallas_kernels import select_topn as st

LOG2E = math.log2(math.e)
SLOT_BLOCK = 64  # compressed slots per split-K step of the decode kernel


def _scores_kernel(meta_ref, lse_ref, lg_ref, sc_ref, *, g, m_rows, seg_len, r, c, nsj, off,
                   sel_block, n_init, n_local, head_first=False):
  """Program (b, k, ci): the Eq. 9-11 scores of selection blocks [ci * nsj, (ci + 1) * nsj)."""
  ci = pl.program_id(2)
  nv, t = meta_ref[0], meta_ref[1]
  lse = lse_ref[...]
  lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
  real = lax.iota(jnp.int32, m_rows) < g
  bkc = r * nsj
  cur = t // sel_block
  u = lax.broadcasted_iota(jnp.int32, (bkc, nsj), 0)
  v = lax.broadcasted_iota(jnp.int32, (bkc, nsj), 1)

  def band_sum(chunk, k_base, live):
    """Eq. 8-10 of the slots of one chunk for this program's blocks: [1, nsj] (0 if not live)."""
    slot0 = chunk * bkc
    split = slot0 // seg_len
    col = pl.multiple_of(slot0 - split * seg_len, bkc)
    s = lg_ref[split, :, pl.ds(col, bkc)]  # [m_rows, bkc] natural-log logits
    slot = slot0 + lax.iota(jnp.int32, bkc)
    ok = real[:, None] & (slot < nv)[None, :] & live
    p = jnp.where(ok, jnp.exp2(s * LOG2E - lse2[:, None]), 0.0)  # Eq. 8
    w = st._band(u, k_base, r, c)  # [bkc, nsj] float32 (small integers)
    if head_first:  # Eq. 10 (the head sum), then Eq. 9's band in float32: no matmul
      return jnp.sum(jnp.sum(p, axis=0)[:, None] * w, axis=0)[None, :]
    return jnp.sum(st._exact_dot(st._split3(p), w.astype(jnp.bfloat16)), axis=0)[None, :]  # Eq. 9, 10

  # A chunk's blocks also take the last slots of the chunk before (Eq. 9's band reaches back).
  own = (band_sum(ci, r * v + off, True)
         + band_sum(jnp.maximum(ci - 1, 0), r * (nsj + v) + off, ci > 0))
  j = ci * nsj + lax.broadcasted_iota(jnp.int32, (1, nsj), 1)
  elig = j <= cur
  forced = elig & ((j < n_init) | (j > cur - n_local))
  sc_ref[...] = jnp.where(forced, jnp.inf, jnp.where(elig, own, -jnp.inf)).reshape(nsj)


def _topn_kernel(sc_ref, idx_ref, *, ns, n, loop=False):
  """Program (b, k): the n best of the group's block scores (+inf forced, -inf ineligible), by
  n rounds of (max, lowest block holding it), then ascending with -1 in empty slots."""
  nsp, npad = sc_ref.shape[0], idx_ref.shape[0]
  j = lax.broadcasted_iota(jnp.int32, (1, nsp), 1)
  vals = jnp.where(j < ns, sc_ref[...].reshape(1, nsp), -jnp.inf)  # slots past Ns: never written
  idx_ref[...] = _best_n(vals, j, n=n, npad=npad, loop=loop)


def _best_n(vals, j, *, n, npad, loop=False):
  """[NP] ascending block ids of the n best of vals [1, S] (block ids j [1, S]; +inf forced, -inf
  ineligible): n rounds of (max, lowest block holding it), -1 in empty slots. loop: the rounds
  in a lax.fori_loop instead of unrolled (less code; see select_topn.PICK_LOOP)."""
  a_val, a_idx = st.best_n_rounds(vals, j, n=n, npad=npad, loop=loop)
  return st._ascending(a_val, a_idx, n=n).reshape(npad)


def _band_topn_kernel(meta_ref, lse_ref, own_ref, mref_ref, nxt_ref, mnx_ref, idx_ref, *, g,
                      steps, walked, nsj, nsj_pad, ns, n, sel_block, n_init, n_local):
  """Program (b, k): Eq. 8-11 and the top-n from the decode walk's per-step band sums
  (decode_attention._walk with band): score of block j = sum over the group's heads of
  exp2(m_step - lse) * (own sums of its step + next-step sums of the step before), then n rounds
  of (max, lowest block holding it), ascending, -1 in empty slots. Steps the walk did not reach
  hold garbage and are selected away (never multiplied into a kept value)."""
  nv, t = meta_ref[0], meta_ref[1]
  # walked steps (0 when nothing is visible; never more than the cache's `walked` blocks, so no
  # row the masks below accept is unwritten)
  cnt = jnp.minimum((nv - 1) // SLOT_BLOCK + 1, walked)
  si = lax.broadcasted_iota(jnp.int32, (steps, nsj_pad), 0)
  vi = lax.broadcasted_iota(jnp.int32, (steps, nsj_pad), 1)
  own_ok, nxt_ok = si < cnt, (si >= 1) & (si <= cnt)
  score = jnp.zeros((steps, nsj_pad), jnp.float32)
  for h in range(g):  # Eq. 10: the group's real heads
    lse = lse_ref[h]
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    own = jnp.exp2(mref_ref[:, h] - lse2)[:, None] * own_ref[:, h, :]
    nxt = (jnp.exp2(mnx_ref[pl.ds(0, steps), h] - lse2)[:, None]
           * nxt_ref[pl.ds(0, steps), h, :])
    score = score + jnp.where(own_ok, own, 0.0) + jnp.where(nxt_ok, nxt, 0.0)
  cur = t // sel_block
  j = si * nsj + vi
  elig = (vi < nsj) & (j < ns) & (j <= cur)
  forced = elig & ((j < n_init) | (j > cur - n_local))
  vals = jnp.where(forced, jnp.inf, jnp.where(elig, score, -jnp.inf))  # Eq. 11
  # One row for the rounds: 1-D reductions (a 2-D one to a scalar lowers as two).
  vals, j = vals.reshape(1, steps * nsj_pad), j.reshape(1, steps * nsj_pad)
  idx_ref[...] = _best_n(vals, j, n=n, npad=idx_ref.shape[0])


# Selection blocks per score program: the matrix unit's minimum width of the band dot (its
# r * 16 >= 16 rows then follow for any r = l'/d >= 1).
CHUNK_BLOCKS = 16


def supports(qg_shape, kc_shape, vc_shape, num_sel_blocks, block, stride, sel_block,
             blocks_per_split=None):
  """(ok, reason): whether the fused compression + top-n decode path handles this call."""
  b, kh = qg_shape[:2]
  ok, why = da.supports(qg_shape, kc_shape, vc_shape, SLOT_BLOCK)
  if not ok:
    return ok, why
  r = sel_block // stride
  if sel_block % stride or r & (r - 1):
    return False, f"l'/d = {sel_block}/{stride} must be a power of two"
  if block % stride or block > sel_block:
    return False, f"l={block} must be a multiple of d={stride} and at most l'={sel_block}"
  nsj = CHUNK_BLOCKS
  nb = kc_shape[2] // SLOT_BLOCK
  bps = blocks_per_split or da.default_blocks_per_split(b, kh, nb)
  seg_len, bkc = bps * SLOT_BLOCK, r * nsj
  if seg_len % bkc:
    return False, f"a top-n chunk of {bkc} slots straddles the {seg_len}-slot logits splits"
  if C.cdiv(nb, bps) * seg_len < C.cdiv(num_sel_blocks, nsj) * bkc:
    return False, (f"compressed cache of {kc_shape[2]} slots is shorter than the "
                   f"{C.cdiv(num_sel_blocks, nsj) * bkc} the top-n walk reads")
  return True, "ok"


def band_supports(kc_shape, num_sel_blocks, block, stride, sel_block, alignment):
  """(ok, reason): whether scores_in_walk=True handles these shapes: l'/d divides the 64-slot
  walk step, Eq. 9's band reaches back at most one step, and the steps cover every selection
  block."""
  r, c = sel_block // stride, block // stride
  if sel_block % stride or SLOT_BLOCK % r:
    return False, f"l'/d = {sel_block}/{stride} must divide the {SLOT_BLOCK}-slot walk step"
  if block % stride:
    return False, f"l={block} must be a multiple of d={stride}"
  reach = r + c - 2 - st.ALIGN_OFFSET[alignment](r)
  if reach > SLOT_BLOCK:
    return False, (f"Eq. 9's band reaches {reach} slots back (l'/d={r}, l/d={c}, {alignment}), "
                   f"more than one {SLOT_BLOCK}-slot step")
  nb = kc_shape[2] // SLOT_BLOCK
  if da.band_steps(nb) * (SLOT_BLOCK // r) < num_sel_blocks:
    return False, (f"{nb} steps of {SLOT_BLOCK // r} selection blocks do not cover "
                   f"{num_sel_blocks} (compressed cache too short)")
  return True, "ok"


@functools.partial(jax.jit, static_argnames=(
    "num_sel_blocks", "block", "stride", "sel_block", "num_selected", "num_init", "num_local",
    "alignment", "scale", "blocks_per_split", "cmp_num_stages", "topn_num_warps",
    "scores_in_walk", "scores_head_first", "topn_loop", "interpret"))
def compressed_select_decode(qg, k_cmp, v_cmp, t, nv, *, num_sel_blocks, block, stride,
                             sel_block, num_selected, num_init=1, num_local=2,
                             alignment="overlap", scale=None, blocks_per_split=None,
                             cmp_num_stages=2, topn_num_warps=2, scores_in_walk=False,
                             scores_head_first=True, topn_loop=False, interpret=False):
  """Compression branch + top-n of one query per sequence.

  qg [B, K, G, Dk]; k_cmp [B, K, S, Dk], v_cmp [B, K, S, Dv] (head-major, S a multiple of 64);
  t: the query position; nv: the number of visible compressed slots (int32 scalars, may be traced).
  Returns o_cmp [B, K, G, Dv], lse [B, K, G] float32, block_idx [B, K, n] int32.
  scores_in_walk=True: the block scores come from Eq. 9's band sums written by the compressed
  walk itself and one scores + top-n kernel (`_band_topn`: two launches instead of three), where
  `band_supports` allows it (logged otherwise). Correct on the H200 (compiled decode tests) but
  slower there: 64k batch 8 192/128 0.119 ms a step against 0.078 ms (the walk 41 vs 27 us, the
  band top-n 41 us vs scores + top-n 18 us; benchmarks/results/decode_walk_h200.md), so off.
  scores_head_first (three-kernel path; the default since 2026-12-03): the scores kernel sums the
  group's heads before Eq. 9's band and then applies the band in float32 without matmuls (as
  select_topn.HEAD_FIRST in the training top-n). On the H200 (benchmarks/results/
  decode_headfirst_h200.md) the scores kernel took 7.0 instead of 10.9 us a step at 64k, batch 8,
  192/128 (device time of the step 68.9 vs 73.3 us); False keeps the band matmuls.
  topn_loop: the top-n kernel's rounds in a loop instead of unrolled (opt-in: no change measured,
  7.3 vs 7.1 us).
  """
  if alignment not in st.ALIGN_OFFSET:
    raise ValueError(f"alignment={alignment!r}: expected one of {sorted(st.ALIGN_OFFSET)}")
  b, kh, g, _ = qg.shape
  t, nv = jnp.asarray(t, jnp.int32), jnp.asarray(nv, jnp.int32)
  band = None
  if scores_in_walk:
    ok, why = da.supports(qg.shape, k_cmp.shape, v_cmp.shape, SLOT_BLOCK)
    if ok:
      ok, why = band_supports(k_cmp.shape, num_sel_blocks, block, stride, sel_block, alignment)
    if ok:
      r = sel_block // stride
      band = (r, block // stride, st.ALIGN_OFFSET[alignment](r), max(16, SLOT_BLOCK // r))
    else:  # said once per shape; the three-kernel path below then runs (or refuses)
      C.log_once(("decode_band_unsupported", qg.shape, k_cmp.shape, why), "decode scores in "
                 "the walk not used (%s): the three-kernel scoring + top-n instead", why)
  if band is None:
    ok, why = supports(qg.shape, k_cmp.shape, v_cmp.shape, num_sel_blocks, block, stride,
                       sel_block, blocks_per_split)
    if not ok:
      raise ValueError(f"compressed_select_decode does not support this call: {why}")
  # The walk over the compressed cache: its logits (three-kernel path) or its band sums.
  acc, m, l, walk_out = da.prefix_partials(
      qg, k_cmp, v_cmp, nv - 1, SLOT_BLOCK, scale, blocks_per_split, None, 4, cmp_num_stages,
      interpret, want_logits=band is None, band=band)
  o, lse = da.merge_splits(acc, m, l, qg.dtype)
  m_rows = walk_out[0].shape[3] if band else walk_out.shape[3]
  lse_rows = jnp.pad(lse, ((0, 0), (0, 0), (0, m_rows - g)), constant_values=-jnp.inf)
  meta = jnp.broadcast_to(jnp.stack([nv, t]), (b, kh, 2))
  npad = C.next_pow2(num_selected)
  n = min(num_selected, num_sel_blocks)
  if band is not None:
    idx = _band_topn(meta, lse_rows, walk_out, g=g, nb=k_cmp.shape[2] // SLOT_BLOCK, band=band,
                     ns=num_sel_blocks, n=n, npad=npad, sel_block=sel_block, n_init=num_init,
                     n_local=num_local, num_warps=topn_num_warps, interpret=interpret)
    return o, lse, idx[..., :num_selected]
  lg = walk_out
  splits, seg_len = lg.shape[2], lg.shape[4]
  r = sel_block // stride
  nsj = CHUNK_BLOCKS
  chunks = C.cdiv(num_sel_blocks, nsj)
  kernel = functools.partial(
      _scores_kernel, g=g, m_rows=m_rows, seg_len=seg_len, r=r, c=block // stride, nsj=nsj,
      off=st.ALIGN_OFFSET[alignment](r), sel_block=sel_block, n_init=num_init,
      n_local=num_local, head_first=scores_head_first)
  C.log_once(("decode_scores", qg.shape, k_cmp.shape, num_sel_blocks, interpret),
             "decode block scores: qg=%s k_cmp=%s selection blocks=%d chunks=%d interpret=%s",
             qg.shape, k_cmp.shape, num_sel_blocks, chunks, interpret)
  scores = pl.pallas_call(
      kernel,
      grid=(b, kh, chunks),
      in_specs=[da.per_group(2), da.per_group(m_rows), da.per_group(splits, m_rows, seg_len)],
      out_specs=pl.BlockSpec((None, None, nsj), lambda bb, kk, cc: (bb, kk, cc)),
      # A power-of-two row for the top-n kernel's load; slots past Ns stay unwritten (masked).
      out_shape=jax.ShapeDtypeStruct((b, kh, C.next_pow2(chunks * nsj)), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="nsa_decode_scores",
  )(meta, lse_rows, lg)
  idx = pl.pallas_call(
      functools.partial(_topn_kernel, ns=num_sel_blocks, n=n, loop=topn_loop),
      grid=(b, kh),
      in_specs=[da.per_group(scores.shape[-1])],
      out_specs=da.per_group(npad),
      out_shape=jax.ShapeDtypeStruct((b, kh, npad), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=topn_num_warps, num_stages=1),
      interpret=interpret,
      name="nsa_decode_topn",
  )(scores)
  return o, lse, idx[..., :num_selected]


def _band_topn(meta, lse_rows, band_out, *, g, nb, band, ns, n, npad, sel_block, n_init, n_local,
               num_warps, interpret):
  """scores_in_walk=True's second launch: the walk's band sums band_out = (own, mref, nxt, mnx)
  -> block_idx [B, K, NP] (`_band_topn_kernel`, one program per (sequence, KV group))."""
  own, mref, nxt, mnx = band_out
  b, kh, steps, m_rows, nsj_pad = own.shape
  C.log_once(("decode_band_topn", own.shape, ns, interpret),
             "decode block scores in the walk + top-n: band sums %s, selection blocks=%d "
             "interpret=%s", own.shape, ns, interpret)
  return pl.pallas_call(
      functools.partial(_band_topn_kernel, g=g, steps=steps, walked=nb,
                        nsj=SLOT_BLOCK // band[0], nsj_pad=nsj_pad, ns=ns, n=n,
                        sel_block=sel_block, n_init=n_init, n_local=n_local),
      grid=(b, kh),
      in_specs=[da.per_group(2), da.per_group(m_rows), da.per_group(steps, m_rows, nsj_pad),
                da.per_group(steps, m_rows), da.per_group(steps + 1, m_rows, nsj_pad),
                da.per_group(steps + 1, m_rows)],
      out_specs=da.per_group(npad),
      out_shape=jax.ShapeDtypeStruct((b, kh, npad), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="nsa_decode_band_topn",
  )(meta, lse_rows, own, mref, nxt, mnx)
