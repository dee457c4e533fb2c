"""Compression-branch attention of NSA (Eq. 7-8): Pallas Triton-lowered kernels, hand-written VJP.

Query t (0-indexed) sees compressed block i iff i*d + l - 1 <= t (the block lies wholly in its
past), the block lies inside one document and t is in that document
(nsa_jax.reference.cmp_visible_mask).
A program owns a tile of `tq` query positions x the G query heads of one KV group (GQA heads become
tile rows, padded to a power of two) and walks the compressed keys with online softmax, stopping at
the last block any of its positions can see (block-causal skipping).

Backward: dq on query tiles (p recomputed from the saved log-sum-exp); dK/dV with one program per
tile of compressed keys walking the query tiles that can see it (no atomics, deterministic).
The forward also returns the log-sum-exp: the top-n kernel (select_topn.py) needs it to turn logits
into the probabilities of Eq. 8, and its cotangent is honoured in the backward.

Contract: compress_attention(q [B,T,H,Dk], k_cmp [B,Nc,K,Dk], v_cmp [B,Nc,K,Dv], block, stride,
segment_ids=None, scale=None) -> (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32), equal to
nsa_jax.reference.compressed_attention's (o, lse); a query with no visible block gets o = 0 and
lse = -inf.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (atomic_add_rows, cdiv, dim_pieces, dot_pieces, next_pow2,
                                    softmax_step, store_rows)
from pallas_kernels._common import load_pieces as load_rows
from pallas_kernels._common import segment_ids_int32
from pallas_kernels import select_attention_mgpu as mgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- tiling and helpers

@dataclasses.dataclass(frozen=True)
class CmpTiling:
  """Static tiling (hashable: a static custom_vjp argument).

  rows: query rows (tokens x padded heads) per forward program; tokens per tile = rows // Gp.
  block_k: compressed keys per inner step of the forward and dq kernels.
  bwd_block_k: compressed keys owned by one dK/dV program.
  bwd_rows: query rows per dq program and per inner step of the dK/dV kernel (unless dkv_rows).
  bwd_splits: programs per tile of compressed keys in the dK/dV kernel; each walks an equal share
    of the query tiles that see the keys and writes float32 partial sums, added in XLA in a fixed
    order (deterministic). With one program per key tile the low key tiles (seen by every later
    query) ran far longer than the rest: 256 programs at T=65536, the longest 64x the shortest.
  bwd_unmasked_tiles: the dK/dV kernel skips the visibility mask on query tiles that see the whole
    key tile (G a power of two, >= 16 rows without wrapped copies). Same values.
  bwd_unmasked_with_ids: ... also with segment ids, where the tile's queries share the key tile's
    one document (unmasked_ends). With the small-head launch of 4 warps it lost (H100, 8k layer,
    16 / 1 heads, 64/64, benchmarks/results/doc_mask_trial_h100_s40: dK/dV kernel 8.65 vs 6.60 ms
    with ~3 documents a row, 12.44 vs 10.61 ms with long ones, although it reaches ~98% of the
    tiles there); with 8 warps (SMALL_HEAD_DKV_LAUNCH_IDS) it was the fastest variant measured
    with long documents and within 1% of the fastest (the path off with 2 stages) with ~3 a row.
  seg_unmasked_steps: with segment ids, the forward and dq kernels split their key walk: a query
    tile wholly in one run of equal ids compares ids only on the key steps before that run's start
    (run_starts) and applies just the causal / window mask from there on (inside the run the id
    test is true wherever the causal one is). Same values; without ids nothing changes.
  seg_bounds: with segment ids, the forward and dq kernels instead take each row's run start
    (run_starts) as its document's first key: a block is visible iff the causal (and window) test
    passes and it starts at or after that position. One loop, no id loads or compares. Equal to
    the id test, since the kernels take the ids as document runs (_common.segment_ids_int32: an
    id that comes back later is another document). Off by default (a trial switch).
  dq_block_k, dkv_rows, dkv_num_warps, dkv_num_stages: the dq kernel's keys per step and the dK/dV
    kernel's own rows / warps / stages; 0 takes block_k and bwd_rows, and for warps / stages
    dkv_launch()'s choice (bwd_num_warps / bwd_num_stages except for small heads).
  dq_num_warps: the dq kernel's warps; 0 takes dq_warps()'s choice (bwd_num_warps except for the
    window kernels at small heads).
  bwd_fused_dq: no dq kernel; the dK/dV kernel, which already has dS for each (query tile, key
    tile) pair, adds dS @ K into a float32 dq with atomic adds (as FlashAttention-2's backward):
    five matmuls a pair instead of seven, but dq's summation order varies from run to run (not
    bitwise deterministic; dK/dV stay deterministic). Costs a float32 dq buffer (twice a 16-bit
    dq's bytes: 3.2 GB at 64k, 64 heads, d_k = 192), zeroed before and scaled / cast after.
  Defaults from a sweep on the H200 at T=65536, 64/4 heads, 192/128 (benchmarks/results/
  nsa_sweep.json): 128-row backward tiles with 8 warps took the fwd+bwd from 122 to 83 ms.
  """
  rows: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  bwd_block_k: int = 64
  bwd_rows: int = 128
  bwd_num_warps: int = 8
  bwd_num_stages: int = 2
  bwd_splits: int = 8
  bwd_unmasked_tiles: bool = True
  bwd_unmasked_with_ids: bool = True
  seg_unmasked_steps: bool = True
  seg_bounds: bool = False
  dq_block_k: int = 0
  dkv_rows: int = 0
  dkv_num_warps: int = 0
  dkv_num_stages: int = 0
  dq_num_warps: int = 0
  bwd_fused_dq: bool = False


# What compress_attention runs without a tiling (read at call time: a trial may replace it).
DEFAULT_TILING = CmpTiling()

# The dK/dV kernel at small heads (16-bit inputs, d_k, d_v <= 64, tiles of <= 128 rows, <= 64 keys
# a program): 4 warps and 3 pipeline stages. H200, benchmarks/cmp_tiling_trial.py at the training
# layers (16 query heads in 1 KV group, 64/64; cmp_tiling_trial_h200_confirm.md, _fwd.md): the
# compression backward 1.115 vs 1.306 ms and 1.104 vs 1.289 ms (8k, B = 8), 1.624 vs 2.017 ms
# (16k, B = 4) against 8 warps and 2 stages. Three stages did not fit in shared memory at 192/128
# (305,152 bytes asked, 232,448 available) nor with 256-row tiles at 64/64 (249,856), and 128/128
# and float32 were not measured: those keep bwd_num_warps / bwd_num_stages.
SMALL_HEAD_DKV_LAUNCH = (4, 3)
# ... and where the kernel runs its unmasked path with segment ids: 8 warps (3 stages). H100,
# benchmarks/doc_mask_trial.py at the 8k layer (dense causal with ids on the window kernels, B = 8,
# 16 / 1 heads, 64/64; benchmarks/results/doc_mask_trial_h100_s40b): the dK/dV kernel with that
# path 5.79 / 8.63 ms (~3 documents a row / long ones) against 8.76 / 12.31 with (4, 3); with the
# path off 6.72 / 10.60 at (4, 3) and 5.76 / 8.98 at (4, 2). Measured on the window kernels only;
# the compression kernels with ids take it too. Where the path does not run (G not a power of
# two, wrapped rows, bwd_unmasked_with_ids off) the launch without ids stays (8 warps there were
# not measured).
SMALL_HEAD_DKV_LAUNCH_IDS = (8, 3)


# The window kernels' dq kernel (w < T) at small heads (16-bit inputs, d_k, d_v <= 64, tiles of
# <= 128 rows): 4 warps. H100, benchmarks/doc_mask_trial.py --window 512 at the 8k training layer
# (B = 8, 16 / 1 heads, 64/64; benchmarks/results/windq_h100_s46): with document ids 0.63 / 0.61
# ms against 0.85 / 0.84 with 8 warps (mean 16384 / 4096 tokens; with 8 warps the ids' code took
# the kernel from 122 to 170 registers a thread, halving its occupancy, ncu_window_h100_s46),
# without ids 0.54 against 0.57 (two calls each). Not taken: the compression kernels' dq (with 4
# warps its backward took 1.52 against 1.34 ms with ids, 1.13 against 1.14 without, same machine,
# cmp_tiling_trial) and w = T (not measured).
SMALL_HEAD_WINDOW_DQ_WARPS = 4


def small_heads(g, rows, dk, dv, itemsize):
  """Whether a backward kernel's tile is the small-head case its launch rules were measured on:
  16-bit inputs, d_k, d_v <= 64, tiles of <= 128 real rows (of `rows` asked for, G heads a
  group)."""
  return max(dk, dv) <= 64 and tile_shape(g, rows)[2] <= 128 and itemsize <= 2


def dq_warps(tiling, g, dk, dv, itemsize, window, t):
  """num_warps of the dq kernel: the tiling's own when set, else SMALL_HEAD_WINDOW_DQ_WARPS for
  the window kernels (0 < window < t) at small heads, else bwd_num_warps."""
  if tiling.dq_num_warps:
    return tiling.dq_num_warps
  small = small_heads(g, tiling.bwd_rows, dk, dv, itemsize)
  return SMALL_HEAD_WINDOW_DQ_WARPS if small and 0 < window < t else tiling.bwd_num_warps


def dkv_launch(tiling, g, dk, dv, itemsize, unmasked_ids=False):
  """(num_warps, num_stages) of the dK/dV kernel for G heads a group and inputs of `itemsize`
  bytes: the tiling's own when set, else SMALL_HEAD_DKV_LAUNCH (SMALL_HEAD_DKV_LAUNCH_IDS where
  the kernel runs its unmasked path with segment ids) where it was measured to help and to fit,
  else the backward's."""
  small = (small_heads(g, tiling.dkv_rows or tiling.bwd_rows, dk, dv, itemsize)
           and tiling.bwd_block_k <= 64)
  warps, stages = ((SMALL_HEAD_DKV_LAUNCH_IDS if unmasked_ids else SMALL_HEAD_DKV_LAUNCH) if small
                   else (tiling.bwd_num_warps, tiling.bwd_num_stages))
  return tiling.dkv_num_warps or warps, tiling.dkv_num_stages or stages


def tile_shape(g, rows):
  """(tokens per tile tq, padded heads gp, tile rows m = tq * gp) for G heads per KV group."""
  gp = next_pow2(g)
  tq = max(1, rows // gp)
  return tq, gp, max(16, tq * gp)


def tile_rows(tile, kk, *, tq, g, gp, m, t, h):
  """Rows of a query tile: row r is token r // gp, head r % gp of KV group kk.

  Padded heads (r % gp >= g) and positions past T are made copies of a real row so that every load
  stays in bounds; `valid` marks the real ones (sums over rows must mask the copies).
  Returns pos [m] (query position), row [m] (row of the [T*H, D] view of q / o), valid [m].
  """
  r = lax.iota(jnp.int32, m)
  if m > tq * gp:  # fewer rows than the matrix-unit minimum: wrap around
    r = r % (tq * gp)
  head = r % gp
  raw = tile * tq + r // gp
  valid = (head < g) & (raw < t)
  if m > tq * gp:
    valid = valid & (lax.iota(jnp.int32, m) < tq * gp)
  pos = jnp.minimum(raw, t - 1)
  return pos, pos * h + kk * g + jnp.minimum(head, g - 1), valid


def load_block(ref, start, n, pieces):
  return [ref[pl.ds(start, n), pl.ds(off, size)] for off, size in pieces]


def num_cmp_blocks(t, block, stride):
  """Nc: compressed blocks of T tokens (block i covers [i*d, i*d + l)); as nsa_jax.config's,
  which this package does not import."""
  return 0 if t < block else (t - block) // stride + 1


def num_visible(pos, block, stride, nc):
  """How many compressed blocks position `pos` sees (blocks 0 .. i with i*d + l - 1 <= pos)."""
  n = jnp.where(pos >= block - 1, (jnp.maximum(pos - block + 1, 0)) // stride + 1, 0)
  return jnp.minimum(n, nc)


def first_step(first_pos, steps, *, block, stride, window, bk):
  """The first key step (of bk blocks) of a query tile starting at `first_pos` that can hold a
  visible block: with a window w, the step holding the first block whose last key lies in
  (first_pos - w, first_pos], at most `steps`; without one a literal 0, so that the loop's lower
  bound stays a constant (the program as before windows)."""
  if not window:
    return 0
  first = jnp.maximum((first_pos - window - block + 1) // stride + 1, 0)
  return jnp.minimum(first // bk, steps)


def run_starts(seg):
  """[B, T] int32: the first position of each position's run of equal ids (its document's first
  position: every run is a document, segment_ids_int32)."""
  b, t = seg.shape
  ar = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  begins = jnp.concatenate([jnp.ones((b, 1), jnp.bool_), seg[:, 1:] != seg[:, :-1]], axis=1)
  return lax.cummax(jnp.where(begins, ar, 0), axis=1)


def run_lasts(seg):
  """[B, T] int32: the last position of each position's run of equal ids (run_starts' mirror;
  run_lasts[p] + 1 is the first run start after p, T past the last run)."""
  b, t = seg.shape
  ar = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  ends = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones((b, 1), jnp.bool_)], axis=1)
  return lax.cummin(jnp.where(ends, ar, t - 1), axis=1, reverse=True)


def seg_free_step(first, steps, seg_q, qlo_ref, pos, *, stride, bk):
  """The first key step from which the forward / dq walk needs no id test (seg_unmasked_steps):
  for a tile whose rows all hold one id (one run: the rows are consecutive positions), the step
  whose blocks all start at or after the run's start; a block there that the causal (and window)
  test lets through lies inside the run, so it holds the rows' id. `steps` (none) for a tile that
  spans a document boundary. Clipped to [first, steps]. qlo_ref: the run starts (doc_bounds)."""
  one_run = jnp.min(seg_q) == jnp.max(seg_q)
  mid = cdiv(cdiv(jnp.min(qlo_ref[pos]), stride), bk)
  return jnp.clip(jnp.where(one_run, mid, steps), first, steps)


def seg_walk(tiling, has_seg):
  """(seg_split, seg_bounds): how the forward / dq kernels' key walk takes segment ids (both read
  the run starts qlo of doc_bounds)."""
  bounds = has_seg and tiling.seg_bounds
  return has_seg and tiling.seg_unmasked_steps and not bounds, bounds


def key_walk(body, init, first, steps, *, has_seg, seg_split, seg_q, qlo_ref, pos, stride, bk):
  """The forward / dq kernels' loop over key steps [first, steps): body(i, carry, ids), ids
  compared (when given) on every step, or with seg_split only before seg_free_step's step and the
  causal / window test alone from there on. Without ids one masked loop: a mask-free loop over
  the leading chunks (tried 2026-11-30) was no faster in the forward and 13% slower in the dq
  kernel (nsa_h200_profile_3511786.json); the id test costs more (doc_mask_trial_h100_s40)."""
  if not seg_split:
    return lax.fori_loop(first, steps, functools.partial(body, ids=has_seg), init)
  mid = seg_free_step(first, steps, seg_q, qlo_ref, pos, stride=stride, bk=bk)
  carry = lax.fori_loop(first, mid, functools.partial(body, ids=True), init)
  return lax.fori_loop(mid, steps, functools.partial(body, ids=False), carry)


def doc_first_step(first, qlo_ref, pos, steps, *, stride, bk):
  """`first` raised past the keys before the tile's documents: a block visible to a row starts at
  or after that row's document start qlo (doc_bounds), so no step before the tile's smallest
  qlo // stride holds one."""
  lo = jnp.min(qlo_ref[pos]) // stride
  return jnp.maximum(first, jnp.minimum(lo // bk, steps))


def cmp_visible(pos, kidx, seg_q, bseg, bpure, *, block, stride, nc, window=0, lo=None):
  """[m, bk] mask: block kidx is in pos's past (and, with a window w, its last key is one of the
  last w positions up to pos), exists, and (with segments) in pos's document: ids equal and the
  block pure, or (lo, per row: CmpTiling.seg_bounds) the block starts at or after lo."""
  end = kidx * stride + (block - 1)
  vis = (end[None, :] <= pos[:, None]) & (kidx < nc)[None, :]
  if window:
    vis = vis & (end[None, :] > pos[:, None] - window)
  if seg_q is not None:
    vis = vis & (seg_q[:, None] == bseg[None, :]) & (bpure != 0)[None, :]
  if lo is not None:
    vis = vis & ((kidx * stride)[None, :] >= lo[:, None])
  return vis


def block_meta(seg, nc_pad, block, stride):
  """Per compressed block: segment of its first token and whether it lies in one document.

  seg [B, T] int32 -> bseg, bpure [B, nc_pad] int32 (padding blocks: pure = 0).
  """
  b, t = seg.shape
  nc = num_cmp_blocks(t, block, stride)
  pos = jnp.arange(nc)[:, None] * stride + jnp.arange(block)[None, :]
  sb = seg[:, pos]  # [B, Nc, l]
  pure = jnp.all(sb == sb[:, :, :1], axis=-1).astype(jnp.int32)
  pad = ((0, 0), (0, nc_pad - nc))
  return jnp.pad(sb[:, :, 0], pad), jnp.pad(pure, pad)


def doc_bounds(seg, bpure, *, nc, stride, has_seg):
  """Per-document loop bounds of the kernels (packed documents: a tile skips the keys and queries
  of other documents instead of walking and masking them).

  qlo [B, T]: the first position of each query's document (a visible block starts at or after it);
  khi [B, Ncp]: the last query position of each compressed block's document (-1 for blocks no
  query sees: mixed or padding). A document is a run of equal ids (the kernels' ids are document
  runs, segment_ids_int32), so these are run_starts / run_lasts. Without segment ids: zeros, not
  read by the kernels."""
  b, t = seg.shape
  ncp = bpure.shape[1]
  if not has_seg:
    return jnp.zeros((b, t), jnp.int32), jnp.zeros((b, ncp), jnp.int32)
  first, last = run_starts(seg), run_lasts(seg)
  kidx = jnp.arange(ncp)
  khi = last[:, jnp.minimum(kidx * stride, t - 1)]
  khi = jnp.where((kidx < nc)[None, :] & (bpure != 0), khi, -1)
  return first, khi


def unmasked_ends(seg, bseg, bpure, *, nc, block, stride, tq, bk):
  """[B, Ncp] int32, one value per dK/dV key tile (repeated over its bk blocks): the end
  (exclusive) of the run of query tiles, from the tile's first fully causal one
  f = ceil(((start + bk - 1) * stride + block - 1) / tq) on, whose queries all share the key tile's
  one document (packed documents: the dK/dV kernel skips the mask there, as it does without
  segment ids). f itself (an empty run) when the key tile mixes documents, holds a block that
  straddles one or a padding block (past nc), when query tile f is not wholly in that document, or
  when it starts at or past T. Ids compare for equality, as the mask does. The kernel still caps
  the run at the causal / window limits and at T // tq."""
  b, t = seg.shape
  ncp = bseg.shape[1]
  nkt = ncp // bk
  start = jnp.arange(nkt) * bk
  f = -(-((start + bk - 1) * stride + block - 1) // tq)  # [nkt]
  bs, bp = bseg.reshape(b, nkt, bk), bpure.reshape(b, nkt, bk)
  doc = bs[:, :, 0]
  kpure = jnp.all(bs == doc[:, :, None], axis=2) & jnp.all(bp != 0, axis=2)
  kpure = kpure & (start + bk <= nc)[None, :]
  run_last = run_lasts(seg)
  p0 = jnp.minimum(f * tq, t - 1)
  ok = kpure & (f * tq < t)[None, :] & (seg[:, p0] == doc)
  run_end = (run_last[:, p0] + 1) // tq  # query tiles wholly inside that run end here
  out = jnp.where(ok, jnp.maximum(run_end, f[None, :]), f[None, :]).astype(jnp.int32)
  return jnp.repeat(out, bk, axis=1)


def _whole(*shape):
  """BlockSpec of batch bb's whole array on a (x, group, batch) grid."""
  return pl.BlockSpec((None, *shape), lambda i, j, bb: (bb,) + (0,) * len(shape))


def _group(*shape):
  """BlockSpec of KV group j of batch bb of a [B, K, ...] array."""
  return pl.BlockSpec((None, None, *shape), lambda i, j, bb: (bb, j) + (0,) * len(shape))


# ----------------------------------------------------------------------------- forward

def _fwd_kernel(seg_ref, bseg_ref, bpure_ref, qlo_ref, q_ref, k_ref, v_ref, o_ref,
                lse_ref, *, tq, g, gp, m, t, h, nc, block, stride, bk, dk_pieces, dv_pieces, scale,
                has_seg, seg_split, seg_bounds, window):
  tile, kk = pl.program_id(0), pl.program_id(1)
  pos, row, _ = tile_rows(tile, kk, tq=tq, g=g, gp=gp, m=m, t=t, h=h)
  qs = load_rows(q_ref, row, dk_pieces)
  seg_q = seg_ref[pos] if has_seg and not seg_bounds else None
  lo = qlo_ref[pos] if seg_bounds else None
  last = jnp.minimum(tile * tq + tq - 1, t - 1)
  steps = cdiv(num_visible(last, block, stride, nc), bk)
  first = first_step(tile * tq, steps, block=block, stride=stride, window=window, bk=bk)
  if has_seg:
    first = doc_first_step(first, qlo_ref, pos, steps, stride=stride, bk=bk)

  def body(i, carry, ids):
    m_i, l_i, accs = carry
    start = pl.multiple_of(i * bk, bk)
    kidx = start + lax.iota(jnp.int32, bk)
    ks, vs = load_block(k_ref, start, bk, dk_pieces), load_block(v_ref, start, bk, dv_pieces)
    bseg = bseg_ref[pl.ds(start, bk)] if ids else None
    bpure = bpure_ref[pl.ds(start, bk)] if ids else None
    s = dot_pieces(qs, ks) * (scale * LOG2E)  # base-2 logits
    vis = cmp_visible(pos, kidx, seg_q if ids else None, bseg, bpure, block=block, stride=stride,
                      nc=nc, window=window, lo=lo)
    s = jnp.where(vis, s, -jnp.inf)
    return softmax_step((m_i, l_i, accs), s, vs)

  init = (jnp.full((m,), -jnp.inf, jnp.float32), jnp.zeros((m,), jnp.float32),
          tuple(jnp.zeros((m, size), jnp.float32) for _, size in dv_pieces))
  m_i, l_i, accs = key_walk(body, init, first, steps, has_seg=seg_q is not None,
                            seg_split=seg_split, seg_q=seg_q, qlo_ref=qlo_ref, pos=pos,
                            stride=stride, bk=bk)
  seen = l_i > 0.0
  l_safe = jnp.where(seen, l_i, 1.0)
  for (off, _), a in zip(dv_pieces, accs):
    store_rows(o_ref, row, off, (a / l_safe[:, None]).astype(o_ref.dtype))
  lse_ref[row] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)


def _forward(q, kc, vc, seg, bseg, bpure, *, nc, block, stride, scale, tiling, has_seg, interpret,
             window=0):
  """q [B,T,H,Dk]; kc/vc [B,K,Ncp,D] (group-major, padded); seg [B,T]; bseg/bpure [B,Ncp]."""
  b, t, h, dk = q.shape
  kh, ncp, dv = kc.shape[1], kc.shape[2], vc.shape[3]
  g = h // kh
  tq, gp, m = tile_shape(g, tiling.rows)
  qlo, _ = doc_bounds(seg, bpure, nc=nc, stride=stride, has_seg=has_seg)
  split, bounds = seg_walk(tiling, has_seg)
  kernel = functools.partial(
      _fwd_kernel, tq=tq, g=g, gp=gp, m=m, t=t, h=h, nc=nc, block=block, stride=stride,
      bk=tiling.block_k, dk_pieces=dim_pieces(dk), dv_pieces=dim_pieces(dv), scale=scale,
      has_seg=has_seg, seg_split=split, seg_bounds=bounds, window=window)
  o, lse = pl.pallas_call(
      kernel,
      grid=(cdiv(t, tq), kh, b),
      in_specs=[_whole(t), _whole(ncp), _whole(ncp), _whole(t), _whole(t * h, dk),
                _group(ncp, dk), _group(ncp, dv)],
      out_specs=[_whole(t * h, dv), _whole(t * h)],
      out_shape=[jax.ShapeDtypeStruct((b, t * h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, t * h), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                           num_stages=tiling.num_stages),
      interpret=interpret,
      name="nsa_win_fwd" if window else "nsa_cmp_fwd",
  )(seg, bseg, bpure, qlo, q.reshape(b, t * h, dk), kc, vc)
  return o.reshape(b, t, h, dv), lse.reshape(b, t, h)


# ----------------------------------------------------------------------------- backward: dq

def _dq_kernel(seg_ref, bseg_ref, bpure_ref, qlo_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, tq, g, gp, m, t, h, nc, block, stride, bk, dk_pieces,
               dv_pieces, scale, has_seg, seg_split, seg_bounds, window):
  tile, kk = pl.program_id(0), pl.program_id(1)
  pos, row, _ = tile_rows(tile, kk, tq=tq, g=g, gp=gp, m=m, t=t, h=h)
  qs, dos = load_rows(q_ref, row, dk_pieces), load_rows(do_ref, row, dv_pieces)
  lse = lse_ref[row]
  lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
  delta = delta_ref[row]
  seg_q = seg_ref[pos] if has_seg and not seg_bounds else None
  lo = qlo_ref[pos] if seg_bounds else None
  last = jnp.minimum(tile * tq + tq - 1, t - 1)
  steps = cdiv(num_visible(last, block, stride, nc), bk)
  first = first_step(tile * tq, steps, block=block, stride=stride, window=window, bk=bk)
  if has_seg:
    first = doc_first_step(first, qlo_ref, pos, steps, stride=stride, bk=bk)

  def body(i, accs, ids):
    start = pl.multiple_of(i * bk, bk)
    kidx = start + lax.iota(jnp.int32, bk)
    ks, vs = load_block(k_ref, start, bk, dk_pieces), load_block(v_ref, start, bk, dv_pieces)
    bseg = bseg_ref[pl.ds(start, bk)] if ids else None
    bpure = bpure_ref[pl.ds(start, bk)] if ids else None
    s = dot_pieces(qs, ks) * (scale * LOG2E)
    vis = cmp_visible(pos, kidx, seg_q if ids else None, bseg, bpure, block=block, stride=stride,
                      nc=nc, window=window, lo=lo)
    p = jnp.where(vis, jnp.exp2(s - lse2[:, None]), 0.0)
    ds = (p * (dot_pieces(dos, vs) - delta[:, None])).astype(ks[0].dtype)
    return tuple(a + plgpu.dot(ds, kp) for a, kp in zip(accs, ks))

  init = tuple(jnp.zeros((m, size), jnp.float32) for _, size in dk_pieces)
  accs = key_walk(body, init, first, steps, has_seg=seg_q is not None, seg_split=seg_split,
                  seg_q=seg_q, qlo_ref=qlo_ref, pos=pos, stride=stride, bk=bk)
  for (off, _), a in zip(dk_pieces, accs):
    store_rows(dq_ref, row, off, (a * scale).astype(dq_ref.dtype))


# ----------------------------------------------------------------------------- backward: dK, dV

def _dkv_kernel(seg_ref, bseg_ref, bpure_ref, qlo_ref, khi_ref, kfull_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, *refs, tq, g, gp, m, t, h, nc, ncp, block, stride, bk,
                dk_pieces, dv_pieces, scale, has_seg, splits, unmasked, window, fused_dq,
                interpret):
  # fused_dq: refs = (dq_in, dk, dv, dq): dq_in and dq alias one float32 buffer of zeros.
  dk_ref, dv_ref = refs[-3:-1] if fused_dq else refs
  dq_ref = refs[-1] if fused_dq else None
  pid, kk = pl.program_id(0), pl.program_id(1)
  j, part = pid // splits, pid % splits
  start = pl.multiple_of(j * bk, bk)
  kidx = start + lax.iota(jnp.int32, bk)
  ks, vs = load_block(k_ref, start, bk, dk_pieces), load_block(v_ref, start, bk, dv_pieces)
  bseg = bseg_ref[pl.ds(start, bk)] if has_seg else None
  bpure = bpure_ref[pl.ds(start, bk)] if has_seg else None
  nt = cdiv(t, tq)
  end_first = start * stride + block - 1  # the last key of block `start`
  end_last = (start + bk - 1) * stride + block - 1  # ... and of this tile's last block
  first_tile = jnp.minimum(end_first, t) // tq  # first query that sees key `start`
  # With a window w, the last query that sees this tile's last block is end_last + w - 1.
  last_tile = nt if not window else jnp.minimum(nt, (end_last + window - 1) // tq + 1)
  if has_seg:  # no query past the last one of the tile's blocks' documents sees them
    last_doc = jnp.max(khi_ref[pl.ds(start, bk)])
    last_tile = jnp.maximum(first_tile, jnp.minimum(last_tile, last_doc // tq + 1))
  # This program's share of the query tiles [first_tile, last_tile).
  share = cdiv(last_tile - first_tile, splits)
  lo = jnp.minimum(first_tile + part * share, last_tile)
  hi = jnp.minimum(lo + share, last_tile)
  # Tiles [full_lo, full_hi) see every key of the tile and hold only real rows: no mask there.
  if not unmasked:  # _backward decides (powers of two, no wrapped copy rows, the tiling's switch)
    full_lo = full_hi = lo
  else:
    full_lo = jnp.clip(cdiv(end_last, tq), lo, hi)
    full_lo = jnp.where(start + bk <= nc, full_lo, hi)
    # With a window, a tile sees the whole key tile only while its last position is within w - 1
    # of the tile's first block.
    full_hi = t // tq if not window else jnp.minimum(t // tq, (end_first + window) // tq)
    if has_seg:  # ... and, with documents, while its queries share the key tile's one document
      full_hi = jnp.minimum(full_hi, jnp.min(kfull_ref[pl.ds(start, bk)]))
    full_hi = jnp.clip(full_hi, full_lo, hi)

  def body(i, accs, masked):
    dk_accs, dv_accs = accs
    pos, row, valid = tile_rows(i, kk, tq=tq, g=g, gp=gp, m=m, t=t, h=h)
    qs, dos = load_rows(q_ref, row, dk_pieces), load_rows(do_ref, row, dv_pieces)
    lse = lse_ref[row]
    lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
    delta = delta_ref[row]
    s = dot_pieces(qs, ks) * (scale * LOG2E)
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      seg_q = seg_ref[pos] if has_seg else None
      vis = cmp_visible(pos, kidx, seg_q, bseg, bpure, block=block, stride=stride, nc=nc,
                        window=window)
      vis = vis & valid[:, None]  # copied rows must not count twice
      p = jnp.where(vis, p, 0.0)
    pt = p.astype(dos[0].dtype)
    dv_accs = tuple(a + plgpu.dot(pt, dp, trans_a=True) for a, dp in zip(dv_accs, dos))
    ds = (p * (dot_pieces(dos, vs) - delta[:, None])).astype(qs[0].dtype)
    dk_accs = tuple(a + plgpu.dot(ds, qp, trans_a=True) for a, qp in zip(dk_accs, qs))
    if fused_dq:
      # Copied rows have ds = 0: on a GPU adding them to their real rows changes nothing; the
      # interpreter's atomic add keeps one of several writes to a row (and masks it does not
      # interpret), so there they go to scratch rows of their own past T*H.
      drow = jnp.where(valid, row, t * h + lax.iota(jnp.int32, m)) if interpret else row
      for (off, _), kp in zip(dk_pieces, ks):
        atomic_add_rows(dq_ref, drow, off, plgpu.dot(ds, kp))
    return dk_accs, dv_accs

  init = (tuple(jnp.zeros((bk, size), jnp.float32) for _, size in dk_pieces),
          tuple(jnp.zeros((bk, size), jnp.float32) for _, size in dv_pieces))
  accs = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), init)
  accs = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), accs)
  dk_accs, dv_accs = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), accs)
  out = pl.multiple_of(part * ncp + start, bk)  # this program's float32 partial sums
  for (off, size), a in zip(dk_pieces, dk_accs):
    dk_ref[pl.ds(out, bk), pl.ds(off, size)] = a * scale
  for (off, size), a in zip(dv_pieces, dv_accs):
    dv_ref[pl.ds(out, bk), pl.ds(off, size)] = a


def _backward(q, kc, vc, seg, bseg, bpure, o, lse, do, dlse, *, nc, block, stride, scale, tiling,
              has_seg, interpret, window=0):
  b, t, h, dk = q.shape
  kh, ncp, dv = kc.shape[1], kc.shape[2], vc.shape[3]
  g = h // kh
  # dL/dlogits = p * (dp - delta) with delta = rowsum(do * o) - dlse (lse's own cotangent).
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse
  delta = jnp.where(lse == -jnp.inf, 0.0, delta).reshape(b, t * h)
  lse_f = lse.reshape(b, t * h)
  qf, dof = q.reshape(b, t * h, dk), do.astype(q.dtype).reshape(b, t * h, dv)
  common = dict(g=g, t=t, h=h, nc=nc, block=block, stride=stride, dk_pieces=dim_pieces(dk),
                dv_pieces=dim_pieces(dv), scale=scale, has_seg=has_seg, window=window)
  qlo, khi = doc_bounds(seg, bpure, nc=nc, stride=stride, has_seg=has_seg)
  # seg, bseg, bpure, qlo; then (dK/dV only) khi and the unmasked runs; then q, k, v, do, lse, delta
  head_ins, head_args = [_whole(t), _whole(ncp), _whole(ncp), _whole(t)], (seg, bseg, bpure, qlo)
  tail_ins = [_whole(t * h, dk), _group(ncp, dk), _group(ncp, dv), _whole(t * h, dv),
              _whole(t * h), _whole(t * h)]
  tail_args = (qf, kc, vc, dof, lse_f, delta)

  fused = tiling.bwd_fused_dq
  if not fused:
    tq, gp, m = tile_shape(g, tiling.bwd_rows)
    split, bounds = seg_walk(tiling, has_seg)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, tq=tq, gp=gp, m=m, bk=tiling.dq_block_k or tiling.block_k,
                          seg_split=split, seg_bounds=bounds, **common),
        grid=(cdiv(t, tq), kh, b),
        in_specs=head_ins + tail_ins,
        out_specs=_whole(t * h, dk),
        out_shape=jax.ShapeDtypeStruct((b, t * h, dk), q.dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=dq_warps(tiling, g, dk, dv, jnp.dtype(q.dtype).itemsize, window, t),
            num_stages=tiling.bwd_num_stages),
        interpret=interpret,
        name="nsa_win_dq" if window else "nsa_cmp_dq",
    )(*head_args, *tail_args)

  tq, gp, m = tile_shape(g, tiling.dkv_rows or tiling.bwd_rows)
  bk = tiling.bwd_block_k
  splits = max(1, tiling.bwd_splits)
  # the unmasked inner tiles need G a power of two and no wrapped copy rows (m > tq * gp)
  unmasked = (g == gp and m == tq * gp and tiling.bwd_unmasked_tiles
              and (not has_seg or tiling.bwd_unmasked_with_ids))
  warps, stages = dkv_launch(tiling, g, dk, dv, jnp.dtype(q.dtype).itemsize, has_seg and unmasked)
  kfull = (unmasked_ends(seg, bseg, bpure, nc=nc, block=block, stride=stride, tq=tq, bk=bk)
           if has_seg and unmasked else jnp.zeros((b, ncp), jnp.int32))
  ins = head_ins + [_whole(ncp), _whole(ncp)] + tail_ins
  args = head_args + (khi, kfull) + tail_args
  out_specs = [_group(splits * ncp, dk), _group(splits * ncp, dv)]
  out_shape = [jax.ShapeDtypeStruct((b, kh, splits * ncp, dk), jnp.float32),
               jax.ShapeDtypeStruct((b, kh, splits * ncp, dv), jnp.float32)]
  if fused:  # dq: a float32 buffer of zeros, in and out (aliased), added to atomically; m rows
    out_specs.append(_whole(t * h + m, dk))  # past T*H: the interpreter's scratch rows
    out_shape.append(jax.ShapeDtypeStruct((b, t * h + m, dk), jnp.float32))
    ins, args = ins + out_specs[-1:], args + (jnp.zeros(out_shape[-1].shape, jnp.float32),)
  outs = pl.pallas_call(
      functools.partial(_dkv_kernel, tq=tq, gp=gp, m=m, bk=bk, ncp=ncp, splits=splits,
                        unmasked=unmasked, fused_dq=fused,
                        interpret=interpret, **common),
      grid=(ncp // bk * splits, kh, b),  # low key tiles (seen by the most queries) start first
      in_specs=ins,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases={len(args) - 1: 2} if fused else {},
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=interpret,
      name=("nsa_win_dkv" if window else "nsa_cmp_dkv") + ("_dq_atomic" if fused else ""),
  )(*args)
  dkc, dvc = outs[:2]
  if fused:
    dq = (outs[2][:, :t * h] * scale).astype(q.dtype)
  # Partial sums added in a fixed order: deterministic.
  dkc = jnp.sum(dkc.reshape(b, kh, splits, ncp, dk), axis=2).astype(kc.dtype)
  dvc = jnp.sum(dvc.reshape(b, kh, splits, ncp, dv), axis=2).astype(vc.dtype)
  return dq.reshape(b, t, h, dk), dkc, dvc


# ----------------------------------------------------------------------------- custom VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _cmp(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg, interpret):
  return _forward(q, kc, vc, seg, bseg, bpure, nc=nc, block=block, stride=stride, scale=scale,
                  tiling=tiling, has_seg=has_seg, interpret=interpret)


def _cmp_fwd(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg, interpret):
  o, lse = _cmp(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg, interpret)
  # Saved: the inputs (needed anyway), o and lse ([B,T,H], small); p is recomputed, never stored.
  return (o, lse), (q, kc, vc, seg, bseg, bpure, o, lse)


def _cmp_bwd(nc, block, stride, scale, tiling, has_seg, interpret, res, cts):
  q, kc, vc, seg, bseg, bpure, o, lse = res
  do, dlse = cts
  dq, dkc, dvc = _backward(q, kc, vc, seg, bseg, bpure, o, lse, do, dlse, nc=nc, block=block,
                           stride=stride, scale=scale, tiling=tiling, has_seg=has_seg,
                           interpret=interpret)
  return dq, dkc, dvc, None, None, None


_cmp.defvjp(_cmp_fwd, _cmp_bwd)


# The Mosaic GPU (TMA + wgmma) forward, the Triton backward (select_attention_mgpu.py). Slower than
# the Triton forward on the H200 (19.7 vs 14.4 ms at 64k, 192/128), so only an explicit
# backend="mosaic" (implementation="pallas-mosaic") runs it.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _cmp_mosaic(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg, interpret):
  return mgpu.cmp_forward(q, kc, vc, nc=nc, block=block, stride=stride, scale=scale,
                          interpret=interpret)


def _cmp_mosaic_fwd(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg,
                    interpret):
  o, lse = mgpu.cmp_forward(q, kc, vc, nc=nc, block=block, stride=stride, scale=scale,
                            interpret=interpret)
  return (o, lse), (q, kc, vc, seg, bseg, bpure, o, lse)


_cmp_mosaic.defvjp(_cmp_mosaic_fwd, _cmp_bwd)


# cuDNN flash attention on folded queries for the forward (pallas_kernels.compress_fold: the d queries that
# see the same compressed blocks become heads of one causal call), the Triton backward on its
# o and lse. No segment ids. Faster than the Triton forward at long T (H200: 11.8 vs 14.4 ms at
# 64k, 192/128), while the Triton backward beats cuDNN's there (51.4 vs 55.5 ms, d_v padded).
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _cmp_cudnn(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg, interpret):
  return _cudnn_forward(q, kc, vc, nc, block, stride, scale, interpret)


def _cudnn_forward(q, kc, vc, nc, block, stride, scale, interpret):
  from pallas_kernels import compress_fold as cmp_fold
  unpad = lambda x: x[:, :, :nc].transpose(0, 2, 1, 3)  # [B, K, ncp, D] -> [B, Nc, K, D]
  return cmp_fold.compressed_attention(q, unpad(kc), unpad(vc), block, stride, scale,
                                       implementation="xla" if interpret else "cudnn")


def _cmp_cudnn_fwd(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg,
                   interpret):
  o, lse = _cudnn_forward(q, kc, vc, nc, block, stride, scale, interpret)
  return (o, lse), (q, kc, vc, seg, bseg, bpure, o, lse)


_cmp_cudnn.defvjp(_cmp_cudnn_fwd, _cmp_bwd)


# ----------------------------------------------------------------------------- public API

def supports(q_shape, kc_shape, vc_shape):
  """(ok, reason): whether the kernels handle these shapes."""
  b, t, h, dk = q_shape
  if kc_shape[0] != b or kc_shape[3] != dk or vc_shape[:3] != kc_shape[:3]:
    return False, f"k_cmp {kc_shape} / v_cmp {vc_shape} do not match q {q_shape}"
  if h % kc_shape[2]:
    return False, f"{h} query heads not a multiple of {kc_shape[2]} KV heads"
  for name, d in (("d_k", dk), ("d_v", vc_shape[3])):
    if d < 16 or d % 16:
      return False, f"{name}={d}: needs a multiple of 16 for the matrix unit"
  if t * h >= 2 ** 31:
    return False, f"T*H={t * h} too large for int32 row indices"
  return True, "ok"


def compress_attention(q, k_cmp, v_cmp, block, stride, segment_ids=None, scale=None, *,
                       interpret=False, tiling=None, backend="triton"):
  """Compression-branch attention; see the module docstring. Returns (o, lse).

  backend: "triton" (default), "mosaic" (Mosaic GPU forward, Triton backward; no segment ids;
  slower than Triton on the H200 at 64k, so only on request) or "cudnn" (cuDNN flash attention
  on folded queries for the forward, pallas_kernels.compress_fold, Triton backward; no segment ids; XLA
  attention in place of cuDNN when interpret=True)."""
  if backend not in ("triton", "mosaic", "cudnn"):
    raise ValueError(f"backend={backend!r}: expected 'triton', 'mosaic' or 'cudnn'")
  ok, why = supports(q.shape, k_cmp.shape, v_cmp.shape)
  if not ok:
    raise ValueError(f"compress_attention does not support this call: {why}")
  tiling = tiling or DEFAULT_TILING
  b, t, h, dk = q.shape
  nc = k_cmp.shape[1]
  expect = num_cmp_blocks(t, block, stride)
  if nc != expect:
    raise ValueError(f"k_cmp has {nc} blocks, expected {expect} for T={t}, l={block}, d={stride}")
  scale = float(dk ** -0.5 if scale is None else scale)
  step = math.lcm(tiling.block_k, tiling.bwd_block_k, tiling.dq_block_k or tiling.block_k)
  ncp = max(step, cdiv(nc, step) * step)
  kc = jnp.pad(k_cmp, ((0, 0), (0, ncp - nc), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  vc = jnp.pad(v_cmp, ((0, 0), (0, ncp - nc), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  seg, has_seg = segment_ids_int32(segment_ids, b, t, "compress_attention")
  if has_seg:
    bseg, bpure = block_meta(seg, ncp, block, stride)
  else:
    bseg = bpure = jnp.zeros((b, ncp), jnp.int32)
  impl = _cmp
  if backend == "mosaic":
    ok, why = mgpu.cmp_supports(q.shape, kc.shape, vc.shape, has_seg, q.dtype)
    if not ok:
      raise ValueError(f"compress_attention[mosaic] does not support this call: {why}")
    impl = _cmp_mosaic
  if backend == "cudnn":
    if has_seg:
      raise ValueError("compress_attention[cudnn] does not take segment ids (one visibility rule "
                       "per folded group). Fix: backend='triton'")
    impl = _cmp_cudnn
  o, lse = impl(q, kc, vc, seg, bseg, bpure, nc, block, stride, scale, tiling, has_seg, interpret)
  return o, lse
