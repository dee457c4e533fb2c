"""Memory-sane plain-JAX NSA: the whole op computed in query chunks, never a [T, T] tensor.

Computes what `nsa_jax.reference` computes (same masks, same top-n tie-breaking, same -1 padding)
but walks the queries in chunks of C = `query_chunk` with `lax.map`:
- compression + selection: each chunk attends to all Nc compressed keys ([C, H, Nc] logits), remaps
  the probabilities onto selection blocks with a strided band sum (Eq. 9), sums them over each KV
  group (Eq. 10) and takes the top n (Eq. 11); scores never exist for all T at once;
- selection: each chunk gathers only its queries' n chosen blocks ([C, K, n * l'] keys);
- window: each chunk attends to a band of C + w - 1 keys.
`nsa_attention` runs all three branches and the gated sum in ONE loop, so only the gated output
(not three branch outputs) is stored per token. Chunk bodies are rematerialised (`jax.checkpoint`):
the backward pass keeps the chunk inputs, not the gathered keys or logits of every chunk. Scratch
memory is O(C * (H * Nc + K * n * l' * (d_k + d_v) + H * (C + w))) on top of O(T) inputs/outputs.
This is the path for CPU and for backends without the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax import reference
from nsa_jax.config import NSAConfig, num_cmp_blocks
from nsa_jax.reference import _segments
from nsa_jax.xla_scores import (cmp_to_sel_banded, quest_block_bounds, quest_scores_chunk,
                                select_blocks_at)

DEFAULT_QUERY_CHUNK = 512

__all__ = ["compressed_attention_and_select", "select_attention", "window_attention",
           "nsa_attention", "cmp_to_sel_banded", "select_blocks_at"]


# ----------------------------------------------------------------------------- chunking

def _chunking(t, query_chunk):
  """(chunk length C, number of chunks N) for T queries."""
  c = max(1, min(query_chunk, t))
  return c, -(-t // c)


def _to_chunks(x, c, n, fill=0):
  """[B, T, ...] -> [N, B, C, ...], padding time to N * C ("edge" repeats the last token)."""
  if x is None:
    return None
  pad = [(0, 0), (0, n * c - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  x = jnp.pad(x, pad, mode="edge") if fill == "edge" else jnp.pad(x, pad, constant_values=fill)
  return jnp.moveaxis(x.reshape(x.shape[0], n, c, *x.shape[2:]), 1, 0)


def _from_chunks(y, t):
  """[N, B, C, ...] -> [B, T, ...], dropping the padded queries."""
  y = jnp.moveaxis(y, 0, 1)
  return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :t]


def _query_chunks(q, segment_ids, c, n, sel_block=None):
  """The per-chunk loop inputs: chunk start c0 [N], q [N, B, C, H, Dk], seg [N, B, C] (None
  without packing) and, with sel_block, first [N, B, C]: the selection block where each query's
  document starts. Padded queries (past T) are computed and dropped."""
  xs = dict(c0=jnp.arange(n) * c, q=_to_chunks(q, c, n), seg=_to_chunks(segment_ids, c, n, "edge"))
  if sel_block is not None and segment_ids is not None:
    xs["first"] = _to_chunks(reference.document_starts(segment_ids) // sel_block, c, n, "edge")
  return xs


def _check_segments(segment_ids, b, t):
  # Validate the shape, but keep None: without packing every segment mask term is skipped.
  return None if segment_ids is None else _segments(segment_ids, b, t)


def _f32(x):
  """Upcast an operand that every chunk reads (closed over by the loop): the backward pass then
  sums the per-chunk gradients in float32. A bf16 running sum over hundreds of chunks would drop
  the small contributions. Chunk bodies cast back to the input dtype: the forward is unchanged."""
  return None if x is None else x.astype(jnp.float32)


def _map_chunks(body, xs):
  # Remat each chunk: the backward pass recomputes the gathered keys and logits of one chunk at a
  # time instead of storing them for all chunks. prevent_cse is only needed outside loops.
  return jax.lax.map(jax.checkpoint(body, prevent_cse=False), xs)


# ----------------------------------------------------------------------------- compression + top-n

def _cmp_select_chunk_fn(q, k_cmp, v_cmp, k_slc, cfg: NSAConfig, seg, scale, want_cmp, want_idx):
  """fn(x) -> {"o", "lse"} (compression branch, if want_cmp) and {"idx"} (top-n, if want_idx) for
  one chunk x of _query_chunks(..., sel_block)."""
  b, t, h, _ = q.shape
  kh = cfg.num_kv_heads
  ns = cfg.num_sel_blocks(t)
  nc = 0 if k_cmp is None else k_cmp.shape[1]
  need_p = want_idx and cfg.selector == "nsa"
  run_cmp = (want_cmp or need_p) and nc > 0
  if run_cmp:
    pos = reference.cmp_block_positions(t, cfg.cmp_block, cfg.cmp_stride)  # [Nc, l]
    ends = jnp.asarray(pos[:, -1])
    if seg is not None:  # the pieces of reference.cmp_visible_mask that do not depend on t
      seg_blk = seg[:, pos]
      seg_first = seg_blk[:, :, 0]
      pure = jnp.all(seg_blk == seg_blk[:, :, :1], axis=-1)
    k_cmp32, v_cmp32 = _f32(k_cmp), _f32(v_cmp)
  if want_idx and cfg.selector == "quest":
    kmax, kmin = quest_block_bounds(k_slc, cfg.sel_block)

  def chunk(x):
    q_c = x["q"]
    c = q_c.shape[1]
    positions = x["c0"] + jnp.arange(c)
    out, scores = {}, None
    if run_cmp:
      visible = (positions[:, None] >= ends[None, :])[None]  # [1, C, Nc]
      if seg is not None:
        visible = visible & (x["seg"][:, :, None] == seg_first[:, None, :]) & pure[:, None, :]
      visible = visible[:, None]
      k_c, v_c = k_cmp32.astype(k_cmp.dtype), v_cmp32.astype(v_cmp.dtype)
      out["o"], out["lse"] = reference.masked_attention(q_c, k_c, v_c, visible, scale)
      if need_p:
        p_cmp = reference.compression_probs(q_c, k_c, out["lse"], visible, scale)
        p_slc = cmp_to_sel_banded(p_cmp, ns, cfg)  # [B, C, H, Ns]
        scores = p_slc.reshape(b, c, kh, h // kh, ns).sum(axis=3)  # Eq. 10
    elif want_cmp:  # no compressed block (T < l): zero output, like the reference
      out["o"] = jnp.zeros((b, c, h, v_cmp.shape[-1]), q.dtype)
      out["lse"] = jnp.full((b, c, h), -jnp.inf, jnp.float32)
    if want_idx:
      if cfg.selector == "quest":
        scores = quest_scores_chunk(q_c, kmax, kmin)
      elif scores is None:  # no compressed block at all: only the forced blocks matter
        scores = jnp.zeros((b, c, kh, ns), jnp.float32)
      out["idx"] = select_blocks_at(scores, positions, x.get("first"), cfg)
    return out

  return chunk


def compressed_attention_and_select(q, k_cmp, v_cmp, k_slc, cfg: NSAConfig, segment_ids=None,
                                    scale=None):
  """Compression branch and top-n selection, chunked over queries.

  q [B, T, H, Dk]; k_cmp [B, Nc, K, Dk]; v_cmp [B, Nc, K, Dv]; k_slc [B, T, K, Dk] (read only when
  cfg.selector == "quest"). Returns o_cmp [B, T, H, Dv] (q's dtype), lse_cmp [B, T, H] float32
  (-inf with no visible block) and block_idx [B, T, K, n] int32, equal to
  reference.compressed_attention, then reference.selection_scores (or quest_scores) and
  reference.select_blocks. block_idx carries no gradient (top-n is not differentiable).
  """
  b, t = q.shape[:2]
  seg = _check_segments(segment_ids, b, t)
  c, n = _chunking(t, cfg.query_chunk)
  fn = _cmp_select_chunk_fn(q, k_cmp, v_cmp, k_slc, cfg, seg, scale, True, True)
  ys = _map_chunks(fn, _query_chunks(q, seg, c, n, cfg.sel_block))
  return _from_chunks(ys["o"], t), _from_chunks(ys["lse"], t), _from_chunks(ys["idx"], t)


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
  p, lse = reference.masked_softmax(logits, mask)
  p = p.astype(v.dtype)
  o = jnp.einsum("bkgcs,bkcsd->bckgd", p, v, preferred_element_type=jnp.float32)
  return o.astype(out_dtype), lse


def _select_chunk_fn(q, k, v, block_size, seg, scale):
  """fn(x, idx [B, C, K, n]) -> (o [B, C, H, Dv], lse [B, C, H]) for one chunk x of queries."""
  b, t, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[-1]
  scale = dk ** -0.5 if scale is None else scale
  ns = -(-t // block_size)
  tb = ns * block_size

  def blocks(x):  # [B, T, K, D] -> [B, K, Ns, l', D]
    x = jnp.pad(x, ((0, 0), (0, tb - t), (0, 0), (0, 0)))
    return x.reshape(b, ns, block_size, kh, x.shape[-1]).transpose(0, 3, 1, 2, 4)

  k_blk, v_blk = blocks(_f32(k)), blocks(_f32(v))
  if seg is not None:
    seg_blk = jnp.pad(seg, ((0, 0), (0, tb - t)), mode="edge").reshape(b, ns, block_size)
  take = jax.vmap(lambda a, i: a[i])  # per batch row: a [Ns, ...], i [M] -> [M, ...]
  take_bk = jax.vmap(take)  # per batch row and KV head

  def chunk(x, idx):
    q_c = x["q"]
    c, n_sel = q_c.shape[1], idx.shape[-1]
    positions = x["c0"] + jnp.arange(c)
    safe = jnp.clip(idx, 0, ns - 1)
    gather_idx = safe.transpose(0, 2, 1, 3).reshape(b, kh, c * n_sel)
    k_g = take_bk(k_blk, gather_idx).astype(k.dtype).reshape(b, kh, c, n_sel * block_size, dk)
    v_g = take_bk(v_blk, gather_idx).astype(v.dtype).reshape(b, kh, c, n_sel * block_size, dv)
    key_pos = safe[..., None] * block_size + jnp.arange(block_size)  # [B, C, K, n, l']
    mask = _unique_slots(idx, ns)[..., None] & (key_pos <= positions[None, :, None, None, None])
    if seg is not None:
      key_seg = take(seg_blk, safe.reshape(b, -1)).reshape(key_pos.shape)
      mask = mask & (key_seg == x["seg"][:, :, None, None, None])
    mask = mask.reshape(b, c, kh, -1).transpose(0, 2, 1, 3)[:, :, None]  # [B, K, 1, C, S]
    qg = q_c.reshape(b, c, kh, h // kh, dk)
    logits = jnp.einsum("bckgd,bkcsd->bkgcs", qg, k_g, preferred_element_type=jnp.float32) * scale
    o, lse = _attend(logits, mask, v_g, q.dtype)
    return o.reshape(b, c, h, dv), lse.transpose(0, 3, 1, 2).reshape(b, c, h)

  return chunk


def select_attention(q, k, v, block_idx, block_size, segment_ids=None, scale=None, *,
                     query_chunk=DEFAULT_QUERY_CHUNK):
  """Selection branch (Eq. 12), gathering only the selected blocks of each query chunk.

  q [B, T, H, Dk]; k [B, T, K, Dk]; v [B, T, K, Dv]; block_idx [B, T, K, n] int32 (-1 = empty;
  repeated or out-of-range entries are ignored like the reference's one-hot mask does).
  Returns o [B, T, H, Dv] (q's dtype), lse [B, T, H] float32, like reference.select_attention.
  """
  b, t = q.shape[:2]
  seg = _check_segments(segment_ids, b, t)
  if block_idx.ndim != 4 or tuple(block_idx.shape[:3]) != tuple(k.shape[:3]):
    raise ValueError(f"block_idx has shape {tuple(block_idx.shape)}, expected [B, T, K, n] = "
                     f"{tuple(k.shape[:3])} + (n,). Fix: one list of n blocks per token and KV head.")
  reference.require_integers(block_idx, "block_idx", "block indices (-1 for an empty slot)",
                             "pass an int32 array.")
  c, n = _chunking(t, query_chunk)
  fn = _select_chunk_fn(q, k, v, block_size, seg, scale)
  xs = _query_chunks(q, seg, c, n)
  xs["idx"] = _to_chunks(block_idx, c, n, fill=-1)
  o, lse = _map_chunks(lambda x: fn(x, x["idx"]), xs)
  return _from_chunks(o, t), _from_chunks(lse, t)


# ----------------------------------------------------------------------------- window branch

def _window_chunk_fn(q, k, v, window, seg, scale, c, n):
  """fn(x) -> (o, lse) for one chunk x of C queries: keys [c0 - w + 1, c0 + C) only."""
  t = q.shape[1]
  band = min(c + window - 1, n * c)  # a window longer than T needs no more than all keys
  front = band - c
  pad_t = ((0, 0), (front, n * c - t), (0, 0), (0, 0))
  k_pad, v_pad = jnp.pad(_f32(k), pad_t), jnp.pad(_f32(v), pad_t)
  if seg is not None:
    seg_pad = jnp.pad(seg, ((0, 0), (front, n * c - t)), mode="edge")

  def chunk(x):
    c0 = x["c0"]
    positions = c0 + jnp.arange(c)
    k_b = jax.lax.dynamic_slice_in_dim(k_pad, c0, band, axis=1).astype(k.dtype)  # from c0 - front
    v_b = jax.lax.dynamic_slice_in_dim(v_pad, c0, band, axis=1).astype(v.dtype)
    key_pos = c0 - front + jnp.arange(band)
    mask = ((key_pos[None, :] >= 0) & (key_pos[None, :] <= positions[:, None])
            & (positions[:, None] - key_pos[None, :] < window))[None]  # [1, C, band]
    if seg is not None:
      seg_b = jax.lax.dynamic_slice_in_dim(seg_pad, c0, band, axis=1)
      mask = mask & (x["seg"][:, :, None] == seg_b[:, None, :])
    return reference.masked_attention(x["q"], k_b, v_b, mask[:, None], scale)

  return chunk


def window_attention(q, k, v, window, segment_ids=None, scale=None, *,
                     query_chunk=DEFAULT_QUERY_CHUNK):
  """Sliding-window branch, banded: a chunk of queries [c0, c0 + C) reads only the keys
  [c0 - w + 1, c0 + C). Returns o [B, T, H, Dv], lse [B, T, H] like reference.window_attention."""
  b, t = q.shape[:2]
  seg = _check_segments(segment_ids, b, t)
  c, n = _chunking(t, query_chunk)
  o, lse = _map_chunks(_window_chunk_fn(q, k, v, window, seg, scale, c, n),
                       _query_chunks(q, seg, c, n))
  return _from_chunks(o, t), _from_chunks(lse, t)


# ----------------------------------------------------------------------------- the whole op

def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg: NSAConfig,
                  segment_ids=None, scale=None, return_aux=False, block_idx=None):
  """The whole NSA op (Eq. 5), memory-sane; same contract as reference.nsa_attention.

  q [B, T, H, Dk]; k_cmp/v_cmp [B, Nc, K, D]; k_slc/v_slc, k_win/v_win [B, T, K, D];
  gates [B, T, H, 3] in (cmp, slc, win) order. Returns o [B, T, H, Dv] (q's dtype) and, with
  return_aux, a dict with the block indices and per-branch outputs.
  """
  reference.check_nsa_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids)
  reference.check_block_idx(block_idx, q, cfg)
  b, t = q.shape[:2]
  seg = _check_segments(segment_ids, b, t)
  c, n = _chunking(t, cfg.query_chunk)
  want_idx = "slc" in cfg.branches
  given_idx = block_idx is not None  # selector="aux"'s gate, or an override (select_edit)
  # Like the reference, the compression branch also runs when it only feeds the NSA selector.
  want_cmp = "cmp" in cfg.branches or (want_idx and cfg.selector == "nsa")
  if want_cmp or (want_idx and not given_idx):
    cmp_fn = _cmp_select_chunk_fn(q, k_cmp, v_cmp, k_slc, cfg, seg, scale, want_cmp,
                                  want_idx and not given_idx)
  if want_idx:
    slc_fn = _select_chunk_fn(q, k_slc, v_slc, cfg.sel_block, seg, scale)
  if "win" in cfg.branches:
    win_fn = _window_chunk_fn(q, k_win, v_win, cfg.window, seg, scale, c, n)

  def chunk(x):  # all branches and the gated sum of one chunk: only o leaves the loop
    outs, aux = {}, {}
    r = cmp_fn(x) if want_cmp or (want_idx and not given_idx) else {}
    if want_cmp:
      outs["cmp"] = r["o"]
    if given_idx:
      r["idx"] = x["idx"]
    if want_idx:
      outs["slc"], _ = slc_fn(x, r["idx"])
      aux["block_idx"] = r["idx"]
    if "win" in cfg.branches:
      outs["win"], _ = win_fn(x)
    o = reference.combine(outs, x["gates"], cfg.branches).astype(q.dtype)
    if return_aux:
      aux["outputs"] = outs
      return o, aux
    return o

  xs = _query_chunks(q, seg, c, n, cfg.sel_block)
  xs["gates"] = _to_chunks(gates, c, n)
  if given_idx:
    xs["idx"] = _to_chunks(block_idx, c, n, "edge")
  ys = _map_chunks(chunk, xs)
  if return_aux:
    return jax.tree.map(lambda y: _from_chunks(y, t), ys)
  return _from_chunks(ys, t)


# ----------------------------------------------------------------------------- compression (phi)
# The reference gathers the overlapping blocks ([B, Nc, l, K, D], each key copied l/d times) and
# its gradient is a scatter-add back onto [B, T, K, D]. With l = m * d (NSAConfig enforces it)
# block i is the m consecutive stride-d chunks i .. i+m-1, so phi's first layer is a sum of m
# shifted per-chunk matmuls: no gather, no scatter, the same FLOPs. (At the 8k training step the
# gathered form cost ~10 ms of 234 a step, profiled on the H200, 2026-11-30.)


def _chunks(x, block, stride):
  """x [B, T, K, D] -> chunks [B, Nc + m - 1, d, K, D] (the stride-d chunks the blocks cover)."""
  b, t, kh, dim = x.shape
  nc = num_cmp_blocks(t, block, stride)
  n = nc + block // stride - 1
  return x[:, :n * stride].reshape(b, n, stride, kh, dim), nc


def mean_compress(x, block, stride):
  """`reference.mean_compress` without the gather: mean of the m chunk means of each block."""
  if block % stride or x.shape[1] < block:
    return reference.mean_compress(x, block, stride)
  m = block // stride
  c, nc = _chunks(x, block, stride)
  s = jnp.sum(c.astype(jnp.float32), axis=2)  # [B, Nc + m - 1, K, D]
  tot = sum(s[:, j:j + nc] for j in range(m))
  return (tot / block).astype(x.dtype)


def mlp_compress(x, params, block, stride):
  """`reference.mlp_compress` without the gather (same parameters, same result up to rounding).

  h_i = silu(sum_j chunk_{i+j} @ W1[j] + pos @ W1 + b1), accumulated in float32; the position
  encoding's share pos @ W1 is one vector for every block.
  """
  if block % stride or x.shape[1] < block:
    return reference.mlp_compress(x, params, block, stride)
  m = block // stride
  c, nc = _chunks(x, block, stride)
  b, n, d, kh, dim = c.shape
  hidden = params["w1"].shape[-1]
  flat = c.transpose(0, 1, 3, 2, 4).reshape(b, n, kh, d * dim)
  w1 = params["w1"].astype(x.dtype).reshape(m, d * dim, hidden)
  z = jnp.einsum("bnkf,mfh->bnkmh", flat, w1, preferred_element_type=jnp.float32)
  pre = sum(z[:, j:j + nc, :, j] for j in range(m))
  pos = params["pos"].astype(jnp.float32).reshape(-1) @ params["w1"].astype(jnp.float32)
  pre = pre + pos + params["b1"].astype(jnp.float32)
  h = jax.nn.silu(pre.astype(x.dtype))
  return h @ params["w2"].astype(x.dtype) + params["b2"].astype(x.dtype)
