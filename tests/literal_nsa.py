"""A literal NSA oracle: plain Python loops over tokens, heads and blocks, numpy float64.

Written straight from /work/shared/NSA.md (Yuan et al. 2025, Eq. 7-12), not from
nsa_jax/reference.py, and it imports nothing from nsa_jax, so it cannot inherit the reference's
mistakes. Every rule is spelled out where it is used, one query at a time. It is slow on purpose:
use shapes of a few hundred tokens at most.

Layout: q [B, T, H, Dk]; raw k [B, T, K, Dk], v [B, T, K, Dv]; compressed k/v [B, Nc, K, D];
query head h belongs to KV group h // (H // K). segment_ids [B, T] (None: one document) mark packed
documents: a document is a contiguous run of one id, so an id that comes back after another id
starts a new document (4 | 9 | 4 is three documents). Positions s and t share a document iff s
lies between t's doc_start and doc_end, found by walking the row; ids are never compared across a
gap.
"""

from __future__ import annotations

import math

import numpy as np

BRANCHES = ("cmp", "slc", "win")  # gate channel order


# ----------------------------------------------------------------------------- small helpers

def _f64(x):
  return np.asarray(x, np.float64)


def _segments(segment_ids, b, t):
  if segment_ids is None:
    return np.zeros((b, t), np.int64)
  return np.asarray(segment_ids)


def doc_start(seg_row, t):
  """First position of the document (contiguous run of one segment id) holding position t."""
  s = t
  while s > 0 and seg_row[s - 1] == seg_row[t]:
    s -= 1
  return s


def doc_end(seg_row, t):
  """Last position of the document holding position t."""
  s = t
  while s + 1 < len(seg_row) and seg_row[s + 1] == seg_row[t]:
    s += 1
  return s


def attend(q, keys, values, scale, dv):
  """Softmax attention of one query over lists of key/value vectors.

  Returns (o [Dv], lse, probabilities). With no key: o = 0, lse = -inf (the spec's zero output).
  """
  if not keys:
    return np.zeros(dv), -math.inf, []
  logits = [scale * float(np.dot(q, k)) for k in keys]
  mx = max(logits)
  e = [math.exp(x - mx) for x in logits]
  z = sum(e)
  p = [x / z for x in e]
  o = np.zeros(dv)
  for pi, vi in zip(p, values):
    o += pi * vi
  return o, mx + math.log(z), p


# ----------------------------------------------------------------------------- compression (Eq. 7)

def num_cmp_blocks(t_len, l, d):
  """Blocks i with [i*d, i*d + l) inside [0, T)."""
  n = 0
  while n * d + l <= t_len:
    n += 1
  return n


def mean_compress(x, l, d):
  """x [B, T, K, D] -> [B, Nc, K, D]: block i is the mean of raw positions i*d .. i*d + l - 1."""
  x = _f64(x)
  b, t, kh, dim = x.shape
  nc = num_cmp_blocks(t, l, d)
  out = np.zeros((b, nc, kh, dim))
  for bi in range(b):
    for i in range(nc):
      for k in range(kh):
        acc = np.zeros(dim)
        for p in range(l):
          acc += x[bi, i * d + p, k]
        out[bi, i, k] = acc / l
  return out


def _silu(x):
  return x / (1.0 + np.exp(-x))


def mlp_compress(x, params, l, d):
  """phi: for each block and KV head, add pos[p] to the p-th raw key of the block, flatten the l
  keys in order (p-major), then w2 . silu(w1 . flat + b1) + b2.

  params: pos [l, D], w1 [l*D, F], b1 [F], w2 [F, Dout], b2 [Dout]. Returns [B, Nc, K, Dout].
  """
  x = _f64(x)
  pos, w1, b1, w2, b2 = (_f64(params[n]) for n in ("pos", "w1", "b1", "w2", "b2"))
  b, t, kh, _ = x.shape
  nc = num_cmp_blocks(t, l, d)
  out = np.zeros((b, nc, kh, w2.shape[1]))
  for bi in range(b):
    for i in range(nc):
      for k in range(kh):
        flat = []
        for p in range(l):
          flat.extend(x[bi, i * d + p, k] + pos[p])
        hidden = _silu(np.asarray(flat) @ w1 + b1)
        out[bi, i, k] = hidden @ w2 + b2
  return out


def cmp_block_visible(seg_row, t, i, l, d):
  """Query t sees compressed block i iff the block ends at or before t (i*d + l - 1 <= t) and all
  l raw positions of the block are in t's document."""
  if i * d + l - 1 > t:
    return False
  return doc_start(seg_row, t) <= i * d and i * d + l - 1 <= doc_end(seg_row, t)


def compressed_attention(q, k_cmp, v_cmp, l, d, segment_ids=None, scale=None):
  """Compression branch. Returns o [B, T, H, Dv], lse [B, T, H], p_cmp [B, T, H, Nc] (Eq. 8)."""
  q, k_cmp, v_cmp = _f64(q), _f64(k_cmp), _f64(v_cmp)
  b, t_len, h_num, dk = q.shape
  nc, kh, dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[3]
  g = h_num // kh
  scale = dk ** -0.5 if scale is None else scale
  seg = _segments(segment_ids, b, t_len)
  o = np.zeros((b, t_len, h_num, dv))
  lse = np.full((b, t_len, h_num), -math.inf)
  p_cmp = np.zeros((b, t_len, h_num, nc))
  for bi in range(b):
    for t in range(t_len):
      vis = [i for i in range(nc) if cmp_block_visible(seg[bi], t, i, l, d)]
      for h in range(h_num):
        kv = h // g
        o[bi, t, h], lse[bi, t, h], p = attend(
            q[bi, t, h], [k_cmp[bi, i, kv] for i in vis], [v_cmp[bi, i, kv] for i in vis], scale, dv)
        for i, pi in zip(vis, p):
          p_cmp[bi, t, h, i] = pi
  return o, lse, p_cmp


# ----------------------------------------------------------------------------- scoring (Eq. 9-10)

def eq9_cmp_indices(j, l, d, lsel, alignment):
  """Compression block indices summed into selection block j (with repeats), Eq. 9:
  overlap: (l'/d)(j+1) - 1 - m - n; literal (printed): (l'/d) j - m - n; m < l'/d, n < l/d."""
  out = []
  for m in range(lsel // d):
    for n in range(l // d):
      if alignment == "overlap":
        out.append((lsel // d) * (j + 1) - 1 - m - n)
      elif alignment == "literal":
        out.append((lsel // d) * j - m - n)
      else:
        raise ValueError(alignment)
  return out


def selection_scores(p_cmp, num_kv_heads, t_len, l, d, lsel, alignment="overlap"):
  """[B, T, K, Ns]: per query, Eq. 9 remap of each head's p_cmp, summed over the group's heads
  (Eq. 10, probabilities not logits). Out-of-range compression indices are skipped."""
  p_cmp = _f64(p_cmp)
  b, n_queries, h_num, nc = p_cmp.shape
  g = h_num // num_kv_heads
  ns = -(-t_len // lsel)  # selection blocks of a sequence of t_len tokens
  scores = np.zeros((b, n_queries, num_kv_heads, ns))
  for bi in range(b):
    for t in range(n_queries):
      for kv in range(num_kv_heads):
        for j in range(ns):
          s = 0.0
          for h in range(kv * g, (kv + 1) * g):
            for i in eq9_cmp_indices(j, l, d, lsel, alignment):
              if 0 <= i < nc:
                s += p_cmp[bi, t, h, i]
          scores[bi, t, kv, j] = s
  return scores


# ----------------------------------------------------------------------------- top-n (Eq. 11)

def select_one(scores_row, t, seg_row, lsel, n, n_init, n_local):
  """Blocks chosen for query t from scores_row [Ns]. Returns (sorted block list, margin).

  Eligible: j*l' <= t and block [j*l', (j+1)*l') overlaps t's document. Forced (counted inside n):
  the first n_init blocks of the document (from floor(doc_start / l')) and the n_local blocks
  ending with the one holding t, when eligible. The remaining slots go to the highest scores,
  ties to the lower index; fewer eligible blocks than n: all of them. `margin` is the score gap
  between the last block chosen by score and the first one left out (inf when no choice was made).
  """
  ns = len(scores_row)
  ds, de = doc_start(seg_row, t), doc_end(seg_row, t)
  eligible = [j for j in range(ns)
              if j * lsel <= t and j * lsel <= de and (j + 1) * lsel - 1 >= ds]
  first, cur = ds // lsel, t // lsel
  forced = {first + a for a in range(n_init)} | {cur - a for a in range(n_local)}
  forced = {j for j in forced if j in eligible}
  rest = sorted((j for j in eligible if j not in forced), key=lambda j: (-scores_row[j], j))
  slots = n - len(forced)
  assert slots >= 0, "more forced blocks than n"
  chosen = sorted(forced | set(rest[:slots]))
  margin = math.inf
  if 0 < slots < len(rest):
    margin = float(scores_row[rest[slots - 1]] - scores_row[rest[slots]])
  return chosen, margin


def select_blocks(scores, lsel, n, n_init=1, n_local=2, segment_ids=None):
  """[B, T, K, Ns] scores -> block indices [B, T, K, n] (ascending, -1 padding), margins [B, T, K]."""
  scores = _f64(scores)
  b, t_len, kh, _ = scores.shape
  seg = _segments(segment_ids, b, t_len)
  idx = np.full((b, t_len, kh, n), -1, np.int64)
  margin = np.full((b, t_len, kh), math.inf)
  for bi in range(b):
    for t in range(t_len):
      for kv in range(kh):
        chosen, margin[bi, t, kv] = select_one(scores[bi, t, kv], t, seg[bi], lsel, n, n_init,
                                               n_local)
        idx[bi, t, kv, :len(chosen)] = chosen
  return idx, margin


# ----------------------------------------------------------------------------- raw-key branches

def _raw_branch(q, k, v, visible, segment_ids, scale):
  """Attention of each (b, t, h) over raw positions s with visible(bi, t, kv, s) true."""
  q, k, v = _f64(q), _f64(k), _f64(v)
  b, t_len, h_num, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  g = h_num // kh
  scale = dk ** -0.5 if scale is None else scale
  seg = _segments(segment_ids, b, t_len)
  o = np.zeros((b, t_len, h_num, dv))
  lse = np.full((b, t_len, h_num), -math.inf)
  for bi in range(b):
    for t in range(t_len):
      first, last = doc_start(seg[bi], t), doc_end(seg[bi], t)  # t's document
      for h in range(h_num):
        kv = h // g
        keys = [s for s in range(t_len) if visible(bi, t, kv, s) and s <= t
                and first <= s <= last]
        o[bi, t, h], lse[bi, t, h], _ = attend(
            q[bi, t, h], [k[bi, s, kv] for s in keys], [v[bi, s, kv] for s in keys], scale, dv)
  return o, lse


def select_attention(q, k, v, block_idx, lsel, segment_ids=None, scale=None):
  """Selection branch (Eq. 12): raw keys s of the selected blocks (s // l' in the set, -1 ignored),
  with s <= t and s in t's document."""
  block_idx = np.asarray(block_idx)
  sets = {}

  def visible(bi, t, kv, s):
    key = (bi, t, kv)
    if key not in sets:
      sets[key] = {int(j) for j in block_idx[bi, t, kv] if j >= 0}
    return s // lsel in sets[key]

  return _raw_branch(q, k, v, visible, segment_ids, scale)


def window_attention(q, k, v, w, segment_ids=None, scale=None):
  """Sliding-window branch: raw keys s in (t - w, t] of t's document."""
  return _raw_branch(q, k, v, lambda bi, t, kv, s: t - w < s, segment_ids, scale)


def causal_attention(q, k, v, segment_ids=None, scale=None):
  """Full causal attention inside each document."""
  return _raw_branch(q, k, v, lambda bi, t, kv, s: True, segment_ids, scale)


# ----------------------------------------------------------------------------- the whole op

def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, *, l, d, lsel, n, w,
                  n_init=1, n_local=2, alignment="overlap", branches=BRANCHES, segment_ids=None,
                  scale=None, block_idx=None):
  """o_t = sum_c g_c * o_c over `branches`; gates [B, T, H, 3] in (cmp, slc, win) order.

  block_idx: optional [B, T, K, n] to use instead of this oracle's own top-n (the caller decides
  near-ties; see select_one's margin). Returns o [B, T, H, Dv] float64 and a dict of every
  intermediate (p_cmp, scores, block_idx, margin, per-branch outputs and lse).
  """
  gates = _f64(gates)
  t_len, kh = q.shape[1], k_slc.shape[2]
  aux = {}
  o_cmp, aux["lse_cmp"], aux["p_cmp"] = compressed_attention(q, k_cmp, v_cmp, l, d, segment_ids,
                                                             scale)
  aux["scores"] = selection_scores(aux["p_cmp"], kh, t_len, l, d, lsel, alignment)
  aux["block_idx"], aux["margin"] = select_blocks(aux["scores"], lsel, n, n_init, n_local,
                                                  segment_ids)
  use_idx = aux["block_idx"] if block_idx is None else np.asarray(block_idx)
  o_slc, aux["lse_slc"] = select_attention(q, k_slc, v_slc, use_idx, lsel, segment_ids, scale)
  o_win, aux["lse_win"] = window_attention(q, k_win, v_win, w, segment_ids, scale)
  aux["outputs"] = {"cmp": o_cmp, "slc": o_slc, "win": o_win}
  o = np.zeros_like(o_win)
  for name in branches:
    c = BRANCHES.index(name)
    o += gates[..., c:c + 1] * aux["outputs"][name]
  return o, aux
