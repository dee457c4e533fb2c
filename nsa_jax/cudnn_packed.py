"""cuDNN's packed-sequence flash attention for packed documents (segment ids).

cuDNN's causal / sliding-window call through jax.nn.dot_product_attention takes no document ids,
so with segment ids dense layers and NSA's window branch ran our Triton window kernels. cuDNN itself
does take packed documents: per-row segment offsets and lengths ("packed layout", Hopper and
later), which jax exposes only through its private
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`. This module calls that.

Who uses it:
- Dense layers with document masking in training: `config.data.cudnn_packed_cap` ("auto", the
  default: the training loop sets the cap from its first batches through `auto_cap` and
  `set_dense_cap`; "off"; or a fixed cap). Library users call `set_dense_cap(M)` themselves.
- Everything (dense layers and NSA's window branch) with the environment variable
  NSA_CUDNN_PACKED=M, which overrides the above (0: off for both). NSA's window branch uses it only
  so: at the 8k training layer it gained nothing in training (below) and costs the workspace.

The cap M (documents in one row) is static because cuDNN's call shapes hold it, and memory grows
with it: the softmax statistics saved for the backward are B x M x heads x T floats, and the
backward's workspace is about 8 bytes x B x M x T x heads x head dim (a review helper on an H100,
2026-12-07: at the 8k training layer, B = 8, 16 heads of 64, 4.3 GiB at M = 8 and 33 GiB at
M = 64, against 0.15 GiB for our kernels), so M should be the data's real largest count, not a
generous bound. A row with more than M documents never gets a cut answer: `packed_attention`
checks the count inside the jitted graph and runs the fallback (our kernels) for the whole call
instead.

Measured (one H100, the 8k training layer, benchmarks/results/cudnn_packed_h100_s42/): with at
most 3-5 documents a row (M = 8) the dense backward takes 4.8-6.8 ms against 9.7-13.4 ms for our
kernels; with 25 a row (M = 32) it is slower (3.9 against 3.3 ms), hence `AUTO_MAX_DOCS`. In
training (one H100, the masked 8k LM, benchmarks/results/packedpair_h100_s43/): dense 314.7k
tokens/s with M = 8 against 227.0k with our kernels (+5.8 GB peak); NSA with its window branch
packed 281.1k against 280.5k.

Documents are runs of equal ids (a change of id starts one), as on every other path
(nsa_jax.reference.document_runs): an id that comes back later in a row is another document.

The private call is pinned to jax 0.11.2's signature; a jax that changes it fails loudly here.
"""
import logging
import os

import jax
import jax.numpy as jnp

ENV = "NSA_CUDNN_PACKED"


# Above this many documents in one row "auto" keeps our kernels: at 25 a row (M = 32) the packed
# call was slower (module docstring); between 8 and 32 it is untimed.
AUTO_MAX_DOCS = 16
# "auto" also keeps our kernels where the estimated backward workspace exceeds this share of the
# device's memory.
AUTO_MAX_MEMORY_SHARE = 1 / 8
_dense_cap = 0  # set_dense_cap's value


def env_cap() -> int | None:
  """The cap from NSA_CUDNN_PACKED (0: off), or None where it is unset."""
  raw = os.environ.get(ENV, "").strip()
  if not raw:
    return None
  try:
    m = int(raw)
  except ValueError:
    m = -1
  if m < 0:
    raise ValueError(f"{ENV}={raw!r}: expected the largest number of documents in one row (a "
                     "non-negative integer, e.g. 64), or unset / 0 for off")
  return m


def set_dense_cap(m: int) -> None:
  """Dense layers with segment ids run cuDNN's packed layout with document cap `m` (0: our
  kernels), read when a call is traced; NSA_CUDNN_PACKED, where set, overrides it. The training
  loop sets it from config.data.cudnn_packed_cap."""
  global _dense_cap
  if isinstance(m, bool) or not isinstance(m, int) or m < 0:
    raise ValueError(f"set_dense_cap({m!r}): expected the largest number of documents in one row "
                     "(a non-negative int; 0 for off)")
  _dense_cap = m


def dense_cap() -> int:
  """set_dense_cap's value (0: none set)."""
  return _dense_cap


def packed_cap(dense: bool = False) -> int:
  """The document cap M for a call (0: off): NSA_CUDNN_PACKED where set, else for dense layers
  set_dense_cap's value, for the window branch 0."""
  m = env_cap()
  if m is not None:
    return m
  return _dense_cap if dense else 0


def cap_source(dense: bool = False) -> str:
  """Where packed_cap's value comes from, for log lines."""
  return ENV if env_cap() is not None or not dense else "the dense cap (data.cudnn_packed_cap)"


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
  the module docstring) for q (an array or its [B, T, heads, head dim] shape); the forward needs
  none."""
  b, t, h, d = getattr(q, "shape", q)
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


def choice_note(q, m: int, source: str = ENV) -> str:
  """The log line's reason for choosing the packed call (the cap and its backward workspace)."""
  return (f"segment ids, {source}={m}: cuDNN's packed layout (backward workspace ~"
          f"{workspace_bytes(q, m) / 2**30:.1f} GiB a call), our Triton kernels for a batch with "
          f"more than {m} documents a row")


def cap_report(seg_batches, cap: int, source: str = ENV) -> tuple[int, str]:
  """(log level, message): how the cap M fits the documents a row of some batches' segment ids
  (numpy [B, T] each): the largest count, and the share of batches that would run the fallback
  (a batch falls back whole when one of its rows holds more than M documents)."""
  import numpy as np
  counts = [np.asarray(documents_per_row(np.asarray(s))) for s in seg_batches]
  over = sum(int(c.max() > cap) for c in counts)
  allc = np.concatenate(counts)
  msg = (f"{source}={cap}: documents a row in {len(counts)} training batches: max {int(allc.max())}, "
         f"mean {allc.mean():.1f}; {over} of {len(counts)} batches hold a row above the cap and "
         f"run our Triton kernels instead of cuDNN's packed layout (on the devices that hold such "
         f"a row)")
  if over:
    return logging.WARNING, msg + (f". Fix: raise {source} to {int(allc.max())} or more (the "
                                   f"backward workspace grows with it)" +
                                   (" or leave it unset" if source == ENV else ""))
  return logging.INFO, msg


def auto_cap(most: int, n_batches: int, q_shape, memory_bytes=None) -> tuple[int, str]:
  """(cap, why) for data.cudnn_packed_cap="auto" from `most`, the largest count of documents in
  one row of the first `n_batches` batches: rounded up to a multiple of 4 (a later batch with a
  few more still fits; one with more than the cap runs our kernels, whole); 0 (our kernels) where
  that count exceeds AUTO_MAX_DOCS or the backward workspace for q_shape (one device's [B, T,
  heads, head dim]) exceeds AUTO_MAX_MEMORY_SHARE of memory_bytes (None: not checked)."""
  seen = f"at most {most} documents a row in {n_batches} batches"
  if most > AUTO_MAX_DOCS:
    return 0, (f"{seen}, more than {AUTO_MAX_DOCS}: our Triton kernels (cuDNN's packed layout was "
               f"slower at 25 a row, and its workspace grows with the count)")
  cap = max(4, -(-most // 4) * 4)
  ws = workspace_bytes(q_shape, cap)
  if memory_bytes and ws > AUTO_MAX_MEMORY_SHARE * memory_bytes:
    return 0, (f"{seen}: cuDNN's packed layout with cap {cap} would need ~{ws / 2**30:.1f} GiB of "
               f"backward workspace, more than {AUTO_MAX_MEMORY_SHARE:.0%} of the device's "
               f"{memory_bytes / 2**30:.0f} GiB: our Triton kernels (set "
               f"--config.data.cudnn_packed_cap={cap} to use it anyway)")
  return cap, (f"{seen}: cuDNN's packed layout with cap {cap} (backward workspace ~"
               f"{ws / 2**30:.1f} GiB a call; a batch with a row above it runs our Triton kernels "
               f"on the devices that hold such a row)")
