"""KV caches and cached decoding for TransformerLM: `prefill` through the parallel forward pass,
then `decode_step` one token at a time, with logits equal to the parallel forward pass.

Per NSA layer the cache holds (head-major [B, K, S, D], batch first so it shards on the batch axis):
  k_slc, v_slc  raw rotated selection keys/values, S = max_len rounded up to whole selection blocks;
  k_win, v_win  a ring of the last min(w, max_len) window keys/values (slot p % W), or absent when
                the window shares the selection projection (shared_kv) and reads k_slc instead;
  buf_k, buf_v  the last l UN-rotated compression-projection keys/values, oldest first: a rolling
                buffer from which phi makes one compressed key/value every d tokens;
  k_cmp, v_cmp  the compressed keys (rotated at the block end i*d + l - 1) and values, one slot per
                block that fits in max_len; slot i is written when token i*d + l - 1 arrives.
Per dense layer: k, v [B, K, S, D]. Every sequence of a batch sits at the same position `pos`.

Only the modules' public pieces are used (projections, `compress`, `gates`, norms, MLPs), so any
change to the parallel layers shows up as a mismatch in tests/test_decode.py, never as silent drift.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from nsa_jax import decode_math as dm
from nsa_jax.attention import NSAAttention
from nsa_jax.config import NSAConfig, num_cmp_blocks
from nsa_jax.layers import apply_rope
from nsa_jax.model import check_token_ids


def _pytree(cls, meta=()):
  data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))


@_pytree
@dataclasses.dataclass
class NSALayerCache:
  """One NSA layer's cache; fields a configuration does not need are None (see module doc)."""
  k_slc: jax.Array | None = None
  v_slc: jax.Array | None = None
  k_win: jax.Array | None = None
  v_win: jax.Array | None = None
  buf_k: jax.Array | None = None
  buf_v: jax.Array | None = None
  k_cmp: jax.Array | None = None
  v_cmp: jax.Array | None = None

  def arrays(self) -> dict:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@_pytree
@dataclasses.dataclass
class DenseLayerCache:
  """One dense layer's cache: rotated keys k [B, K, S, Dk] and values v [B, K, S, Dv]."""
  k: jax.Array
  v: jax.Array


@functools.partial(_pytree, meta=("max_len",))
@dataclasses.dataclass
class DecodeCache:
  """The whole model's cache: pos (int32 scalar) = tokens cached so far = next token's position."""
  pos: jax.Array
  layers: tuple
  max_len: int


# ----------------------------------------------------------------------------- layout

def _needs(cfg: NSAConfig) -> dict:
  """Which cache parts a configuration reads."""
  slc = "slc" in cfg.branches
  cmp = "cmp" in cfg.branches or (slc and cfg.selector == "nsa")
  win = "win" in cfg.branches
  return {"cmp": cmp, "slc": slc or (win and cfg.shared_kv), "win": win and not cfg.shared_kv}


def _proj_name(cfg: NSAConfig, branch: str) -> str:
  return "shared" if cfg.shared_kv else branch


def _sel_len(cfg: NSAConfig, max_len: int) -> int:
  return -(-max_len // cfg.sel_block) * cfg.sel_block


def nsa_cache_shapes(cfg: NSAConfig, batch: int, max_len: int) -> dict:
  """Shapes of an NSA layer cache (head-major [B, K, S, D]); absent parts are missing keys."""
  kh, dk, dv = cfg.num_kv_heads, cfg.head_dim, cfg.dim_v
  need, out = _needs(cfg), {}
  if need["slc"]:
    s = _sel_len(cfg, max_len)
    out.update(k_slc=(batch, kh, s, dk), v_slc=(batch, kh, s, dv))
  if need["win"]:
    w = min(cfg.window, max_len)
    out.update(k_win=(batch, kh, w, dk), v_win=(batch, kh, w, dv))
  if need["cmp"]:
    # Whole 64-slot tiles (the split-K decode kernel walks 64 at a time); unseen slots are masked.
    nc = -(-max(1, num_cmp_blocks(max_len, cfg.cmp_block, cfg.cmp_stride)) // 64) * 64
    out.update(buf_k=(batch, kh, cfg.cmp_block, dk), buf_v=(batch, kh, cfg.cmp_block, dv),
               k_cmp=(batch, kh, nc, dk), v_cmp=(batch, kh, nc, dv))
  return out


def init_cache(model, batch: int, max_len: int, dtype=None) -> DecodeCache:
  """An empty cache (pos = 0) for up to max_len tokens; dtype: default the model's compute dtype."""
  if max_len < 1 or max_len > model.cfg.max_seq_len:
    raise ValueError(f"max_len={max_len} must be in [1, model max_seq_len="
                     f"{model.cfg.max_seq_len}]. Fix: lower max_len or build the model with a "
                     "larger max_seq_len.")
  if model.cfg.selection_from_layer is not None:
    raise ValueError(f"model.selection_from_layer={model.cfg.selection_from_layer}: cached "
                     "decoding of layers that reuse another layer's selection is not written (the "
                     "decode step selects per layer). Fix: score such a model with the parallel "
                     "forward pass (model(tokens)), or train with selection_from_layer=None.")
  layers = []
  for block in model.blocks:
    attn = block.attn
    dt = dtype or attn.dtype
    if isinstance(attn, NSAAttention):
      shapes = nsa_cache_shapes(attn.cfg, batch, max_len)
      layers.append(NSALayerCache(**{n: jnp.zeros(s, dt) for n, s in shapes.items()}))
    else:
      layers.append(DenseLayerCache(k=jnp.zeros((batch, attn.kh, max_len, attn.dk), dt),
                                    v=jnp.zeros((batch, attn.kh, max_len, attn.dv), dt)))
  return DecodeCache(pos=jnp.zeros((), jnp.int32), layers=tuple(layers), max_len=max_len)


def cache_shardings(cache: DecodeCache, mesh, batch_axis="data"):
  """NamedShardings that split every cache array on its batch axis (pos is replicated)."""
  P = jax.sharding.PartitionSpec
  def spec(x):
    return jax.sharding.NamedSharding(mesh, P(batch_axis) if x.ndim else P())
  return jax.tree.map(spec, cache)


def _head_major(x):
  return jnp.swapaxes(x, 1, 2)  # [B, T, K, D] <-> [B, K, T, D]


def _write(cache, new, start):
  """cache [B, K, S, D] with new [B, K, n, D] written at time slots start.. (traced start ok)."""
  return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start, axis=2)


# ----------------------------------------------------------------------------- projections

def _kv(attn: NSAAttention, x, branch):
  """Raw (un-rotated) k [B, T, K, Dk], v [B, T, K, Dv] of one branch's projection."""
  cfg, (b, t, _) = attn.cfg, x.shape
  name = _proj_name(cfg, branch)
  return (attn.k_proj[name](x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim),
          attn.v_proj[name](x).reshape(b, t, cfg.num_kv_heads, cfg.dim_v))


def _rope(attn, x, positions):
  return apply_rope(x, positions, attn.rope_theta)


# ----------------------------------------------------------------------------- prefill

def _fill_nsa(attn: NSAAttention, x, cache: NSALayerCache) -> NSALayerCache:
  """Writes positions 0..T-1 of one NSA layer's input x [B, T, d_model] into an empty cache."""
  cfg, (b, t, _) = attn.cfg, x.shape
  x = x.astype(attn.dtype)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  c = cache.arrays()
  if c["k_slc"] is not None:
    k, v = _kv(attn, x, "slc")
    c["k_slc"] = _write(c["k_slc"], _head_major(_rope(attn, k, pos)), 0)
    c["v_slc"] = _write(c["v_slc"], _head_major(v), 0)
  if c["k_win"] is not None:
    k, v = _kv(attn, x, "win")
    k = _rope(attn, k, pos)
    ring = dm.ring_positions(t - 1, c["k_win"].shape[2])  # what slot s holds after position T-1
    keep = (ring >= 0)[None, None, :, None]
    src = jnp.clip(ring, 0, t - 1)
    c["k_win"] = jnp.where(keep, _head_major(k)[:, :, src], 0).astype(c["k_win"].dtype)
    c["v_win"] = jnp.where(keep, _head_major(v)[:, :, src], 0).astype(c["v_win"].dtype)
  if c["k_cmp"] is not None:
    k, v = _kv(attn, x, "cmp")
    if t >= cfg.cmp_block:
      k_cmp, v_cmp = attn.compress(k, v, pos)  # every block already complete, rotated at its end
      c["k_cmp"] = _write(c["k_cmp"], _head_major(k_cmp), 0)
      c["v_cmp"] = _write(c["v_cmp"], _head_major(v_cmp), 0)
    l = cfg.cmp_block
    tail = lambda a: _head_major(jnp.pad(a, ((0, 0), (l, 0), (0, 0), (0, 0)))[:, -l:])
    c["buf_k"], c["buf_v"] = (tail(k).astype(c["buf_k"].dtype), tail(v).astype(c["buf_v"].dtype))
  return NSALayerCache(**c)


def _fill_dense(attn, x, cache: DenseLayerCache) -> DenseLayerCache:
  b, t, _ = x.shape
  x = x.astype(attn.dtype)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  k = apply_rope(attn.k_proj(x).reshape(b, t, attn.kh, attn.dk), pos, attn.rope_theta)
  v = attn.v_proj(x).reshape(b, t, attn.kh, attn.dv)
  return DenseLayerCache(k=_write(cache.k, _head_major(k), 0), v=_write(cache.v, _head_major(v), 0))


def prefill(model, tokens, max_len: int, dtype=None):
  """Runs the parallel forward pass over a prompt and fills a fresh cache.

  tokens [B, T] int (1 <= T <= max_len). Returns (logits [B, T, vocab] float32, cache with pos = T).
  The block loop repeats TransformerLM.__call__ so each layer's input can be projected into the
  cache; its logits equal model(tokens).
  """
  if tokens.ndim != 2 or tokens.shape[1] < 1:
    raise ValueError(f"tokens must be [batch, time] with time >= 1, got shape {tokens.shape}")
  check_token_ids(tokens, model.cfg.vocab_size)  # eager calls; a jitted prefill cannot raise
  if "nsa" in model.cfg.attention_kinds:
    dm.check_decodable(model.cfg.nsa)
  b, t = tokens.shape
  if t > max_len:
    raise ValueError(f"prompt of {t} tokens does not fit a cache of max_len={max_len}. "
                     "Fix: raise max_len or shorten the prompt.")
  cache = init_cache(model, b, max_len, dtype)
  x = model.embed(tokens)
  layers = []
  for block, layer_cache in zip(model.blocks, cache.layers):
    h = block.attn_norm(x)
    fill = _fill_nsa if isinstance(block.attn, NSAAttention) else _fill_dense
    layers.append(fill(block.attn, h, layer_cache))
    x = x + block.attn(h)
    x = x + block.mlp(block.mlp_norm(x))
  logits = _head(model, x)
  return logits, DecodeCache(pos=jnp.asarray(t, jnp.int32), layers=tuple(layers), max_len=max_len)


def _head(model, x):
  x = model.final_norm(x)
  logits = model.embed.attend(x) if model.cfg.tie_embeddings else model.lm_head(x)
  return logits.astype(jnp.float32)


# ----------------------------------------------------------------------------- one decode step

def _step_nsa(attn: NSAAttention, x, t, cache: NSALayerCache, kernels):
  """x [B, 1, d_model] at position t -> (y [B, 1, d_model], cache holding t)."""
  cfg, b = attn.cfg, x.shape[0]
  x = x.astype(attn.dtype)
  pos = jnp.full((b, 1), t, jnp.int32)
  q = _rope(attn, attn.q_proj(x).reshape(b, 1, cfg.num_heads, cfg.head_dim), pos)[:, 0]
  c = cache.arrays()
  if c["k_slc"] is not None:
    k, v = _kv(attn, x, "slc")
    c["k_slc"] = _write(c["k_slc"], _head_major(_rope(attn, k, pos)), t)
    c["v_slc"] = _write(c["v_slc"], _head_major(v), t)
  if c["k_win"] is not None:
    k, v = _kv(attn, x, "win")
    slot = jnp.mod(t, c["k_win"].shape[2])
    c["k_win"] = _write(c["k_win"], _head_major(_rope(attn, k, pos)), slot)
    c["v_win"] = _write(c["v_win"], _head_major(v), slot)
  if c["k_cmp"] is not None:
    c.update(_step_compression(attn, x, t, c))
  gates = attn.gates(x)[:, 0]
  o, _ = dm.nsa_decode(q, c, t, gates, cfg, **kernels)
  y = attn.o_proj(o.reshape(b, 1, cfg.num_heads * cfg.dim_v).astype(attn.dtype))
  return y, NSALayerCache(**c)


def _step_compression(attn: NSAAttention, x, t, c):
  """Rolls the new raw key into the buffer; when it completes block i = (t - l + 1) / d, phi turns
  the buffer into compressed slot i (rotated at t = i*d + l - 1, as NSAAttention.compress does)."""
  cfg, b = attn.cfg, x.shape[0]
  l, d = cfg.cmp_block, cfg.cmp_stride
  k, v = _kv(attn, x, "cmp")
  buf_k = jnp.concatenate([c["buf_k"][:, :, 1:], _head_major(k).astype(c["buf_k"].dtype)], axis=2)
  buf_v = jnp.concatenate([c["buf_v"][:, :, 1:], _head_major(v).astype(c["buf_v"].dtype)], axis=2)
  start = t - l + 1
  done = (start >= 0) & (jnp.mod(start, d) == 0)
  slot = jnp.clip(start // d, 0, c["k_cmp"].shape[2] - 1)
  positions = jnp.broadcast_to(start + jnp.arange(l), (b, l))
  k_new, v_new = attn.compress(_head_major(buf_k), _head_major(buf_v), positions)  # [B, 1, K, D]
  old_k = jax.lax.dynamic_slice_in_dim(c["k_cmp"], slot, 1, axis=2)
  old_v = jax.lax.dynamic_slice_in_dim(c["v_cmp"], slot, 1, axis=2)
  k_cmp = _write(c["k_cmp"], jnp.where(done, _head_major(k_new).astype(old_k.dtype), old_k), slot)
  v_cmp = _write(c["v_cmp"], jnp.where(done, _head_major(v_new).astype(old_v.dtype), old_v), slot)
  return {"buf_k": buf_k, "buf_v": buf_v, "k_cmp": k_cmp, "v_cmp": v_cmp}


def _step_dense(attn, x, t, cache: DenseLayerCache):
  b = x.shape[0]
  x = x.astype(attn.dtype)
  pos = jnp.full((b, 1), t, jnp.int32)
  q = apply_rope(attn.q_proj(x).reshape(b, 1, attn.h, attn.dk), pos, attn.rope_theta)[:, 0]
  k = apply_rope(attn.k_proj(x).reshape(b, 1, attn.kh, attn.dk), pos, attn.rope_theta)
  v = attn.v_proj(x).reshape(b, 1, attn.kh, attn.dv)
  k_all = _write(cache.k, _head_major(k), t)
  v_all = _write(cache.v, _head_major(v), t)
  o, _ = dm.dense_decode(dm.group_heads(q, attn.kh), k_all, v_all, t)
  y = attn.o_proj(o.reshape(b, 1, attn.h * attn.dv).astype(attn.dtype))
  return y, DenseLayerCache(k=k_all, v=v_all)


def check_room(cache: DecodeCache, steps: int = 1):
  """Raises ValueError unless `steps` more tokens fit (needs a concrete cache.pos)."""
  pos = int(cache.pos)
  if pos + steps > cache.max_len:
    raise ValueError(f"KV cache overflow: {pos} tokens cached, {steps} more requested, max_len="
                     f"{cache.max_len}. Fix: prefill with a larger max_len (at most the model's "
                     "max_seq_len) or generate fewer tokens.")


def decode_step(model, cache: DecodeCache, token, *, select_fn=None, prefix_fn=None,
                cmp_select_fn=None, select_window_fn=None, check=True):
  """Appends one token per sequence and returns (logits [B, vocab] float32, new cache).

  token [B] int. Outside jit a full cache raises ValueError. Under jit (cache.pos traced) the check
  cannot raise: call `check_room(cache, n)` before a loop of n steps; an overflowing step returns
  NaN logits, and its cache writes go where the clamped index points (the dense cache's last
  slot, the window ring's slot t % W, the selection cache's padding): the cache is then stale,
  not corrupt-looking, so call check_room first.
  select_fn, prefix_fn, cmp_select_fn, select_window_fn: Pallas decode kernels for the selection /
  compression and window branches / fused compression + top-n / selection + window in one launch
  (see `pallas_decode_kernels`); None = plain JAX.
  """
  if check and not isinstance(cache.pos, jax.core.Tracer):
    check_room(cache)
  t = cache.pos
  token = jnp.asarray(token).reshape(-1, 1)
  leaves = jax.tree.leaves(cache.layers)
  if leaves and token.shape[0] != leaves[0].shape[0]:  # shapes are static: this holds under jit
    raise ValueError(f"token holds {token.shape[0]} ids but the cache holds {leaves[0].shape[0]} "
                     f"sequences. Fix: pass one token per cached sequence, shape [{leaves[0].shape[0]}]")
  check_token_ids(token, model.cfg.vocab_size)  # eager calls; under jit the ids are sampled ones
  x = model.embed(token)
  layers = []
  for block, layer_cache in zip(model.blocks, cache.layers):
    h = block.attn_norm(x)
    if isinstance(block.attn, NSAAttention):
      y, new = _step_nsa(block.attn, h, t, layer_cache,
                         dict(select_fn=select_fn, prefix_fn=prefix_fn,
                              cmp_select_fn=cmp_select_fn, select_window_fn=select_window_fn))
    else:
      y, new = _step_dense(block.attn, h, t, layer_cache)
    layers.append(new)
    x = x + y
    x = x + block.mlp(block.mlp_norm(x))
  logits = _head(model, x)[:, 0]
  logits = jnp.where(t < cache.max_len, logits, jnp.nan)
  return logits, DecodeCache(pos=t + 1, layers=tuple(layers), max_len=cache.max_len)


# ----------------------------------------------------------------------------- jitted entry points

def pallas_decode_kernels(interpret=False) -> dict:
  """{select_fn, prefix_fn, cmp_select_fn, select_window_fn}: the Pallas decode kernels (split-K
  attention, the fused compression + top-n, selection + window in one launch), for decode_step /
  jit_decode."""
  from pallas_kernels import decode_attention as kern
  from pallas_kernels import decode_select
  return {"select_fn": functools.partial(kern.select_decode, interpret=interpret),
          "prefix_fn": functools.partial(kern.prefix_decode, interpret=interpret),
          "cmp_select_fn": functools.partial(decode_select.compressed_select_decode,
                                             interpret=interpret),
          "select_window_fn": functools.partial(kern.select_window_decode, interpret=interpret)}


def jit_decode(model, *, select_fn=None, prefix_fn=None, cmp_select_fn=None,
               select_window_fn=None):
  """(params, prefill_fn, step_fn): jitted functions over the split model state, so the weights
  are arguments, not constants baked into the executable.

  prefill_fn(params, tokens, max_len) -> (logits, cache); step_fn(params, cache, token) ->
  (logits, cache), with the cache donated.
  """
  graphdef, params = nnx.split(model)

  @functools.partial(jax.jit, static_argnums=2)
  def prefill_fn(params, tokens, max_len):
    return prefill(nnx.merge(graphdef, params), tokens, max_len)

  @functools.partial(jax.jit, donate_argnums=1)
  def step_fn(params, cache, token):
    return decode_step(nnx.merge(graphdef, params), cache, token, select_fn=select_fn,
                       prefix_fn=prefix_fn, cmp_select_fn=cmp_select_fn,
                       select_window_fn=select_window_fn, check=False)

  return params, prefill_fn, step_fn
