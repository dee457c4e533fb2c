"""The compression branch (Eq. 7-8) as ONE causal attention call, so that cuDNN's flash attention
can run it on a GPU.

Query t sees compressed block i iff i*d + l - 1 <= t (nsa_jax.reference.cmp_visible_mask, no
segments). Shift the queries by l - 1 (s = t - l + 1; the first l - 1 queries see nothing) and the
rule becomes i <= s // d: the d consecutive queries of group g = s // d all see exactly blocks
0..g. So fold each group's d positions into the head axis,

  q [B, T, K*G, D] -> drop the first l-1 rows, pad to Nc*d -> [B, Nc, K * d * G, D],

and the branch is plain causal attention (query group g sees keys 0..g, top-left aligned) with
Nc queries, Nc keys and d*G query heads per KV head (the GQA order cuDNN expects: KV head major).
The number of groups equals Nc = (T - l) // d + 1 exactly (padded to an even count for cuDNN:
extra groups and zero keys at the end, seen only by each other, sliced off). Same FLOPs as the
Pallas kernel, but in cuDNN's tuned flash kernels (forward and backward).

Returns (o [B, T, H, Dv] in q.dtype, lse [B, T, H] float32, natural log, -inf for queries that see
no block), the contract of pallas_kernels.compress_attention. lse carries no gradient here (the NSA
op only feeds it to the top-n, whose block indices are integers); o is differentiable.

implementation="cudnn" (GPU, bf16/fp16) or "xla" (any backend; plain-JAX attention, used by
the tests to check the fold itself on a CPU).

Checked on the H200 against the plain-JAX path (`bench_nsa --check`, T = 2048): o, lse, the
top-n indices fed by this lse, and the gradients through cuDNN's backward (2026-11-30,
benchmarks/results/nsa_h200_foldnsa.md); the fold's own reshapes also on the CPU. Lives in
pallas_kernels (which never imports nsa_jax) next to the Triton kernels it stands in for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


# The private cuDNN entry point and its residual layout were read in this jax minor version only.
CHECKED_JAX = (0, 11)


def _device_capability():
  """Compute capability of the first device as (major, minor), or None if it has none."""
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return tuple(int(x) for x in str(cc).split(".")[:2]) if cc else None
  except ValueError:
    return None


def supports(dk, dv, dtype, has_seg, capability=None):
  """(ok, reason): whether the cuDNN fold applies: no segment ids, bf16/fp16, head dims cuDNN
  takes after padding d_v up to d_k or the reverse, a Hopper-or-newer GPU (`capability`, default:
  the first device's; head dims above 128 need it), and the jax minor version it was checked in."""
  if has_seg:
    return False, "segment ids (the fold needs one visibility rule for every query of a group)"
  if tuple(jax.__version_info__[:2]) != CHECKED_JAX:
    return False, (f"jax {jax.__version__}: the private cuDNN call was checked with jax "
                   f"{CHECKED_JAX[0]}.{CHECKED_JAX[1]} only")
  try:  # a private jax module (public jax.nn.dot_product_attention casts lse to bfloat16)
    from jax._src.cudnn import fused_attention_stablehlo as fa
    fa.dot_product_attention, fa.MaskType.CAUSAL  # noqa: B018
  except (ImportError, AttributeError) as e:
    return False, f"jax's cuDNN attention module is not where jax 0.11.2 has it ({e})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False, f"dtype {jnp.dtype(dtype).name} (cuDNN flash takes bfloat16/float16)"
  dim = max(dk, dv)
  if dim > 256 or dim % 8:
    return False, f"head dim {dim} (cuDNN needs <= 256 and a multiple of 8)"
  cap = capability if capability is not None else _device_capability()
  if cap is None or cap < (9, 0):
    return False, f"GPU compute capability {cap} (measured and checked on Hopper, sm_90, only)"
  return True, "ok"


def pad_head_dim(x, dim):
  """x [..., D] zero-padded on its last axis to `dim` (cuDNN needs d_k == d_v; zero columns leave
  the logits unchanged and give zero outputs, sliced off). x itself when already that wide: no
  jnp.pad, a nested jit."""
  if x.shape[-1] == dim:
    return x
  return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, dim - x.shape[-1]),))


def padded_groups(nc):
  """Query groups (= keys) after padding Nc: even, and a multiple of 64 beyond 64."""
  return -(-nc // 64) * 64 if nc > 64 else nc + nc % 2


def fold_queries(q, block, stride, num_cmp, kv_heads):
  """q [B, T, K*G, D] -> [B, num_cmp, K*stride*G, D] (see the module docstring; num_cmp may
  exceed the real Nc, the extra groups are zero rows)."""
  b, t, h, dim = q.shape
  g = h // kv_heads
  qs = q[:, block - 1:]
  qs = jnp.pad(qs, ((0, 0), (0, num_cmp * stride - qs.shape[1]), (0, 0), (0, 0)))
  qs = qs.reshape(b, num_cmp, stride, kv_heads, g, dim).transpose(0, 1, 3, 2, 4, 5)
  return qs.reshape(b, num_cmp, kv_heads * stride * g, dim)


def unfold(x, t, block, stride, kv_heads, fill):
  """Inverse of fold_queries for [B, Nc, K*stride*G, ...] -> [B, T, K*G, ...]; the first block-1
  positions (which see no compressed block) get `fill`."""
  b, nc, hf = x.shape[:3]
  g = hf // (kv_heads * stride)
  rest = x.shape[3:]
  y = x.reshape((b, nc, kv_heads, stride, g) + rest)
  y = jnp.moveaxis(y, 3, 2).reshape((b, nc * stride, kv_heads * g) + rest)
  y = y[:, :t - block + 1]
  head = jnp.full((b, block - 1, kv_heads * g) + rest, fill, x.dtype)
  return jnp.concatenate([head, y], axis=1)


def _attention(qf, k, v, scale, implementation, sliding_window=None):
  """Causal attention with the log-sum-exp: (o [B, N, Hq, D], lse [B, N, Hq] float32).

  "cudnn" calls jax's own cuDNN flash-attention wrapper below the public
  jax.nn.dot_product_attention, because the public one returns the log-sum-exp cast to the
  output dtype (bfloat16: ~3% error in p = exp(s - lse), enough to reorder the top-n); this one
  returns cuDNN's float32 softmax statistics. It is a private module (checked by `supports`).
  sliding_window=w: only the keys m with n - w < m <= n (pallas_kernels.window_attention's
  "cudnn-fwd" backend); None: causal."""
  if implementation == "cudnn":
    from jax._src.cudnn import fused_attention_stablehlo as fa
    o, lse = fa.dot_product_attention(qf, k, v, scale=scale, mask_type=fa.MaskType.CAUSAL,
                                      qkv_layout="BTNH", return_residual=True,
                                      sliding_window_length=sliding_window)
    b, n, hq, _ = qf.shape
    # jax 0.11 returns [B, heads, T]; a different layout fails here, except when heads == T,
    # which only the jax-version gate in `supports` covers.
    if lse.shape != (b, hq, n):
      raise NotImplementedError(f"cuDNN softmax stats of shape {lse.shape} for q {qf.shape}: "
                                "not the [B, heads, T] layout this fold was checked with. Fix: "
                                "implementation='pallas-triton'")
    return o, jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32)
  if implementation == "xla":
    b, n, hq, dim = qf.shape
    kh = k.shape[2]
    qg = qf.reshape(b, n, kh, hq // kh, dim)
    s = jnp.einsum("bnkgd,bmkd->bkgnm", qg, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    if sliding_window:  # keys m with n - w < m <= n, as cuDNN's sliding_window_length
      causal = causal & (jnp.arange(n)[:, None] - jnp.arange(n)[None, :] < sliding_window)
    s = jnp.where(causal, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, K, G, N]
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bkgnm,bmkd->bnkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (o.reshape(b, n, hq, -1).astype(qf.dtype),
            jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, n, hq))
  raise ValueError(f"implementation={implementation!r}: expected 'cudnn' or 'xla'")


def compressed_attention(q, k_cmp, v_cmp, block, stride, scale=None, *, implementation="cudnn"):
  """Compression-branch attention without segment ids: (o [B,T,H,Dv], lse [B,T,H] float32)."""
  b, t, h, dk = q.shape
  nc, kh, dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[-1]
  if h % kh:
    raise ValueError(f"{h} query heads are not a multiple of {kh} KV heads")
  expect = 0 if t < block else (t - block) // stride + 1
  if nc != expect:
    raise ValueError(f"k_cmp has {nc} blocks, expected {expect} for T={t}, l={block}, d={stride}")
  if nc == 0:
    return jnp.zeros((b, t, h, dv), q.dtype), jnp.full((b, t, h), -jnp.inf, jnp.float32)
  scale = float(dk ** -0.5 if scale is None else scale)
  dim = max(dk, dv)
  pad = lambda x: pad_head_dim(x, dim)  # noqa: E731
  # cuDNN's training path refuses odd lengths; a multiple of 64 also fills its tiles. Extra zero
  # keys k >= Nc are seen only by the extra query groups g >= Nc (causal), which are sliced off.
  ncp = padded_groups(nc)
  pad_k = lambda x: jnp.pad(pad(x), ((0, 0), (0, ncp - nc), (0, 0), (0, 0))).astype(q.dtype)
  qf = fold_queries(pad(q), block, stride, ncp, kh)
  o, lse = _attention(qf, pad_k(k_cmp), pad_k(v_cmp), scale, implementation)
  o = unfold(o[..., :dv], t, block, stride, kh, 0).astype(q.dtype)
  # Load-bearing: jax's cuDNN backward drops the log-sum-exp's cotangent without a word
  # (fused_attention_stablehlo: grad_output = grad_output[0]); stop_gradient makes that explicit.
  # Callers that need lse's gradient use compress_attention(backend="cudnn") (Triton backward).
  lse = unfold(jax.lax.stop_gradient(lse), t, block, stride, kh, -jnp.inf)
  return o, lse
