"""Flax NNX attention layers: `NSAAttention` (the paper's three-branch sparse attention) and
`DenseAttention` (the full causal baseline with the same projections).

RoPE placement: queries, selection keys and window keys are rotated at their own positions.
Compressed keys are made by phi from UN-rotated keys (so phi sees position-free content and its
own learned intra-block position encoding), then rotated as if they sat at their block's last
position i*d + l - 1; a query at t therefore sees compressed block i at relative distance
t - (i*d + l - 1) >= 0, like any other past key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nsa_jax import aux_selector, ops, reference, xla
from nsa_jax.config import NSAConfig
from nsa_jax.layers import (annotated, apply_rope, default_positions, dtype_of, linear,
                            sharding_scope)


class CompressionMLP(nnx.Module):
  """phi (Eq. 7): MLP over a flattened block of l keys plus a learned intra-block position encoding.

  Shared by all KV heads. Hidden width cfg.cmp_hidden_dim.
  """

  def __init__(self, block, dim_in, dim_out, hidden, *, param_dtype, rngs):
    init = nnx.initializers.lecun_normal()
    zeros = nnx.initializers.zeros_init()
    self.pos = nnx.Param(annotated(nnx.initializers.normal(0.02), None, None)(
        rngs.params(), (block, dim_in), param_dtype))
    self.w1 = nnx.Param(annotated(init, None, None)(rngs.params(), (block * dim_in, hidden),
                                                    param_dtype))
    self.b1 = nnx.Param(annotated(zeros, None)(None, (hidden,), param_dtype))
    self.w2 = nnx.Param(annotated(init, None, None)(rngs.params(), (hidden, dim_out), param_dtype))
    self.b2 = nnx.Param(annotated(zeros, None)(None, (dim_out,), param_dtype))

  def params(self):
    return {n: getattr(self, n)[...] for n in ("pos", "w1", "b1", "w2", "b2")}


class NSAAttention(nnx.Module):
  """Native Sparse Attention layer: x [B, T, d_model] -> [B, T, d_model].

  Parameters: q projection; separate key/value projections for the compression, selection and
  window branches (cfg.shared_kv=True shares one pair, the paper's ablation); phi for keys and
  values (cfg.compression="mlp"); a gate Linear(d_model -> 3 * heads) + sigmoid; output projection;
  with selector="aux", the block-importance gate's projections aux_wq, aux_wk [d_k, aux_dim].
  """

  def __init__(self, d_model: int, cfg: NSAConfig, *, rope_theta=10000.0, dtype="float32",
               param_dtype="float32", rngs: nnx.Rngs):
    if not isinstance(cfg, NSAConfig):
      raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    self.cfg, self.d_model, self.rope_theta = cfg, d_model, rope_theta
    self.dtype, pdt = dtype_of(dtype), dtype_of(param_dtype)
    h, kh, dk, dv = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim_v
    kw = dict(dtype=self.dtype, param_dtype=pdt, rngs=rngs)
    with sharding_scope():
      self.q_proj = linear(d_model, h * dk, ("embed", "heads"), **kw)
      kv_names = ("shared",) if cfg.shared_kv else ("cmp", "slc", "win")
      self.k_proj = nnx.Dict({n: linear(d_model, kh * dk, ("embed", "kv_heads"), **kw)
                              for n in kv_names})
      self.v_proj = nnx.Dict({n: linear(d_model, kh * dv, ("embed", "kv_heads"), **kw)
                              for n in kv_names})
      if cfg.compression == "mlp":
        f = cfg.cmp_hidden_dim
        self.phi_k = CompressionMLP(cfg.cmp_block, dk, dk, f, param_dtype=pdt, rngs=rngs)
        self.phi_v = CompressionMLP(cfg.cmp_block, dv, dv, f, param_dtype=pdt, rngs=rngs)
      if cfg.gating == "sigmoid":
        self.gate = linear(d_model, 3 * h, ("embed", None), use_bias=True, **kw)
      if cfg.selector == "aux":
        init = annotated(nnx.initializers.lecun_normal(), None, None)
        self.aux_wq = nnx.Param(init(rngs.params(), (dk, cfg.aux_dim), pdt))
        self.aux_wk = nnx.Param(init(rngs.params(), (dk, cfg.aux_dim), pdt))
      self.o_proj = linear(h * dv, d_model, ("heads", "embed"), **kw)

  def _kv(self, x, branch):
    name = "shared" if self.cfg.shared_kv else branch
    b, t, _ = x.shape
    k = self.k_proj[name](x).reshape(b, t, self.cfg.num_kv_heads, self.cfg.head_dim)
    v = self.v_proj[name](x).reshape(b, t, self.cfg.num_kv_heads, self.cfg.dim_v)
    return k, v

  def compress(self, k, v, positions):
    """Raw (un-rotated) k/v [B, T, K, D] -> compressed k (rotated at block ends), v [B, Nc, K, D].

    Gather-free phi (`xla.mlp_compress`); `reference.mlp_compress` is what it is tested against.
    """
    cfg = self.cfg
    if cfg.compression == "mlp":
      k_cmp = xla.mlp_compress(k, self.phi_k.params(), cfg.cmp_block, cfg.cmp_stride)
      v_cmp = xla.mlp_compress(v, self.phi_v.params(), cfg.cmp_block, cfg.cmp_stride)
    else:
      k_cmp = xla.mean_compress(k, cfg.cmp_block, cfg.cmp_stride)
      v_cmp = xla.mean_compress(v, cfg.cmp_block, cfg.cmp_stride)
    ends = reference.cmp_block_positions(k.shape[1], cfg.cmp_block, cfg.cmp_stride)[:, -1]
    k_cmp = apply_rope(k_cmp, positions[:, ends], self.rope_theta)
    return k_cmp, v_cmp

  def gates(self, x):
    b, t, _ = x.shape
    if self.cfg.gating == "sum":
      return jnp.ones((b, t, self.cfg.num_heads, 3), jnp.float32)
    return jax.nn.sigmoid(self.gate(x).astype(jnp.float32)).reshape(b, t, self.cfg.num_heads, 3)

  def __call__(self, x, *, segment_ids=None, positions=None, implementation=None,
               return_aux=False, return_selector_loss=False):
    """y [B, T, d_model]; with return_aux also a dict (block_idx, gates, ...); with
    return_selector_loss also the "aux" selector's loss per token [B, T] (zeros for the other
    selectors): y, aux, loss in that order, each present only when asked."""
    cfg = self.cfg
    if x.ndim != 3 or x.shape[-1] != self.d_model:
      raise ValueError(f"NSAAttention expects x [batch, time, {self.d_model}], got {x.shape}")
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    if positions is None:
      positions = default_positions(b, t, segment_ids)
    # Named scopes label the kernels in profiles (experiments/profile_step.py groups by them).
    with jax.named_scope("nsa_q"):
      q = apply_rope(self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim), positions,
                     self.rope_theta)
    with jax.named_scope("nsa_kv_cmp"):
      k_c, v_c = self._kv(x, "cmp")
      k_cmp, v_cmp = self.compress(k_c, v_c, positions)
    with jax.named_scope("nsa_kv"):
      k_s, v_s = self._kv(x, "slc")
      k_w, v_w = self._kv(x, "win")
      k_s = apply_rope(k_s, positions, self.rope_theta)
      k_w = k_s if cfg.shared_kv else apply_rope(k_w, positions, self.rope_theta)
    block_idx, sel_loss = None, jnp.zeros((b, t), jnp.float32)
    if cfg.selector == "aux" and "slc" in cfg.branches:
      block_idx, sel_loss = aux_selector.select(q, k_s, self.aux_wq[...], self.aux_wk[...], cfg,
                                                segment_ids)
    with jax.named_scope("nsa_gates"):
      gates = self.gates(x)
    with jax.named_scope("nsa_op"):
      out = ops.nsa_attention(q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates, cfg,
                              segment_ids=segment_ids, implementation=implementation,
                              return_aux=return_aux, block_idx=block_idx)
    o, aux = out if return_aux else (out, None)
    with jax.named_scope("nsa_out"):
      y = self.o_proj(o.reshape(b, t, cfg.num_heads * cfg.dim_v).astype(self.dtype))
    result = (y,)
    if return_aux:
      aux["gates"] = gates
      result += (aux,)
    if return_selector_loss:
      result += (sel_loss,)
    return result if len(result) > 1 else y


class DenseAttention(nnx.Module):
  """Full causal GQA attention with RoPE: cuDNN on a GPU, XLA elsewhere (the baseline)."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int,
               head_dim_v: int | None = None, *, rope_theta=10000.0, dtype="float32",
               param_dtype="float32", implementation="auto", rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}. "
                       "Fix: choose num_heads as a multiple of num_kv_heads.")
    self.d_model, self.h, self.kh, self.dk = d_model, num_heads, num_kv_heads, head_dim
    self.dv = head_dim if head_dim_v is None else head_dim_v
    self.rope_theta, self.implementation = rope_theta, implementation
    self.dtype = dtype_of(dtype)
    kw = dict(dtype=self.dtype, param_dtype=dtype_of(param_dtype), rngs=rngs)
    with sharding_scope():
      self.q_proj = linear(d_model, self.h * self.dk, ("embed", "heads"), **kw)
      self.k_proj = linear(d_model, self.kh * self.dk, ("embed", "kv_heads"), **kw)
      self.v_proj = linear(d_model, self.kh * self.dv, ("embed", "kv_heads"), **kw)
      self.o_proj = linear(self.h * self.dv, d_model, ("heads", "embed"), **kw)

  def __call__(self, x, *, segment_ids=None, positions=None, implementation=None):
    if x.ndim != 3 or x.shape[-1] != self.d_model:
      raise ValueError(f"DenseAttention expects x [batch, time, {self.d_model}], got {x.shape}")
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    if positions is None:
      positions = default_positions(b, t, segment_ids)
    with jax.named_scope("dense_qkv"):
      q = apply_rope(self.q_proj(x).reshape(b, t, self.h, self.dk), positions, self.rope_theta)
      k = apply_rope(self.k_proj(x).reshape(b, t, self.kh, self.dk), positions, self.rope_theta)
      v = self.v_proj(x).reshape(b, t, self.kh, self.dv)
    with jax.named_scope("dense_op"):
      o = ops.dense_attention(q, k, v, segment_ids, implementation=implementation or
                              self.implementation)
    with jax.named_scope("dense_out"):
      return self.o_proj(o.reshape(b, t, self.h * self.dv))
