"""The attention math of one decode step: a single new query per sequence against a KV cache.

Plain JAX, pure functions on arrays (no modules, no cache bookkeeping: see nsa_jax.decode). Each
function mirrors the parallel path (nsa_jax.reference / nsa_jax.xla) for the LAST query of a
sequence of length t + 1, so token-by-token decoding reproduces the parallel forward pass.

Layout: the query q [B, H, Dk] is already rotated; caches are head-major, [B, K, S, D], so that a
selection block is one contiguous [l', D] slab per KV head (what the Pallas decode kernel reads).
t is the new token's position, an int32 scalar shared by the whole batch (it may be traced).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from nsa_jax import ops, reference, xla
from nsa_jax.config import NSAConfig


def group_heads(q, num_kv_heads):
  """[B, H, D] -> [B, K, G, D]: head h belongs to KV group h // G, as in reference.py."""
  b, h, d = q.shape
  return q.reshape(b, num_kv_heads, h // num_kv_heads, d)


def attend(qg, k, v, mask, scale=None):
  """Masked softmax attention of one query per head over a cache.

  qg [B, K, G, Dk]; k [B, K, S, Dk]; v [B, K, S, Dv]; mask bool broadcastable to [B, K, S].
  Returns o [B, K, G, Dv] in qg's dtype and lse [B, K, G] float32; a query that sees nothing gets
  o = 0, lse = -inf (the semantics of reference.masked_attention).
  """
  scale = qg.shape[-1] ** -0.5 if scale is None else scale
  m = jnp.broadcast_to(mask, (k.shape[0], k.shape[1], k.shape[2]))[:, :, None, :]
  logits = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
  p, lse = reference.masked_softmax(logits, m)
  o = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v,
                 preferred_element_type=jnp.float32)
  return o.astype(qg.dtype), lse


# ----------------------------------------------------------------------------- compression

def num_visible_cmp(t, cfg: NSAConfig):
  """Compressed blocks fully in the past of query t: i*d + l - 1 <= t (NSA.md 1.1)."""
  return jnp.where(t >= cfg.cmp_block - 1, (t - cfg.cmp_block + 1) // cfg.cmp_stride + 1, 0)


def compressed_decode(qg, k_cmp, v_cmp, t, cfg: NSAConfig, scale=None):
  """Compression branch (Eq. 7-8) for query t over the cache's Nc slots (only visible ones count).

  Returns o [B, K, G, Dv], lse [B, K, G], p_cmp [B, K, G, Nc] (zero on invisible slots).
  """
  visible = jnp.arange(k_cmp.shape[2]) < num_visible_cmp(t, cfg)
  o, lse = attend(qg, k_cmp, v_cmp, visible, scale)
  scale = qg.shape[-1] ** -0.5 if scale is None else scale
  logits = jnp.einsum("bkgd,bksd->bkgs", qg, k_cmp, preferred_element_type=jnp.float32) * scale
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
  p = jnp.where(visible, jnp.exp(jnp.where(visible, logits, 0.0) - lse_safe), 0.0)
  return o, lse, p


# ----------------------------------------------------------------------------- selection

def nsa_block_scores(p_cmp, num_sel, cfg: NSAConfig):
  """Eq. 9 remap onto selection blocks, then Eq. 10 sum over the group's heads: [B, K, Ns].

  Slots past (l'/d) * Ns (cache padding) are never visible, so they are dropped first."""
  p_cmp = p_cmp[..., :num_sel * (cfg.sel_block // cfg.cmp_stride)]
  return xla.cmp_to_sel_banded(p_cmp, num_sel, cfg).sum(axis=2)


def quest_block_scores(qg, k_slc, t, sel_block):
  """Quest heuristic (NSA.md 2, ablation): per block channel min/max of the cached keys <= t.

  The block holding t is only partly written; it is a forced local block whenever
  num_local_blocks >= 1, so its partial bounds never decide anything.
  """
  b, kh, s, dk = k_slc.shape
  ns = s // sel_block
  kb = k_slc.astype(jnp.float32).reshape(b, kh, ns, sel_block, dk)
  live = (jnp.arange(s) <= t).reshape(1, 1, ns, sel_block, 1)
  kmax = jnp.max(jnp.where(live, kb, -jnp.inf), axis=3)
  kmin = jnp.min(jnp.where(live, kb, jnp.inf), axis=3)
  # Blocks with no live key (the future) are ineligible anyway; keep their scores finite.
  kmax, kmin = jnp.where(jnp.isfinite(kmax), kmax, 0.0), jnp.where(jnp.isfinite(kmin), kmin, 0.0)
  hi = jax.lax.Precision.HIGHEST  # as in xla.quest_scores_chunk: ranking must not depend on TF32
  q32 = qg.astype(jnp.float32)
  s_ = (jnp.einsum("bkgd,bknd->bkn", jnp.maximum(q32, 0.0), kmax, precision=hi)
        + jnp.einsum("bkgd,bknd->bkn", jnp.minimum(q32, 0.0), kmin, precision=hi))
  return s_


def select_blocks_decode(scores, t, cfg: NSAConfig):
  """Top-n block indices [B, K, n] int32 for query t (ascending, -1 in empty slots), with the
  forced initial and local blocks: reference.select_blocks for one query of one document."""
  b = scores.shape[0]
  idx = xla.select_blocks_at(scores[:, None], jnp.reshape(t, (1,)),
                             jnp.zeros((b, 1), jnp.int32), cfg)
  return idx[:, 0]


def select_decode(qg, k_slc, v_slc, block_idx, t, block_size, scale=None):
  """Selection branch (Eq. 12): gathers only the n selected blocks of each KV head.

  k_slc [B, K, S, Dk] with S a multiple of block_size; block_idx [B, K, n] (-1 = empty).
  Returns o [B, K, G, Dv], lse [B, K, G].
  """
  b, kh, s, dk = k_slc.shape
  n = block_idx.shape[-1]
  ns = s // block_size
  safe = jnp.clip(block_idx, 0, ns - 1)
  take = jax.vmap(jax.vmap(lambda a, i: a[i]))  # per batch row and KV head
  k_g = take(k_slc.reshape(b, kh, ns, block_size, dk), safe).reshape(b, kh, n * block_size, dk)
  v_g = take(v_slc.reshape(b, kh, ns, block_size, -1), safe).reshape(b, kh, n * block_size, -1)
  key_pos = safe[..., None] * block_size + jnp.arange(block_size)  # [B, K, n, l']
  mask = (block_idx[..., None] >= 0) & (key_pos <= t)
  return attend(qg, k_g, v_g, mask.reshape(b, kh, n * block_size), scale)


# ----------------------------------------------------------------------------- window, dense

def ring_positions(t, size):
  """Positions held by the slots of a ring buffer of `size` written at p % size, after position t
  was written: slot s holds t - ((t - s) mod size) (negative: never written)."""
  s = jnp.arange(size)
  return t - jnp.mod(t - s, size)


def window_decode(qg, k_win, v_win, t, window, scale=None):
  """Sliding window (t - w, t] from a ring cache [B, K, W, D] written at slot p % W, W <= w
  only when the whole cache is shorter than w (then it holds every position)."""
  pos = ring_positions(t, k_win.shape[2])
  mask = (pos >= 0) & (t - pos < window)
  return attend(qg, k_win, v_win, mask, scale)


def window_from_full(qg, k, v, t, window, scale=None):
  """Sliding window read from a full-length cache [B, K, S, D] (shared_kv: no ring of its own):
  a dynamic slice of the last min(w, S) positions, so the cost stays O(w)."""
  size = min(window, k.shape[2])
  start = jnp.clip(t - size + 1, 0, k.shape[2] - size)
  k_b = jax.lax.dynamic_slice_in_dim(k, start, size, axis=2)
  v_b = jax.lax.dynamic_slice_in_dim(v, start, size, axis=2)
  pos = start + jnp.arange(size)
  return attend(qg, k_b, v_b, (pos <= t) & (t - pos < window), scale)


def dense_decode(qg, k, v, t, scale=None):
  """Full causal attention of query t over a cache [B, K, S, D]: keys 0..t."""
  return attend(qg, k, v, jnp.arange(k.shape[2]) <= t, scale)


# ----------------------------------------------------------------------------- the whole NSA step

def compressed_decode_with(prefix_fn, qg, k_cmp, v_cmp, t, cfg: NSAConfig, scale=None):
  """compressed_decode through a split-K kernel (pallas_kernels.decode_attention.prefix_decode)
  that returns the logits of the same pass, from which p_cmp follows without re-reading K_cmp."""
  nv = num_visible_cmp(t, cfg)
  o, lse, logits = prefix_fn(qg, k_cmp, v_cmp, nv - 1, scale, return_logits=True)
  visible = jnp.arange(k_cmp.shape[2]) < nv
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
  p = jnp.where(visible, jnp.exp(jnp.where(visible, logits, 0.0) - lse_safe), 0.0)
  return o, lse, p


def cmp_select_with(cmp_select_fn, qg, k_cmp, v_cmp, t, num_sel, cfg: NSAConfig, scale=None):
  """(o_cmp, block_idx) from a fused compression + top-n kernel
  (pallas_kernels.decode_select.compressed_select_decode), or None where it does not support the
  shapes (the caller then runs the generic path)."""
  from pallas_kernels import decode_select  # kernels are optional on the plain-JAX path
  ok, why = decode_select.supports(qg.shape, k_cmp.shape, v_cmp.shape, num_sel, cfg.cmp_block,
                                   cfg.cmp_stride, cfg.sel_block)
  if not ok:  # a slower path: said once per shape, as a warning on a GPU
    ops.log_once(logging.WARNING if ops.on_gpu() else logging.INFO,
                 f"fused decode scoring + top-n not used for k_cmp{tuple(k_cmp.shape)} ({why}): "
                 "plain-JAX scoring")
    return None
  o, _, idx = cmp_select_fn(qg, k_cmp, v_cmp, t, num_visible_cmp(t, cfg), num_sel_blocks=num_sel,
                            block=cfg.cmp_block, stride=cfg.cmp_stride, sel_block=cfg.sel_block,
                            num_selected=cfg.num_selected, num_init=cfg.num_init_blocks,
                            num_local=cfg.num_local_blocks, alignment=cfg.score_alignment,
                            scale=scale)
  return o, idx


def check_decodable(cfg: NSAConfig):
  """Cached decoding supports the "nsa" and "quest" selectors; "aux" (a training-time ablation
  whose gate lives in the layer) is refused with a clear error rather than decoded wrongly."""
  if "slc" in cfg.branches and cfg.selector == "aux":
    raise NotImplementedError(
        "cached decoding does not support selector='aux' (the auxiliary-loss selector is a "
        "training-time ablation). Fix: evaluate it with the parallel forward pass (model(tokens)), "
        "or decode a model trained with selector='nsa' or 'quest'.")


def _kernel_takes(fn, what, qg, k, v, block_size=64):
  """Whether the Pallas decode kernel fn (None: not given) takes these shapes (head dims multiples
  of 16, whole blocks of block_size slots, blocks of >= 16 tokens); where it does not, the branch
  runs plain JAX, said once per shape (a warning on a GPU), instead of the kernel raising."""
  if fn is None:
    return False
  from pallas_kernels import decode_attention as kern  # kernels are optional on the plain-JAX path
  ok, why = kern.supports(qg.shape, k.shape, v.shape, block_size)
  if not ok:
    ops.log_once(logging.WARNING if ops.on_gpu() else logging.INFO,
                 f"Pallas decode kernel not used for the {what} cache k{tuple(k.shape)} ({why}): "
                 "plain JAX")
  return ok


def nsa_decode(q, caches, t, gates, cfg: NSAConfig, scale=None, select_fn=None, prefix_fn=None,
               cmp_select_fn=None, select_window_fn=None):
  """NSA attention (Eq. 5) of one new query per sequence.

  q [B, H, Dk] rotated at t; gates [B, H, 3] in (cmp, slc, win) order; caches a dict with the
  arrays each enabled branch needs (head-major, already holding position t):
    k_cmp, v_cmp [B, K, Nc, D]; k_slc, v_slc [B, K, S, D]; k_win, v_win [B, K, W, D] (ring), or no
    k_win when the window reads the selection cache (shared_kv).
  select_fn: optional replacement of `select_decode` with the same signature (the Pallas kernel).
  prefix_fn: optional split-K kernel for the compression and window branches
    (pallas_kernels.decode_attention.prefix_decode); used where the cache length is a multiple
    of 64 slots, plain JAX elsewhere.
  cmp_select_fn: optional fused compression branch + top-n kernel
    (pallas_kernels.decode_select.compressed_select_decode), used for the NSA selector where it
    supports the shapes.
  select_window_fn: optional kernel running the selection and a window ring in one launch
    (pallas_kernels.decode_attention.select_window_decode), used where the window has its own
    ring of W <= w slots, a multiple of l'.
  Returns o [B, H, Dv] in q's dtype and aux {"block_idx": [B, K, n]} (when selection runs).
  """
  b, h, _ = q.shape
  check_decodable(cfg)
  qg = group_heads(q, cfg.num_kv_heads)
  outs, aux = {}, {}
  want_slc = "slc" in cfg.branches
  idx = fused = None
  if want_slc:
    ns = caches["k_slc"].shape[2] // cfg.sel_block
  if want_slc and cfg.selector == "nsa" and cmp_select_fn is not None:
    fused = cmp_select_with(cmp_select_fn, qg, caches["k_cmp"], caches["v_cmp"], t, ns, cfg, scale)
  if fused is not None:
    o_cmp, idx = fused
    if "cmp" in cfg.branches:
      outs["cmp"] = o_cmp
  elif "cmp" in cfg.branches or (want_slc and cfg.selector == "nsa"):
    if _kernel_takes(prefix_fn, "compressed", qg, caches["k_cmp"], caches["v_cmp"]):
      o_cmp, _, p_cmp = compressed_decode_with(prefix_fn, qg, caches["k_cmp"], caches["v_cmp"], t,
                                               cfg, scale)
    else:
      o_cmp, _, p_cmp = compressed_decode(qg, caches["k_cmp"], caches["v_cmp"], t, cfg, scale)
    outs["cmp"] = o_cmp
  if want_slc:
    if idx is None and cfg.selector == "nsa":
      idx = select_blocks_decode(nsa_block_scores(p_cmp, ns, cfg), t, cfg)
    elif idx is None:
      idx = select_blocks_decode(quest_block_scores(qg, caches["k_slc"], t, cfg.sel_block), t, cfg)
    k_win = caches.get("k_win")
    slc_kernel = _kernel_takes(select_fn or select_window_fn, "selection", qg, caches["k_slc"],
                               caches["v_slc"], cfg.sel_block)
    if (select_window_fn is not None and slc_kernel and "win" in cfg.branches and k_win is not None
        and k_win.shape[2] <= cfg.window
        and _kernel_takes(select_window_fn, "window", qg, k_win, caches["v_win"], cfg.sel_block)):
      live = jnp.minimum(t, k_win.shape[2] - 1)  # ring slots <= min(t, W - 1) hold positions
      outs["slc"], _, outs["win"], _ = select_window_fn(
          qg, caches["k_slc"], caches["v_slc"], idx, t, k_win, caches["v_win"], live,
          cfg.sel_block, scale)
    else:
      fn = select_fn if select_fn is not None and slc_kernel else select_decode
      outs["slc"], _ = fn(qg, caches["k_slc"], caches["v_slc"], idx, t, cfg.sel_block, scale)
    aux["block_idx"] = idx
  if "win" in cfg.branches and "win" not in outs:
    k_win = caches.get("k_win")
    if (k_win is not None and k_win.shape[2] <= cfg.window
        and _kernel_takes(prefix_fn, "window", qg, k_win, caches["v_win"])):
      # A ring of W <= w slots holds only in-window positions: slots <= min(t, W - 1) are live.
      live = jnp.minimum(t, k_win.shape[2] - 1)
      outs["win"], _ = prefix_fn(qg, k_win, caches["v_win"], live, scale)
    elif k_win is not None:
      outs["win"], _ = window_decode(qg, caches["k_win"], caches["v_win"], t, cfg.window, scale)
    else:
      outs["win"], _ = window_from_full(qg, caches["k_slc"], caches["v_slc"], t, cfg.window, scale)
  outs = {name: o.reshape(b, h, -1) for name, o in outs.items()}
  return reference.combine(outs, gates, cfg.branches).astype(q.dtype), aux
