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
import numpy as np
from flax import nnx

from nsa_jax import aux_selector, ops, reference, xla
from nsa_jax.config import DENSE_IMPLEMENTATIONS, NSAConfig
from nsa_jax.layers import (HEAD_MESH_AXIS, annotated, apply_rope, auto_mesh, check_layer_inputs,
                            check_rope_head_dim, default_positions, dtype_of, linear,
                            sharding_scope)

# The input projections as one matmul (fused_projection; the parameters are the same Linear
# layers in every mode, so checkpoints do not care). "all" (the default): the query projection,
# the key / value projections (NSAAttention's six, DenseAttention's two) and NSA's gate; "kv": the
# key / value projections only; "none": one matmul per projection, as before 2026-12-02. On a mesh
# whose tensor axis does not divide the KV heads the per-KV-head reshape cannot carry the
# projections' sharding (XLA would reshard activations), so there every mode runs as "none".
# Read when traced. Measured on the H200 (8k training step): docs/RESULTS.md §0.
FUSE_PROJ = "all"
FUSE_MODES = ("all", "kv", "none")


def fuse_mode(kv_heads):
  """FUSE_PROJ as it applies to a layer with kv_heads KV heads under the mesh in context."""
  if FUSE_PROJ not in FUSE_MODES:
    raise ValueError(f"attention.FUSE_PROJ={FUSE_PROJ!r}: not one of {FUSE_MODES}")
  mesh = auto_mesh()
  tensor = 1 if mesh is None else mesh.shape.get(HEAD_MESH_AXIS, 1)
  return "none" if kv_heads % tensor else FUSE_PROJ


def fused_projection(x, lins, kv_heads, dtype):
  """[x @ W_i (+ b_i) as [B, T, kv_heads, w_i]] for Linear layers lins = [(lin, w_i)] whose
  kv_heads * w_i outputs are laid out KV-head-major (query heads h = k * G + g, G * d_k columns per
  KV head; NSA's gate: G * 3), as one matmul: the kernels are concatenated per KV head into
  [d_model, kv_heads, sum w_i] (the KV-head axis keeps its sharding) and the result split."""
  d_model = x.shape[-1]
  if dtype is None:  # as nnx.Linear's promote_dtype without a dtype
    dtype = jnp.result_type(x, *(a[...] for lin, _ in lins
                                 for a in (lin.kernel, lin.bias) if a is not None))
  w = jnp.concatenate([lin.kernel[...].astype(dtype).reshape(d_model, kv_heads, d)
                       for lin, d in lins], axis=-1)
  y = jnp.einsum("btm,mhe->bthe", x.astype(dtype), w)
  parts = jnp.split(y, np.cumsum([d for _, d in lins])[:-1].tolist(), axis=-1)
  return [p if lin.bias is None else p + lin.bias[...].astype(dtype).reshape(kv_heads, d)
          for p, (lin, d) in zip(parts, lins)]


def project_inputs(x, q, kvs, extra, kv_heads, dtype):
  """Outputs [B, T, kv_heads, w] of the (Linear, w) pairs q, *kvs, *extra, in that order, in as
  few matmuls as fuse_mode(kv_heads) allows: "all" one (fused_projection), "kv" one for kvs and
  the others alone, "none" each Linear called on its own."""
  mode = fuse_mode(kv_heads)
  b, t, _ = x.shape
  alone = lambda lin, w: lin(x).reshape(b, t, kv_heads, w)
  if mode == "all":
    return fused_projection(x, [q, *kvs, *extra], kv_heads, dtype)
  kv = (fused_projection(x, kvs, kv_heads, dtype) if mode == "kv"
        else [alone(*p) for p in kvs])
  return [alone(*q), *kv, *(alone(*p) for p in extra)]


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
    check_rope_head_dim("NSAAttention", cfg.head_dim)  # the op itself takes any head_dim
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

  def _project(self, x):
    """(q [B, T, H, D] before RoPE, gate logits [B, T, H, 3] or None, {branch: (k, v)} raw
    keys and values [B, T, K, D]) of x, in as few matmuls as fuse_mode() allows (project_inputs):
    with "all" one, so x is read once and the backward pass makes dx with one matmul instead of
    summing eight."""
    cfg = self.cfg
    b, t, _ = x.shape
    h, kh, dk, dv = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim_v
    g = h // kh
    names = ("shared",) if cfg.shared_kv else ("cmp", "slc", "win")
    kvs = [(lin, d) for n in names for lin, d in ((self.k_proj[n], dk), (self.v_proj[n], dv))]
    extra = [(self.gate, g * 3)] if cfg.gating == "sigmoid" else []
    q, *parts = project_inputs(x, (self.q_proj, g * dk), kvs, extra, kh, self.dtype)
    gate = parts.pop().reshape(b, t, h, 3) if extra else None
    kv = {n: (parts[2 * i], parts[2 * i + 1]) for i, n in enumerate(names)}
    if cfg.shared_kv:
      kv = {br: kv["shared"] for br in ("cmp", "slc", "win")}
    return q.reshape(b, t, h, dk), gate, kv

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

  def gates(self, x, logits=None):
    """[B, T, H, 3] branch gates of x (sigmoid of the gate Linear; logits: that Linear's output
    [B, T, H, 3] when already made); ones with gating="sum"."""
    b, t, _ = x.shape
    if self.cfg.gating == "sum":
      return jnp.ones((b, t, self.cfg.num_heads, 3), jnp.float32)
    if logits is None:
      logits = self.gate(x).reshape(b, t, self.cfg.num_heads, 3)
    return jax.nn.sigmoid(logits.astype(jnp.float32))

  def __call__(self, x, *, segment_ids=None, positions=None, implementation=None,
               return_aux=False, return_selector_loss=False, select_edit=None, block_idx=None):
    """y [B, T, d_model]; with return_aux also a dict (block_idx, gates, ...); with
    return_selector_loss also the "aux" selector's loss per token [B, T] (zeros for the other
    selectors): y, aux, loss in that order, each present only when asked.

    block_idx: [B, T, K, n] blocks chosen outside the layer (ascending, -1 in empty slots), read
    by the selection branch instead of the layer's own choice, e.g. an earlier layer's selection
    (ModelConfig.selection_from_layer; not the paper). Not with selector="aux".

    select_edit (interventions, e.g. experiments/needle_eval.py --force_key_layers): a function
    block_idx [B, T, K, n] -> block_idx [B, T, K, n] applied to the layer's selection (its own,
    or the block_idx given) before the selection branch reads it (ascending, -1 in empty slots,
    as the selector writes them). Unless blocks are given (block_idx, or selector="aux"'s gate)
    the op runs once more to read the layer's choice: an evaluation tool, not a training one."""
    cfg = self.cfg
    segment_ids = check_layer_inputs("NSAAttention", x, self.d_model, segment_ids, positions)
    # (block_idx without a selection branch is refused by the op: reference.check_block_idx)
    if select_edit is not None and "slc" not in cfg.branches:
      raise ValueError(f"select_edit was given but branches={cfg.branches!r} has no selection "
                       "branch. Fix: drop select_edit for this layer.")
    if block_idx is not None and cfg.selector == "aux":
      raise ValueError("block_idx was given to a layer with selector='aux', whose own gate "
                       "chooses its blocks. Fix: use selector='nsa' or 'quest', or drop block_idx.")
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    if positions is None:
      positions = default_positions(b, t, segment_ids)
    # Named scopes label the kernels in profiles (experiments/profile_step.py groups by them).
    with jax.named_scope("nsa_q"):  # with FUSE_PROJ the K/V (and gate) projections too
      q, gate_logits, kv = self._project(x)
      q = apply_rope(q, positions, self.rope_theta)
    with jax.named_scope("nsa_kv_cmp"):
      k_cmp, v_cmp = self.compress(*kv["cmp"], positions)
    with jax.named_scope("nsa_kv"):
      (k_s, v_s), (k_w, v_w) = kv["slc"], kv["win"]
      k_s = apply_rope(k_s, positions, self.rope_theta)
      k_w = k_s if cfg.shared_kv else apply_rope(k_w, positions, self.rope_theta)
    sel_loss = jnp.zeros((b, t), jnp.float32)
    if cfg.selector == "aux" and "slc" in cfg.branches:
      block_idx, sel_loss = aux_selector.select(q, k_s, self.aux_wq[...], self.aux_wk[...], cfg,
                                                segment_ids)
    with jax.named_scope("nsa_gates"):
      gates = self.gates(x, gate_logits)
    with jax.named_scope("nsa_op"):
      args = (q, k_cmp, v_cmp, k_s, v_s, k_w, v_w, gates, cfg)
      kw = dict(segment_ids=segment_ids, implementation=implementation)
      if select_edit is not None:
        if block_idx is None:  # the layer's own choice: one run of the op to read it
          block_idx = ops.nsa_attention(*args, **kw, return_aux=True, block_idx=None)[1][
              "block_idx"]
        edited = select_edit(block_idx)
        if getattr(edited, "shape", None) != block_idx.shape:
          raise ValueError(f"select_edit returned {getattr(edited, 'shape', type(edited))}, "
                           f"expected the selection's shape {block_idx.shape} [B, T, K, n]. Fix: "
                           "return an edited copy of the block_idx it is given.")
        block_idx = edited
      out = ops.nsa_attention(*args, **kw, return_aux=return_aux, block_idx=block_idx)
    o, aux = out if return_aux else (out, None)
    with jax.named_scope("nsa_out"):
      y = self.o_proj(o.reshape(b, t, cfg.num_heads * cfg.dim_v).astype(self.dtype))
    result = (y,)
    if return_aux:
      aux["gates"] = gates
      aux["q"], aux["k_slc"] = q, k_s  # after RoPE, as the selection branch sees them
      result += (aux,)
    if return_selector_loss:
      result += (sel_loss,)
    return result if len(result) > 1 else y


class DenseAttention(nnx.Module):
  """Full causal GQA attention with RoPE (the baseline): nsa_jax.ops.dense_attention, by default
  cuDNN on a GPU (the Pallas Triton kernels with segment ids), XLA elsewhere."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int,
               head_dim_v: int | None = None, *, rope_theta=10000.0, dtype="float32",
               param_dtype="float32", implementation="auto", rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}. "
                       "Fix: choose num_heads as a multiple of num_kv_heads.")
    check_rope_head_dim("DenseAttention", head_dim)
    if implementation not in DENSE_IMPLEMENTATIONS:  # refused when built, as ModelConfig does
      raise ValueError(f"DenseAttention(implementation={implementation!r}): expected one of "
                       f"{DENSE_IMPLEMENTATIONS}. Fix: pass one of them ('auto' picks per call).")
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

  def _project(self, x):
    """q [B, T, H, D], k, v [B, T, K, D] before RoPE, in as few matmuls as fuse_mode() allows
    (project_inputs, as NSAAttention's)."""
    b, t, _ = x.shape
    q, k, v = project_inputs(x, (self.q_proj, self.h // self.kh * self.dk),
                             [(self.k_proj, self.dk), (self.v_proj, self.dv)], [], self.kh,
                             self.dtype)
    return q.reshape(b, t, self.h, self.dk), k, v

  def __call__(self, x, *, segment_ids=None, positions=None, implementation=None,
               return_aux=False):
    """y [B, T, d_model]; with return_aux also {"q", "k"} after RoPE (diagnostics)."""
    segment_ids = check_layer_inputs("DenseAttention", x, self.d_model, segment_ids, positions)
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    if positions is None:
      positions = default_positions(b, t, segment_ids)
    with jax.named_scope("dense_qkv"):
      q, k, v = self._project(x)
      q, k = (apply_rope(a, positions, self.rope_theta) for a in (q, k))
    with jax.named_scope("dense_op"):
      o = ops.dense_attention(q, k, v, segment_ids, implementation=implementation or
                              self.implementation)
    with jax.named_scope("dense_out"):
      y = self.o_proj(o.reshape(b, t, self.h * self.dv))
    return (y, {"q": q, "k": k}) if return_aux else y
