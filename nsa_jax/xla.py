"""Memory-sane plain-JAX NSA: the whole op computed in query chunks, never a [T, T] tensor.

Computes what `nsa_jax.reference` computes (same masks, same top-n tie-breaking, same -1 padding)
but walks the queries in chunks of C = `query_chunk` with `lax.map`:
- compression + selection: each chunk attends to all Nc compressed keys ([C, H, Nc] logits), remaps
  the probabilities onto selection blocks with a strided band sum (Eq. 9), sums them over each KV
  group (Eq. 10) and takes the top n (Eq. 11); scores never exist for all T at once;
- selection: each chunk gathers only its queries' n chosen blocks ([C, K, n * l'] keys);
- window: each chunk attends to a band of C + w - 1 keys.
Chunk bodies are rematerialised (`jax.checkpoint`), so the backward pass stores only the chunk
inputs, not the gathered keys or the logits of every chunk. Peak memory is
O(C * (H * Nc + K * n * l' * (d_k + d_v) + H * (C + w))) on top of the O(T) inputs and outputs.
This is the path for CPU and for backends without the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax import reference
from nsa_jax.config import NSAConfig
from nsa_jax.reference import _segments

DEFAULT_QUERY_CHUNK = 512


# ----------------------------------------------------------------------------- chunking

def _chunking(t, query_chunk):
  """(chunk length C, number of chunks N, padded length N * C) for T queries."""
  c = max(1, min(query_chunk, t))
  n = -(-t // c)
  return c, n, n * c


def _to_chunks(x, c, n, mode="constant", fill=0):
  """[B, T, ...] -> [N, B, C, ...], padding time to N * C."""
  pad = [(0, 0), (0, n * c - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  x = jnp.pad(x, pad, mode=mode) if mode == "edge" else jnp.pad(x, pad, constant_values=fill)
  return jnp.moveaxis(x.reshape(x.shape[0], n, c, *x.shape[2:]), 1, 0)


def _from_chunks(y, t):
  """[N, B, C, ...] -> [B, T, ...], dropping the padded queries."""
  y = jnp.moveaxis(y, 0, 1)
  return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :t]


def _f32(x):
  """Upcast an operand that every chunk reads (closed over by the loop): the backward pass then
  sums the per-chunk gradients in float32. A bf16 running sum over hundreds of chunks would drop
  the small contributions. Bodies cast back to the input dtype, so the forward is unchanged."""
  return None if x is None else x.astype(jnp.float32)


def _map_chunks(body, xs):
  # Remat each chunk: the backward pass recomputes the gathered keys and logits of one chunk at a
  # time instead of storing them for all chunks. prevent_cse is only needed outside loops.
  return jax.lax.map(jax.checkpoint(body, prevent_cse=False), xs)


# ----------------------------------------------------------------------------- scoring (Eq. 9-11)

def cmp_to_sel_banded(p_cmp, num_sel, cfg: NSAConfig):
  """Eq. 9 as a strided band sum: [..., Nc] -> [..., Ns], equal to p_cmp @ cmp_to_sel_weights.

  Selection block j receives p_cmp[base_j - k] with weight #{(m, n): m + n = k, m < l'/d, n < l/d}
  for k < l'/d + l/d - 1, where base_j = (l'/d) j ("literal") or (l'/d)(j + 1) - 1 ("overlap").
  Costs O(Ns * (l' + l) / d) instead of the dense O(Nc * Ns) matmul.
  """
  if cfg.score_alignment not in ("overlap", "literal"):
    raise ValueError(f"score_alignment={cfg.score_alignment!r}: expected 'overlap' or 'literal'")
  r, c = cfg.sel_block // cfg.cmp_stride, cfg.cmp_block // cfg.cmp_stride
  off = r - 1 if cfg.score_alignment == "overlap" else 0
  left = r + c - 2  # zeros standing for compression blocks before block 0
  nc = p_cmp.shape[-1]
  # r * Ns >= T / d >= Nc, so the right pad is never negative.
  pads = [(0, 0)] * (p_cmp.ndim - 1) + [(left, r * num_sel - nc)]
  padded = jnp.pad(p_cmp.astype(jnp.float32), pads)
  out = None
  for k in reversed(range(r + c - 1)):  # ascending compression index, like the dense matmul
    weight = min(k, r - 1, c - 1, r + c - 2 - k) + 1
    start = left + off - k
    term = jax.lax.slice_in_dim(padded, start, start + r * (num_sel - 1) + 1, stride=r, axis=-1)
    term = term * float(weight)
    out = term if out is None else out + term
  return out


def select_blocks_at(scores, positions, doc_first_block, cfg: NSAConfig):
  """reference.select_blocks for a chunk of queries at absolute `positions` [C].

  scores [B, C, K, Ns]; doc_first_block [B, C]: selection block holding each query's document start.
  Returns [B, C, K, n] int32, ascending, -1 in empty slots; ties go to the lower block index.
  """
  ns = scores.shape[-1]
  cur = (positions // cfg.sel_block)[None, :, None]  # [1, C, 1]
  first = doc_first_block[:, :, None]  # [B, C, 1]
  j = jnp.arange(ns)[None, None, :]
  eligible = (j <= cur) & (j >= first)
  forced = ((j < first + cfg.num_init_blocks) | (j > cur - cfg.num_local_blocks)) & eligible
  s = jnp.where(forced[:, :, None], jnp.inf, jax.lax.stop_gradient(scores))
  s = jnp.where(eligible[:, :, None], s, -jnp.inf)
  n_eff = min(cfg.num_selected, ns)
  vals, idx = jax.lax.top_k(s, n_eff)  # stable: equal scores keep the lower index first
  idx = jnp.sort(jnp.where(vals == -jnp.inf, ns, idx), axis=-1)
  idx = jnp.where(idx == ns, -1, idx).astype(jnp.int32)
  pad = [(0, 0)] * 3 + [(0, cfg.num_selected - n_eff)]
  return jnp.pad(idx, pad, constant_values=-1)


def quest_block_bounds(k, sel_block):
  """Per selection block channel max and min of the keys: kmax, kmin [B, K, Ns, Dk] float32."""
  b, t, kh, dk = k.shape
  ns = -(-t // sel_block)
  pad = ns * sel_block - t
  kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  kb = kp.reshape(b, ns, sel_block, kh, dk)
  valid = (np.arange(ns * sel_block) < t).reshape(1, ns, sel_block, 1, 1)
  kmax = jnp.max(jnp.where(valid, kb, -jnp.inf), axis=2).transpose(0, 2, 1, 3)
  kmin = jnp.min(jnp.where(valid, kb, jnp.inf), axis=2).transpose(0, 2, 1, 3)
  return kmax, kmin


def quest_scores_chunk(q, kmax, kmin):
  """reference.quest_scores for a chunk q [B, C, H, Dk]: [B, C, K, Ns].

  sum_d max(q_d kmax_d, q_d kmin_d) = max(q, 0) . kmax + min(q, 0) . kmin (kmax >= kmin), two
  matmuls instead of a [C, H, Ns, Dk] product tensor.
  """
  b, c, h, dk = q.shape
  kh = kmax.shape[1]
  qg = q.astype(jnp.float32).reshape(b, c, kh, h // kh, dk)
  hi = jax.lax.Precision.HIGHEST  # no TF32: the ranking should not depend on the backend
  return (jnp.einsum("bckgd,bknd->bckn", jnp.maximum(qg, 0.0), kmax, precision=hi)
          + jnp.einsum("bckgd,bknd->bckn", jnp.minimum(qg, 0.0), kmin, precision=hi))


# ----------------------------------------------------------------------------- compression + top-n

def _cmp_block_meta(seg, cfg: NSAConfig):
  """Per compressed block: last raw position [Nc], segment of its first token [B, Nc], and whether
  the block lies inside one document [B, Nc] (the pieces of reference.cmp_visible_mask)."""
  pos = reference.cmp_block_positions(seg.shape[1], cfg.cmp_block, cfg.cmp_stride)
  seg_blk = seg[:, pos]  # [B, Nc, l]
  pure = jnp.all(seg_blk == seg_blk[:, :, :1], axis=-1)
  return jnp.asarray(pos[:, -1]), seg_blk[:, :, 0], pure


def _cmp_and_select(q, k_cmp, v_cmp, k_slc, cfg: NSAConfig, seg, scale, want_cmp, want_idx):
  """Chunked compression attention and/or top-n block selection; unwanted outputs are None."""
  b, t, h, dk = q.shape
  kh = cfg.num_kv_heads
  c, n, _ = _chunking(t, cfg.query_chunk)
  ns = cfg.num_sel_blocks(t)
  nc = 0 if k_cmp is None else k_cmp.shape[1]
  need_p = want_idx and cfg.selector == "nsa"
  run_cmp = (want_cmp or need_p) and nc > 0
  if run_cmp:
    ends, seg_first, pure = _cmp_block_meta(seg, cfg)
    k_dtype, v_dtype = k_cmp.dtype, v_cmp.dtype
    k_cmp32, v_cmp32 = _f32(k_cmp), _f32(v_cmp)
  if want_idx and cfg.selector == "quest":
    kmax, kmin = quest_block_bounds(k_slc, cfg.sel_block)
  doc_first = reference.document_starts(seg) // cfg.sel_block
  xs = (jnp.arange(n) * c, _to_chunks(q, c, n), _to_chunks(seg, c, n, "edge"),
        _to_chunks(doc_first, c, n, "edge"))

  def body(x):
    c0, q_c, seg_c, first_c = x
    positions = c0 + jnp.arange(c)
    out, scores = {}, None
    if run_cmp:
      visible = ((positions[:, None] >= ends[None, :])[None]
                 & (seg_c[:, :, None] == seg_first[:, None, :]) & pure[:, None, :])[:, None]
      k_c, v_c = k_cmp32.astype(k_dtype), v_cmp32.astype(v_dtype)
      out["o"], out["lse"] = reference.masked_attention(q_c, k_c, v_c, visible, scale)
      if need_p:
        p_cmp = reference.compression_probs(q_c, k_c, out["lse"], visible, scale)
        p_slc = cmp_to_sel_banded(p_cmp, ns, cfg)  # [B, C, H, Ns]
        scores = p_slc.reshape(b, c, kh, h // kh, ns).sum(axis=3)  # Eq. 10
    if want_idx:
      if cfg.selector == "quest":
        scores = quest_scores_chunk(q_c, kmax, kmin)
      elif scores is None:  # no compressed block at all (T < l): only forced blocks matter
        scores = jnp.zeros((b, c, kh, ns), jnp.float32)
      out["idx"] = select_blocks_at(scores, positions, first_c, cfg)
    return out

  ys = _map_chunks(body, xs)
  o = lse = idx = None
  if want_cmp:
    if run_cmp:
      o, lse = _from_chunks(ys["o"], t), _from_chunks(ys["lse"], t)
    else:
      o = jnp.zeros((b, t, h, v_cmp.shape[-1]), q.dtype)
      lse = jnp.full((b, t, h), -jnp.inf, jnp.float32)
  if want_idx:
    idx = _from_chunks(ys["idx"], t)
  return o, lse, idx


def compressed_attention_and_select(q, k_cmp, v_cmp, k_slc, cfg: NSAConfig, segment_ids=None,
                                    scale=None):
  """Compression branch and top-n selection, chunked over queries.

  q [B, T, H, Dk]; k_cmp [B, Nc, K, Dk]; v_cmp [B, Nc, K, Dv]; k_slc [B, T, K, Dk] (used only by
  cfg.selector == "quest"). Returns o_cmp [B, T, H, Dv] (q's dtype), lse_cmp [B, T, H] float32
  (-inf with no visible block) and block_idx [B, T, K, n] int32, equal to
  reference.compressed_attention followed by reference.selection_scores / quest_scores and
  reference.select_blocks. block_idx carries no gradient (top-n is not differentiable).
  """
  b, t = q.shape[:2]
  seg = _segments(segment_ids, b, t)
  return _cmp_and_select(q, k_cmp, v_cmp, k_slc, cfg, seg, scale, want_cmp=True, want_idx=True)


# ----------------------------------------------------------------------------- selection branch

def _unique_slots(block_idx, num_sel):
  """[..., n] bool: slot holds a real block (0 <= j < Ns) not already listed in an earlier slot;
  the reference's one-hot mask counts a repeated block once."""
  n = block_idx.shape[-1]
  ok = (block_idx >= 0) & (block_idx < num_sel)
  earlier = np.tril(np.ones((n, n), bool), -1)  # [m, m'] = m' < m
  dup = jnp.any((block_idx[..., :, None] == block_idx[..., None, :]) & earlier, axis=-1)
  return ok & ~dup


def _attend(logits, mask, v, out_dtype):
  """Masked softmax over the last axis, then p @ v, NaN-free like reference.masked_attention.

  logits [B, K, G, C, S] float32; mask broadcastable to it; v [B, K, C, S, Dv].
  Returns o [B, C, K, G, Dv] (out_dtype) and lse [B, K, G, C] float32.
  """
  logits = jnp.where(mask, logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.where(mask, jnp.exp(logits - mx), 0.0)
  s = jnp.sum(e, axis=-1, keepdims=True)
  s_safe = jnp.where(s > 0, s, 1.0)
  lse = jnp.where(s > 0, jnp.log(s_safe) + mx, -jnp.inf)[..., 0]
  p = (e / s_safe).astype(v.dtype)
  o = jnp.einsum("bkgcs,bkcsd->bckgd", p, v, preferred_element_type=jnp.float32)
  return o.astype(out_dtype), lse


def select_attention(q, k, v, block_idx, block_size, segment_ids=None, scale=None, *,
                     query_chunk=DEFAULT_QUERY_CHUNK):
  """Selection branch (Eq. 12), gathering only the selected blocks of each query chunk.

  q [B, T, H, Dk]; k [B, T, K, Dk]; v [B, T, K, Dv]; block_idx [B, T, K, n] int32 (-1 = empty).
  Returns o [B, T, H, Dv] (q's dtype), lse [B, T, H] float32, like reference.select_attention.
  """
  b, t, h, dk = q.shape
  kh, dv, n_sel = k.shape[2], v.shape[-1], block_idx.shape[-1]
  scale = dk ** -0.5 if scale is None else scale
  seg = _segments(segment_ids, b, t)
  c, n, _ = _chunking(t, query_chunk)
  ns = -(-t // block_size)
  tb = ns * block_size

  def blocks(x):  # [B, T, K, D] -> [B, K, Ns, l', D]
    x = jnp.pad(x, ((0, 0), (0, tb - t), (0, 0), (0, 0)))
    return x.reshape(b, ns, block_size, kh, x.shape[-1]).transpose(0, 3, 1, 2, 4)

  k_blk, v_blk = blocks(_f32(k)), blocks(_f32(v))
  seg_blk = jnp.pad(seg, ((0, 0), (0, tb - t)), mode="edge").reshape(b, ns, block_size)
  take = jax.vmap(lambda a, i: a[i])  # per batch row: a [Ns, ...], i [M] -> [M, ...]
  take_bk = jax.vmap(take)  # per batch row and KV head
  xs = (jnp.arange(n) * c, _to_chunks(q, c, n), _to_chunks(seg, c, n, "edge"),
        _to_chunks(block_idx, c, n, fill=-1))

  def body(x):
    c0, q_c, seg_c, idx_c = x
    positions = c0 + jnp.arange(c)
    use = _unique_slots(idx_c, ns)  # [B, C, K, n]
    safe = jnp.clip(idx_c, 0, ns - 1)
    gather_idx = safe.transpose(0, 2, 1, 3).reshape(b, kh, c * n_sel)
    k_g = take_bk(k_blk, gather_idx).astype(k.dtype).reshape(b, kh, c, n_sel * block_size, dk)
    v_g = take_bk(v_blk, gather_idx).astype(v.dtype).reshape(b, kh, c, n_sel * block_size, dv)
    key_pos = safe[..., None] * block_size + jnp.arange(block_size)  # [B, C, K, n, l']
    key_seg = take(seg_blk, safe.reshape(b, -1)).reshape(key_pos.shape)
    mask = (use[..., None] & (key_pos <= positions[None, :, None, None, None])
            & (key_seg == seg_c[:, :, None, None, None]))
    mask = mask.reshape(b, c, kh, -1).transpose(0, 2, 1, 3)[:, :, None]  # [B, K, 1, C, S]
    qg = q_c.reshape(b, c, kh, h // kh, dk)
    logits = jnp.einsum("bckgd,bkcsd->bkgcs", qg, k_g, preferred_element_type=jnp.float32) * scale
    o, lse = _attend(logits, mask, v_g, q.dtype)
    return o.reshape(b, c, h, dv), lse.transpose(0, 3, 1, 2).reshape(b, c, h)

  o, lse = _map_chunks(body, xs)
  return _from_chunks(o, t), _from_chunks(lse, t)


# ----------------------------------------------------------------------------- window branch

def window_attention(q, k, v, window, segment_ids=None, scale=None, *,
                     query_chunk=DEFAULT_QUERY_CHUNK):
  """Sliding-window branch, banded: the chunk of queries [c0, c0 + C) attends to the keys
  [c0 - w + 1, c0 + C) of the same document within (t - w, t]. Returns o, lse like
  reference.window_attention."""
  b, t = q.shape[:2]
  seg = _segments(segment_ids, b, t)
  c, n, tp = _chunking(t, query_chunk)
  band = min(c + window - 1, tp)  # a window longer than T needs no more than all keys
  front = band - c
  pad_t = ((0, 0), (front, tp - t), (0, 0), (0, 0))
  k_pad, v_pad = jnp.pad(_f32(k), pad_t), jnp.pad(_f32(v), pad_t)
  seg_pad = jnp.pad(seg, ((0, 0), (front, tp - t)), mode="edge")
  xs = (jnp.arange(n) * c, _to_chunks(q, c, n), _to_chunks(seg, c, n, "edge"))

  def body(x):
    c0, q_c, seg_c = x
    positions = c0 + jnp.arange(c)
    k_b = jax.lax.dynamic_slice_in_dim(k_pad, c0, band, axis=1).astype(k.dtype)  # from c0 - front
    v_b = jax.lax.dynamic_slice_in_dim(v_pad, c0, band, axis=1).astype(v.dtype)
    seg_b = jax.lax.dynamic_slice_in_dim(seg_pad, c0, band, axis=1)
    key_pos = c0 - front + jnp.arange(band)
    near = ((key_pos[None, :] >= 0) & (key_pos[None, :] <= positions[:, None])
            & (positions[:, None] - key_pos[None, :] < window))
    mask = (near[None] & (seg_c[:, :, None] == seg_b[:, None, :]))[:, None]  # [B, 1, C, band]
    return reference.masked_attention(q_c, k_b, v_b, mask, scale)

  o, lse = _map_chunks(body, xs)
  return _from_chunks(o, t), _from_chunks(lse, t)


# ----------------------------------------------------------------------------- the whole op

def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg: NSAConfig,
                  segment_ids=None, scale=None, return_aux=False):
  """The whole NSA op (Eq. 5), memory-sane; same contract as reference.nsa_attention.

  q [B, T, H, Dk]; k_cmp/v_cmp [B, Nc, K, D]; k_slc/v_slc, k_win/v_win [B, T, K, D];
  gates [B, T, H, 3] in (cmp, slc, win) order. Returns o [B, T, H, Dv] (q's dtype) and, with
  return_aux, a dict with the block indices and per-branch outputs.
  """
  reference.check_nsa_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids)
  b, t = q.shape[:2]
  seg = _segments(segment_ids, b, t)
  want_idx = "slc" in cfg.branches
  # Like the reference, the compression branch also runs when it only feeds the NSA selector.
  want_cmp = "cmp" in cfg.branches or (want_idx and cfg.selector == "nsa")
  outs, aux = {}, {}
  if want_cmp or want_idx:
    o_cmp, _, idx = _cmp_and_select(q, k_cmp, v_cmp, k_slc, cfg, seg, scale, want_cmp, want_idx)
    if want_cmp:
      outs["cmp"] = o_cmp
  if want_idx:
    outs["slc"], _ = select_attention(q, k_slc, v_slc, idx, cfg.sel_block, seg, scale,
                                      query_chunk=cfg.query_chunk)
    aux["block_idx"] = idx
  if "win" in cfg.branches:
    outs["win"], _ = window_attention(q, k_win, v_win, cfg.window, seg, scale,
                                      query_chunk=cfg.query_chunk)
  o = reference.combine(outs, gates, cfg.branches).astype(q.dtype)
  if return_aux:
    aux["outputs"] = outs
    return o, aux
  return o
