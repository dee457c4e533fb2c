"""One entry point for the NSA op, `nsa_attention(..., implementation=...)`, and the dense baseline.

Implementations:
  "reference": dense masks (nsa_jax.reference); exact, O(T^2) memory; for checking.
  "xla":       memory-sane plain JAX (nsa_jax.xla); any backend.
  "pallas":    Pallas GPU kernels (pallas_kernels) for the selection branch, cuDNN or plain JAX for
               the window, plain JAX for compression scoring until its kernel lands.
  "auto":      "pallas" on a GPU when the kernels support the shape, else "xla".
Which one ran is logged once per shape (logger "nsa_jax"); on a GPU a fallback is a warning.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from nsa_jax import reference
from nsa_jax.config import NSAConfig

log = logging.getLogger("nsa_jax")


@functools.lru_cache(maxsize=256)
def _log_once(level, msg):
  log.log(level, msg)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _pallas_support(q, k, v, cfg: NSAConfig):
  try:
    from pallas_kernels import select_attention as sk
  except ImportError as e:  # kernels not built into this checkout
    return False, f"pallas_kernels.select_attention unavailable ({e})"
  return sk.supports(q.shape, k.shape, v.shape, cfg.num_selected, cfg.sel_block, "triton")


def resolve_implementation(requested, q, k_slc, v_slc, cfg: NSAConfig) -> str:
  """Turns "auto" into a concrete implementation and logs the choice."""
  shape = f"q{tuple(q.shape)} {q.dtype}"
  if requested == "auto":
    if on_gpu():
      ok, why = _pallas_support(q, k_slc, v_slc, cfg)
      if ok:
        impl = "pallas"
      else:
        impl = "xla"
        _log_once(logging.WARNING, f"NSA on GPU falls back to the plain-JAX path for {shape}: {why}")
    else:
      impl = "xla"
  else:
    impl = requested
  if impl not in ("pallas", "xla", "reference"):
    raise ValueError(f"implementation={impl!r}: expected 'auto', 'pallas', 'xla' or 'reference'")
  _log_once(logging.INFO, f"NSA attention implementation: {impl} for {shape} on {jax.default_backend()}")
  return impl


def window_attention(q, k, v, window, segment_ids=None, scale=None, *, allow_cudnn=True):
  """Sliding-window branch: cuDNN's left window on a GPU when it applies, else plain JAX."""
  from nsa_jax import xla
  cudnn_ok = (allow_cudnn and on_gpu() and segment_ids is None and q.shape[-1] == v.shape[-1]
              and q.dtype in (jnp.bfloat16, jnp.float16))
  if cudnn_ok:
    _log_once(logging.INFO, f"NSA window branch: cuDNN local window for q{tuple(q.shape)}")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=(window - 1, 0), implementation="cudnn")
  o, _ = xla.window_attention(q, k, v, window, segment_ids, scale)
  return o


def _pallas_nsa(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids, scale,
                return_aux):
  from nsa_jax import xla
  from pallas_kernels.select_attention import select_attention as select_kernel
  reference.check_nsa_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids)
  outs, aux = {}, {}
  need_scores = "slc" in cfg.branches
  if "cmp" in cfg.branches or need_scores:
    o_cmp, _, idx = xla.compressed_attention_and_select(q, k_cmp, v_cmp, k_slc, cfg, segment_ids,
                                                        scale)
    outs["cmp"] = o_cmp
  if need_scores:
    outs["slc"], _ = select_kernel(q, k_slc, v_slc, idx, cfg.sel_block, segment_ids, scale)
    aux["block_idx"] = idx
  if "win" in cfg.branches:
    outs["win"] = window_attention(q, k_win, v_win, cfg.window, segment_ids, scale)
  o = reference.combine(outs, gates, cfg.branches).astype(q.dtype)
  if return_aux:
    aux["outputs"] = outs
    return o, aux
  return o


def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg: NSAConfig,
                  segment_ids=None, scale=None, implementation=None, return_aux=False):
  """The whole NSA op. Shapes as in `nsa_jax.reference.nsa_attention`.

  implementation: None (use cfg.implementation), "auto", "pallas", "xla" or "reference".
  """
  impl = resolve_implementation(implementation or cfg.implementation, q, k_slc, v_slc, cfg)
  args = (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg)
  if impl == "reference":
    return reference.nsa_attention(*args, segment_ids=segment_ids, scale=scale,
                                   return_aux=return_aux)
  if impl == "xla":
    from nsa_jax import xla
    return xla.nsa_attention(*args, segment_ids=segment_ids, scale=scale, return_aux=return_aux)
  return _pallas_nsa(*args, segment_ids, scale, return_aux)


def dense_attention(q, k, v, segment_ids=None, scale=None, implementation="auto"):
  """Dense causal attention: cuDNN on a GPU (bf16/fp16, d_k == d_v), XLA elsewhere."""
  if implementation == "auto":
    implementation = ("cudnn" if on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16)
                      and q.shape[-1] == v.shape[-1] else "xla")
  _log_once(logging.INFO, f"dense attention implementation: {implementation} for q{tuple(q.shape)}")
  if implementation == "reference":
    return reference.dense_causal_attention(q, k, v, segment_ids, scale)[0]
  if implementation == "xla" and q.shape[-1] != v.shape[-1]:
    return reference.dense_causal_attention(q, k, v, segment_ids, scale)[0]
  if segment_ids is not None:
    mask = reference.causal_mask(segment_ids)  # [B, 1, T, T]
    return jax.nn.dot_product_attention(q, k, v, scale=scale, mask=mask,
                                        implementation=None if implementation == "xla" else
                                        implementation)
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                      implementation=None if implementation == "xla" else
                                      implementation)
