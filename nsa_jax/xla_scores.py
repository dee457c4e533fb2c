"""Block scoring and top-n selection for one chunk of queries (used by `nsa_jax.xla`).

Each function computes, for a chunk of queries, exactly what its `nsa_jax.reference` counterpart
computes for all T at once: Eq. 9 remap, Quest-style scores, top-n with forced blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax import reference
from nsa_jax.config import NSAConfig


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

  scores [B, C, K, Ns]; doc_first_block [B, C] (or None: no packing): selection block holding each
  query's document start.
  Returns [B, C, K, n] int32, ascending, -1 in empty slots; ties go to the lower block index.
  """
  cur = (positions // cfg.sel_block)[None, :]  # [1, C]
  # None: one document per row, starting at block 0.
  first = jnp.zeros_like(cur) if doc_first_block is None else doc_first_block  # [B|1, C]
  return reference.topn_blocks(scores, cur, first, cfg)


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
