"""The auxiliary-loss block selector (selector="aux"): the paper's §6.1 ablation, SeerAttention-like.

Instead of reading block importance off the compression branch (NSA) or off key bounds (Quest), a
small learned gate predicts it, and an auxiliary loss teaches the gate what full attention would
have looked at:

  kbar_j   = mean of the (rotated) selection keys of block j                  [B, Ns, K, Dk]
  logit    = (q_h W_q) . (kbar_j W_k) / sqrt(d_gate), per query head h         [B, T, H, Ns]
  p_pred   = softmax of the logits over the COMPLETE past blocks of t's document
             (j < cur(t), j >= the document's first block: no key after t is ever pooled)
  score    = sum of p_pred over the heads of a KV group (as Eq. 10 sums probabilities)
  p_true   = full causal attention of head h (softmax of q.k / sqrt(Dk) over keys <= t of the
             same document), summed over each block's keys, restricted to the same blocks and
             renormalised: the target, with stop_gradient
  loss_t   = mean over heads of KL(p_true || p_pred); 0 where t has no complete past block.

Top-n then applies NSA's own rules (reference.topn_blocks: forced initial and local blocks, ties
to the lower index), so the selector is the only difference from NSA. The gate sees q and kbar
through stop_gradient: the auxiliary loss trains W_q and W_k only, and selection stays
non-differentiable, as in NSA. The target needs every query's attention to every key, computed in
query chunks ([B, C, H, T] at a time): meant for ablations at small scale, not for long context.
Blocks that straddle a document start pool keys of the previous document (index choice only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax import reference
from nsa_jax.config import NSAConfig


def pooled_keys(k, sel_block):
  """k [B, T, K, Dk] -> per selection block mean [B, Ns, K, Dk] float32 (a partial last block is
  averaged over its real keys)."""
  b, t, kh, dk = k.shape
  ns = -(-t // sel_block)
  kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, ns * sel_block - t), (0, 0), (0, 0)))
  count = jnp.minimum(sel_block, t - sel_block * jnp.arange(ns)).astype(jnp.float32)
  return kp.reshape(b, ns, sel_block, kh, dk).sum(axis=2) / count[None, :, None, None]


def _past_blocks(positions, first, sel_block, ns):
  """[B|1, C, 1, Ns] bool: complete past blocks of each query's document."""
  j = jnp.arange(ns)
  cur = positions // sel_block
  return ((j[None, None, :] < cur[..., None]) & (j[None, None, :] >= first[..., None]))[:, :, None]


def _chunk_terms(q_c, positions, seg_c, first_c, kbar_g, kk, seg, w_q, cfg: NSAConfig, scale):
  """One query chunk: (group scores [B, C, K, Ns], KL per token [B, C]). kk: the keys repeated
  per query head, float32, stop-gradient [B, T, H, Dk]."""
  b, c, h, dk = q_c.shape
  t, kh = kk.shape[1], kbar_g.shape[2]
  g, ns = h // kh, kbar_g.shape[1]
  allowed = _past_blocks(positions, first_c, cfg.sel_block, ns)  # [B|1, C, 1, Ns]
  q32 = jax.lax.stop_gradient(q_c).astype(jnp.float32)
  qg = (q32 @ w_q).reshape(b, c, kh, g, -1)  # [B, C, K, G, Dg]
  logits = jnp.einsum("bckgd,bnkd->bckgn", qg, kbar_g).reshape(b, c, h, ns)
  logits = logits / jnp.sqrt(jnp.float32(w_q.shape[-1]))
  p_pred, lse_pred = reference.masked_softmax(logits, allowed)
  scores = p_pred.reshape(b, c, kh, g, ns).sum(axis=3)
  # The target: full causal attention of each head, mass per block, over the same blocks.
  scale = dk ** -0.5 if scale is None else scale
  att = jnp.einsum("bchd,bshd->bchs", q32, kk) * scale
  vis = (jnp.arange(t)[None, None, :] <= positions[..., None])  # [1|B, C, T]
  vis = vis & (seg[:, None, :] == seg_c[:, :, None])
  p_att, _ = reference.masked_softmax(att, vis[:, :, None, :])
  pad = ns * cfg.sel_block - t
  mass = jnp.pad(p_att, ((0, 0), (0, 0), (0, 0), (0, pad))).reshape(
      b, c, h, ns, cfg.sel_block).sum(axis=-1)
  mass = jnp.where(allowed, mass, 0.0)
  tot = jnp.sum(mass, axis=-1, keepdims=True)
  p_true = jax.lax.stop_gradient(jnp.where(tot > 0, mass / jnp.where(tot > 0, tot, 1.0), 0.0))
  # log p_pred as logits - lse: keeps a gradient even where the gate's probability underflows.
  log_pred = logits - jnp.where(jnp.isfinite(lse_pred), lse_pred, 0.0)[..., None]
  log_ratio = jnp.where(p_true > 0, jnp.log(jnp.where(p_true > 0, p_true, 1.0)) - log_pred, 0.0)
  kl = jnp.sum(p_true * log_ratio, axis=-1)  # [B, C, H]; 0 where nothing is allowed
  return scores, jnp.mean(kl, axis=-1)


def select(q, k_slc, w_q, w_k, cfg: NSAConfig, segment_ids=None, scale=None, chunk=256):
  """Block indices [B, T, K, n] chosen by the gate, and the auxiliary loss per token [B, T]
  (mean over heads of KL(full-attention block mass || gate), see the module docstring).

  q [B, T, H, Dk] and k_slc [B, T, K, Dk] as given to the NSA op (rotated); w_q, w_k [Dk, Dg]."""
  scores, kl, first = scores_and_loss(q, k_slc, w_q, w_k, cfg, segment_ids, scale, chunk)
  cur = (jnp.arange(q.shape[1]) // cfg.sel_block)[None, :]
  return reference.topn_blocks(scores, cur, first, cfg), kl


def scores_and_loss(q, k_slc, w_q, w_k, cfg: NSAConfig, segment_ids=None, scale=None, chunk=256):
  """The gate's group scores [B, T, K, Ns] (summed head probabilities), the loss per token [B, T]
  and each token's document-start block [B, T]."""
  b, t, h, dk = q.shape
  seg = reference._segments(segment_ids, b, t)
  first = reference.document_starts(seg) // cfg.sel_block  # [B, T]
  kbar = jax.lax.stop_gradient(pooled_keys(k_slc, cfg.sel_block))
  kbar_g = kbar @ w_k.astype(jnp.float32)  # [B, Ns, K, Dg]
  c = min(chunk, t)
  n = -(-t // c)
  padq = n * c - t
  qp = jnp.pad(q, ((0, 0), (0, padq), (0, 0), (0, 0))).reshape(b, n, c, h, dk)
  segp = jnp.pad(seg, ((0, 0), (0, padq)), mode="edge").reshape(b, n, c)
  firstp = jnp.pad(first, ((0, 0), (0, padq)), mode="edge").reshape(b, n, c)
  w_q32 = w_q.astype(jnp.float32)
  kk = jnp.repeat(jax.lax.stop_gradient(k_slc).astype(jnp.float32), h // k_slc.shape[2], axis=2)

  def one(i):
    positions = jnp.minimum(i * c + jnp.arange(c), t - 1)[None]  # padded rows copy row T-1
    return _chunk_terms(qp[:, i], positions, segp[:, i], firstp[:, i], kbar_g, kk, seg, w_q32,
                        cfg, scale)

  scores, kl = jax.lax.map(one, jnp.arange(n))  # [n, B, c, K, Ns], [n, B, c]
  scores = jnp.moveaxis(scores, 0, 1).reshape(b, n * c, -1, scores.shape[-1])[:, :t]
  kl = jnp.moveaxis(kl, 0, 1).reshape(b, n * c)[:, :t]
  return scores, kl, first
