"""Sliding-window branch of NSA (Eq. 5, window w): Pallas Triton-lowered kernels, hand-written VJP.

Query t sees key s iff t - w < s <= t and s, t lie in the same document
(nsa_jax.reference.window_attention). The kernels are the compression kernels
(compress_attention.py) with l = d = 1, so that every raw key is its own "block", and a lower
bound on the keys: a forward / dq program walks only the keys [t0 - w + 1, t1] of its query tile,
a dK/dV program only the query tiles [s0, s1 + w - 1] that see its keys, and the unmasked inner
tiles of that walk skip the mask. GQA heads become tile rows (all heads of a KV group share the
keys they read), d_k != d_v needs no padding, segment ids are honoured, and the dK/dV sums are
deterministic (one program per key tile, no atomics). With CmpTiling.bwd_fused_dq (off by
default) the dK/dV kernel also adds dq atomically and no dq kernel runs.

Why a kernel of our own beside cuDNN's sliding window (issue 5, deliverable 3): cuDNN takes
neither segment ids (packed documents ran the plain-JAX path on a GPU) nor d_k != d_v (d_v is
padded to d_k). Where cuDNN applies, `backend` picks the forward: "triton", or "cudnn-fwd"
(cuDNN's sliding-window forward with its float32 softmax statistics, this module's backward).
nsa_jax.ops.window_backend chooses between these and cuDNN's own forward + backward (cuDNN where
it applies and d_k == d_v; these kernels for d_k != d_v, where they were faster on an H100).

Contract: window_attention(q [B,T,H,Dk], k [B,T,K,Dk], v [B,T,K,Dv], window, segment_ids=None,
scale=None) -> (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32), equal to
nsa_jax.reference.window_attention's. Every query sees at least itself, so lse is finite.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import compress_attention as ca
from pallas_kernels._common import cdiv, segment_ids_int32

# Tiles of the compression kernels, except that the dK/dV walk is one program per key tile: a
# key tile is seen by only ~(w + 64) / tokens-per-tile query tiles, so splitting that walk (the
# compression kernel's remedy for its long low tiles) would only add float32 partial sums.
WINDOW_TILING = dataclasses.replace(ca.CmpTiling(), bwd_splits=1)


def _layout(k, v, seg, tiling):
  """The kernels' layout: keys / values group-major [B, K, Tp, D], padded to a multiple of the
  tiles' key step, and per-key segment ids (bseg) with bpure = 1 (a one-token block lies in one
  document)."""
  b, t = seg.shape
  step = math.lcm(tiling.block_k, tiling.bwd_block_k, tiling.dq_block_k or tiling.block_k)
  tp = cdiv(t, step) * step
  kc, vc = (jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
            for x in (k, v))
  bseg = jnp.pad(seg, ((0, 0), (0, tp - t)))
  bpure = jnp.pad(jnp.ones((b, t), jnp.int32), ((0, 0), (0, tp - t)))
  return kc, vc, bseg, bpure


def _triton_forward(q, k, v, seg, window, scale, tiling, has_seg, interpret):
  kc, vc, bseg, bpure = _layout(k, v, seg, tiling)
  return ca._forward(q, kc, vc, seg, bseg, bpure, nc=q.shape[1], block=1, stride=1, scale=scale,
                     tiling=tiling, has_seg=has_seg, interpret=interpret, window=window)


def _cudnn_forward(q, k, v, seg, window, scale, tiling, has_seg, interpret):
  """cuDNN's sliding-window forward with its float32 softmax statistics, through the private
  call of pallas_kernels.compress_fold (checked there by `supports`). Head dims that differ are
  zero-padded to the larger (logits and kept columns unchanged). interpret=True (no GPU): that
  module's plain-JAX attention stands in for cuDNN, so CPU tests check this path's VJP."""
  from pallas_kernels import compress_fold as cf
  if interpret:
    return cf._attention(q, k, v, scale, "xla", sliding_window=window)
  dv = v.shape[-1]
  dim = max(q.shape[-1], dv)
  o, lse = cf._attention(*(cf.pad_head_dim(x, dim) for x in (q, k, v)), scale, "cudnn",
                         sliding_window=window)
  return o[..., :dv], lse


def _make(forward):
  """custom_vjp over (q, k, v, seg): `forward`, then this module's Triton backward."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
  def f(q, k, v, seg, window, scale, tiling, has_seg, interpret):
    return forward(q, k, v, seg, window, scale, tiling, has_seg, interpret)

  def fwd(q, k, v, seg, window, scale, tiling, has_seg, interpret):
    o, lse = forward(q, k, v, seg, window, scale, tiling, has_seg, interpret)
    # Saved: the inputs, o and lse ([B,T,H]); p is recomputed in the backward, never stored.
    return (o, lse), (q, k, v, seg, o, lse)

  def bwd(window, scale, tiling, has_seg, interpret, res, cts):
    q, k, v, seg, o, lse = res
    do, dlse = cts
    kc, vc, bseg, bpure = _layout(k, v, seg, tiling)
    dq, dkc, dvc = ca._backward(q, kc, vc, seg, bseg, bpure, o, lse, do, dlse, nc=q.shape[1],
                                block=1, stride=1, scale=scale, tiling=tiling, has_seg=has_seg,
                                interpret=interpret, window=window)
    back = lambda x: x[:, :, :q.shape[1]].transpose(0, 2, 1, 3)  # noqa: E731
    return dq, back(dkc), back(dvc), None

  f.defvjp(fwd, bwd)
  return f


_IMPLS = {"triton": _make(_triton_forward), "cudnn-fwd": _make(_cudnn_forward)}


def supports(q_shape, k_shape, v_shape):
  """(ok, reason): whether the kernels handle these shapes."""
  if not len(q_shape) == len(k_shape) == len(v_shape) == 4:
    return False, (f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)}: each must be "
                   "[batch, time, heads, head_dim]")
  b, t, h, dk = q_shape
  if min(b, t, h, k_shape[2]) < 1:
    return False, f"q {tuple(q_shape)} / k {tuple(k_shape)}: batch, time and heads must be >= 1"
  if tuple(k_shape) != (b, t, k_shape[2], dk) or tuple(v_shape[:3]) != tuple(k_shape[:3]):
    return False, f"k {tuple(k_shape)} / v {tuple(v_shape)} do not match q {tuple(q_shape)}"
  return ca.supports(q_shape, k_shape, v_shape)


def _check_tiling(tiling):
  if not isinstance(tiling, ca.CmpTiling):
    raise TypeError(f"tiling={tiling!r}: expected a pallas_kernels.compress_attention.CmpTiling "
                    "(e.g. dataclasses.replace(WINDOW_TILING, rows=128))")
  for f in ("rows", "block_k", "bwd_block_k", "bwd_rows", "dq_block_k", "dkv_rows"):
    x = getattr(tiling, f)
    if (f in ("dq_block_k", "dkv_rows") and x == 0):  # 0: take block_k / bwd_rows
      continue
    if x < 1 or x & (x - 1):
      raise ValueError(f"tiling.{f}={x}: the Triton lowering loads power-of-two tiles. Fix: a "
                       "power of two (e.g. 64)")


def check_window(window):
  """The window as a Python int >= 1 (a NumPy / 0-d integer array is taken; it is static: it
  sets the kernels' key bounds), else a ValueError naming the fix."""
  import operator
  try:
    w = None if isinstance(window, bool) else operator.index(window)
  except TypeError:
    w = None
  if w is None or w < 1:
    raise ValueError(f"window={window!r}: expected a positive static integer (keys t - w < s <= "
                     "t), e.g. window=512; a traced value cannot set the kernels' bounds")
  return w


def window_attention(q, k, v, window, segment_ids=None, scale=None, *, interpret=False,
                     tiling=None, backend="triton"):
  """Sliding-window attention; see the module docstring. Returns (o, lse).

  backend: "triton" (forward and backward kernels) or "cudnn-fwd" (cuDNN's sliding-window forward,
  the Triton backward; no segment ids; where compress_fold.supports allows cuDNN; plain-JAX
  attention in place of cuDNN when interpret=True)."""
  if backend not in ("triton", "cudnn-fwd"):
    raise ValueError(f"backend={backend!r}: expected 'triton' or 'cudnn-fwd'")
  window = check_window(window)
  ok, why = supports(q.shape, k.shape, v.shape)
  if not ok:
    raise ValueError(f"window_attention does not support this call: {why}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernels take one "
                     "dtype (mixed inputs would run at the lower precision). Fix: cast them to "
                     "one dtype")
  if backend == "cudnn-fwd" and segment_ids is not None:
    raise ValueError("window_attention[cudnn-fwd] does not take segment ids (cuDNN's sliding "
                     "window has no document mask). Fix: backend='triton'")
  if backend == "cudnn-fwd" and not interpret:
    from pallas_kernels import compress_fold as cf
    ok, why = cf.supports(q.shape[-1], v.shape[-1], q.dtype, False)
    if not ok:
      raise ValueError(f"window_attention[cudnn-fwd] does not support this call: {why}. Fix: "
                       "backend='triton'")
  tiling = WINDOW_TILING if tiling is None else tiling
  _check_tiling(tiling)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  window = min(window, q.shape[1])  # a window past T is the whole causal past
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
  seg, has_seg = segment_ids_int32(segment_ids, q.shape[0], q.shape[1], "window_attention")
  return _IMPLS[backend](q, k, v, seg, window, scale, tiling, has_seg, interpret)
