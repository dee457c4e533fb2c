"""Next-token samplers for generation: greedy, temperature, top-k and top-p (nucleus), jit-friendly.

All settings are static Python numbers; logits [B, V] float32 -> tokens [B] int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def filter_top_k(logits, k: int):
  """Keeps the k largest logits per row (ties at the k-th value are all kept), -inf elsewhere."""
  if k <= 0 or k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits >= kth, logits, -jnp.inf)


def filter_top_p(logits, p: float):
  """Nucleus filter: keeps the smallest set of most likely tokens whose probability reaches p
  (the most likely token is always kept), -inf elsewhere."""
  if p >= 1.0:
    return logits
  order = jnp.argsort(-logits, axis=-1)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each token
  keep_sorted = before < p
  keep = jnp.zeros_like(keep_sorted).at[
      jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
  return jnp.where(keep, logits, -jnp.inf)


def check_sampling(temperature, top_k, top_p):
  """The sampling settings, refused with the fix named (NaN fails every range check here)."""
  if not temperature >= 0:
    raise ValueError(f"temperature={temperature}: must be a number >= 0 (0 = greedy)")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k={top_k!r}: must be an integer >= 0 (0 = off)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p}: must be in (0, 1] (1 = off)")


def sample(key, logits, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
  """One token per row. temperature 0 = greedy (argmax); otherwise softmax(logits / temperature)
  restricted by top_k (0 = off) and then top_p (1 = off)."""
  check_sampling(temperature, top_k, top_p)
  logits = logits.astype(jnp.float32)
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  # Shifted so the best logit is 0 first: a tiny temperature then sends the rest to -inf (the
  # argmax) instead of overflowing every logit to +-inf and sampling token 0.
  logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
  logits = filter_top_p(filter_top_k(logits, top_k), top_p)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
