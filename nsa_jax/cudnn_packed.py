"""cuDNN's packed-sequence flash attention for packed documents (segment ids), opt-in.

With segment ids the library's GPU default for dense layers and NSA's window branch is our Triton
window kernels, because cuDNN's causal / sliding-window call through jax.nn.dot_product_attention
takes no document ids. cuDNN itself does take packed documents: per-row segment offsets and
lengths ("packed layout", Hopper and later), which jax exposes only through its private
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`. This module calls that, behind
the environment variable NSA_CUDNN_PACKED=M (M: the static cap on documents in one row; unset or
0: off), so the choice can be timed (benchmarks/cudnn_packed_trial.py) before it becomes a default.

The cap is static because cuDNN's call shapes hold it, and memory grows with it: the softmax
statistics saved for the backward are B x M x heads x T floats, and the backward's workspace is
about 8 bytes x B x M x T x heads x head dim (a review helper on an H100, 2026-12-07: at the 8k
training layer, B = 8, 16 heads of 64, 4.3 GiB at M = 8 and 33 GiB at M = 64, against 0.15 GiB
for our kernels), so M should be the data's real largest count, not a generous bound. A row with more
than M documents never gets a cut answer: `packed_attention` checks the count inside the jitted
graph and runs the fallback (our kernels) for the whole call instead.

Measured (one H100, the 8k training layer, benchmarks/results/cudnn_packed_h100_s42/): with at
most 3-5 documents a row (M = 8) the dense backward takes 4.8-6.8 ms against 9.7-13.4 ms for our
kernels; with 25 a row (M = 32) it is slower (3.9 against 3.3 ms). Off by default until a training
run confirms it.

Documents are runs of equal ids (a change of id starts one), as the data pipeline makes them
(cumulative counts); ids that come back to an earlier value are separate documents here, while
the other paths treat equal ids as one document.

The private call is pinned to jax 0.11.2's signature; a jax that changes it fails loudly here.
"""
import logging
import os

import jax
import jax.numpy as jnp

ENV = "NSA_CUDNN_PACKED"


def packed_cap() -> int:
  """The segment cap M from NSA_CUDNN_PACKED (0: off)."""
  raw = os.environ.get(ENV, "").strip()
  if not raw:
    return 0
  try:
    m = int(raw)
  except ValueError:
    m = -1
  if m < 0:
    raise ValueError(f"{ENV}={raw!r}: expected the largest number of documents in one row (a "
                     "non-negative integer, e.g. 64), or unset / 0 for off")
  return m


def packed_params(seg, max_docs: int):
  """(seqlen [B, M], offsets [B, M + 1]) of cuDNN's packed layout for [B, T] document ids whose
  documents are contiguous runs (a change of id starts a document): row b's r-th run starts at
  offsets[b, r] and holds seqlen[b, r] tokens; entries past a row's last run are -1 (cuDNN's
  padding). Runs past M are dropped: callers check documents_per_row(seg) <= M."""
  b, t = seg.shape
  start = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  run = jnp.cumsum(start.astype(jnp.int32), axis=1) - 1  # [B, T] run index of each token
  rows = jnp.arange(b)[:, None]
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # non-starts and runs past M scatter out of bounds and are dropped (offsets[:, M] stays -1:
  # jax packs every row's non-negative entries together, so an extra start would shift the rows
  # after it)
  offsets = jnp.full((b, max_docs + 1), -1, jnp.int32).at[
      rows, jnp.where(start & (run < max_docs), run, max_docs + 1)].set(pos, mode="drop")
  counts = jnp.zeros((b, max_docs), jnp.int32).at[rows, run].add(1, mode="drop")
  return jnp.where(counts > 0, counts, -1), offsets


def documents_per_row(seg):
  """[B] int32: documents (contiguous runs of one id) in each row; traceable."""
  return 1 + jnp.sum((seg[:, 1:] != seg[:, :-1]).astype(jnp.int32), axis=1)


def applies(q, k, v) -> tuple[bool, str]:
  """(ok, why not): whether cuDNN's packed call takes these inputs on this machine."""
  if jax.default_backend() != "gpu":
    return False, "no GPU"
  if q.dtype not in (jnp.bfloat16, jnp.float16) or not q.dtype == k.dtype == v.dtype:
    return False, f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: cuDNN takes 16-bit inputs of one dtype"
  if q.shape[-1] != v.shape[-1] or q.shape[-1] % 8 or q.shape[-1] > 256:
    return False, f"head dims {q.shape[-1]}/{v.shape[-1]}: equal, a multiple of 8, <= 256"
  cc = getattr(jax.devices()[0], "compute_capability", "0")
  if float(cc) < 9.0:
    return False, f"compute capability {cc}: the packed layout needs Hopper (9.0) or later"
  from jax._src.cudnn import fused_attention_stablehlo as fa
  try:
    version = fa.check_cudnn_version()
  except RuntimeError as e:
    return False, f"cuDNN: {e}"
  if version < 90600:
    return False, f"cuDNN {version}: the packed layout needs 9.6 or later"
  return True, ""


def workspace_bytes(q, max_docs: int) -> int:
  """The packed backward's workspace, about 8 bytes x B x M x T x heads x head dim (measured, see
  the module docstring); the forward needs none."""
  b, t, h, d = q.shape
  return 8 * b * max_docs * t * h * d


def packed_attention(q, k, v, seg, window, max_docs, scale=None, fallback=None):
  """Causal attention inside each document of `seg` ([B, T] ids; window: the last `window` tokens
  of the document, or None / >= T for all of it), BTNH, through cuDNN's packed layout with the
  static cap `max_docs`. Where some row holds more documents than the cap, `fallback(q, k, v,
  seg)` computes the call instead (chosen inside the graph), so no row is ever cut."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # private: pinned to jax 0.11.2
  if max_docs < 1:
    raise ValueError(f"max_docs={max_docs}: the packed layout needs a cap of at least 1 document")
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  sw = None if window is None or window >= q.shape[1] else int(window)

  def cudnn(q, k, v, seg):
    seqlen, offsets = packed_params(seg, max_docs)
    return fa.dot_product_attention(q, k, v, None, None, seqlen, seqlen, offsets, offsets,
                                    scale=scale, mask_type=fa.MaskType.PADDING_CAUSAL,
                                    qkv_layout="BTNH", sliding_window_length=sw)

  if fallback is None:
    return cudnn(q, k, v, seg)
  fits = jnp.max(documents_per_row(seg)) <= max_docs
  return jax.lax.cond(fits, cudnn, fallback, q, k, v, seg)


def choice_note(q, m: int) -> str:
  """The log line's reason for choosing the packed call (the cap and its backward workspace)."""
  return (f"segment ids, {ENV}={m}: cuDNN's packed layout (backward workspace ~"
          f"{workspace_bytes(q, m) / 2**30:.1f} GiB a call), our Triton kernels for a batch with "
          f"more than {m} documents a row")


def cap_report(seg_batches, cap: int) -> tuple[int, str]:
  """(log level, message): how the cap M fits the documents a row of some batches' segment ids
  (numpy [B, T] each): the largest count, and the share of batches that would run the fallback
  (a batch falls back whole when one of its rows holds more than M documents)."""
  import numpy as np
  counts = [np.asarray(documents_per_row(np.asarray(s))) for s in seg_batches]
  over = sum(int(c.max() > cap) for c in counts)
  allc = np.concatenate(counts)
  msg = (f"{ENV}={cap}: documents a row in {len(counts)} training batches: max {int(allc.max())}, "
         f"mean {allc.mean():.1f}; {over} of {len(counts)} batches hold a row above the cap and "
         f"run our Triton kernels instead of cuDNN's packed layout")
  if over:
    return logging.WARNING, msg + (f". Fix: raise {ENV} to {int(allc.max())} or more (the "
                                   f"backward workspace grows with it) or leave it unset")
  return logging.INFO, msg
