"""NSA block importance and top-n selection (Eq. 8-11) fused in one Pallas Triton-lowered kernel.

Writes only block_idx [B, T, K, n] int32 (without TWO_PASS): the [H, T, Nc] probabilities and the
[T, K, Ns] scores never reach memory. A program owns `tq` query positions x the G heads of one KV
group and walks the selection blocks in chunks of `sel_chunk` (= r * sel_chunk compressed blocks,
r = l'/d):
  1. p = exp(q . K_cmp * scale - lse) on visible blocks (Eq. 8; lse from compress_attention);
  2. Eq. 9 as a matmul with the constant band matrix W (weights 1,2,2,2,1 for l=32, d=16, l'=64):
     a chunk of compressed blocks feeds its own selection blocks and the next chunk's, so the part
     for the next chunk is carried. p is split into three bfloat16 terms so that the matrix unit
     computes p @ W to float32 accuracy (W holds small integers, exact in bfloat16);
  3. Eq. 10: sum over the group's heads (a reshape + sum over the tile rows of one token);
  4. Eq. 11: forced blocks get +inf, ineligible ones -inf, and the chunk is merged into a running
     top-n: replace-the-minimum while any candidate beats the current n-th best (`_merge`), or
     for rows of up to 32 chunks all at once by ranks (`_rank_merge`; see RANK_MERGE below).
With TWO_PASS (the default at every length since 2026-12-03) step 4 is split off: the kernel
writes the chunk's candidates to a float32 buffer of at most TWO_PASS_MAX_BYTES (token slices beyond
it) and a second kernel picks each row's n best, with the same order and ties; with it, HEAD_FIRST
swaps steps 2 and 3 (head sum first, then the band in float32 on the token rows).
Order and ties exactly as nsa_jax.reference.select_blocks: the n largest scores, equal scores going
to the lower block index (a later chunk never displaces an equal score; the evicted entry is the
smallest score, highest index), output ascending, -1 in empty slots. Floating-point sums run in a
different order than the reference, so two scores within ~1e-7 relative may rank differently.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compress_attention as ca
from pallas_kernels._common import segment_ids_int32

LOG2E = math.log2(math.e)
BIG = 2 ** 30
# Optional code paths of the kernel, each giving the same indices (the tests run every one on and
# off, compiled on the H200 too). A/Bs: benchmarks/results/topn_merge_h200.md (2026-11-30) and
# topn_paths_h200.md (2026-12-01).
# CARRY_BOUNDS: the merge loop carries its bounds (five reductions an iteration instead of seven).
#   No gain at 64k (17.0 vs 17.3 ms), a loss at the 8k training layer (1.26 vs 1.12 ms): off.
# FIRST_FILL: with n = 16 = the chunk width, the first chunk's candidates become the list unmerged.
#   A gain where a row has few chunks (8k layer, 8 chunks: 0.94 vs 1.12 ms), a loss where it has
#   many (64k, 64 chunks: 20.3 vs 17.3 ms), so it is on only up to FIRST_FILL_MAX_CHUNKS chunks.
# CARRY_VEC: Eq. 9's part for the next chunk touches only its first column(s) (one, or two with
#   the literal alignment and l >= 3d; in the paper's overlap alignment only the chunk's last
#   compressed block, weight 1), so each is carried as a [rows] vector (a weighted row sum of p
#   in float32) instead of three more band matmuls that are almost all zeros.
# RANK_MERGE: merge a chunk by ranks (every entry of list + chunk counts what beats it; the n best
#   move to the slot of their rank) in a fixed number of whole-tile steps, instead of the while
#   loop that inserts one candidate a row per iteration.
# When CARRY_VEC and RANK_MERGE are None, chunk_paths picks them per shape by the rule measured
# in topn_paths_h200.md (every run's numbers are there): the rank merge for rows of up to 32
# chunks (T <= 32k at l' = 64; 8k-32k faster in every run), with the vector carry from 9 chunks
# at d_k >= 128 (it lost at 8 chunks and at d_k = 64); rows of 33-64 chunks (64k) take both only
# at d_k >= 192 (faster in all four runs at 192/128, slower in all four at 128/128); the loop
# merge and the matmul carry elsewhere, and for n above the measured 16.
# Env NSA_TOPN_<NAME> = 0 or 1 forces a path off or on.


def _env_flag(name, default):
  v = os.environ.get(f"NSA_TOPN_{name}")
  return default if v is None else v == "1"


CARRY_BOUNDS = _env_flag("CARRY_BOUNDS", False)
# TWO_PASS: no running top-n in the chunk loop. The kernel writes each chunk's candidate scores
#   (Eq. 10 with the forced / ineligible blocks as +inf / -inf) to a float32 buffer
#   [B, tokens * K, NSP], and a second kernel picks each row's n best from it (n rounds of max and
#   lowest-index-among-equals). Same order and ties as the merges. The buffer covers at most
#   TWO_PASS_MAX_BYTES; longer sequences are walked in token slices in a lax.fori_loop, so the
#   extra memory stays bounded (no T x T/l' array at any length).
#   Default (None): on for rows of at least TWO_PASS_MIN_CHUNKS chunks, now 1 (every length). From
#   2026-12-02 it was on from 33 chunks (T > 32k at l' = 64) after four 64k A/Bs (top-n -4.6% to
#   -6.3%; topn_twopass_default_h200.md). With HEAD_FIRST and the pick's new launch (below) it is
#   the fastest top-n in every H200 sweep of 2026-12-03 (topn_pick_h200.md): 8k training layer
#   0.59 vs 0.84 ms (the best merge), 16k 1.20 vs 1.61 (128/128) and 1.43 vs 1.73 (192/128), 32k
#   3.78 / 3.83 vs 4.66 / 4.82 and 4.69 / 4.86 vs 5.33 / 5.35, 64k 13.17 vs 16.50 and 15.81 vs 18.38.
TWO_PASS = _env_flag("TWO_PASS", None)
TWO_PASS_MIN_CHUNKS = 1
TWO_PASS_MAX_BYTES = 1 << 28
# The pick kernel's launch: about PICK_ELEMS scores a program (rows = PICK_ELEMS // row width),
# PICK_WARPS warps, and the n rounds unrolled in Python or (PICK_LOOP) a lax.fori_loop. Nsight
# Compute at 64k (benchmarks/results/ncu_h200.md) of the first launch (8 rows of 1024 scores,
# 4 warps, unrolled): 255 registers, 12.5% occupancy, 1.11 ms a 16k-token slice, a quarter of
# the top-n's time. Sweep (topn_pick_h200.md, one H200, 2026-12-03; whole top-n, HEAD_FIRST on):
# 4 rows + loop 13.17 / 15.81 ms at 64k 128/128 / 192/128 against 15.06 / 17.95 with the first
# launch, 3.83 / 4.86 at 32k; 8 warps gained nothing (16.16 / 18.91).
PICK_ELEMS = int(os.environ.get("NSA_TOPN_PICK_ELEMS", 4096))
PICK_WARPS = int(os.environ.get("NSA_TOPN_PICK_WARPS", 4))
PICK_LOOP = _env_flag("PICK_LOOP", True)


# The scores kernel's tile: ROWS (query heads x tokens) a program; LONG_ROWS where measured faster:
# d_k == LONG_ROWS_DK, G == LONG_ROWS_G, rows of at least LONG_ROWS_MIN_CHUNKS chunks, TWO_PASS
# (the merges were slower with 128 rows, 2026-11-29). Env NSA_TOPN_ROWS forces one size.
# H200 sweeps of 2026-12-03 (benchmarks/results/topn_rows_h200.md, HEAD_FIRST on; 64k repeated
# in a second call): 128 rows vs 64 at 128/128, G = 16: 64k 12.31 / 12.22 vs 13.06 / 13.10 ms,
# 32k 3.79 vs 4.01. Not adopted: 16k 128/128 (1.19 / 1.17 vs 1.23 / 1.11: the calls disagree),
# the 8k training layer at 64/64 (0.66 vs 0.57: slower), and 192/128, where 128 rows read a
# little faster in one run each (64k 15.53 vs 15.78, 32k 4.54 vs 4.56, 16k 1.31 vs 1.39) but
# were not repeated. Other group sizes were not timed.
ROWS = 64
LONG_ROWS = 128
LONG_ROWS_MIN_CHUNKS = 32
LONG_ROWS_DK = 128
LONG_ROWS_G = 16


def _rows_env():
  v = os.environ.get("NSA_TOPN_ROWS", "")
  if not v:
    return None
  if not v.isdigit() or int(v) < 16 or int(v) & (int(v) - 1):
    raise ValueError(f"NSA_TOPN_ROWS={v!r}: the top-n scores kernel's tile rows must be a power "
                     "of two >= 16 (Triton tiles, and the 16-row matrix-unit minimum). Fix: e.g. "
                     "NSA_TOPN_ROWS=64, or unset it for the measured rule")
  return int(v)


ROWS_ENV = _rows_env()


def default_rows(row_chunks, dk, g):
  """Tile rows of the scores kernel for rows of `row_chunks` chunks, head dim d_k, group size G."""
  if ROWS_ENV is not None:
    return ROWS_ENV
  long = (row_chunks >= LONG_ROWS_MIN_CHUNKS and dk == LONG_ROWS_DK and g == LONG_ROWS_G
          and uses_two_pass(row_chunks))
  return LONG_ROWS if long else ROWS


def rows_for(q_shape, kv_heads, stride, sel_block, sel_chunk=16):
  """default_rows for a call of select_topn on q [B, T, H, d_k] (what supports() and select_topn
  use when no rows are given)."""
  if stride <= 0 or sel_block <= 0 or sel_block % stride or kv_heads <= 0:
    return ROWS  # supports() names the problem
  nsj = _chunk_width(sel_chunk, sel_block // stride)
  return default_rows(_row_chunks(q_shape[1], sel_block, nsj), q_shape[-1],
                      q_shape[2] // kv_heads)


def _chunk_width(sel_chunk, r):
  """Selection blocks a chunk (nsj): the dots need >= 16 columns and rows."""
  return max(sel_chunk, 16, 16 // r)


def _row_chunks(t, sel_block, nsj):
  """Chunks of nsj selection blocks in a row of T tokens (the kernel's chunk loop length)."""
  return ca.cdiv(ca.cdiv(t, sel_block), nsj)


def uses_two_pass(row_chunks):
  """Whether a row of `row_chunks` chunks takes TWO_PASS: the flag where set, else the rule."""
  return row_chunks >= TWO_PASS_MIN_CHUNKS if TWO_PASS is None else TWO_PASS


# HEAD_FIRST: Eq. 10 before Eq. 9 (both are linear, so the order is free): the group's heads are
#   summed first, p [tq * G, r * nsj] -> [tq, r * nsj] in float32, and the band (Eq. 9) is then a
#   float32 broadcast-multiply-sum on the tq rows instead of three bfloat16 matmuls on the tq * G
#   rows (no three-term split; the next chunk's part is carried as [tq] vectors, as CARRY_VEC
#   does). Default (None): on with TWO_PASS, off with the merges. H200 top-n sweeps
#   (topn_pick_h200.md, 2026-12-03, first launch of the pick): two-pass 15.06 vs 16.12 ms (64k
#   128/128, twice: 15.03 vs 16.16) and 17.95 vs 18.43 (64k 192/128); with the merges it was
#   slower (18.0 vs 16.5 ms at 64k 128/128).
HEAD_FIRST = _env_flag("HEAD_FIRST", None)
FIRST_FILL = _env_flag("FIRST_FILL", True)
FIRST_FILL_MAX_CHUNKS = 8
CARRY_VEC = _env_flag("CARRY_VEC", None)
RANK_MERGE = _env_flag("RANK_MERGE", None)
RANK_MERGE_CHUNKS = (1, 32)
CARRY_VEC_MIN_CHUNKS = 9
RANK_MERGE_MAX_N = 16  # the measured n; the rank merge's [rows, NP, NP] compares grow as n^2
CARRY_VEC_MIN_DK = 128
LONG_ROW_CHUNKS = (33, 64)  # rows where both paths need d_k >= LONG_ROW_MIN_DK
LONG_ROW_MIN_DK = 192


def chunk_paths(row_chunks, dk, n=16):
  """(carry_vec, rank_merge) for rows of at most `row_chunks` chunks, head dim d_k and n selected
  blocks: the flags where set, else the measured rule (the rank merge for RANK_MERGE_CHUNKS and
  n <= RANK_MERGE_MAX_N, the vector carry with it at d_k >= CARRY_VEC_MIN_DK from
  CARRY_VEC_MIN_CHUNKS chunks on; both for LONG_ROW_CHUNKS at d_k >= LONG_ROW_MIN_DK)."""
  rank = carry = False
  if n <= RANK_MERGE_MAX_N:
    if RANK_MERGE_CHUNKS[0] <= row_chunks <= RANK_MERGE_CHUNKS[1]:
      rank, carry = True, dk >= CARRY_VEC_MIN_DK and row_chunks >= CARRY_VEC_MIN_CHUNKS
    elif LONG_ROW_CHUNKS[0] <= row_chunks <= LONG_ROW_CHUNKS[1]:
      rank = carry = dk >= LONG_ROW_MIN_DK
  return (carry if CARRY_VEC is None else CARRY_VEC, rank if RANK_MERGE is None else RANK_MERGE)


ALIGN_OFFSET = {"overlap": lambda r: r - 1, "literal": lambda r: 0}


def _band(u, k_base, r, c):
  """Eq. 9 weight of compressed block (chunk row u) for a selection block whose base - chunk start
  is k_base: #{(m, n): m < r, n < c, m + n = k_base - u}."""
  k = k_base - u
  w = jnp.minimum(jnp.minimum(k, r - 1), jnp.minimum(c - 1, r + c - 2 - k)) + 1
  return jnp.where((k >= 0) & (k <= r + c - 2), w, 0).astype(jnp.float32)


def carried_columns(r, c, nsj, off):
  """The next chunk's selection blocks (columns v) that this chunk's compressed blocks feed
  through Eq. 9's band (static: at most two for l <= l')."""
  k = r * (nsj + np.arange(nsj)[None, :]) + off - np.arange(r * nsj)[:, None]
  return [int(v) for v in np.nonzero(((k >= 0) & (k <= r + c - 2)).any(axis=0))[0]]


def _split3(x):
  """float32 x = hi + mid + lo, each bfloat16 (24 significant bits in all)."""
  hi = x.astype(jnp.bfloat16)
  r1 = x - hi.astype(jnp.float32)
  mid = r1.astype(jnp.bfloat16)
  lo = (r1 - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  return hi, mid, lo


def _exact_dot(parts, w):
  acc = None
  for p in parts:
    d = plgpu.dot(p, w)
    acc = d if acc is None else acc + d
  return acc


def _merge(a_val, a_idx, cand, jv, *, n):
  """Merge candidates cand [tq, S] (block ids jv) into the running top-n (a_val, a_idx) [tq, NP].

  One candidate per row and iteration (the best one, lower block on ties) replaces the row's worst
  entry (smallest score, highest block among equals) while any row has a candidate that beats it.
  With CARRY_BOUNDS the bounds for the next test are computed at the end of each iteration and
  carried (five reductions an iteration instead of seven)."""
  npad = a_val.shape[1]
  slot = lax.broadcasted_iota(jnp.int32, a_val.shape, 1)
  real = slot < n

  def bounds(a_val, c):
    return jnp.max(c, axis=1), jnp.min(jnp.where(real, a_val, jnp.inf), axis=1)

  def any_beats(c_best, a_min):
    return jnp.max((c_best > a_min).astype(jnp.int32)) > 0

  def step(a_val, a_idx, c, c_best, a_min):
    c_pick = jnp.min(jnp.where(c == c_best[:, None], jv, BIG), axis=1)  # ties: lower block
    a_eff = jnp.where(real, a_val, jnp.inf)
    key = jnp.where(a_eff == a_min[:, None], (a_idx + 1) * npad + slot, -1)
    evict = jnp.max(key, axis=1) & (npad - 1)  # smallest score, highest block among equals
    ins = c_best > a_min
    hit = ins[:, None] & (slot == evict[:, None])
    a_val = jnp.where(hit, c_best[:, None], a_val)
    a_idx = jnp.where(hit, c_pick[:, None], a_idx)
    c = jnp.where(ins[:, None] & (jv == c_pick[:, None]), -jnp.inf, c)
    return a_val, a_idx, c

  if CARRY_BOUNDS:
    def carried(st):  # state: a_val, a_idx, c, their bounds, whether to go on
      a_val, a_idx, c = step(*st[:5])
      c_best, a_min = bounds(a_val, c)
      return a_val, a_idx, c, c_best, a_min, any_beats(c_best, a_min)

    c_best, a_min = bounds(a_val, cand)
    st = lax.while_loop(lambda st: st[5], carried,
                        (a_val, a_idx, cand, c_best, a_min, any_beats(c_best, a_min)))
    return st[0], st[1]

  def cond(st):
    a_val, _, c = st
    return any_beats(*bounds(a_val, c))

  def body(st):
    a_val, a_idx, c = st
    return step(a_val, a_idx, c, *bounds(a_val, c))

  a_val, a_idx, _ = lax.while_loop(cond, body, (a_val, a_idx, cand))
  return a_val, a_idx


def _rank_merge(a_val, a_idx, cand, jv, *, n):
  """_merge's result without its loop: the n best of list + chunk by (score desc, block asc).

  Every candidate's block is above every listed block (chunks come in order), so a listed entry
  beats an equal candidate; equal listed entries (only empty slots: -inf, -1) order by slot. The
  order is strict, so the ranks of the list's n real slots and the S candidates are distinct, and
  the entry of rank s < n moves to slot s."""
  npad, ns = a_val.shape[1], cand.shape[1]
  slot = lax.broadcasted_iota(jnp.int32, a_val.shape, 1)
  real = slot < n
  a3, ai3 = a_val[:, :, None], a_idx[:, :, None]  # [tq, NP, 1]: the entry ranked
  b3, bi3 = a_val[:, None, :], a_idx[:, None, :]  # [tq, 1, NP]: the entries it is compared with
  s1 = lax.broadcasted_iota(jnp.int32, (1, npad, npad), 1)
  s2 = lax.broadcasted_iota(jnp.int32, (1, npad, npad), 2)
  c3, c3t = cand[:, :, None], cand[:, None, :]  # [tq, S, 1], [tq, 1, S]
  k1 = lax.broadcasted_iota(jnp.int32, (1, ns, ns), 1)
  k2 = lax.broadcasted_iota(jnp.int32, (1, ns, ns), 2)
  real2 = (s2 < n)
  # listed entry: beaten by listed entries before it in the order, and by better candidates
  over_a = (b3 > a3) | ((b3 == a3) & ((bi3 < ai3) | ((bi3 == ai3) & (s2 < s1))))
  rank_a = (jnp.sum((over_a & real2).astype(jnp.int32), axis=2)
            + jnp.sum((c3t > a3).astype(jnp.int32), axis=2))
  rank_a = jnp.where(real, rank_a, BIG)
  # candidate: beaten by listed entries at least as good, and by candidates before it in the order
  over_c = (c3t > c3) | ((c3t == c3) & (k2 < k1))
  rank_c = (jnp.sum(((b3 >= c3) & real[:, None, :]).astype(jnp.int32), axis=2)
            + jnp.sum(over_c.astype(jnp.int32), axis=2))
  # the entry of rank s goes to slot s (slots >= n: empty); s1 indexes [1, slot, source] here
  from_a = rank_a[:, None, :] == s1
  from_c = rank_c[:, None, :] == lax.broadcasted_iota(jnp.int32, (1, npad, ns), 1)
  new_val = jnp.maximum(jnp.max(jnp.where(from_a, b3, -jnp.inf), axis=2),
                        jnp.max(jnp.where(from_c, c3t, -jnp.inf), axis=2))
  new_idx = (jnp.sum(jnp.where(from_a, bi3, 0), axis=2)
             + jnp.sum(jnp.where(from_c, jv[:, None, :], 0), axis=2))
  return jnp.where(real, new_val, -jnp.inf), jnp.where(real, new_idx, -1)


def _ascending(a_val, a_idx, *, n):
  """[tq, NP] chosen blocks -> ascending block ids, -1 in empty slots (and in slots >= n)."""
  slot = lax.broadcasted_iota(jnp.int32, a_val.shape, 1)
  key = jnp.where((slot < n) & (a_val > -jnp.inf), a_idx, BIG)
  out = jnp.full(a_val.shape, -1, jnp.int32)
  for s in range(n):
    mn = jnp.min(key, axis=1)
    out = jnp.where(slot == s, jnp.where(mn == BIG, -1, mn)[:, None], out)
    key = jnp.where(key == mn[:, None], BIG, key)
  return out


def _topn_kernel(seg_ref, first_ref, bseg_ref, bpure_ref, q_ref, k_ref, lse_ref, *refs, tq, g,
                 gp, m, t, h, kh, nc, block, stride, sel_block, nsj, n, npad, n_init, n_local, off,
                 dk_pieces, scale, has_seg, carry_vec, rank_merge, first_fill, two_pass=False,
                 head_first=False):
  # two_pass: refs = (tile0_ref [1]: the slice's first tile, scores_ref [slice rows, NSP]);
  # else refs = (idx_ref,)
  if two_pass:
    tile0_ref, scores_ref = refs
    tile0 = tile0_ref[0]
    tile, kk = pl.program_id(0) + tile0, pl.program_id(1)
  else:
    (idx_ref,) = refs
    tile, kk = pl.program_id(0), pl.program_id(1)
  pos, row, _ = ca.tile_rows(tile, kk, tq=tq, g=g, gp=gp, m=m, t=t, h=h)
  # Only padded heads are dropped: tokens past T copy token T-1 whole, so they compute (and store)
  # exactly its indices.
  real_head = lax.iota(jnp.int32, m) % gp < g
  qs = ca.load_rows(q_ref, row, dk_pieces)
  lse = lse_ref[row]
  lse2 = jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)
  seg_q = seg_ref[pos] if has_seg else None
  r, c = sel_block // stride, block // stride
  bkc = r * nsj
  tpos = jnp.minimum(tile * tq + lax.iota(jnp.int32, tq), t - 1)  # per token of the tile
  cur = tpos // sel_block
  first = first_ref[tpos] if has_seg else jnp.zeros((tq,), jnp.int32)
  u = lax.broadcasted_iota(jnp.int32, (bkc, nsj), 0)
  v = lax.broadcasted_iota(jnp.int32, (bkc, nsj), 1)
  w_own32 = _band(u, r * v + off, r, c)  # [bkc, nsj] float32 (HEAD_FIRST's band)
  w_own = w_own32.astype(jnp.bfloat16)  # the band matmuls' (small integers: exact)
  last = jnp.minimum(tile * tq + tq - 1, t - 1)
  chunks = last // sel_block // nsj + 1
  carry_vec = carry_vec or head_first  # head_first carries [tq] vectors of the head sums
  if carry_vec:
    cols = carried_columns(r, c, nsj, off)
    col = lax.broadcasted_iota(jnp.int32, (m, nsj), 1)
    uc = lax.iota(jnp.int32, bkc)
    # the weights as [bkc] vectors, built like _band (a kernel cannot capture array constants)
    wvecs = [_band(uc, r * (nsj + vv) + off, r, c) for vv in cols]
  else:
    w_next = _band(u, r * (nsj + v) + off, r, c).astype(jnp.bfloat16)

  def body(ci, st, fill=False):
    a_val, a_idx, carry = st
    start = ci * bkc if fill else pl.multiple_of(ci * bkc, bkc)  # fill: ci is the literal 0
    kidx = start + lax.iota(jnp.int32, bkc)
    ks = ca.load_block(k_ref, start, bkc, dk_pieces)
    bseg = bseg_ref[pl.ds(start, bkc)] if has_seg else None
    bpure = bpure_ref[pl.ds(start, bkc)] if has_seg else None
    s = ca.dot_pieces(qs, ks) * (scale * LOG2E)
    vis = ca.cmp_visible(pos, kidx, seg_q, bseg, bpure, block=block, stride=stride, nc=nc)
    if gp > g:
      vis = vis & real_head[:, None]
    p = jnp.where(vis, jnp.exp2(s - lse2[:, None]), 0.0)  # Eq. 8
    if head_first:
      hp = jnp.sum(p.reshape(tq, gp, bkc), axis=1)  # Eq. 10 first: [tq, bkc]
      own = jnp.sum(hp[:, :, None] * w_own32[None, :, :], axis=1)  # Eq. 9 [tq, nsj]
      colt = lax.broadcasted_iota(jnp.int32, (tq, nsj), 1)
      for vv, cv in zip(cols, carry):
        own = own + jnp.where(colt == vv, cv[:, None], 0.0)
      carry = tuple(jnp.sum(hp * wv[None, :], axis=1) for wv in wvecs)
    elif carry_vec:
      parts = _split3(p)
      own = _exact_dot(parts, w_own)  # Eq. 9 [m, nsj]
      for vv, cv in zip(cols, carry):
        own = own + jnp.where(col == vv, cv[:, None], 0.0)
      own = jnp.sum(own.reshape(tq, gp, nsj), axis=1)  # Eq. 10 [tq, nsj]
      carry = tuple(jnp.sum(p * wv[None, :], axis=1) for wv in wvecs)
    else:
      parts = _split3(p)
      own = _exact_dot(parts, w_own)  # Eq. 9 [m, nsj]
      nxt = _exact_dot(parts, w_next)
      own = jnp.sum(own.reshape(tq, gp, nsj), axis=1) + carry  # Eq. 10 [tq, nsj]
      carry = jnp.sum(nxt.reshape(tq, gp, nsj), axis=1)
    j = ci * nsj + lax.broadcasted_iota(jnp.int32, (tq, nsj), 1)
    elig = (j <= cur[:, None]) & (j >= first[:, None])
    forced = elig & ((j < first[:, None] + n_init) | (j > cur[:, None] - n_local))
    cand = jnp.where(forced, jnp.inf, jnp.where(elig, own, -jnp.inf))
    if fill:  # the first chunk's nsj = n candidates are the list (-inf: empty slots)
      return cand, j, carry
    if two_pass:  # the slice's row of each token: (token - first token of the slice) * K + group
      ca.store_rows(scores_ref, (tpos - tile0 * tq) * kh + kk, ci * nsj, cand)
      return a_val, a_idx, carry
    a_val, a_idx = (_rank_merge if rank_merge else _merge)(a_val, a_idx, cand, j, n=n)
    return a_val, a_idx, carry

  carry0 = (tuple(jnp.zeros((tq if head_first else m,), jnp.float32) for _ in cols) if carry_vec
            else jnp.zeros((tq, nsj), jnp.float32))
  init = (jnp.full((tq, npad), -jnp.inf, jnp.float32), jnp.full((tq, npad), -1, jnp.int32), carry0)
  # With nsj == n == NP the first chunk needs no merge (16 of the ~45 merge iterations of a
  # 128-block row at n = 16): its candidates become the list, then chunks 1.. merge as before.
  # Every tile has at least one chunk.
  c0 = 0
  if first_fill:
    init, c0 = body(0, init, fill=True), 1
  a_val, a_idx, _ = lax.fori_loop(c0, chunks, body, init)
  if not two_pass:
    ca.store_rows(idx_ref, tpos * kh + kk, 0, _ascending(a_val, a_idx, n=n))


def _pick_kernel(tile0_ref, scores_ref, idx_ref, *, rows, kh, t, tq, sel_block, n, npad, nsp,
                 loop=False):
  """TWO_PASS's second kernel: `rows` rows of the slice's score buffer -> their n best blocks
  (score desc, block asc), ascending, -1 in empty slots. Columns past a token's own block were
  not written by the first kernel (or hold -inf there): masked here before anything reads them."""
  r = pl.program_id(0) * rows + lax.iota(jnp.int32, rows)
  cur = jnp.minimum(tile0_ref[0] * tq + r // kh, t - 1) // sel_block
  j = lax.broadcasted_iota(jnp.int32, (rows, nsp), 1)
  vals = jnp.where(j <= cur[:, None], scores_ref[r, pl.ds(0, nsp)], -jnp.inf)
  a_val, a_idx = best_n_rounds(vals, j, n=n, npad=npad, loop=loop)
  ca.store_rows(idx_ref, r, 0, _ascending(a_val, a_idx, n=n))


def best_n_rounds(vals, j, *, n, npad, loop):
  """(a_val, a_idx) [rows, NP] of vals [rows, S] (block ids j [rows, S]): n rounds of (the best
  left, the lowest block among equals), each pick then leaving its row; slots past the picks and
  rounds that find only -inf hold -inf (and the block of that -inf, dropped by _ascending).
  loop: the rounds in a lax.fori_loop (PICK_LOOP) instead of unrolled. Also the decode top-n's."""
  rows = vals.shape[0]
  slot = lax.broadcasted_iota(jnp.int32, (rows, npad), 1)

  def round_(s, state):
    vals, a_val, a_idx = state
    best = jnp.max(vals, axis=1, keepdims=True)
    pick = jnp.min(jnp.where(vals == best, j, BIG), axis=1, keepdims=True)  # ties: lower block
    a_val = jnp.where(slot == s, best, a_val)
    a_idx = jnp.where(slot == s, pick, a_idx)
    return jnp.where(j == pick, -jnp.inf, vals), a_val, a_idx

  state = (vals, jnp.full((rows, npad), -jnp.inf, jnp.float32),
           jnp.full((rows, npad), -1, jnp.int32))
  if loop:
    state = lax.fori_loop(0, n, round_, state)
  else:
    for s in range(n):
      state = round_(s, state)
  return state[1], state[2]


def supports(q_shape, kc_shape, block, stride, sel_block, rows=None):
  """(ok, reason): whether the kernel handles these shapes and block sizes (rows: the tile rows,
  None: the rule select_topn applies by default)."""
  b, t, h, dk = q_shape
  if kc_shape[0] != b or kc_shape[3] != dk or h % kc_shape[2]:
    return False, f"k_cmp {kc_shape} does not match q {q_shape}"
  rows = rows_for(q_shape, kc_shape[2], stride, sel_block) if rows is None else rows
  if dk < 16 or dk % 16:
    return False, f"d_k={dk}: needs a multiple of 16"
  r = sel_block // stride
  if sel_block % stride or r & (r - 1):
    return False, f"l'/d = {sel_block}/{stride} must be a power of two"
  tq, gp, m = ca.tile_shape(h // kc_shape[2], rows)
  if m != tq * gp:
    return False, f"rows={rows} below the 16-row matrix-unit minimum"
  if t * h >= 2 ** 31:
    return False, f"T*H={t * h} too large for int32 row indices"
  return True, "ok"


def document_first_block(seg, sel_block):
  """[B, T] selection block holding each token's document start (segments are contiguous)."""
  return ca.run_starts(seg) // sel_block


def select_topn(q, k_cmp, lse, *, block, stride, sel_block, num_selected, num_init=1, num_local=2,
                alignment="overlap", segment_ids=None, scale=None, interpret=False, rows=None,
                sel_chunk=16, num_warps=4, num_stages=2):
  """Top-n selection blocks [B, T, K, n] int32 from q [B,T,H,Dk], k_cmp [B,Nc,K,Dk], lse [B,T,H]
  (the compression softmax's log-sum-exp). Not differentiable (inputs are stop_gradient-ed).
  rows: the scores kernel's tile rows (None: default_rows, by the measured rule)."""
  if rows is None:
    rows = rows_for(q.shape, k_cmp.shape[2], stride, sel_block, sel_chunk)
  ok, why = supports(q.shape, k_cmp.shape, block, stride, sel_block, rows)
  if not ok:
    raise ValueError(f"select_topn does not support this call: {why}")
  if alignment not in ALIGN_OFFSET:
    raise ValueError(f"alignment={alignment!r}: expected one of {sorted(ALIGN_OFFSET)}")
  q, k_cmp, lse = (lax.stop_gradient(x) for x in (q, k_cmp, lse))
  b, t, h, dk = q.shape
  expect = ca.num_cmp_blocks(t, block, stride)
  if k_cmp.shape[1] != expect:
    raise ValueError(f"select_topn: k_cmp has {k_cmp.shape[1]} compressed blocks, expected "
                     f"{expect} for T={t}, l={block}, d={stride}. Fix: compress the same T tokens.")
  if tuple(lse.shape) != (b, t, h):
    raise ValueError(f"select_topn: lse has shape {tuple(lse.shape)}, expected [B, T, H] = "
                     f"{(b, t, h)} (compress_attention's second output).")
  if block > sel_block:
    raise ValueError(f"select_topn: l={block} > l'={sel_block}; NSA's scores need l <= l' "
                     "(NSAConfig checks this). Fix: choose the selection block at least as long.")
  nc, kh = k_cmp.shape[1], k_cmp.shape[2]
  g = h // kh
  tq, gp, m = ca.tile_shape(g, rows)
  r = sel_block // stride
  nsj = _chunk_width(sel_chunk, r)
  bkc = r * nsj
  ns = ca.cdiv(t, sel_block)
  ncp = max(ca.cdiv(ns, nsj) * bkc, ca.cdiv(nc, bkc) * bkc)
  kc = jnp.pad(k_cmp, ((0, 0), (0, ncp - nc), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  seg, has_seg = segment_ids_int32(segment_ids, b, t, "select_topn")
  if has_seg:
    bseg, bpure = ca.block_meta(seg, ncp, block, stride)
    first = document_first_block(seg, sel_block).astype(jnp.int32)
  else:
    bseg = bpure = jnp.zeros((b, ncp), jnp.int32)
    first = jnp.zeros((b, t), jnp.int32)
  npad = ca.next_pow2(num_selected)
  scale = float(dk ** -0.5 if scale is None else scale)
  row_chunks = _row_chunks(t, sel_block, nsj)
  carry_vec, rank_merge = chunk_paths(row_chunks, dk, num_selected)
  first_fill = FIRST_FILL and nsj == num_selected == npad and row_chunks <= FIRST_FILL_MAX_CHUNKS
  two_pass = uses_two_pass(row_chunks)
  head_first = two_pass if HEAD_FIRST is None else HEAD_FIRST
  kernel = functools.partial(
      _topn_kernel, tq=tq, g=g, gp=gp, m=m, t=t, h=h, kh=kh, nc=nc, block=block, stride=stride,
      sel_block=sel_block, nsj=nsj, n=num_selected, npad=npad, n_init=num_init,
      n_local=num_local, off=ALIGN_OFFSET[alignment](r), dk_pieces=ca.dim_pieces(dk), scale=scale,
      has_seg=has_seg, carry_vec=carry_vec, rank_merge=rank_merge, first_fill=first_fill,
      head_first=head_first)
  w = ca._whole
  args = (seg, first, bseg, bpure, q.reshape(b, t * h, dk), kc, lse.reshape(b, t * h))
  in_specs = [w(t), w(t), w(ncp), w(ncp), w(t * h, dk), ca._group(ncp, dk), w(t * h)]
  params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  if two_pass:
    idx = _two_pass(functools.partial(kernel, first_fill=False, two_pass=True), args, in_specs,
                    params, b=b, t=t, tq=tq, kh=kh, nsp=ca.next_pow2(row_chunks * nsj),
                    sel_block=sel_block, n=num_selected, npad=npad, interpret=interpret)
  else:
    idx = pl.pallas_call(
        kernel,
        grid=(ca.cdiv(t, tq), kh, b),
        in_specs=in_specs,
        out_specs=w(t * kh, npad),
        out_shape=jax.ShapeDtypeStruct((b, t * kh, npad), jnp.int32),
        compiler_params=params,
        interpret=interpret,
        name="nsa_select_topn",
    )(*args)
  return idx.reshape(b, t, kh, npad)[..., :num_selected]


def two_pass_slice(b, t, tq, kh, nsp):
  """Tokens per slice of TWO_PASS (a multiple of tq): as many as keep the score buffer
  [B, tokens * K, NSP] float32 within TWO_PASS_MAX_BYTES (all T when it fits)."""
  per_token = b * kh * nsp * 4
  return min(ca.cdiv(t, tq) * tq, max(tq, TWO_PASS_MAX_BYTES // per_token // tq * tq))


def _two_pass(kernel, args, in_specs, params, *, b, t, tq, kh, nsp, sel_block, n, npad,
              interpret):
  """TWO_PASS: per slice of tokens, the scores kernel then the pick kernel; [B, T * K, npad]."""
  if PICK_ELEMS < 1 or PICK_ELEMS & (PICK_ELEMS - 1):
    raise ValueError(f"select_topn: PICK_ELEMS={PICK_ELEMS} (NSA_TOPN_PICK_ELEMS) must be a "
                     "power of two >= 1: the pick kernel's rows a program are PICK_ELEMS // row "
                     "width and Triton tiles need power-of-two sizes. Fix: e.g. 4096 (default)")
  ts = two_pass_slice(b, t, tq, kh, nsp)
  slices, tiles = ca.cdiv(t, ts), ts // tq
  prow = max(1, min(64, PICK_ELEMS // nsp))  # rows a pick program takes (scores in registers)
  brows = ca.cdiv(ts * kh, prow) * prow  # buffer rows, padded to whole pick programs
  one = pl.BlockSpec((1,), lambda *_: (0,))
  w = ca._whole
  scores_call = pl.pallas_call(
      kernel,
      grid=(tiles, kh, b),
      in_specs=in_specs + [one],
      out_specs=w(brows, nsp),
      out_shape=jax.ShapeDtypeStruct((b, brows, nsp), jnp.float32),
      compiler_params=params,
      interpret=interpret,
      name="nsa_select_topn_scores",
  )
  pick_call = pl.pallas_call(
      functools.partial(_pick_kernel, rows=prow, kh=kh, t=t, tq=tq, sel_block=sel_block, n=n,
                        npad=npad, nsp=nsp, loop=PICK_LOOP),
      grid=(brows // prow, 1, b),
      in_specs=[one, w(brows, nsp)],
      out_specs=w(brows, npad),
      out_shape=jax.ShapeDtypeStruct((b, brows, npad), jnp.int32),
      compiler_params=plgpu.CompilerParams(num_warps=PICK_WARPS, num_stages=1),
      interpret=interpret,
      name="nsa_select_topn_pick",
  )

  def one_slice(si):
    tile0 = jnp.reshape(si * tiles, (1,)).astype(jnp.int32)
    return pick_call(tile0, scores_call(*args, tile0))[:, :ts * kh]

  if slices == 1:
    return one_slice(0)[:, :t * kh]
  out = jnp.zeros((b, slices * ts * kh, npad), jnp.int32)
  out = lax.fori_loop(0, slices, lambda si, o: lax.dynamic_update_slice_in_dim(
      o, one_slice(si), si * ts * kh, axis=1), out)
  return out[:, :t * kh]
