"""Shared helpers of the selection kernels: tiling config, dim splitting, and the index maps built in XLA.

The Triton lowering only loads power-of-two sized tiles, so head dims such as 192 are walked in
power-of-two pieces (`dim_pieces`). The index maps (`tile_union`, `inverse_lists`) are built once per
call in plain XLA from block_idx [B, T, K, n]; the kernels only read them as scalars or small vectors.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG = logging.getLogger("pallas_kernels")
_LOGGED: set = set()

BIG = 2 ** 30  # sort sentinel for empty slots: larger than any block index


def log_once(key, msg, *args):
  """Log `msg` once per distinct `key` (called at trace time, so once per shape)."""
  if key not in _LOGGED:
    _LOGGED.add(key)
    LOG.info(msg, *args)


def _require_integers(x, who, name, what, fix, allow_bool=False):
  """TypeError naming the problem unless x holds integers (or booleans with allow_bool): the
  kernels would truncate floats. (nsa_jax.reference.require_integers is the same check for the
  ops; this package does not import nsa_jax.)"""
  if not (jnp.issubdtype(x.dtype, jnp.integer) or (allow_bool and x.dtype == jnp.bool_)):
    raise TypeError(f"{who}: {name} has dtype {x.dtype}; {what} must be integers. Fix: {fix}")


def check_indices(block_idx, who):
  """Block indices must be integers: a float index would be truncated (1.5 -> block 1) where the
  reference ignores it."""
  _require_integers(block_idx, who, "block_idx", "block indices (-1 for an empty slot)",
                    "pass an int32 array, e.g. idx.astype(jnp.int32) after checking the values "
                    "are whole numbers.")


def document_runs(seg):
  """[B, T] int32 index (0, 1, 2, ...) of each token's contiguous run of equal ids in its row:
  nsa_jax.reference.document_runs, the one meaning of segment ids (each run a document, an id
  that comes back later starts another one). The kernels' id tests then agree with the paths
  that take each row's document start."""
  change = (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)
  return jnp.concatenate([jnp.zeros_like(seg[:, :1], jnp.int32),  # [B, 0] when T = 0
                          jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def segment_ids_int32(segment_ids, b, t, who):
  """(int32 [B, T] document runs of the segment ids (document_runs), has_seg) for a kernel: the
  shape must be [B, T] and the ids integers (a float id would be truncated, merging documents
  0.0 and 0.5)."""
  if segment_ids is None:
    return jnp.zeros((b, t), jnp.int32), False
  if tuple(segment_ids.shape) != (b, t):
    raise ValueError(f"{who}: segment_ids has shape {tuple(segment_ids.shape)}, expected "
                     f"[batch, time] = {(b, t)}. Fix: one document id per token of each sequence.")
  _require_integers(segment_ids, who, "segment_ids", "document ids",
                    "pass int32 ids (e.g. the cumulative count of document starts).",
                    allow_bool=True)
  return document_runs(segment_ids), True


def cdiv(a, b):
  return -(-a // b)


def next_pow2(x):
  p = 1
  while p < x:
    p *= 2
  return p


def dim_pieces(d):
  """Split a head dim into power-of-two (offset, size) pieces, largest first: 192 -> (0,128),(128,64)."""
  pieces, off = [], 0
  while off < d:
    size = 1 << ((d - off).bit_length() - 1)
    pieces.append((off, size))
    off += size
  return tuple(pieces)


@dataclasses.dataclass(frozen=True)
class SelectTiling:
  """Static tiling of the selection kernels (hashable: passed as a static custom_vjp argument).

  mode: how a multi-token tile walks its tokens' blocks.
    "union": one stacked tile (tokens x G heads as rows) walks the union of its tokens' blocks,
      masking rows whose token did not pick the block (fills the 16-row matrix unit when G < 16);
    "shared": each token keeps its own G-row tile and softmax state; blocks picked by every token of
      the tile are loaded once and used by all of them, the rest per token (exact FLOPs, fewer bytes).
  tokens_per_tile: query positions per forward/dq program (1 = the paper's per-token program, the G
    heads padded up to 16 rows when G < 16).
  block_k: keys per inner step (divides block_size).
  bwd_tokens: tokens gathered per dK/dV inner step (rows = bwd_tokens * G).
  chunk_entries: max (token, block) entries one dK/dV program handles (load balance vs. partials).
  blocks_per_step: selected blocks the "union" forward folds into its softmax state per loop step
    (one rescale for all of them; their loads are independent, so more of them are in flight).
    The "shared" forward and the backward kernels walk one block a step whatever this says.
  dq_blocks_per_step: selected blocks the "union" dq kernel walks per loop step (independent loads
    and accumulations; 1 = one a step, as before this field existed).
  """
  tokens_per_tile: int = 1
  mode: str = "union"
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  bwd_tokens: int = 4
  chunk_entries: int = 512
  bwd_num_warps: int = 4
  bwd_num_stages: int = 2
  blocks_per_step: int = 1
  dq_blocks_per_step: int = 1


def default_tiling(g, block_size):
  """Measured default (H200, T=64k, n=16, l'=64, see benchmarks/results/select_h200_*.md).

  G >= 16: the paper's per-token tile (16 rows): fastest measured on the worst-case "random"
  pattern (fwd 16.6 ms vs 18.0 "shared" x2, 20.8 "shared" x4, 20.5 "union" x4); "shared" x4 is the
  better choice when neighbouring tokens share most blocks; two selected blocks a forward step.
  G < 16: "union" tiles stacking 16 // G tokens into the 16-row matrix-unit minimum.
  """
  bwd = max(1, 64 // g)
  bk = min(64, block_size)
  # 2 blocks a forward step for the per-token tile (H200, 64k, G=16: random 16.36 vs 17.30 ms,
  # clustered 16.30 vs 17.10; 4 a step: 26.0 ms; G=4 union x4: 54.0 vs 52.7, so 1 there).
  bps = 2 if g >= 16 and bk == block_size else 1
  # G = 16's 16-row per-token tile: 2 warps for its forward and dq kernels (H200, T=64k, 128/128,
  # the whole op's own top-n lists: dq 18.82 -> 17.00 ms, backward 30.81 -> 28.61, forward 16.59
  # -> 16.27; 8 warps 25.5 ms dq; benchmarks/results/select_bwd_trial_h200_64k128_dq.md. H100,
  # 4 -> 2 warps: 192/128 top-n backward 51.11 -> 50.12 ms, forward 24.47 -> 24.94; 128/128
  # random lists backward 31.84 -> 30.49, forward 18.43 -> 18.20; the whole op's 128/128 backward
  # 71.61 / 71.25 -> 70.26 / 69.26 ms, select_bwd_trial_h100_*.md, warps2_ab_h100/). Wider tiles
  # (G > 16, or the union tiles built from this one) keep 4; G < 16 was not measured.
  warps = 2 if g == 16 else 4
  return SelectTiling(tokens_per_tile=max(1, 16 // g), block_k=bk, bwd_tokens=bwd,
                      blocks_per_step=bps, num_warps=warps)


# Mean distinct blocks of a 4-token tile at or below which G >= 16 uses the 4-token "union" tile
# (per slot of the block list). H200, T=64k, G=16, n=16 (select_h200_union4.md): the union tile
# takes 8.5 / 22.4 ms (fwd / bwd) at ~19 distinct blocks a tile ("clustered") and 20.2 / 34.6 ms at
# ~55 ("random"); the per-token tile 16.4 / 26.6-31.4 ms on both. Linear in between, the two cross
# near 38-45 distinct blocks: switch at 2.25 n = 36.
UNION_SWITCH = 2.25
UNION_TOKENS = 4


def clustered_tiling(g, block_size):
  """The tiling G >= 16 switches to when a call's neighbouring tokens share most blocks (None for
  G < 16, whose default already stacks tokens)."""
  if g < 16 or block_size < 16:
    return None
  return dataclasses.replace(default_tiling(g, block_size), tokens_per_tile=UNION_TOKENS,
                             blocks_per_step=1, num_warps=4)


def mean_union(block_idx, tq, max_tiles=512):
  """Mean number of distinct blocks in the lists of tq consecutive tokens (one KV group), estimated
  on at most ~max_tiles evenly spaced tiles per batch row and group (one small sort)."""
  b, t, kh, n = block_idx.shape
  nt = t // tq
  if nt == 0:
    return jnp.float32(n)
  step = max(1, nt // max_tiles)
  x = block_idx[:, :nt * tq].reshape(b, nt, tq, kh, n)[:, ::step]
  x = x.transpose(0, 1, 3, 2, 4).reshape(b, -1, kh, tq * n)
  s = jnp.sort(jnp.where(x < 0, BIG, x), axis=-1, stable=False)
  new = jnp.concatenate([s[..., :1] < BIG, (s[..., 1:] != s[..., :-1]) & (s[..., 1:] < BIG)], -1)
  return jnp.mean(jnp.sum(new, axis=-1).astype(jnp.float32))


def use_union(block_idx, switch=None):
  """The automatic choice (a traced bool): whether these block lists [B, T, K, n] get the union
  tile rather than the other one. switch = (tokens, factor): union when tiles of `tokens`
  consecutive tokens average <= factor * n distinct blocks; default (UNION_TOKENS, UNION_SWITCH),
  G >= 16's 4-token union tile (`clustered_tiling`) against the per-token one."""
  tokens, factor = switch or (UNION_TOKENS, UNION_SWITCH)
  return mean_union(block_idx, tokens) <= factor * block_idx.shape[-1]


def rows_of(g, tq):
  """Rows of a query tile: tq tokens x g heads, padded up to a power of two >= 16."""
  return max(16, next_pow2(g * tq))


# ----------------------------------------------------------------------------- XLA index maps

def search_sorted(a, v, side="left"):
  """jnp.searchsorted as an unrolled binary search (log2 len(a) gather steps, no loop).

  jnp.searchsorted's default method is a lax while loop: 60 of them (7-18 iterations, each a few
  tiny kernel launches) ran per 8k training step through these index maps (H200 profile,
  2026-12-01, benchmarks/results/step_profile_8k_hlo.md). Removing them did not change that step's
  time measurably (214.1 -> 214.9 ms, compile_time_overhead_h200.json); kept for the smaller
  program. Same results (tests/test_select_kernel.py)."""
  return jnp.searchsorted(a, v, side=side, method="scan_unrolled")


def tile_maps(block_idx, tiling):
  """The forward/dq index maps of `tiling.mode` (tuple of int32 arrays, see tile_union/tile_shared)."""
  if tiling.mode == "shared":
    return tile_shared(block_idx, tiling.tokens_per_tile)
  if tiling.mode == "union":
    return tile_union(block_idx, tiling.tokens_per_tile)
  raise ValueError(f"tiling.mode={tiling.mode!r}: expected 'union' or 'shared'")


def map_specs(maps):
  """BlockSpecs (grid (tile, group, batch)) of the index maps: one tile's slice of each."""
  def spec(a):
    tail = a.shape[3:]
    return pl.BlockSpec((None, None, None, *tail), lambda i, j, bb: (bb, i, j) + (0,) * len(tail))
  return [spec(a) for a in maps]


def tile_shared(block_idx, tq):
  """Blocks shared by all tq tokens of a tile, and each token's remaining (private) blocks.

  block_idx [B, T, K, n]. Returns common [B, nT, K, n], ccnt [B, nT, K, 1], private [B, nT, K, tq, n],
  pcnt [B, nT, K, tq] (lists ascending, 0 past their count). Tokens past T repeat token T-1's list,
  so their (unstored-anyway duplicate) rows compute the same values as token T-1.
  """
  b, t, kh, n = block_idx.shape
  nt = cdiv(t, tq)
  x = jnp.pad(block_idx, ((0, 0), (0, nt * tq - t), (0, 0), (0, 0)), mode="edge")
  x = x.reshape(b, nt, tq, kh, n).transpose(0, 1, 3, 2, 4)  # [B, nT, K, tq, n]
  valid = x >= 0
  hit = x[..., :, :, None, None] == jnp.where(valid, x, -2)[..., None, None, :, :]
  in_all = jnp.all(jnp.any(hit, axis=-1), axis=-1) & valid  # [B, nT, K, tq, n]

  def compact(a):
    a = jnp.sort(jnp.where(a < 0, BIG, a), axis=-1, stable=False)
    return jnp.where(a < BIG, a, 0).astype(jnp.int32), jnp.sum(a < BIG, axis=-1).astype(jnp.int32)

  common, ccnt = compact(jnp.where(in_all[..., 0, :], x[..., 0, :], -1))
  private, pcnt = compact(jnp.where(valid & ~in_all, x, -1))
  return common, ccnt[..., None], private, pcnt


def tile_union(block_idx, tq):
  """Union of the block lists of tq consecutive tokens.

  block_idx [B, T, K, n] int32 (-1 empty). Returns ub [B, nT, K, U] (ascending union, 0 past cnt),
  bits [B, nT, K, U] int32 (bit i set iff token i of the tile picked that block), cnt [B, nT, K, 1].
  With tq = 1 this is block_idx itself (no sort), empty slots carrying bits = 0.
  """
  b, t, kh, n = block_idx.shape
  if tq == 1:
    valid = block_idx >= 0
    return (jnp.where(valid, block_idx, 0), valid.astype(jnp.int32),
            jnp.full((b, t, kh, 1), n, jnp.int32))
  nt = cdiv(t, tq)
  x = jnp.pad(block_idx, ((0, 0), (0, nt * tq - t), (0, 0), (0, 0)), constant_values=-1)
  x = x.reshape(b, nt, tq, kh, n).transpose(0, 1, 3, 2, 4)  # [B, nT, K, tq, n]
  flat = jnp.where(x < 0, BIG, x).reshape(b, nt, kh, tq * n)  # token-major: entry e is token e // n
  s = jnp.sort(flat, axis=-1, stable=False)
  dup = jnp.concatenate([jnp.zeros_like(s[..., :1], bool), s[..., 1:] == s[..., :-1]], axis=-1)
  s = jnp.sort(jnp.where(dup, BIG, s), axis=-1, stable=False)
  cnt = jnp.sum(s < BIG, axis=-1).astype(jnp.int32)
  # Each (token, slot) entry sets its token's bit at its block's place in the union (a token's valid
  # blocks are distinct, so adding bits is or-ing them).
  u = tq * n
  tok_bit = jnp.where(flat < BIG, 1 << (jnp.arange(u, dtype=jnp.int32) // n), 0)
  place = jax.vmap(lambda srt, q: search_sorted(srt, q))(s.reshape(-1, u), flat.reshape(-1, u))
  bits = jax.vmap(lambda p, v: jnp.zeros((u + 1,), jnp.int32).at[p].add(v))(place, tok_bit.reshape(-1, u))
  bits = bits[:, :u].reshape(b, nt, kh, u)
  return jnp.where(s < BIG, s, 0), bits, cnt[..., None]


def inverse_lists(block_idx, num_blocks, chunk):
  """Inverse selection map, cut into work items of at most `chunk` entries.

  Returns (all per [B, K, ...], int32):
    tokens [B, K, T*n]: query positions sorted by (block, position) (the entries);
    item_blk, item_start, item_end [B, K, W]: block and entry range of each work item (empty: start = end);
    blk_first, blk_items [B, K, NB]: first work item of each block and how many it has.
  Items of a block are contiguous and ordered, so a fixed-order sum over them is deterministic.
  """
  b, t, kh, n = block_idx.shape
  if num_blocks * t >= 2 ** 31:
    raise ValueError(f"T={t} too long for int32 (block, position) keys")
  pos = jnp.arange(t, dtype=jnp.int32)[None, :, None, None]
  key = jnp.where(block_idx >= 0, block_idx * t + pos, num_blocks * t)
  key = jnp.sort(key.transpose(0, 2, 1, 3).reshape(b, kh, t * n), axis=-1, stable=False)
  tokens = key % t
  bounds = jnp.arange(num_blocks + 1, dtype=jnp.int32) * t
  starts = jax.vmap(jax.vmap(lambda k: search_sorted(k, bounds, side="left")))(key).astype(jnp.int32)
  cnt = starts[..., 1:] - starts[..., :-1]  # [B, K, NB]
  blk_items = cdiv(cnt, chunk).astype(jnp.int32)
  item_end_cum = jnp.cumsum(blk_items, axis=-1)
  blk_first = (item_end_cum - blk_items).astype(jnp.int32)
  w_total = cdiv(t * n, chunk) + num_blocks
  w = jnp.arange(w_total, dtype=jnp.int32)
  blk = jax.vmap(jax.vmap(lambda c: search_sorted(c, w, side="right")))(item_end_cum).astype(jnp.int32)
  live = blk < num_blocks
  blk_c = jnp.minimum(blk, num_blocks - 1)
  local = w - jnp.take_along_axis(blk_first, blk_c, axis=-1)
  s0 = jnp.take_along_axis(starts[..., :-1], blk_c, axis=-1) + local * chunk
  s1 = jnp.minimum(s0 + chunk, jnp.take_along_axis(starts[..., 1:], blk_c, axis=-1))
  item_start = jnp.where(live, s0, 0).astype(jnp.int32)
  item_end = jnp.where(live, s1, 0).astype(jnp.int32)
  return tokens.astype(jnp.int32), blk_c, item_start, item_end, blk_first, blk_items


# ----------------------------------------------------------------------------- in-kernel pieces

def tile_rows(tile, kk, *, tq, g, m, t, h):
  """Rows of a query tile (tq tokens x g heads of KV group kk, padded to m rows).

  Padding rows (r >= tq*g) and positions past T are exact copies of a real row (same position, head
  and token slot), so they compute bitwise the same values and every store can stay unmasked: no
  masked-off lane aliases a real row (the CPU interpreter's scatter would race on such duplicates).
  Returns tok [m] (token slot in the tile), pos [m] (query position), row [m] (row of the [T*H, D]
  view of q/o/dq).
  """
  r = jax.lax.iota(jnp.int32, m)
  if m > tq * g:
    r = r % (tq * g)
  pos = jnp.minimum(tile * tq + r // g, t - 1)
  return pos - tile * tq, pos, pos * h + kk * g + r % g


def load_pieces(ref, rows, pieces):
  """[len(rows), size] loads of each power-of-two column piece of a [N, D] ref."""
  return [ref[rows, pl.ds(off, size)] for off, size in pieces]


def dot_pieces(a_pieces, b_pieces):
  """sum_i a_i @ b_i^T in float32 (the contraction split into power-of-two pieces)."""
  acc = None
  for a, b in zip(a_pieces, b_pieces):
    d = plgpu.dot(a, b, trans_b=True)
    acc = d if acc is None else acc + d
  return acc


def kv_steps(blk, kk, k_ref, v_ref, seg_ref, *, bk, block_size, t, kh, dk_pieces, dv_pieces,
             has_seg):
  """Per l'-block of the selection kernels, its key steps: (key positions, K pieces, V pieces, key
  segment ids or None)."""
  for sub in range(block_size // bk):
    kpos, krow = key_rows(blk, sub, kk, bk=bk, block_size=block_size, t=t, kh=kh)
    seg_k = seg_ref[jnp.minimum(kpos, t - 1)] if has_seg else None
    yield kpos, load_pieces(k_ref, krow, dk_pieces), load_pieces(v_ref, krow, dv_pieces), seg_k


def union_block(ub_ref, bits_ref, cnt, i, j, bps, tok):
  """Block j of loop step i of a union walk that takes bps blocks a step: (block, rows_on), rows_on
  = the rows whose token picked it. Past the tile's count the last slot is read again with every
  row off (bps > 1 only)."""
  u = jnp.minimum(i * bps + j, ub_ref.shape[0] - 1)
  rows_on = ((bits_ref[u] >> tok) & 1) == 1
  if bps > 1:
    rows_on = rows_on & (i * bps + j < cnt)
  return ub_ref[u], rows_on


def key_rows(blk, sub, kk, *, bk, block_size, t, kh):
  """Key positions [bk] of step `sub` of block blk and their rows in the [T*K, D] view of k/v."""
  kpos = blk * block_size + sub * bk + jax.lax.iota(jnp.int32, bk)
  return kpos, jnp.minimum(kpos, t - 1) * kh + kk


def visible(rows_on, pos, kpos, seg_q=None, seg_k=None):
  """[m, bk] mask: row switched on, causal (key <= query) and same segment."""
  vis = rows_on[:, None] & (kpos[None, :] <= pos[:, None])
  if seg_q is not None:
    vis = vis & (seg_q[:, None] == seg_k[None, :])
  return vis


def store_rows(ref, rows, off, val):
  """ref[rows, off:off+size] = val (rows [m]); all-array indices, the form that both the Triton
  lowering and the CPU interpreter accept for a row scatter."""
  cols = off + jax.lax.iota(jnp.int32, val.shape[1])
  plgpu.store(ref.at[rows[:, None], cols[None, :]], val)


def atomic_add_rows(ref, rows, off, val):
  """Atomic ref[rows, off:off+size] += val. Keep `rows` distinct: on a GPU duplicates add up, but
  the CPU interpreter (jax 0.11.2) keeps one of their writes; masks it does not interpret."""
  cols = off + jax.lax.iota(jnp.int32, val.shape[1])
  plgpu.atomic_add(ref, (rows[:, None], cols[None, :]), val)


def softmax_step(state, s, vs):
  """One online-softmax step (shared by every kernel): fold base-2 logits s [m, bk] (-inf where
  masked) and values vs into the state (running max, running sum, accumulators)."""
  return softmax_steps(state, [(s, vs)])


def softmax_steps(state, steps, return_p=False):
  """Fold several (logits, values) pairs into the state with one shared rescale. return_p: also
  the steps' probabilities p = exp2(s - m_new) (m_new = 0 where a row saw nothing), as a list."""
  m_i, l_i, accs = state
  m_new = m_i
  for s, _ in steps:
    m_new = jnp.maximum(m_new, jnp.max(s, axis=1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked row so far: avoid inf - inf
  alpha = jnp.exp2(m_i - m_use)
  l_i = l_i * alpha
  accs = tuple(a * alpha[:, None] for a in accs)
  ps = []
  for s, vs in steps:
    p = jnp.exp2(s - m_use[:, None])
    ps.append(p)
    pv = p.astype(vs[0].dtype)
    accs = tuple(a + plgpu.dot(pv, vp) for a, vp in zip(accs, vs))
    l_i = l_i + jnp.sum(p, axis=1)
  return ((m_new, l_i, accs), ps) if return_p else (m_new, l_i, accs)
