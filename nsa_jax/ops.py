"""One entry point for the NSA op, `nsa_attention(..., implementation=...)`, and the dense baseline.

Implementations:
  "reference": dense masks (nsa_jax.reference); exact, O(T^2) memory; for checking.
  "xla":       memory-sane plain JAX (nsa_jax.xla); any backend.
  "pallas":    Pallas GPU kernels (pallas_kernels): compression attention (fwd + bwd), fused block
               scoring + top-n, selection attention; the window branch on cuDNN's local window
               (plain JAX with segment ids). On a GPU without segment ids and from
               FOLD_MIN_BLOCKS compressed blocks on, the compression forward runs as one cuDNN
               flash-attention call on queries folded by the compression stride
               (pallas_kernels.compress_fold), its backward in cuDNN too at d_k == d_v
               (FOLD_CUDNN_BACKWARD) and in the Triton kernels at d_k != d_v;
               "pallas-triton" / "pallas-mosaic" keep the kernels.
               The Quest selector's scores stay in plain JAX.
               Requested off a GPU, the same kernels run in Pallas' interpreter (slow; tests).
               Backward: the compression kernel saves its inputs, o and lse and recomputes p; the
               top-n indices carry no gradient; the selection kernel keeps its own residuals.
  "auto":      "pallas" on a GPU when the kernels support the shape, else "xla".
Which one ran is logged once per shape (logger "nsa_jax"); on a GPU a fallback is a warning.

Under a device mesh (`jax.set_mesh`, as the training loop does) both ops run inside `jax.shard_map`:
batch rows split over the mesh's batch axes (data, fsdp) and KV groups (with their query heads) over
the tensor axis, so every device runs the kernels on its own rows and heads and the op moves no data
between devices (XLA cannot partition a Pallas custom call by itself: without this it would gather
the inputs and compute the whole op on every device). A dimension the mesh does not divide stays
whole on that axis (computed redundantly there), with a warning naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nsa_jax import reference
from nsa_jax.config import DENSE_IMPLEMENTATIONS, NSAConfig
from nsa_jax import cudnn_packed
from nsa_jax.layers import BATCH_MESH_AXES, HEAD_MESH_AXIS, auto_mesh

log = logging.getLogger("nsa_jax")


@functools.lru_cache(maxsize=256)
def log_once(level, msg):
  """Log msg at level once per distinct (level, msg): called at trace time, so once per shape."""
  log.log(level, msg)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _parse_streams(spec: str) -> dict:
  """"win:1,cmp:2" -> {"win": 1, "cmp": 2}; "" -> {}."""
  out = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, _, num = part.partition(":")
    if name not in ("cmp", "slc", "win") or not num.isdigit() or int(num) < 1:
      raise ValueError(f"NSA_BRANCH_STREAMS entry {part!r}: want branch:stream with branch in "
                       "cmp / slc / win and stream >= 1 (e.g. NSA_BRANCH_STREAMS=win:1)")
    if name in out:
      raise ValueError(f"NSA_BRANCH_STREAMS names branch {name!r} twice ({spec!r}): give each "
                       "branch one stream")
    out[name] = int(num)
  return out


# Experimental (opt-in): run a branch on its own GPU stream through jax's compute_on
# ("gpu_stream:N", XLA's stream annotation), so that it can overlap the other branches, forward
# and backward. {} (the default) keeps every kernel on the one compute stream. The H200 runs
# set --xla_gpu_experimental_stream_annotation=true in XLA_FLAGS; without it XLA still read the
# annotation (the cmp layout failed the same way), so the flag's role is not pinned down.
BRANCH_STREAMS = _parse_streams(os.environ.get("NSA_BRANCH_STREAMS", ""))
STREAMS_OFF_GPU = False  # tests: wrap in compute_on off a GPU too (the annotation is ignored there)
# With streams set: put the branches' ops into one XLA scheduling group
# (_scheduling_group_id), which asks the scheduler to overlap the group's async stream calls
# with its other work (NSA_STREAM_GROUP=1). Forward only: jax does not tag gradient ops.
STREAM_GROUP = os.environ.get("NSA_STREAM_GROUP", "") == "1"


def _stream_group():
  if STREAM_GROUP and not BRANCH_STREAMS and on_gpu():
    log_once(logging.WARNING, "NSA_STREAM_GROUP=1 without NSA_BRANCH_STREAMS does nothing: the "
             "group only matters for branches on their own streams")
  if not (STREAM_GROUP and BRANCH_STREAMS and (on_gpu() or STREAMS_OFF_GPU)):
    return contextlib.nullcontext()
  from jax.experimental.xla_metadata import set_xla_metadata
  log_once(logging.INFO, "NSA branches in one XLA scheduling group")
  if on_gpu():
    log_once(logging.WARNING, "NSA_STREAM_GROUP=1: on the H200 with jaxlib 0.11.2 XLA refused the "
             "scheduling group ('Done instruction's start operand is not annotated with the same "
             "id', benchmarks/results/streams_h200.md). If compilation fails, unset it")
  return set_xla_metadata(_scheduling_group_id="1")


def _on_stream(branch, fn, *args, flat=True, why=""):
  """fn(*args), on GPU stream BRANCH_STREAMS[branch] when one is set.

  flat=False: fn traces to nested jits (jnp.pad, plain-JAX attention), which XLA 0.11.2 refused
  inside a stream on the H200 ("No ExecutionStreamId found for call-start"; the cmp layout in
  streams_h200.md, the window's plain-JAX path in gpu_tests_h200_compress_dd04846.log). On a GPU
  such a call runs on the default stream, with a warning naming `why`; off a GPU (tests) it is
  wrapped as usual, since the annotation is ignored there."""
  stream = BRANCH_STREAMS.get(branch)
  if stream is None or not (on_gpu() or STREAMS_OFF_GPU):
    return fn(*args)
  if not flat and on_gpu():
    log_once(logging.WARNING, f"NSA_BRANCH_STREAMS {branch}:{stream} not applied to this call: "
             f"{why}; XLA (jaxlib 0.11.2) refuses nested jits inside a stream ('No "
             "ExecutionStreamId found for call-start'), so the branch runs on the default stream")
    return fn(*args)
  from jax._src import core as jax_core
  from jax.experimental.compute_on import compute_on
  log_once(logging.INFO, f"NSA {branch} branch on GPU stream {stream} (compute_on)")
  if branch != "win" and on_gpu():
    log_once(logging.WARNING, f"NSA_BRANCH_STREAMS {branch}:{stream}: on the H200 with jaxlib "
             "0.11.2 only win:N compiled (a window call that is one flat cuDNN call); XLA "
             "refused cmp ('No ExecutionStreamId found for call-start') and a compile with slc "
             "aborted after a refused one "
             "(benchmarks/results/streams_h200.md). If compilation fails, drop this entry")
  return compute_on(fn, compute_type=f"gpu_stream:{stream}",
                    out_memory_spaces=jax_core.MemorySpace.Device)(*args)


def _pallas_support(q, k, v, cfg: NSAConfig):
  """(ok, reason): whether every Pallas kernel the op needs handles these shapes."""
  try:
    from pallas_kernels import compress_attention as ck
    from pallas_kernels import select_attention as sk
    from pallas_kernels import select_topn as tk
  except ImportError as e:  # kernels not built into this checkout
    return False, f"pallas_kernels unavailable ({e})"
  b, t, h, dk = q.shape
  kc_shape = (b, cfg.num_cmp_blocks(t), cfg.num_kv_heads, dk)
  vc_shape = kc_shape[:3] + (cfg.dim_v,)
  checks = [("select_attention",
             sk.supports(q.shape, k.shape, v.shape, cfg.num_selected, cfg.sel_block, "triton")),
            ("compress_attention", ck.supports(q.shape, kc_shape, vc_shape))]
  if cfg.selector == "nsa":
    checks.append(("select_topn", tk.supports(q.shape, kc_shape, cfg.cmp_block, cfg.cmp_stride,
                                              cfg.sel_block)))
  for name, (ok, why) in checks:
    if not ok:
      return False, f"{name}: {why}"
  return True, "ok"


# "pallas": the Pallas kernels, the selection's backend chosen per shape where measured
# (select_attention.auto_backend: Mosaic GPU or Triton); "pallas-triton": Triton kernels only;
# "pallas-mosaic": the Mosaic GPU selection and compression kernels wherever they apply.
PALLAS_IMPLS = ("pallas", "pallas-triton", "pallas-mosaic")


def resolve_implementation(requested, q, k_slc, v_slc, cfg: NSAConfig) -> str:
  """Turns "auto" into a concrete implementation and logs the choice."""
  shape = f"q{tuple(q.shape)} {q.dtype}"
  impl = requested
  if requested == "auto":
    impl = "pallas" if on_gpu() else "xla"
  if impl in PALLAS_IMPLS:
    ok, why = _pallas_support(q, k_slc, v_slc, cfg)
    if not ok:
      level = logging.WARNING if on_gpu() or requested != "auto" else logging.INFO
      log_once(level, f"NSA falls back to the plain-JAX path for {shape}: {why}")
      impl = "xla"
  if impl not in PALLAS_IMPLS + ("xla", "reference"):
    raise ValueError(f"implementation={impl!r}: expected 'auto', 'pallas', 'pallas-triton', "
                     "'pallas-mosaic', 'xla' or 'reference'")
  log_once(logging.INFO,
           f"NSA attention implementation: {impl} for {shape} on {jax.default_backend()}")
  return impl


# The window branch on a GPU. "cudnn": cuDNN's sliding window, forward and backward (jax.nn's
# local_window_size; no segment ids, 16-bit inputs, d_v zero-padded to d_k when they differ);
# "cudnn-fwd": cuDNN's sliding-window forward with its float32 softmax statistics and the Triton
# backward of pallas_kernels.window_attention; "triton": that module's kernels, forward and
# backward (segment ids, float32, d_k != d_v unpadded). Off a GPU: "xla" (nsa_jax.xla, banded).
# Where neither applies (head dims that are not multiples of 16, mixed dtypes) the plain-JAX
# path runs on a GPU too, with a warning. The rule: see window_backend.
# NSA_WINDOW_BACKEND forces one of the GPU choices (benchmarks, A/B runs).
WINDOW_BACKENDS = ("cudnn", "cudnn-fwd", "triton")


def _cudnn_window_applies(q, segment_ids, allow_cudnn):
  """cuDNN's sliding window takes the call: allowed, no segment ids, 16-bit inputs."""
  return allow_cudnn and segment_ids is None and q.dtype in (jnp.bfloat16, jnp.float16)


def window_backend(q, v, segment_ids=None, allow_cudnn=True) -> str:
  """The window branch's implementation for these inputs (see WINDOW_BACKENDS); logged.

  The rule: cuDNN's whole sliding window where it takes the call (16-bit, no segment ids) and
  d_k == d_v; the Pallas Triton kernels otherwise. With d_k != d_v cuDNN needs d_v padded to d_k,
  and the kernels (no padding) were faster: 64k, 64/4 heads, 192/128, H100 (bench_window,
  2026-12-06, benchmarks/results/window_h100.md) forward 4.49 vs 5.01 ms, backward 16.50 vs
  21.64 ms; at 128/128 and at the 8k training layer (64/64) cuDNN was faster (forward 3.06 vs
  3.93 ms, backward 12.09 vs 13.13 ms at 64k). Only 64k 192/128 was timed with d_k != d_v; shorter
  sequences and small heads with d_k != d_v follow it untimed."""
  if not on_gpu():
    return "xla"
  forced = os.environ.get("NSA_WINDOW_BACKEND", "")
  if forced and forced not in WINDOW_BACKENDS:
    raise ValueError(f"NSA_WINDOW_BACKEND={forced!r}: expected one of {WINDOW_BACKENDS} (or "
                     "unset for the rule)")
  cudnn_ok = _cudnn_window_applies(q, segment_ids, allow_cudnn)
  m = cudnn_packed.packed_cap() if segment_ids is not None and allow_cudnn else 0
  if m and forced:
    log_once(logging.WARNING, f"{cudnn_packed.ENV}={m} and NSA_WINDOW_BACKEND={forced} are both "
             f"set: the window branch follows NSA_WINDOW_BACKEND")
  if m and not forced:
    from pallas_kernels import window_attention as wk
    ok, no = cudnn_packed.applies(q, q, v)
    ok2, no2 = wk.supports(q.shape, v.shape[:3] + q.shape[-1:], v.shape)
    if ok and ok2:
      log_once(logging.INFO, f"NSA window branch for q{tuple(q.shape)} v{tuple(v.shape)}: "
               f"cudnn-packed ({cudnn_packed.choice_note(q, m)})")
      return "cudnn-packed"
    log_once(logging.WARNING, f"{cudnn_packed.ENV}={m} is set, but cuDNN's packed layout does not "
             f"take the window branch on q{tuple(q.shape)} v{tuple(v.shape)} ({no or no2})")
  if forced and (cudnn_ok or forced == "triton"):
    be, why = forced, "NSA_WINDOW_BACKEND"
  elif cudnn_ok and q.shape[-1] == v.shape[-1]:
    be, why = "cudnn", "no segment ids, 16-bit inputs, d_k == d_v"
  else:
    be, why = "triton", ("segment ids" if segment_ids is not None else
                         "cuDNN not allowed" if not allow_cudnn else
                         f"dtype {jnp.dtype(q.dtype).name}" if not cudnn_ok else
                         f"d_k={q.shape[-1]} != d_v={v.shape[-1]}: cuDNN would pad d_v")
    if forced:
      why += f"; NSA_WINDOW_BACKEND={forced} needs cuDNN"
    from pallas_kernels import window_attention as wk
    ok, no = wk.supports(q.shape, v.shape[:3] + q.shape[-1:], v.shape)
    if ok and q.dtype != v.dtype:
      ok, no = False, f"q and v have dtypes {q.dtype} and {v.dtype}"
    if not ok and cudnn_ok:  # cuDNN (padding d_v) rather than plain JAX
      be, why = "cudnn", f"no segment ids and 16-bit inputs; the Pallas kernels refuse ({no})"
    elif not ok:  # the plain-JAX path takes any shape: slow, so said at WARNING
      log_once(logging.WARNING, f"NSA window branch for q{tuple(q.shape)} v{tuple(v.shape)} on "
               f"GPU uses plain JAX: cuDNN does not apply ({why}) and the Pallas window kernels "
               f"refuse the call ({no})")
      return "xla"
  log_once(logging.INFO, f"NSA window branch for q{tuple(q.shape)} v{tuple(v.shape)}: {be} ({why})")
  return be


def _window_flat(q, v, segment_ids):
  """(flat, why) for _on_stream: the window branch is one cuDNN call only when the rule picks
  cuDNN and d_k == d_v (otherwise jnp.pad, the Pallas kernels' layout or the plain-JAX path adds
  nested jits)."""
  if window_backend(q, v, segment_ids) != "cudnn":
    return False, ("the window branch runs Pallas kernels, cuDNN's packed layout or plain JAX "
                   "here (segment ids, a dtype cuDNN does not take, d_k != d_v, or "
                   "NSA_WINDOW_BACKEND)")
  if q.shape[-1] != v.shape[-1]:
    return False, f"the window branch pads d_v={v.shape[-1]} to d_k={q.shape[-1]} for cuDNN"
  return True, ""


def _padded_attention(q, k, v, scale, implementation, **kw):
  """jax.nn.dot_product_attention (implementation None = XLA) with d_k != d_v zero-padded to the
  larger, as cuDNN needs equal head dims: zero query / key columns leave the logits unchanged, zero
  value columns give output columns that are sliced off; the scale stays d_k ** -0.5."""
  dk, dv = q.shape[-1], v.shape[-1]
  if dk != dv:
    from pallas_kernels.compress_fold import pad_head_dim
    scale = dk ** -0.5 if scale is None else scale
    q, k, v = (pad_head_dim(x, max(dk, dv)) for x in (q, k, v))
  return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=implementation,
                                      **kw)[..., :dv]


def _packed_or_kernels(q, k, v, segment_ids, window, cap, scale):
  """cuDNN's packed layout with the document cap `cap` (nsa_jax/cudnn_packed.py), our Triton
  window kernels (w = T for window=None) for a batch with a row above the cap."""
  from pallas_kernels import window_attention as wk
  w = q.shape[1] if window is None else window
  return cudnn_packed.packed_attention(
      q, k, v, segment_ids, window, cap, scale,
      fallback=lambda q, k, v, s: wk.window_attention(q, k, v, w, s, scale,
                                                      interpret=not on_gpu())[0])


def window_attention(q, k, v, window, segment_ids=None, scale=None, *, allow_cudnn=True,
                     backend=None):
  """Sliding-window branch, by window_backend(...) unless `backend` names one of
  WINDOW_BACKENDS or "xla" (any device; the Pallas kernels run interpreted off a GPU).

  cuDNN needs d_k == d_v: the smaller of the two is zero-padded (zero query/key columns leave the
  logits unchanged; zero value columns give zero outputs that are sliced off)."""
  from nsa_jax import xla
  from pallas_kernels import window_attention as wk
  window = wk.check_window(window)
  reference.check_qkv(q, k, v, "window_attention")
  segment_ids = reference.segment_runs(segment_ids, q.shape[:2])  # checked, as runs
  be = window_backend(q, v, segment_ids, allow_cudnn) if backend is None else backend
  if be == "cudnn":
    if segment_ids is not None:
      raise ValueError("window backend 'cudnn' does not take segment ids (cuDNN's sliding window "
                       "has no document mask). Fix: backend='triton' or None (the rule)")
    return _padded_attention(q, k, v, scale, "cudnn", is_causal=True,
                             local_window_size=(window - 1, 0))
  if be in ("triton", "cudnn-fwd"):
    return wk.window_attention(q, k, v, window, segment_ids, scale, interpret=not on_gpu(),
                               backend=be)[0]
  if be == "cudnn-packed":
    if segment_ids is None:
      raise ValueError("window backend 'cudnn-packed' needs segment ids (it packs documents). "
                       "Fix: backend='cudnn' or None (the rule)")
    m = cudnn_packed.packed_cap()
    if not m:
      raise ValueError(f"window backend 'cudnn-packed' needs its document cap: set "
                       f"{cudnn_packed.ENV}=M (the largest number of documents in one row)")
    ok, no = cudnn_packed.applies(q, k, v)
    if not ok:
      raise ValueError(f"window backend 'cudnn-packed' does not take this call ({no}). Fix: "
                       "backend=None (the rule)")
    return _packed_or_kernels(q, k, v, segment_ids, window, m, scale)
  if be != "xla":
    raise ValueError(f"window backend {be!r}: expected one of "
                     f"{WINDOW_BACKENDS + ('cudnn-packed', 'xla')}")
  o, _ = xla.window_attention(q, k, v, window, segment_ids, scale)
  return o


def _pallas_indices(q, k_cmp, v_cmp, lse_cmp, k_slc, cfg: NSAConfig, segment_ids, scale, interpret):
  """Top-n block indices [B, T, K, n]: the fused kernel (NSA selector) or plain JAX (Quest)."""
  from nsa_jax import xla
  from pallas_kernels.select_topn import select_topn
  if cfg.selector == "quest":
    log_once(logging.INFO, "NSA selection indices: Quest scores in plain JAX")
    return xla.compressed_attention_and_select(q, k_cmp, v_cmp, k_slc, cfg, segment_ids, scale)[2]
  return select_topn(q, k_cmp, lse_cmp, block=cfg.cmp_block, stride=cfg.cmp_stride,
                     sel_block=cfg.sel_block, num_selected=cfg.num_selected,
                     num_init=cfg.num_init_blocks, num_local=cfg.num_local_blocks,
                     alignment=cfg.score_alignment, segment_ids=segment_ids, scale=scale,
                     interpret=interpret)


def _mosaic_backends(q, k_slc, v_slc, cfg, segment_ids):
  """(compression backend, selection backend) for implementation="pallas-mosaic": "mosaic" where
  the Mosaic GPU kernel handles the call, else "triton" (logged with the reason)."""
  from pallas_kernels import select_attention_mgpu as mgpu
  b, t, h, dk = q.shape
  kh, has_seg = cfg.num_kv_heads, segment_ids is not None
  ncp = max(64, -(-cfg.num_cmp_blocks(t) // 64) * 64)  # compress_attention's padding
  checks = {"compress": mgpu.cmp_supports(q.shape, (b, kh, ncp, dk), (b, kh, ncp, cfg.dim_v),
                                          has_seg, q.dtype),
            "select": mgpu.supports(q.shape, k_slc.shape, v_slc.shape, cfg.sel_block, has_seg,
                                    q.dtype)}
  from pallas_kernels.select_attention import dkv_backend
  dkv, dkv_why = dkv_backend(h // kh, dk, v_slc.shape[-1], has_seg)
  notes = {"compress": " (backward: Triton)",
           "select": "" if dkv == "mosaic" else f" (dK/dV: Triton, {dkv_why})"}
  out = []
  for name, (ok, why) in checks.items():
    out.append("mosaic" if ok else "triton")
    log_once(logging.INFO if ok else logging.WARNING,
             f"NSA {name} branch: {'Mosaic GPU' if ok else 'Triton'} kernels for "
             f"q{tuple(q.shape)}" + (notes[name] if ok else f" (Mosaic GPU does not apply: {why})"))
  return tuple(out)


def _auto_select_backend(q, k_slc, v_slc, cfg, segment_ids, interpret):
  """Logs which selection kernels implementation="pallas" runs (select_attention.auto_backend)
  and returns "auto" for select_attention to apply the same choice."""
  from pallas_kernels import select_attention as sk
  be, why = sk.auto_backend(q.shape, k_slc.shape, v_slc.shape, cfg.sel_block,
                            segment_ids is not None, q.dtype, interpret)
  g = cfg.num_heads // cfg.num_kv_heads
  union_only = sk.static_union(g, q.shape[1], q.shape[3], v_slc.shape[3])
  what = ("Mosaic GPU" + ((" (4-token union tiles only: T <= STATIC_UNION_MAX_T, head dims <= "
                            "STATIC_UNION_MAX_DIM)" if union_only
                           else " (4-token union tiles; the per-token Triton tile when a call's "
                           "neighbouring tokens share few blocks)") if g >= 16 else "")
          if be == "mosaic" else "Triton" + (
              " (4-token union tiles only: segment ids, STATIC_UNION_IDS, T <= STATIC_UNION_MAX_T, "
              "head dims <= STATIC_UNION_MAX_DIM)" if sk.union_alone_with_ids(
                  g, q.shape[1], q.shape[3], v_slc.shape[3], segment_ids is not None) else ""))
  if be == "mosaic":
    dkv, dkv_why = sk.dkv_backend(g, q.shape[3], v_slc.shape[3], segment_ids is not None)
    what += f" (dK/dV: {dkv_why if dkv == 'mosaic' else 'Triton, ' + dkv_why})"
  log_once(logging.INFO, f"NSA select branch: {what} kernels for q{tuple(q.shape)}: {why}")
  return "auto"


# The cuDNN fold of the compression branch (pallas_kernels.compress_fold) pays off from this many
# compressed blocks on (H200, `bash scripts/h200_kernels.sh foldsweep`,
# benchmarks/results/nsa_h200_foldsweep.md; fwd+bwd ms: Triton / fold fwd + Triton bwd / fold
# fwd + cuDNN bwd):
#   128/128, paper heads: 16k 4.47 / 4.33 / 3.97; 32k 15.0 / 13.9 / 10.5; 64k 53.9 / 50.5 / 33.4.
#   64/64, 16/1 heads, batch 8: 8k 1.96 / 1.93 / 2.18; 16k 5.39 / 5.34 / 4.85.
#   192/128 (cuDNN pads d_v; its backward loses): 16k 5.25 / 5.40 / 6.92; 32k 17.6 / 17.2 / 19.6;
#     64k 64.9 / 62.6 / 66.4.
FOLD_MIN_BLOCKS = 1000       # d_k == d_v: from T = 16k on (l = 32, d = 16)
FOLD_FWD_MIN_BLOCKS = 2000   # d_k != d_v: from T = 32k on
# The fold's backward through cuDNN is the fastest at d_k == d_v. Its gradients were compared with
# plain JAX on the H200 (2026-11-30, `h200_kernels.sh foldnsa`, T = 2048, bf16): relative errors
# q 0.0034, k 0.0041, v 0.0032, the Triton backward's 0.0034 / 0.0038 / 0.0028. Whole op, 64k,
# 128/128, backward: 69.3 ms with it, 86.9 ms with the Triton backward (cuDNN 344 ms). Default on;
# set False to keep the Triton backward under the fold forward.
FOLD_CUDNN_BACKWARD = True


def _auto_cmp_backend(q, v_cmp, segment_ids):
  """Compression branch for implementation="pallas", logged with the reason:
  "cudnn": the fold forward and backward in cuDNN (d_k == d_v and FOLD_CUDNN_BACKWARD, the
  default there);
  "cudnn-fwd": the cuDNN fold forward with the Triton backward (d_k != d_v, where cuDNN pads d_v
  and its backward loses to Triton's, or FOLD_CUDNN_BACKWARD off);
  "triton": where the fold does not apply or the sequence is short."""
  from pallas_kernels import compress_fold as cmp_fold
  if not on_gpu():
    return "triton"
  dk, dv, nc = q.shape[-1], v_cmp.shape[-1], v_cmp.shape[1]
  ok, why = cmp_fold.supports(dk, dv, q.dtype, segment_ids is not None)
  least = FOLD_MIN_BLOCKS if dk == dv else FOLD_FWD_MIN_BLOCKS
  if ok and nc < least:
    ok, why = False, f"{nc} compressed blocks < {least}, where it measured no gain"
  be = ("cudnn" if dk == dv and FOLD_CUDNN_BACKWARD else "cudnn-fwd") if ok else "triton"
  log_once(logging.INFO, f"NSA compress branch for q{tuple(q.shape)}: " + {
      "cudnn": "cuDNN flash attention on queries folded by the compression stride "
               "(pallas_kernels.compress_fold), forward and backward (FOLD_CUDNN_BACKWARD)",
      "cudnn-fwd": "cuDNN fold forward (pallas_kernels.compress_fold), Triton backward",
      "triton": f"Triton kernels (cuDNN fold not used: {why})"}[be])
  return be


def _pallas_nsa(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids, scale,
                return_aux, block_idx=None, kernels="auto", cmp_backend=None, win_backend=None):
  from pallas_kernels.compress_attention import compress_attention
  from pallas_kernels.select_attention import select_attention as select_kernel
  reference.check_nsa_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids)
  reference.check_block_idx(block_idx, q, cfg)
  # Off the GPU the same kernels run in Pallas' interpreter (slow; for tests).
  interpret = not on_gpu()
  cmp_be, slc_be = {"mosaic": lambda: _mosaic_backends(q, k_slc, v_slc, cfg, segment_ids),
                    "triton": lambda: ("triton", "triton"),
                    "auto": lambda: ("auto", _auto_select_backend(q, k_slc, v_slc, cfg,
                                                                  segment_ids, interpret))
                    }[kernels]()
  # cmp_backend (tests, benchmarks): "triton", "mosaic", "cudnn", "cudnn-fwd" or "fold-xla"
  # (cmp_fold's fold through XLA attention, any backend) instead of the choice above.
  cmp_be = cmp_backend or cmp_be
  outs, aux = {}, {}
  with _stream_group():  # a no-op unless STREAM_GROUP (with streams, on a GPU)
    want_idx = "slc" in cfg.branches
    # Like the reference, the compression branch also runs when it only feeds the NSA selector
    # (its log-sum-exp turns the top-n kernel's logits into probabilities).
    if "cmp" in cfg.branches or (want_idx and cfg.selector == "nsa"):
      if cmp_be == "auto":  # decided (and logged) only where the branch runs
        cmp_be = _auto_cmp_backend(q, v_cmp, segment_ids)
      if cmp_be in ("cudnn", "fold-xla") and segment_ids is not None:
        raise ValueError(f"compression backend {cmp_be!r} does not take segment ids (one "
                         "visibility rule per folded group). Fix: use the Triton kernels")
      with jax.named_scope("cmp"):  # scopes label the kernels in profiles (profile_step.py)
        if cmp_be in ("cudnn", "fold-xla"):
          from pallas_kernels import compress_fold as cmp_fold
          cmp_fn = lambda q, k, v: cmp_fold.compressed_attention(  # noqa: E731
              q, k, v, cfg.cmp_block, cfg.cmp_stride, scale,
              implementation="cudnn" if cmp_be == "cudnn" else "xla")
        else:
          cmp_fn = lambda q, k, v: compress_attention(  # noqa: E731
              q, k, v, cfg.cmp_block, cfg.cmp_stride, segment_ids, scale, interpret=interpret,
              backend="cudnn" if cmp_be == "cudnn-fwd" else cmp_be)
        o_cmp, lse_cmp = _on_stream("cmp", cmp_fn, q, k_cmp, v_cmp)
      outs["cmp"] = o_cmp
    if want_idx:
      with jax.named_scope("topn"):
        idx = block_idx if block_idx is not None else _pallas_indices(
            q, k_cmp, v_cmp, lse_cmp if cfg.selector == "nsa" else None, k_slc, cfg, segment_ids,
            scale, interpret)
      with jax.named_scope("slc"):
        outs["slc"], _ = _on_stream("slc", lambda q, k, v, i: select_kernel(
            q, k, v, i, cfg.sel_block, segment_ids, scale, interpret=interpret, backend=slc_be),
            q, k_slc, v_slc, idx)
      aux["block_idx"] = idx
    if "win" in cfg.branches:
      with jax.named_scope("win"):
        flat, why = _window_flat(q, v_win, segment_ids)
        # win_backend (tests, benchmarks): one of WINDOW_BACKENDS or "xla" instead of the rule.
        outs["win"] = _on_stream("win", lambda q, k, v: window_attention(
            q, k, v, cfg.window, segment_ids, scale, backend=win_backend), q, k_win, v_win,
            flat=flat and win_backend in (None, "cudnn"), why=why or "win_backend")
  with jax.named_scope("combine"):
    o = reference.combine(outs, gates, cfg.branches).astype(q.dtype)
  if return_aux:
    aux["outputs"] = outs
    return o, aux
  return o


def splits_heads(kv_heads: int, tensor: int) -> bool:
  """Whether attention ops split their heads over a tensor axis of this size (mesh_layout's rule:
  only where the KV heads divide; otherwise each device computes all heads)."""
  return kv_heads % tensor == 0


def mesh_layout(batch: int, kv_heads: int, what: str):
  """(mesh, batch_axes, head_axis) for the mesh in context, or None when there is none to use.

  batch_axes: every (data, fsdp) axis of the mesh when together they divide `batch` (else only
  those of size 1); head_axis: "tensor" when it divides `kv_heads`, else None."""
  mesh = auto_mesh()
  if mesh is None:
    return None
  sizes = mesh.shape
  if not set(sizes) & {*BATCH_MESH_AXES, HEAD_MESH_AXIS}:
    log_once(logging.WARNING if on_gpu() else logging.INFO,
             f"{what}: the mesh's axes {tuple(sizes)} are none of {BATCH_MESH_AXES + (HEAD_MESH_AXIS,)}"
             "; the op is left to XLA's partitioner (which gathers the inputs of Pallas kernels). "
             "Fix: name the mesh axes data / fsdp / tensor")
    return None
  # Size-1 axes are named too: an axis a spec leaves out is one the backward pass sums over
  # (a psum, an all-reduce in the HLO, even over one device).
  bax = tuple(a for a in BATCH_MESH_AXES if a in sizes)
  nb = math.prod(sizes[a] for a in bax)
  if batch % nb:
    log_once(logging.WARNING, f"{what}: batch {batch} is not divisible by mesh axes {bax} "
             f"(size {nb}); rows stay whole and every device computes them all. Fix: make the "
             "per-step batch a multiple of data*fsdp")
    bax = tuple(a for a in bax if sizes[a] == 1)
  tp = sizes.get(HEAD_MESH_AXIS, 1)
  hax = HEAD_MESH_AXIS if HEAD_MESH_AXIS in sizes and splits_heads(kv_heads, tp) else None
  if tp > 1 and hax is None:
    log_once(logging.WARNING, f"{what}: {kv_heads} KV head(s) cannot be split over tensor={tp}; "
             "attention runs whole on each tensor-parallel device (query heads gathered). Fix: "
             "use n_kv_heads divisible by the tensor axis")
  # Even with nothing to split the op runs under shard_map: whole on every device, its inputs
  # gathered once at the boundary, instead of XLA partitioning (or refusing to partition) the
  # kernels' custom calls.
  return mesh, (bax or None), hax


def _sharded(fn, layout, n4d: int, has_seg: bool, what: str, n_out: int = 1):
  """fn(*n4d arrays [B, ., heads, .], seg?) run per device under shard_map; its output, or each
  of its n_out outputs (pytrees), is made of [B, ., heads, .] arrays."""
  mesh, bax, hax = layout
  spec4 = P(bax, None, hax, None)
  in_specs = (spec4,) * n4d + ((P(bax, None),) if has_seg else ())
  log_once(logging.INFO, f"{what}: per-device under shard_map, batch over {bax}, heads over {hax}"
           f" (mesh {dict(mesh.shape)})")
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                       out_specs=spec4 if n_out == 1 else (spec4,) * n_out, check_vma=False)


def nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg: NSAConfig,
                  segment_ids=None, scale=None, implementation=None, return_aux=False,
                  block_idx=None):
  """The whole NSA op. Shapes as in `nsa_jax.reference.nsa_attention` (block_idx: the blocks
  selector="aux"'s gate chose, or an override of the other selectors' choice).

  implementation: None (use cfg.implementation), "auto" (GPU: "pallas", else "xla"), "pallas"
    (the selection's backend picked per shape from H200 measurements, select_attention.auto_backend),
    "pallas-triton" (Triton kernels only), "pallas-mosaic" (Mosaic GPU selection and compression
    kernels wherever they apply), "xla" or "reference".
  Under a mesh in context it runs per device (module docstring), return_aux=True included (every
  aux array is [B, T, heads, .]: the block indices [B, T, K, n], the branches' [B, T, H, d_v]).
  """
  with jax.named_scope("nsa_attention"):  # names the op in HLO metadata (collectives report)
    return _nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids,
                          scale, implementation, return_aux, block_idx)


def _nsa_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids, scale,
                   implementation, return_aux, block_idx):
  # Every path checks its inputs, but choosing a path (and a mesh layout) already reads shapes.
  reference.check_nsa_inputs(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg)
  segment_ids = reference.segment_runs(segment_ids, q.shape[:2])  # checked, as runs
  layout = mesh_layout(q.shape[0], k_slc.shape[2], "NSA attention")
  if layout is None:
    return _nsa_local(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids, scale,
                      implementation, return_aux, block_idx)
  has_seg, has_idx = segment_ids is not None, block_idx is not None
  mesh, _, hax = layout
  tp = mesh.shape[hax] if hax else 1
  # Each device holds K/tp whole KV groups with their G query heads each.
  local_cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp,
                                  num_kv_heads=cfg.num_kv_heads // tp)

  def local(*xs):
    n4d = 9 if has_idx else 8
    seg = xs[n4d] if has_seg else None
    return _nsa_local(*xs[:8], local_cfg, seg, scale, implementation, return_aux,
                      xs[8] if has_idx else None)

  # block_idx [B, T, K, n] splits like the other [B, ., heads, .] arrays.
  arrays = ((q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates) + ((block_idx,) if has_idx else ())
            + ((segment_ids,) if has_seg else ()))
  return _sharded(local, layout, 9 if has_idx else 8, has_seg, "NSA attention",
                  n_out=2 if return_aux else 1)(*arrays)


def _nsa_local(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg, segment_ids, scale,
               implementation, return_aux, block_idx=None):
  impl = resolve_implementation(implementation or cfg.implementation, q, k_slc, v_slc, cfg)
  args = (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, cfg)
  kw = dict(segment_ids=segment_ids, scale=scale, return_aux=return_aux, block_idx=block_idx)
  if impl == "reference":
    return reference.nsa_attention(*args, **kw)
  if impl == "xla":
    from nsa_jax import xla
    return xla.nsa_attention(*args, **kw)
  return _pallas_nsa(*args, segment_ids, scale, return_aux, block_idx,
                     kernels={"pallas": "auto", "pallas-triton": "triton",
                              "pallas-mosaic": "mosaic"}[impl])


def dense_attention(q, k, v, segment_ids=None, scale=None, implementation="auto"):
  """Dense causal attention; implementation "auto" follows dense_backend (GPU: cuDNN; with segment
  ids cuDNN's packed layout where a document cap is set, else our Triton kernels; XLA elsewhere),
  or one of DENSE_IMPLEMENTATIONS by name.

  Under a mesh in context it runs per device, like nsa_attention."""
  with jax.named_scope("dense_attention"):
    reference.check_qkv(q, k, v, "dense_attention")
    segment_ids = reference.segment_runs(segment_ids, q.shape[:2])  # checked, as runs
    layout = mesh_layout(q.shape[0], k.shape[2], "dense attention")
    if layout is None:
      return _dense_local(q, k, v, segment_ids, scale, implementation)
    has_seg = segment_ids is not None

    def local(q, k, v, *seg):
      return _dense_local(q, k, v, seg[0] if has_seg else None, scale, implementation)

    return _sharded(local, layout, 3, has_seg, "dense attention")(
        q, k, v, *((segment_ids,) if has_seg else ()))


def _kernels_take(q, v):
  """(ok, why not): whether our Triton window kernels take these dense shapes (w = T)."""
  from pallas_kernels import window_attention as wk
  return wk.supports(q.shape, q.shape[:2] + (v.shape[2], q.shape[3]), v.shape)


def dense_backend(q, v, segment_ids=None):
  """(implementation, why) that dense_attention's "auto" runs for these inputs.

  GPU: cuDNN's causal flash call for 16-bit inputs without segment ids (where d_k != d_v, the
  smaller of the two zero-padded, if cuDNN takes the padded dim on this GPU; else our kernels);
  with segment ids (packed documents) cuDNN's packed layout where a document cap is set
  (nsa_jax/cudnn_packed.py: set_dense_cap, which the training loop calls from
  data.cudnn_packed_cap, or NSA_CUDNN_PACKED), else our Pallas Triton kernels (the window kernels
  with w = T: flash tiling, O(T) memory, the ids honoured in the kernels), because cuDNN's causal
  call takes no document ids and the explicit [B, 1, T, T] mask it would need instead grows as
  T^2 (2 GB of bf16 bias per sequence at 32k). Elsewhere XLA."""
  if not on_gpu():
    return "xla", "no GPU"
  half = q.dtype in (jnp.bfloat16, jnp.float16)
  dk, dv = q.shape[-1], v.shape[-1]
  if segment_ids is not None:
    ok, no = _kernels_take(q, v)
    m = cudnn_packed.packed_cap(dense=True)
    if m:
      src = cudnn_packed.cap_source(dense=True)
      packed_ok, packed_no = cudnn_packed.applies(q, q, v)
      if ok and packed_ok:
        return "cudnn-packed", cudnn_packed.choice_note(q, m, src)
      log_once(logging.WARNING, f"{src}={m} is set, but cuDNN's packed layout does "
               f"not take dense attention on q{tuple(q.shape)} v{tuple(v.shape)} "
               f"({packed_no or no})")
    if ok:
      return "pallas", ("segment ids: the Triton kernels take them (cuDNN's causal call would need "
                        "an explicit O(T^2) mask)")
    return "cudnn" if half and dk == dv else "xla", (
        f"segment ids, but the Triton kernels do not take this call ({no}): an explicit "
        "[B, 1, T, T] mask, O(T^2) memory")
  if half and dk == dv:
    return "cudnn", "16-bit inputs"
  if half:
    from pallas_kernels import compress_fold as cf
    ok, no = cf.supports(dk, dv, q.dtype, False)
    if ok:
      return "cudnn", f"16-bit inputs, d_k={dk} != d_v={dv}: the smaller zero-padded"
    if _kernels_take(q, v)[0]:
      return "pallas", f"d_k={dk} != d_v={dv} and cuDNN would not take them padded ({no})"
  return "xla", (f"dtype {jnp.dtype(q.dtype).name}: cuDNN takes 16-bit inputs" if not half else
                 f"d_k={dk} != d_v={dv}: neither cuDNN padded nor the Triton kernels take it")


def _dense_local(q, k, v, segment_ids, scale, implementation):
  if implementation not in DENSE_IMPLEMENTATIONS:
    raise ValueError(f"dense attention implementation={implementation!r}: expected one of "
                     f"{DENSE_IMPLEMENTATIONS} (model.dense_implementation)")
  why, level = "asked for", logging.INFO
  if implementation == "cudnn" and not on_gpu():  # e.g. a GPU run's model evaluated on a CPU
    implementation, why, level = "xla", "cuDNN asked for, but there is no GPU", logging.WARNING
  if implementation == "pallas":
    ok, no = _kernels_take(q, v)
    if not ok:
      raise ValueError(f"dense attention implementation='pallas': the Triton kernels do not take "
                       f"this call ({no}). Fix: model.dense_implementation='auto' (or 'cudnn' / "
                       "'xla')")
  if implementation == "auto":
    implementation, why = dense_backend(q, v, segment_ids)
    if segment_ids is not None and implementation not in ("pallas", "cudnn-packed") and on_gpu():
      level = logging.WARNING  # an explicit T x T mask on a GPU: memory grows as T^2
  log_once(level, f"dense attention implementation: {implementation} for q{tuple(q.shape)} ({why})")
  if implementation == "reference":
    return reference.dense_causal_attention(q, k, v, segment_ids, scale)[0]
  if implementation == "pallas":
    from pallas_kernels import window_attention as wk
    return wk.window_attention(q, k, v, q.shape[1], segment_ids, scale, interpret=not on_gpu())[0]
  if implementation == "cudnn-packed":  # only "auto" picks it (NSA_CUDNN_PACKED)
    m = cudnn_packed.packed_cap(dense=True)
    if not m:
      raise ValueError("dense implementation 'cudnn-packed' needs its document cap: "
                       "nsa_jax.cudnn_packed.set_dense_cap(M) or NSA_CUDNN_PACKED=M (the largest "
                       "number of documents in one row)")
    return _packed_or_kernels(q, k, v, segment_ids, None, m, scale)
  if implementation == "xla" and q.shape[-1] != v.shape[-1]:
    return reference.dense_causal_attention(q, k, v, segment_ids, scale)[0]
  impl = None if implementation == "xla" else implementation  # xla: d_k == d_v here
  if segment_ids is not None:
    return _padded_attention(q, k, v, scale, impl, mask=reference.causal_mask(segment_ids))
  return _padded_attention(q, k, v, scale, impl, is_causal=True)
