"""Reference NSA math in plain JAX: small, dense-mask based, obviously right.

Every piece of NSA (Yuan et al. 2025, Eq. 7-12) is a function here, so users, the memory-sane
plain-JAX path (`nsa_jax.xla`) and the Pallas kernels can be tested one piece at a time. This
file builds [T, T] masks: use it for checking, not for long sequences.

Layout follows `jax.nn.dot_product_attention`: q [B, T, H, d_k], k [B, S, K, d_k],
v [B, S, K, d_v]; head h belongs to KV group h // (H // K).
Segment ids [B, T] mark packed documents: each contiguous run of one id is a document
(document_runs; an id that comes back later in a row starts another document).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import NSAConfig, num_cmp_blocks

BRANCH_ORDER = ("cmp", "slc", "win")  # order of the gate channels


# ----------------------------------------------------------------------------- generic attention

def masked_attention(q, k, v, mask, scale=None):
  """Softmax attention of q over k/v where `mask` allows it.

  Args:
    q: [B, T, H, Dk]; k: [B, S, K, Dk]; v: [B, S, K, Dv]; H a multiple of K.
    mask: bool, broadcastable to [B, K, T, S] (per KV group) or [B, 1, T, S].
    scale: logit scale, default 1/sqrt(Dk).
  Returns:
    o [B, T, H, Dv] in q's dtype, lse [B, T, H] float32. A query with no allowed key gets o = 0
    and lse = -inf (never NaN, also in gradients).
  """
  b, t, h, dk = q.shape
  kh = k.shape[2]
  if h % kh:
    raise ValueError(f"q has {h} heads, not a multiple of k's {kh} KV heads")
  scale = dk ** -0.5 if scale is None else scale
  qg = q.reshape(b, t, kh, h // kh, dk)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  m = jnp.broadcast_to(mask, (b, mask.shape[1], t, k.shape[1]))[:, :, None]
  p, lse = masked_softmax(logits, m)  # lse [B, K, G, T]
  o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  o = o.reshape(b, t, h, v.shape[-1]).astype(q.dtype)
  lse = lse.transpose(0, 3, 1, 2).reshape(b, t, h)
  return o, lse


def masked_softmax(logits, mask):
  """Softmax over the last axis where `mask` allows, NaN-free: a row with nothing allowed gets p = 0
  and lse = -inf, and finite gradients. Returns p (float32) and lse (float32, last axis dropped)."""
  logits = jnp.where(mask, logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.where(mask, jnp.exp(logits - mx), 0.0)
  s = jnp.sum(e, axis=-1, keepdims=True)
  s_safe = jnp.where(s > 0, s, 1.0)
  return e / s_safe, jnp.where(s > 0, jnp.log(s_safe) + mx, -jnp.inf)[..., 0]


def document_runs(segment_ids):
  """[B, T] int32: each token's document as the index (0, 1, 2, ...) of its contiguous run of equal
  ids in the row. A document is a run: an id used again after another one starts a new document
  (packed documents; jax.nn.dot_product_attention instead lets equal ids anywhere see each other).
  Every NSA and dense attention path reads the ids through this, so they agree on any ids: the
  paths that compare ids and the kernels that take each row's document start (the Mosaic
  selection kernels, cuDNN's packed layout) then see the same documents, under jit as eagerly."""
  # host ids (numpy, lists) are compared at their own width before jax sees them: jax without x64
  # would wrap 64-bit ids (2**32 onto 0) and merge documents. Under jit the ids arrive as jax
  # arrays, already narrowed: convert 64-bit ids with this on the host before a jitted call.
  seg = segment_ids if isinstance(segment_ids, jax.Array) else np.asarray(segment_ids)
  change = jnp.asarray(seg[:, 1:] != seg[:, :-1], jnp.int32)
  return jnp.concatenate([jnp.zeros((seg.shape[0], min(1, seg.shape[1])), jnp.int32),  # T = 0, 1
                          jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def _segments(segment_ids, b, t):
  if segment_ids is None:
    return jnp.zeros((b, t), jnp.int32)
  return segment_runs(segment_ids, (b, t))


def document_starts(segment_ids):
  """[B, T] position where each token's document begins (segments are contiguous runs)."""
  t = segment_ids.shape[1]
  pos = jnp.arange(t)
  boundary = jnp.concatenate(
      [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return jax.lax.cummax(jnp.where(boundary, pos, 0), axis=1)


def causal_mask(segment_ids):
  """[B, 1, T, T]: key s visible to query t iff s <= t and same document (ids compared as given:
  the callers pass document_runs ids, so a document is a run)."""
  t = segment_ids.shape[1]
  pos = jnp.arange(t)
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (same & (pos[None, :, None] >= pos[None, None, :]))[:, None]


def window_mask(segment_ids, window):
  """[B, 1, T, T]: key s visible iff t - window < s <= t and same document (ids as causal_mask)."""
  t = segment_ids.shape[1]
  pos = jnp.arange(t)
  near = pos[:, None] - pos[None, :] < window
  return causal_mask(segment_ids) & near[None, None]


# ----------------------------------------------------------------------------- compression (Eq. 7)

def cmp_block_positions(seq_len, block, stride):
  """[Nc, l] raw positions of each compression block: block i covers [i*d, i*d + l)."""
  n = num_cmp_blocks(seq_len, block, stride)
  return np.arange(n)[:, None] * stride + np.arange(block)[None, :]


def cmp_block_view(x, block, stride):
  """[B, T, K, D] -> [B, Nc, l, K, D] (overlapping blocks, gathered)."""
  return x[:, cmp_block_positions(x.shape[1], block, stride)]


def mean_compress(x, block, stride):
  """Mean pooling over each block (the common simplification; an ablation here)."""
  return jnp.mean(cmp_block_view(x, block, stride), axis=2)


def mlp_compress(x, params, block, stride):
  """The paper's phi: an MLP over the flattened block after adding a learned position encoding.

  params: pos [l, D], w1 [l*D, F], b1 [F], w2 [F, D_out], b2 [D_out]; shared by all KV heads.
  Returns [B, Nc, K, D_out].
  """
  blocks = cmp_block_view(x, block, stride) + params["pos"].astype(x.dtype)[:, None, :]
  b, nc, l, kh, d = blocks.shape
  flat = blocks.transpose(0, 1, 3, 2, 4).reshape(b, nc, kh, l * d)
  h = jax.nn.silu(flat @ params["w1"].astype(x.dtype) + params["b1"].astype(x.dtype))
  return h @ params["w2"].astype(x.dtype) + params["b2"].astype(x.dtype)


def cmp_visible_mask(segment_ids, block, stride):
  """[B, 1, T, Nc]: query t sees compressed block i iff i*d + l - 1 <= t and the whole block lies
  in t's document (a block that straddles a document boundary is seen by nobody; ids compared as
  given, as causal_mask)."""
  t = segment_ids.shape[1]
  pos = cmp_block_positions(t, block, stride)
  if pos.shape[0] == 0:
    return jnp.zeros((segment_ids.shape[0], 1, t, 0), bool)
  seg_blk = segment_ids[:, pos]  # [B, Nc, l]
  pure = jnp.all(seg_blk == seg_blk[:, :, :1], axis=-1)
  ends = pos[:, -1]
  past = np.arange(t)[:, None] >= ends[None, :]
  same = segment_ids[:, :, None] == seg_blk[:, None, :, 0]
  return (past[None] & same & pure[:, None, :])[:, None]


def compressed_attention(q, k_cmp, v_cmp, block, stride, segment_ids=None, scale=None):
  """Compression branch: attention over the visible compressed blocks.

  q [B, T, H, Dk]; k_cmp [B, Nc, K, Dk]; v_cmp [B, Nc, K, Dv].
  Returns o [B, T, H, Dv], lse [B, T, H] (f32, -inf with no visible block), and the softmax
  probabilities p_cmp [B, T, H, Nc] (Eq. 8; zero rows where nothing is visible).
  """
  b, t, h, dk = q.shape
  seg = _segments(segment_ids, b, t)
  nc = k_cmp.shape[1]
  if nc == 0:
    return (jnp.zeros((b, t, h, v_cmp.shape[-1]), q.dtype), jnp.full((b, t, h), -jnp.inf),
            jnp.zeros((b, t, h, 0), jnp.float32))
  mask = cmp_visible_mask(seg, block, stride)
  o, lse = masked_attention(q, k_cmp, v_cmp, mask, scale)
  p = compression_probs(q, k_cmp, lse, mask, scale)
  return o, lse, p


def compression_probs(q, k_cmp, lse, mask, scale=None):
  """p_cmp [B, T, H, Nc] = exp(q.K_cmp * scale - lse) on visible blocks (Eq. 8)."""
  b, t, h, dk = q.shape
  kh = k_cmp.shape[2]
  scale = dk ** -0.5 if scale is None else scale
  qg = q.reshape(b, t, kh, h // kh, dk)
  logits = jnp.einsum("btkgd,bskd->btkgs", qg, k_cmp, preferred_element_type=jnp.float32) * scale
  logits = logits.reshape(b, t, h, -1)
  vis = jnp.broadcast_to(mask, (b, 1, t, k_cmp.shape[1]))[:, 0, :, None, :]
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
  return jnp.where(vis, jnp.exp(jnp.where(vis, logits, 0.0) - lse_safe), 0.0)


# ----------------------------------------------------------------------------- scoring (Eq. 9-10)

@functools.lru_cache(maxsize=64)
def cmp_to_sel_weights(num_cmp, num_sel, block, stride, sel_block, alignment="overlap"):
  """[Nc, Ns] integer weights of Eq. 9: p_slc[j] = sum_i W[i, j] p_cmp[i].

  Eq. 9 sums p_cmp[(l'/d) j - m - n] over m < l'/d, n < l/d ("literal"). The compression blocks
  that spatially overlap selection block j are the same pattern shifted to end at (l'/d)(j+1) - 1
  ("overlap", the default). For l=32, d=16, l'=64: literal uses blocks 4j-4..4j, overlap blocks
  4j-1..4j+3, both with weights 1, 2, 2, 2, 1.
  """
  if alignment not in ("overlap", "literal"):
    raise ValueError(f"score_alignment={alignment!r}: expected 'overlap' or 'literal'")
  r, c = sel_block // stride, block // stride
  w = np.zeros((num_cmp, num_sel), np.float32)
  for j in range(num_sel):
    base = r * j if alignment == "literal" else r * (j + 1) - 1
    for m in range(r):
      for n in range(c):
        i = base - m - n
        if 0 <= i < num_cmp:
          w[i, j] += 1
  return w


def selection_scores(p_cmp, num_kv_heads, seq_len, cfg: NSAConfig):
  """Shared block importance [B, T, K, Ns]: Eq. 9 remap, then Eq. 10 sum of probabilities over the
  query heads of each KV group."""
  b, t, h, nc = p_cmp.shape
  ns = cfg.num_sel_blocks(seq_len)
  if nc == 0:
    return jnp.zeros((b, t, num_kv_heads, ns), jnp.float32)
  w = cmp_to_sel_weights(nc, ns, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.score_alignment)
  p_slc = jnp.einsum("bthi,ij->bthj", p_cmp.astype(jnp.float32), jnp.asarray(w))
  return p_slc.reshape(b, t, num_kv_heads, h // num_kv_heads, ns).sum(axis=3)


def quest_scores(q, k, sel_block, segment_ids=None):
  """Quest-style heuristic importance [B, T, K, Ns] (paper section 6.1 ablation): for each selection
  block, sum over channels of max(q * k_max, q * k_min), summed over the group's heads.

  segment_ids is not read: a block's key bounds span the whole block, so with packed documents a
  block straddling a document start scores with the earlier document's keys too (the choice only:
  select_blocks and the attention mask keep other documents out; docs/STATUS.md, known gaps). The
  argument keeps the selectors' common signature."""
  b, t, h, dk = q.shape
  kh = k.shape[2]
  ns = -(-t // sel_block)
  pad = ns * sel_block - t
  kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  valid = jnp.pad(jnp.ones((t,), bool), (0, pad)).reshape(ns, sel_block)[None, :, :, None, None]
  kb = kp.reshape(b, ns, sel_block, kh, dk)
  kmax = jnp.max(jnp.where(valid, kb, -jnp.inf), axis=2)
  kmin = jnp.min(jnp.where(valid, kb, jnp.inf), axis=2)
  qg = q.astype(jnp.float32).reshape(b, t, kh, h // kh, 1, dk)
  kmax = kmax.transpose(0, 2, 1, 3)[:, None, :, None]  # [B, 1, K, 1, Ns, Dk]
  kmin = kmin.transpose(0, 2, 1, 3)[:, None, :, None]
  s = jnp.maximum(qg * kmax, qg * kmin)
  return jnp.sum(s, axis=(3, 5))


# ----------------------------------------------------------------------------- top-n (Eq. 11)

def select_blocks(scores, cfg: NSAConfig, segment_ids=None):
  """Top-n selection block indices [B, T, K, n] (int32; -1 in empty slots), ascending.

  Eligible blocks for query t: j*l' <= t and the block overlaps t's document. Forced (counted inside
  n): the first num_init_blocks blocks of t's document and the num_local_blocks blocks ending with
  the one that holds t. With fewer than n eligible blocks, all eligible blocks are used. Ties go to
  the lower block index (lax.top_k is stable).
  """
  b, t, kh, ns = scores.shape
  seg = _segments(segment_ids, b, t)
  cur = (jnp.arange(t) // cfg.sel_block)[None, :]  # [1, T]
  first = document_starts(seg) // cfg.sel_block  # [B, T]
  return topn_blocks(scores, cur, first, cfg)


def topn_blocks(scores, cur_block, first_block, cfg: NSAConfig):
  """Eq. 11 on scores [B, Q, K, Ns] for queries in selection block cur_block and whose document
  starts in first_block (both broadcastable to [B, Q]): select_blocks' rules, for any set of
  queries (the chunked path calls it per chunk)."""
  ns = scores.shape[-1]
  s = _eq11_keys(jax.lax.stop_gradient(scores), cur_block, first_block, cfg)
  n_eff = min(cfg.num_selected, ns)
  vals, idx = jax.lax.top_k(s, n_eff)  # stable: equal scores keep the lower index first
  idx = jnp.where(vals == -jnp.inf, ns, idx)
  idx = jnp.sort(idx, axis=-1)
  idx = jnp.where(idx == ns, -1, idx).astype(jnp.int32)
  if n_eff < cfg.num_selected:
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, cfg.num_selected - n_eff)), constant_values=-1)
  return idx


def _eq11_keys(scores, cur_block, first_block, cfg: NSAConfig):
  """The values Eq. 11's top-n ranks: scores, +inf for forced blocks (the first num_init_blocks of
  the query's document and the num_local_blocks ending with its own), -inf for blocks that are
  not eligible (after the query's block or before its document's first)."""
  ns = scores.shape[-1]
  cur, first = cur_block[..., None], first_block[..., None]  # [B|1, Q, 1]
  j = jnp.arange(ns)[None, None, :]
  eligible = (j <= cur) & (j >= first)
  forced = ((j < first + cfg.num_init_blocks) | (j > cur - cfg.num_local_blocks)) & eligible
  s = jnp.where(forced[:, :, None], jnp.inf, scores)
  return jnp.where(eligible[:, :, None], s, -jnp.inf)


def topn_cut_margin(scores, cur_block, first_block, cfg: NSAConfig):
  """How close Eq. 11's decision is: the smallest relative gap, over queries and KV heads, between
  the lowest score top-n keeps and the highest it drops (forced and ineligible blocks excluded;
  inf where no eligible block is dropped). Arguments as topn_blocks.

  The selection is exact only up to float32 rounding of the scores: where this margin is ~1e-7,
  another summation order of Eq. 9 (the kernels and the XLA path sum in other orders than this
  reference) may keep the other block. Tests that demand identical indices redraw such inputs."""
  ns = scores.shape[-1]
  n_eff = min(cfg.num_selected, ns)
  if n_eff >= ns:
    return float("inf")
  s = _eq11_keys(scores.astype(jnp.float32), cur_block, first_block, cfg)
  vals = jax.lax.top_k(s, n_eff + 1)[0]
  kept, dropped = vals[..., n_eff - 1], vals[..., n_eff]
  contested = jnp.isfinite(kept) & jnp.isfinite(dropped)
  gap = jnp.abs(kept - dropped) / jnp.maximum(jnp.maximum(jnp.abs(kept), jnp.abs(dropped)), 1e-30)
  return float(jnp.min(jnp.where(contested, gap, jnp.inf)))


def selection_cut_margin(scores, cfg: NSAConfig, segment_ids=None):
  """topn_cut_margin for select_blocks(scores, cfg, segment_ids)'s queries."""
  b, t, kh, ns = scores.shape
  seg = _segments(segment_ids, b, t)
  return topn_cut_margin(scores, (jnp.arange(t) // cfg.sel_block)[None, :],
                         document_starts(seg) // cfg.sel_block, cfg)


# ----------------------------------------------------------------------------- branches

def selection_mask(block_idx, block_size, segment_ids):
  """[B, K, T, T]: key s visible iff its block is among t's selected blocks, s <= t, same document."""
  t = block_idx.shape[1]
  ns = -(-t // block_size)
  chosen = jnp.any(jax.nn.one_hot(block_idx, ns, dtype=jnp.bool_), axis=-2)  # [B, T, K, Ns]
  key_block = jnp.arange(t) // block_size
  per_key = chosen[..., key_block]  # [B, T, K, S]
  return per_key.transpose(0, 2, 1, 3) & causal_mask(segment_ids)


def select_attention(q, k, v, block_idx, block_size, segment_ids=None, scale=None):
  """Selection branch (Eq. 12): attention over the raw keys of the selected blocks.

  q [B, T, H, Dk]; k [B, T, K, Dk]; v [B, T, K, Dv]; block_idx [B, T, K, n] (-1 = empty slot).
  Returns o [B, T, H, Dv], lse [B, T, H] float32. This is the contract of the Pallas kernel.
  """
  b, t = q.shape[:2]
  seg = _segments(segment_ids, b, t)
  return masked_attention(q, k, v, selection_mask(block_idx, block_size, seg), scale)


def window_attention(q, k, v, window, segment_ids=None, scale=None):
  """Sliding-window branch: keys (t - w, t] of the same document. Returns o, lse."""
  b, t = q.shape[:2]
  seg = _segments(segment_ids, b, t)
  return masked_attention(q, k, v, window_mask(seg, window), scale)


def dense_causal_attention(q, k, v, segment_ids=None, scale=None):
  """Full causal attention (the dense baseline and the NSA limits' target)."""
  b, t = q.shape[:2]
  seg = _segments(segment_ids, b, t)
  return masked_attention(q, k, v, causal_mask(seg), scale)


def combine(outputs, gates, branches):
  """o = sum_c g_c * o_c over the enabled branches. gates [B, T, H, 3] in BRANCH_ORDER."""
  out = None
  for name in branches:
    c = BRANCH_ORDER.index(name)
    term = gates[..., c:c + 1].astype(jnp.float32) * outputs[name].astype(jnp.float32)
    out = term if out is None else out + term
  return out


def require_integers(x, name, what, fix, allow_bool=False):
  """TypeError unless x holds integers (or, with allow_bool, booleans): the Pallas kernels would
  truncate floats."""
  if not (jnp.issubdtype(x.dtype, jnp.integer) or (allow_bool and x.dtype == jnp.bool_)):
    raise TypeError(f"{name} has dtype {x.dtype}; {what} must be integers. Fix: {fix}")


def check_block_idx(block_idx, q, cfg: NSAConfig):
  """block_idx [B, T, K, n]: required by selector="aux" (its gate lives in NSAAttention); with the
  other selectors optional, replacing the selector's own choice (interventions: NSAAttention's
  select_edit); refused without a selection branch, which would ignore it."""
  if "slc" not in cfg.branches:
    if block_idx is not None:
      raise ValueError(f"block_idx was given but branches={cfg.branches!r} has no selection "
                       "branch to use it. Fix: drop block_idx, or add 'slc' to the branches.")
    return
  if block_idx is None:
    if cfg.selector != "aux":
      return
    raise ValueError("selector='aux' needs block_idx [B, T, K, n] from its gate "
                     "(nsa_jax.aux_selector.select); NSAAttention passes it. Fix: call the layer, "
                     "or pass block_idx= to the op.")
  require_integers(block_idx, "block_idx", "block indices (-1 for an empty slot)",
                   "pass an int32 array.")
  want = (q.shape[0], q.shape[1], cfg.num_kv_heads, cfg.num_selected)
  if tuple(block_idx.shape) != want:
    raise ValueError(f"block_idx has shape {tuple(block_idx.shape)}, expected [B, T, K, n] = "
                     f"{want}.")


def check_segment_ids(segment_ids, shape):
  """Segment ids are integer (or boolean) document ids, one per token: `shape` = (batch, time);
  each contiguous run of one id is a document (document_runs), so an id may come back later in a
  row as another document. Array-likes (nested lists) are read as numpy arrays."""
  if segment_ids is None:
    return
  if not hasattr(segment_ids, "dtype"):
    segment_ids = np.asarray(segment_ids)
  if tuple(segment_ids.shape) != tuple(shape):
    raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, expected {tuple(shape)}. "
                     "Fix: give one id per token, [batch, time].")
  require_integers(segment_ids, "segment_ids", "document ids (the Pallas kernels would "
                   "truncate 0.5 to 0)", "pass int32 ids, e.g. the cumulative count of document "
                   "starts.", allow_bool=True)


def segment_runs(segment_ids, shape):
  """Checked ids (check_segment_ids against `shape`) as document_runs: the int32 [B, T] run
  indices that every attention path reads (host ids of any width, lists too); None stays None.
  Every attention op calls this on entry."""
  if segment_ids is None:
    return None
  check_segment_ids(segment_ids, shape)
  return document_runs(segment_ids)


def host_segment_runs(segment_ids, shape):
  """For the modules: checked ids, host ids (numpy, lists) turned into their runs here, at full
  width, before anything narrows them; jax arrays pass through unchanged, since the attention ops
  convert them (segment_runs), and the modules' own use (document_starts) reads any ids."""
  if segment_ids is None or isinstance(segment_ids, jax.Array):
    check_segment_ids(segment_ids, shape)
    return segment_ids
  return segment_runs(segment_ids, shape)


def check_qkv(q, k, v, op):
  """Causal self-attention inputs (dense and window attention): q [B, T, H, d_k], k [B, T, K, d_k],
  v [B, T, K, d_v] with H a multiple of K; errors name the tensor and the fix."""
  for name, a in (("q", q), ("k", k), ("v", v)):
    if a.ndim != 4:
      raise ValueError(f"{op}: {name} must be [batch, time, heads, head_dim], got shape "
                       f"{tuple(a.shape)}. Fix: reshape it to 4 dimensions (the layout of "
                       "jax.nn.dot_product_attention).")
  b, t, h, dk = q.shape
  if k.shape[:2] != (b, t) or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} differ in "
                     "batch, time or KV heads; causal self-attention needs k and v [batch, time, "
                     "kv_heads, .] with q's batch and time. Fix: project k and v from the same "
                     "tokens as q.")
  if k.shape[3] != dk:
    raise ValueError(f"{op}: q has head dim {dk} but k has {k.shape[3]}. Fix: project q and k to "
                     "one head dim (v's may differ).")
  if h % k.shape[2]:
    raise ValueError(f"{op}: {h} query heads do not divide into {k.shape[2]} KV heads (GQA needs "
                     "a whole number of query heads per KV head). Fix: choose num_heads a "
                     "multiple of num_kv_heads.")


def check_nsa_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg: NSAConfig,
                     segment_ids=None):
  """Shape checks shared by every NSA implementation; errors name the tensor and the fix."""
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, time, heads, head_dim], got shape {q.shape}. Fix: reshape "
                     "q to 4 dimensions (layout of jax.nn.dot_product_attention).")
  b, t, h, dk = q.shape
  if t < 1 or b < 1:
    raise ValueError(f"q has shape {q.shape}: batch and time must be at least 1. Fix: pass at "
                     "least one token per sequence.")
  if h != cfg.num_heads or dk != cfg.head_dim:
    raise ValueError(f"q has {h} heads of dim {dk} but the config says num_heads={cfg.num_heads}, "
                     f"head_dim={cfg.head_dim}. Fix: reshape q or set the config to match.")
  nc = cfg.num_cmp_blocks(t)
  want = {
      "k_cmp": (b, nc, cfg.num_kv_heads, dk), "v_cmp": (b, nc, cfg.num_kv_heads, cfg.dim_v),
      "k_slc": (b, t, cfg.num_kv_heads, dk), "v_slc": (b, t, cfg.num_kv_heads, cfg.dim_v),
      "k_win": (b, t, cfg.num_kv_heads, dk), "v_win": (b, t, cfg.num_kv_heads, cfg.dim_v),
      "gates": (b, t, h, 3)}
  got = dict(k_cmp=k_cmp, v_cmp=v_cmp, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win,
             gates=gates)
  # Inputs no enabled branch reads may be None; one that is read may not (the plain-JAX path took
  # a missing k_cmp for "no compressed blocks": a zero branch and forced-only selection).
  needed = {"gates"} | ({"k_slc", "v_slc"} if "slc" in cfg.branches else set()) | (
      {"k_win", "v_win"} if "win" in cfg.branches else set())
  if "cmp" in cfg.branches or ("slc" in cfg.branches and cfg.selector == "nsa"):
    needed |= {"k_cmp", "v_cmp"}  # the NSA selector reads the compression softmax
  missing = [n for n in got if n in needed and got[n] is None]
  if missing:
    raise ValueError(f"{', '.join(missing)} is None, but branches={cfg.branches!r} with "
                     f"selector={cfg.selector!r} read it. Fix: pass it (shapes: k_cmp/v_cmp "
                     "[B, Nc, K, D] from mlp_compress, the others [B, T, K, D], gates [B, T, H, 3]), "
                     "or drop the branch that reads it.")
  for name, a in {"q": q, **got}.items():
    if a is not None and not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} has dtype {a.dtype}; NSA attention needs floating-point inputs "
                       f"(an integer {name} would give a truncated result). Fix: cast it to the "
                       "model's float dtype.")
  for name, shape in want.items():
    if got[name] is not None and tuple(got[name].shape) != shape:
      raise ValueError(f"{name} has shape {tuple(got[name].shape)}, expected {shape} "
                       f"(batch={b}, time={t}, cmp blocks={nc}, kv_heads={cfg.num_kv_heads}). Fix: "
                       f"pass {name} in that shape (compressed tensors come from mlp_compress / "
                       "mean_compress of the raw keys/values).")
  check_segment_ids(segment_ids, (b, t))


def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg: NSAConfig,
                  segment_ids=None, scale=None, return_aux=False, block_idx=None):
  """The whole NSA op (Eq. 5), reference version.

  q [B, T, H, Dk]; k_cmp/v_cmp [B, Nc, K, D] compressed keys/values (see mlp_compress);
  k_slc/v_slc, k_win/v_win [B, T, K, D] raw keys/values of the selection and window branches;
  gates [B, T, H, 3] in (cmp, slc, win) order. Returns o [B, T, H, Dv] (q's dtype) and, with
  return_aux, a dict with the block indices and per-branch outputs.
  block_idx: [B, T, K, n] blocks chosen outside the op (ascending, -1 in empty slots): required
  by selector="aux" (its gate lives in NSAAttention); with "nsa" or "quest" it replaces the
  selector's own choice (the compression branch still runs), for interventions.
  """
  check_nsa_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids)
  check_block_idx(block_idx, q, cfg)
  b, t = q.shape[:2]
  seg = _segments(segment_ids, b, t)
  outs, aux = {}, {}
  if "cmp" in cfg.branches or ("slc" in cfg.branches and cfg.selector == "nsa"):
    o_cmp, _, p_cmp = compressed_attention(q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, seg,
                                           scale)
    outs["cmp"] = o_cmp
  if "slc" in cfg.branches:
    if block_idx is not None:
      idx = block_idx
    else:
      scores = (selection_scores(p_cmp, cfg.num_kv_heads, t, cfg) if cfg.selector == "nsa"
                else quest_scores(q, k_slc, cfg.sel_block, seg))
      idx = select_blocks(scores, cfg, seg)
    outs["slc"], _ = select_attention(q, k_slc, v_slc, idx, cfg.sel_block, seg, scale)
    aux["block_idx"] = idx
  if "win" in cfg.branches:
    outs["win"], _ = window_attention(q, k_win, v_win, cfg.window, seg, scale)
  o = combine(outs, gates, cfg.branches).astype(q.dtype)
  if return_aux:
    aux["outputs"] = outs
    return o, aux
  return o
