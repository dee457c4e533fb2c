"""Small building blocks shared by the attention modules and the LM: parameter annotation, RMSNorm,
RoPE, SwiGLU.

Sharding: every parameter carries logical axis names in its `out_sharding` metadata, drawn from
LOGICAL_AXES. Outside a mesh the names are only metadata. Inside `jax.set_mesh(mesh)` together with
`nnx.logical_axis_rules(rules)` Flax shards each parameter at creation (eager sharding), so a
model built inside a jitted init under a mesh is never materialised on one device.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from flax import nnx

from nsa_jax.reference import document_starts, host_segment_runs

# vocab: token ids; embed: residual width; heads / kv_heads: flattened (heads x head_dim) of the
# query and of each key/value projection; mlp: feed-forward hidden width. None: replicated.
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "mlp")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name):
  return DTYPES[name] if isinstance(name, str) else name


def annotated(init, *names):
  """An initializer whose parameters carry logical axis names (see module docstring)."""
  return nnx.with_partitioning(init, tuple(names))


def sharding_scope():
  """Eager sharding only when a mesh is set: lets users build modules with no mesh at all."""
  if jax.sharding.get_abstract_mesh().empty:
    return nnx.use_eager_sharding(False)
  return contextlib.nullcontext()


BATCH_MESH_AXES = ("data", "fsdp")  # mesh axes that split batch rows (nsa_jax.training.sharding)
HEAD_MESH_AXIS = "tensor"           # mesh axis that splits heads (whole KV groups)


def auto_mesh():
  """The mesh in context when the model should lay itself out on it, else None: no mesh, a single
  device, or manual / explicit axes (already inside shard_map, or sharding-in-types)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return None
  return mesh


def constrain_rows(x):
  """Pins an activation [B, ...] to rows split over the mesh's (data, fsdp) axes, the rest whole.

  A no-op without a mesh in context. Without it XLA's propagation may follow the FSDP-sharded
  weights and split the residual stream along d_model, which costs all-to-alls of [B, T, ...]
  activations in every layer; with it FSDP only all-gathers weights and reduce-scatters gradients,
  and tensor parallelism keeps the residual stream whole (Megatron style)."""
  mesh = auto_mesh()
  axes = tuple(a for a in BATCH_MESH_AXES if mesh is not None and a in mesh.shape)
  # No batch axis (a mesh with other axis names) or rows it cannot split: leave it to XLA.
  if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
    return x
  spec = jax.sharding.PartitionSpec(axes, *([None] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, spec)


def linear(d_in, d_out, names, *, dtype, param_dtype, rngs, use_bias=False, init=None):
  init = init or nnx.initializers.lecun_normal()
  return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                    kernel_init=annotated(init, *names),
                    bias_init=annotated(nnx.initializers.zeros_init(), names[-1]), rngs=rngs)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned scale; normalises in float32."""

  def __init__(self, dim, *, eps=1e-6, dtype=jnp.float32, param_dtype=jnp.float32, rngs=None):
    del rngs
    self.eps, self.dtype = eps, dtype
    self.scale = nnx.Param(annotated(nnx.initializers.ones_init(), None)(None, (dim,), param_dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class SwiGLU(nnx.Module):
  """Feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, d_model, hidden, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = linear(d_model, hidden, ("embed", "mlp"), **kw)
    self.up = linear(d_model, hidden, ("embed", "mlp"), **kw)
    self.down = linear(hidden, d_model, ("mlp", "embed"), **kw)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def apply_rope(x, positions, theta=10000.0):
  """Rotary position embedding (half-split form). x [B, T, H, D], positions [B, T] (int)."""
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  ang = positions.astype(jnp.float32)[..., None] * freq  # [B, T, D/2]
  sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def check_rope_head_dim(layer: str, head_dim: int):
  """apply_rope rotates pairs of dimensions: a layer that applies it needs an even head_dim."""
  if head_dim % 2:
    raise ValueError(f"head_dim={head_dim}: {layer} applies RoPE, which needs an even head_dim. "
                     "Fix: use an even head_dim.")


def check_layer_inputs(layer: str, x, d_model: int, segment_ids=None, positions=None):
  """The attention layers' input checks, before anything is computed from them: x [B, T, d_model]
  with T >= 1 and a floating dtype; segment_ids, when given, [B, T] integers or booleans (the
  NSA op needs one row per sequence); positions [B, T] or [1, T] (shared by the batch; any real
  dtype: fractional positions are how RoPE interpolation is done). Returns the segment ids for
  the layer to use (reference.host_segment_runs: host ids as runs, jax arrays unchanged)."""
  if x.ndim != 3 or x.shape[-1] != d_model:
    raise ValueError(f"{layer} expects x [batch, time, {d_model}], got {x.shape}. Fix: pass the "
                     "hidden states with the layer's d_model as the last axis.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{layer} expects floating-point x, got {x.dtype}. Fix: embed token ids "
                     "first (TransformerLM does) or cast x to a float dtype.")
  b, t, _ = x.shape
  if t < 1:
    raise ValueError(f"{layer} got an empty sequence (x {x.shape}). Fix: pass at least one token.")
  if positions is not None and tuple(positions.shape) not in ((b, t), (1, t)):
    raise ValueError(f"positions has shape {tuple(positions.shape)}, expected [batch, time] = "
                     f"{(b, t)} (or [1, time]) from x {x.shape}. Fix: give one position per "
                     "token, shaped like the batch.")
  return host_segment_runs(segment_ids, (b, t))  # the one segment-id check (reference)


def default_positions(batch, seq_len, segment_ids=None):
  """Positions 0..T-1, restarting at each document start when segment_ids are given."""
  pos = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))
  if segment_ids is None:
    return pos
  return pos - document_starts(segment_ids)
