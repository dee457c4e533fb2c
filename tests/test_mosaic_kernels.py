"""The experimental Mosaic GPU forwards (pallas_kernels/select_attention_mgpu.py): selection and
compression attention.

CPU: the kernels run in Mosaic GPU's interpreter on bfloat16 inputs against the float32 reference
of the same values (forward, lse, and through select_attention / compress_attention with
backend="mosaic" the gradients: the selection's dq and, for G >= 8, its dK/dV are Mosaic GPU too;
G = 4's dK/dV and the compression backward are the Triton kernels); each whole differentiable call
is lowered for CUDA through an abstract H100-class device. Seeds come from os.urandom and are
printed.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import reference as ref
from pallas_kernels import _common as C
from pallas_kernels import select_attention_mgpu as mgpu
from pallas_kernels.compress_attention import compress_attention
from pallas_kernels.select_attention import select_attention
try:
  from tests.gpu_mode import INTERPRET, ON_GPU
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from gpu_mode import INTERPRET, ON_GPU

TOL = 3e-2  # bf16 inputs and output, float32 accumulation; o is O(1)
_H100 = dict(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)


def _seed():
  s = int(os.environ.get("NSA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
  print(f"seed={s}")
  return s


def _inputs(rng, b, t, h, kh, dk, dv, n, bs=64):
  """bf16 q/k/v, random causal ascending block lists (some short, -1 padded)."""
  idx = np.full((b, t, kh, n), -1, np.int32)
  for bb in range(b):
    for tt in range(t):
      for k in range(kh):
        cand = np.arange(tt // bs + 1)
        m = int(rng.integers(1, min(n, len(cand)) + 1))
        idx[bb, tt, k, :m] = np.sort(rng.choice(cand, m, replace=False))
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  return f(b, t, h, dk), f(b, t, kh, dk), f(b, t, kh, dv), jnp.asarray(idx), f(b, t, h, dv)


f32 = lambda x: x.astype(jnp.float32)


def _assert_grads_match(ours, theirs, args, do, dlse, names="qkv"):
  """Gradients of sum(o * do) + sum(lse * dlse) (finite lse) through `ours` (bf16 args) and
  `theirs` (the float32 reference of the same values), each within TOL of the reference's scale."""
  def loss(fn, *a):
    o, lse = fn(*a)
    return jnp.sum(f32(o) * f32(do)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * dlse, 0.0))

  idx = tuple(range(len(args)))
  g = jax.grad(lambda *a: loss(ours, *a), idx)(*args)
  rg = jax.grad(lambda *a: loss(theirs, *a), idx)(*map(f32, args))
  for name, a, r in zip(names, g, rg):
    scale = float(jnp.max(jnp.abs(r)))
    err = float(jnp.max(jnp.abs(f32(a) - r)))
    assert err <= TOL * max(scale, 1.0), (f"d{name}", err, scale)


def _assert_select_matches(o, lse, q, k, v, idx):
  """A selection forward's (o, lse) against the float32 reference of the same bf16 inputs."""
  (b, t, h, _), dv = q.shape, v.shape[-1]
  ro, rlse = ref.select_attention(f32(q), f32(k), f32(v), idx, 64)
  assert o.shape == (b, t, h, dv) and o.dtype == q.dtype and lse.shape == (b, t, h)
  np.testing.assert_allclose(f32(o), ro, atol=TOL, rtol=TOL)
  fin = jnp.isfinite(rlse)
  assert bool(jnp.all(jnp.isfinite(lse) == fin))
  np.testing.assert_allclose(jnp.where(fin, lse, 0.0), jnp.where(fin, rlse, 0.0), atol=1e-3, rtol=1e-4)


def _select_grad_fn(g, dk, dv, kh=2, t=300, n=16, **kw):
  """(f, abstract args): value_and_grad of select_attention(**kw) at b=1, T=t, n blocks, G query
  heads a group, for _select_lowered and _select_jaxpr."""
  sd = jax.ShapeDtypeStruct
  args = (sd((1, t, g * kh, dk), jnp.bfloat16), sd((1, t, kh, dk), jnp.bfloat16),
          sd((1, t, kh, dv), jnp.bfloat16), sd((1, t, kh, n), jnp.int32))

  def f(q, k, v, idx):
    def loss(q, k, v):
      o, lse = select_attention(q, k, v, idx, 64, **kw)
      return jnp.sum(f32(o)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
  return f, args


def _select_lowered(g, dk, dv, kh=2, t=300, n=16, **kw):
  """CUDA text (abstract H100-class device) of _select_grad_fn's function: what the Mosaic GPU
  lowering checks (layout inference, wgmma / TMA shapes, barrier counts, the shared-memory limit)
  run on."""
  return _cuda_text(*_select_grad_fn(g, dk, dv, kh, t, n, **kw))


def _cuda_text(f, args):
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(**_H100))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text, "no Mosaic GPU custom call in the lowered module"
  return text


def _select_jaxpr(g, dk, dv, kh=2, t=300, n=16, **kw):
  """The traced program (kernel bodies included) of _select_grad_fn's function, as text: equal
  settings give equal text, unlike the lowered module (whose Mosaic GPU bytecode carries a
  per-process kernel counter), so it tells whether a switch changed the kernels."""
  f, args = _select_grad_fn(g, dk, dv, kh, t, n, **kw)
  return str(jax.make_jaxpr(f)(*args))


# (b, t, h, kh, dk, dv, n): G = 16 (4 tokens a tile), 8, 4 (16 tokens a tile); d_k != d_v; T not
# a multiple of 64 or of the tile
CASES = [(1, 150, 16, 1, 192, 128, 5), (2, 130, 16, 2, 64, 64, 4), (1, 200, 8, 2, 128, 64, 3),
         (1, 90, 4, 1, 64, 128, 2), (1, 140, 64, 1, 64, 64, 3), (1, 100, 32, 1, 64, 64, 2)]


@pytest.mark.parametrize("case", CASES, ids=[f"G{c[2] // c[3]}_{c[4]}x{c[5]}_T{c[1]}" for c in CASES])
def test_forward_matches_reference(case):
  b, t, h, kh, dk, dv, n = case
  rng = np.random.default_rng(_seed())
  q, k, v, idx, _ = _inputs(rng, b, t, h, kh, dk, dv, n)
  maps = C.tile_maps(idx, mgpu.tiling_for(h // kh, 64))
  o, lse = mgpu.forward(q, k, v, maps, block_size=64, scale=dk ** -0.5, interpret=INTERPRET)
  _assert_select_matches(o, lse, q, k, v, idx)


@pytest.mark.parametrize("lean", [True, False], ids=["lean_smem", "separate_smem"])
@pytest.mark.parametrize("shape", [(1, 140, 16, 1, 128, 64, 4), (1, 130, 8, 2, 64, 128, 3)],
                         ids=["G16_mosaic_dkv", "G4_triton_dkv"])
def test_gradients_through_select_attention(monkeypatch, shape, lean):
  """Forward, dq and (G >= 8) dK/dV with the buffers that have disjoint lifetimes sharing shared
  memory (LEAN_SMEM, the default) and with each in its own buffer (as before 2026-12-02)."""
  monkeypatch.setattr(mgpu, "LEAN_SMEM", lean)
  b, t, h, kh, dk, dv, n = shape
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  ours = lambda q, k, v: select_attention(q, k, v, idx, 64, backend="mosaic", interpret=INTERPRET)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)


@pytest.mark.parametrize("backend,h", [("mosaic", 16), ("mosaic", 64), ("triton", 16)])
def test_future_blocks_are_invisible(backend, h):
  """Lists that name blocks after the token (not what top-n produces, but a caller may pass them),
  of random length with -1 slots, unsorted: the keys there are invisible, as in the reference,
  forward and gradients. The Mosaic kernels mask causally only at the last union entry (and the
  first dK/dV steps), which holds because select_attention drops such blocks first; G = 64 (one
  token a tile, unsorted lists) masks every step."""
  b, t, kh, dk, dv, n = 1, 300, 1, 64, 64, 3
  rng = np.random.default_rng(_seed())
  q, k, v, _, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  nb = -(-t // 64)
  idx = np.full((b * t * kh, n), -1, np.int32)
  for row in idx:
    m = int(rng.integers(1, n + 1))
    row[:m] = rng.choice(nb, m, replace=False)  # any block, in any order
  idx = jnp.asarray(idx.reshape(b, t, kh, n))
  assert bool(jnp.any(idx * 64 > jnp.arange(t)[None, :, None, None])), "no future block drawn"
  o, lse = select_attention(q, k, v, idx, 64, backend=backend, interpret=INTERPRET)
  _assert_select_matches(o, lse, q, k, v, idx)
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  ours = lambda q, k, v: select_attention(q, k, v, idx, 64, backend=backend, interpret=INTERPRET)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)


def _doc_ids(rng, b, t, mean):
  """[B, T] int32 ids of contiguous documents cut at random places (not on block boundaries), with
  one sure cut per row in the middle third (at T = 200 and a mean of 70 a row drew no cut about
  6% of the time, and the tests that need an earlier document then failed their own check)."""
  cuts = rng.random((b, t)) < 1.0 / mean
  cuts[np.arange(b), rng.integers(t // 3, 2 * t // 3, size=b)] = True
  return jnp.asarray(np.cumsum(cuts, axis=1), jnp.int32)


# (b, t, h, kh, n, lists, d): G = 16 (4 tokens a tile), G = 4 (16 tokens; dK/dV Triton either
# way with ids), G = 64 (one token a tile, unsorted lists, every step masked); "any": any earlier
# blocks (a caller's lists: blocks before the document, wholly or in part); "doc": only blocks
# from the document's first on, as the top-n picks them
DOC_CASES = [(1, 300, 16, 1, 4, "any", 64), (2, 200, 16, 1, 3, "doc", 64),
             (1, 260, 8, 2, 3, "any", 64), (1, 200, 64, 1, 3, "any", 64),
             (1, 200, 16, 1, 3, "any", 128)]  # d = 128: the forward's K/V ring (KV_RING)


@pytest.mark.parametrize("case", DOC_CASES,
                         ids=[f"G{c[2] // c[3]}_{c[5]}_T{c[1]}_d{c[6]}" for c in DOC_CASES])
def test_segment_ids_as_document_bounds_match_reference(monkeypatch, case):
  """SEGMENT_IDS: the Mosaic forward and dq take packed documents as a per-row lower bound (the
  document start) on the prefix of union entries that can hold earlier keys (doc_maps) and the
  last entry: forward, lse and gradients (dK/dV as DKV_SEGMENT_IDS and dkv_supports choose: the
  Mosaic partials at G >= 8 by default, else Triton, both with the ids) against the reference
  with the same ids."""
  monkeypatch.setattr(mgpu, "SEGMENT_IDS", True)
  b, t, h, kh, n, lists, dk = case
  dv = dk
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  seg = _doc_ids(rng, b, t, 70)
  if lists == "doc":  # the document's first block first, then random later ones up to the token's
    starts = np.asarray(ref.document_starts(seg))
    x = np.full((b, t, kh, n), -1, np.int32)
    for bb in range(b):
      for tt in range(t):
        for kk in range(kh):
          cand = np.arange(starts[bb, tt] // 64, tt // 64 + 1)
          m = int(rng.integers(1, min(n, len(cand)) + 1))
          x[bb, tt, kk, :m] = np.sort(rng.choice(cand, m, replace=False))
    idx = jnp.asarray(x)
  # the bound must matter: some (token, picked block) pairs hold keys of an earlier document
  starts = ref.document_starts(seg)[:, :, None, None]
  assert bool(jnp.any((idx >= 0) & (idx * 64 < starts))), "no block holds an earlier document"
  ours = lambda q, k, v: select_attention(q, k, v, idx, 64, seg, backend="mosaic",
                                          interpret=INTERPRET)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64, seg)
  o, lse = ours(q, k, v)
  ro, rlse = theirs(f32(q), f32(k), f32(v))
  np.testing.assert_allclose(f32(o), ro, atol=TOL, rtol=TOL)
  fin = jnp.isfinite(rlse)
  assert bool(jnp.all(jnp.isfinite(lse) == fin))
  np.testing.assert_allclose(jnp.where(fin, lse, 0.0), jnp.where(fin, rlse, 0.0), atol=1e-3,
                             rtol=1e-4)
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)


# (b, t, h, kh, n, chunk): G = 16 (4 tokens a step), 64 (1 token); small work items (chunk
# entries) so that an item's unmasked prefix, masked run and dead tail fall in different items
DKV_DOC_CASES = [(1, 300, 16, 1, 4, 8), (2, 200, 16, 1, 3, None), (1, 200, 64, 1, 3, 5)]


@pytest.mark.parametrize("case", DKV_DOC_CASES,
                         ids=[f"G{c[2] // c[3]}_T{c[1]}_chunk{c[5]}" for c in DKV_DOC_CASES])
def test_dkv_partials_with_segment_ids_match_reference(monkeypatch, case):
  """DKV_SEGMENT_IDS: the Mosaic dK/dV partials take packed documents (each item stops at its
  first token whose document starts after the block and masks keys before each token's document
  start from its first token whose document starts inside the block): q/k/v gradients of
  backend="mosaic" against the reference with the same ids."""
  monkeypatch.setattr(mgpu, "SEGMENT_IDS", True)
  monkeypatch.setattr(mgpu, "DKV_SEGMENT_IDS", True)
  b, t, h, kh, n, chunk = case
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, 64, 64, n)
  # documents starting on block 1's second key and block 2's last key (the edges of
  # dkv_doc_counts' two bounds, which random cuts rarely hit; the first runs past block 1, so
  # tokens 128-190 reach block 1 outside its causal steps), then random cuts after them
  pos = np.arange(t)
  late = np.cumsum((rng.random((b, t)) < 1.0 / 40) & (pos > 191), axis=1)
  seg = jnp.asarray((pos >= 65) + (pos >= 191) + late, jnp.int32)
  starts = ref.document_starts(seg)[:, :, None, None]
  assert bool(jnp.any((idx >= 0) & (idx * 64 < starts))), "no block holds an earlier document"
  til = mgpu.tiling_for(h // kh, 64)
  if chunk:
    til = dataclasses.replace(til, chunk_entries=chunk)
  ours = lambda q, k, v: select_attention(q, k, v, idx, 64, seg, backend="mosaic", tiling=til,
                                          interpret=INTERPRET)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64, seg)
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)


def test_dkv_doc_counts_by_brute_force():
  """dkv_doc_counts: per work item, the entries whose document starts at or before the block's
  first key (nplain) and before its end (nlive), counted one by one; documents that start on a
  block's first, second and last key included."""
  rng = np.random.default_rng(_seed())
  b, t, kh, n = 2, 260, 2, 3
  idx = _inputs(rng, b, t, 4 * kh, kh, 64, 64, n)[3]
  seg = np.array(_doc_ids(rng, b, t, 30))
  seg[:, 128:] += 1  # a document start on block 2's first key
  seg[:, 65:] += 1   # ... on block 1's second key (the nplain bound's edge)
  seg[:, 191:] += 1  # ... on block 2's last key (the nlive bound's edge)
  seg = jnp.asarray(seg)
  tokens, iblk, istart, iend, _, _ = C.inverse_lists(idx, C.cdiv(t, 64), 7)
  lo, nplain, nlive = mgpu.dkv_doc_counts(seg, tokens, iblk, istart, iend)
  np.testing.assert_array_equal(np.asarray(lo), np.asarray(ref.document_starts(seg)))
  tok, ib, s0, s1 = (np.asarray(x) for x in (tokens, iblk, istart, iend))
  lo = np.asarray(lo)
  for bb in range(b):
    for kk in range(kh):
      for w in range(ib.shape[-1]):
        starts = [lo[bb, tok[bb, kk, e]] for e in range(s0[bb, kk, w], s1[bb, kk, w])]
        first = ib[bb, kk, w] * 64
        assert int(nplain[bb, kk, w]) == sum(s <= first for s in starts), (bb, kk, w)
        assert int(nlive[bb, kk, w]) == sum(s < first + 64 for s in starts), (bb, kk, w)


def test_doc_maps_count_the_entries_under_the_bound():
  """doc_maps: each token's document start (tokens past T repeat the last), and per tile the
  number of union entries starting before its last token's document start, by brute force."""
  rng = np.random.default_rng(_seed())
  b, t, kh, n, tq = 2, 150, 2, 3, 4
  _, _, _, idx, _ = _inputs(rng, b, t, 4 * kh, kh, 64, 64, n)
  seg = _doc_ids(rng, b, t, 40)
  maps = C.tile_union(idx, tq)
  lo, nlo = mgpu.doc_maps(seg, maps, t, tq)
  starts = np.asarray(ref.document_starts(seg))
  nt = -(-t // tq)
  assert lo.shape == (b, nt * tq) and nlo.shape == (b, nt, kh, 1)
  np.testing.assert_array_equal(np.asarray(lo)[:, :t], starts)
  np.testing.assert_array_equal(np.asarray(lo)[:, t:], np.repeat(starts[:, -1:], nt * tq - t, 1))
  x = np.asarray(idx)
  for bb in range(b):
    for it in range(nt):
      last = starts[bb, min(it * tq + tq - 1, t - 1)]
      for kk in range(kh):
        union = {int(j) for i in range(it * tq, min(it * tq + tq, t)) for j in x[bb, i, kk] if j >= 0}
        assert int(nlo[bb, it, kk, 0]) == sum(j * 64 < last for j in union), (bb, it, kk)


@pytest.mark.parametrize("dkv_ids", [False, True], ids=["dkv_triton", "dkv_mosaic"])
def test_segment_ids_lower_for_cuda(monkeypatch, dkv_ids):
  """With SEGMENT_IDS, value_and_grad of backend="mosaic" with ids lowers for CUDA (G = 16, 64/64:
  the 8k layer's shapes; the forward without the OVERLAP walk; dK/dV Triton, or with
  DKV_SEGMENT_IDS the Mosaic partials and the Triton reduce)."""
  import re
  monkeypatch.setattr(mgpu, "SEGMENT_IDS", True)
  monkeypatch.setattr(mgpu, "DKV_SEGMENT_IDS", dkv_ids)
  sd = jax.ShapeDtypeStruct
  t = 300
  args = (sd((1, t, 16, 64), jnp.bfloat16), sd((1, t, 1, 64), jnp.bfloat16),
          sd((1, t, 1, 64), jnp.bfloat16), sd((1, t, 1, 16), jnp.int32), sd((1, t), jnp.int32))

  def f(q, k, v, idx, sid):
    def loss(q, k, v):
      o, lse = select_attention(q, k, v, idx, 64, sid, backend="mosaic")
      return jnp.sum(f32(o)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

  text = _cuda_text(f, args)
  # the Triton dK/dV with the ids (its kernel and its reduce), or the Mosaic partials (a third
  # Mosaic GPU call beside the forward and dq) summed by the Triton reduce
  assert bool(re.search(r"nsa_select_dkv(?!_reduce)", text)) != dkv_ids
  assert "nsa_select_dkv_reduce" in text
  assert len(re.findall(r"custom_call @mosaic_gpu", text)) == (3 if dkv_ids else 2)


def test_refusals_name_the_problem(monkeypatch):
  q = jnp.zeros((1, 64, 16, 64), jnp.bfloat16)
  kv = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  idx = jnp.zeros((1, 64, 1, 2), jnp.int32)
  assert mgpu.SEGMENT_IDS  # on by default: the ids reach the Mosaic forward and dq
  monkeypatch.setattr(mgpu, "SEGMENT_IDS", False)
  with pytest.raises(ValueError, match="SEGMENT_IDS is off"):
    select_attention(q, kv, kv, idx, 64, jnp.zeros((1, 64), jnp.int32), backend="mosaic")
  monkeypatch.undo()
  with pytest.raises(ValueError, match="l' = 64"):
    select_attention(q, kv, kv, idx, 32, backend="mosaic")
  with pytest.raises(ValueError, match="multiples of 64"):
    select_attention(q[..., :48], kv[..., :48], kv, idx, 64, backend="mosaic")
  with pytest.raises(ValueError, match="G=2"):
    select_attention(q[:, :, :2], kv, kv, idx, 64, backend="mosaic")
  with pytest.raises(ValueError, match="bfloat16"):
    select_attention(f32(q), f32(kv), f32(kv), idx, 64, backend="mosaic")
  with pytest.raises(ValueError, match="tokens_per_tile=4"):
    select_attention(q, kv, kv, idx, 64, backend="mosaic", tiling=C.SelectTiling(tokens_per_tile=1))


# Deeper pipelines (FWD_SLOTS / DKV_SLOTS > 2): block j + S - 1 refills the slot of block j - 1.
# Union walks of up to 8 blocks (n = 6, T = 450) refill slots several times at S = 3 and 4; the
# first tiles walk fewer blocks than the pipeline holds; the compression walk (T = 4200: 261
# compressed keys, 5 blocks of 64 for the last tiles) refills a slot at S = 4 (checked there only:
# 45 s interpreted). Measured on the H200 (2026-12-01): 3 and 4 slots are slower than 2 at the 8k
# layer, so the default stays 2 and these tests guard the option.
@pytest.mark.parametrize("slots", [3, 4])
def test_deeper_pipelines_match_reference(monkeypatch, slots):
  monkeypatch.setattr(mgpu, "FWD_SLOTS", slots)
  monkeypatch.setattr(mgpu, "DKV_SLOTS", slots)
  b, t, h, kh, dk, dv, n = 1, 450, 16, 1, 64, 64, 6
  assert mgpu.fwd_slots(dk, dv) == mgpu.fwd_slots(dk, dv, dq=True) == mgpu.dkv_slots(dk, dv) == slots
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  maps = C.tile_maps(idx, mgpu.tiling_for(h // kh, 64))
  o, lse = mgpu.forward(q, k, v, maps, block_size=64, scale=dk ** -0.5, interpret=INTERPRET)
  _assert_select_matches(o, lse, q, k, v, idx)
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  ours = lambda q, k, v: select_attention(q, k, v, idx, 64, backend="mosaic", interpret=INTERPRET)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)
  if slots < 4:
    return
  qc, kc, vc, _ = _cmp_inputs(rng, 1, 4200, 16, 1, 64, 64)  # the compression forward's walk too
  oc, _ = compress_attention(qc, kc, vc, 32, 16, backend="mosaic", interpret=INTERPRET)
  np.testing.assert_allclose(f32(oc), ref.compressed_attention(f32(qc), f32(kc), f32(vc), 32, 16)[0],
                             atol=TOL, rtol=TOL)


def test_pipeline_depth_is_capped_by_shared_memory(monkeypatch):
  """Deeper pipelines than fit fall back to what fits (never below 2); the default stays 2."""
  assert mgpu.fwd_slots(256, 256) == mgpu.dkv_slots(64, 64) == 2
  monkeypatch.setattr(mgpu, "FWD_SLOTS", 8)
  monkeypatch.setattr(mgpu, "DKV_SLOTS", 8)
  for dk, dv in ((64, 64), (192, 128), (256, 256)):
    for dq in (False, True):
      s = mgpu.fwd_slots(dk, dv, dq=dq)
      assert s >= 2 and (s == 2 or mgpu._fwd_smem(dk, dv, s, dq) <= mgpu.SMEM_BYTES)
      assert s == 8 or mgpu._fwd_smem(dk, dv, s + 1, dq) > mgpu.SMEM_BYTES
    s = mgpu.dkv_slots(dk, dv)
    assert s >= 2 and (s == 2 or mgpu._dkv_smem(dk, dv, s) <= mgpu.SMEM_BYTES)
    assert s == 8 or mgpu._dkv_smem(dk, dv, s + 1) > mgpu.SMEM_BYTES
  assert mgpu._dkv_smem(64, 64, 2) == 640 * 128 + 9216  # the formula dkv_supports documented
  assert mgpu.fwd_slots(256, 256) == 2 and mgpu.fwd_slots(64, 64) == 8


@pytest.mark.parametrize("g,dk,dv", [(16, 64, 64), (8, 192, 128)], ids=["G16_64x64", "G8_192x128"])
def test_deeper_pipelines_lower_for_cuda(monkeypatch, g, dk, dv):
  """FWD_SLOTS = DKV_SLOTS = 4 (capped by shared memory: at 192/128 dK/dV keeps 2) through the
  CUDA lowering's checks; the lowered program differs from the 2-slot one (the setting took)."""
  two = _select_jaxpr(g, dk, dv, backend="mosaic")
  assert _select_jaxpr(g, dk, dv, backend="mosaic") == two  # the comparison can tell
  monkeypatch.setattr(mgpu, "FWD_SLOTS", 4)
  monkeypatch.setattr(mgpu, "DKV_SLOTS", 4)
  text = _select_lowered(g, dk, dv, backend="mosaic")
  assert "nsa_select_dkv_reduce" in text  # the Mosaic dK/dV ran (G >= 8)
  assert _select_jaxpr(g, dk, dv, backend="mosaic") != two  # the setting took


# KV_RING: the 64-row forward's K and V in one ring of 3 buffers (K_j in 2j % 3, V_j in 2j + 1).
# Union walks of up to 8 blocks (T = 450) cycle the ring several times; tiles of one and two
# blocks (only part of the prologue runs); G = 4 (16 tokens a tile) and G = 64 (one token a tile,
# every step masked); d_k != d_v keeps the two slot arrays (ring_applies); the compression walk
# (T = 1500: 2 blocks of 64 compressed keys for the last tiles) uses the same kernel.
RING_CASES = [(1, 450, 16, 1, 64, 64, 6), (1, 90, 4, 1, 64, 64, 2), (1, 140, 64, 1, 64, 64, 3),
              (2, 130, 16, 2, 128, 128, 3)]


@pytest.mark.parametrize("case", RING_CASES, ids=[f"G{c[2] // c[3]}_{c[4]}x{c[5]}_T{c[1]}"
                                                  for c in RING_CASES])
def test_kv_ring_matches_reference(monkeypatch, case):
  monkeypatch.setattr(mgpu, "KV_RING", True)
  monkeypatch.setattr(mgpu, "RING_MIN_DIM", 64)  # the small head dims too (interpreter time)
  b, t, h, kh, dk, dv, n = case
  assert mgpu.ring_applies(dk, dv) and not mgpu.ring_applies(192, 128)
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  maps = C.tile_maps(idx, mgpu.tiling_for(h // kh, 64))
  o, lse = mgpu.forward(q, k, v, maps, block_size=64, scale=dk ** -0.5, interpret=INTERPRET)
  _assert_select_matches(o, lse, q, k, v, idx)
  if case != RING_CASES[0]:
    return
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  ours = lambda q, k, v: select_attention(q, k, v, idx, 64, backend="mosaic", interpret=INTERPRET)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)  # dq uses the forward's lse
  qc, kc, vc, _ = _cmp_inputs(rng, 1, 1500, 16, 1, 64, 64)  # the compression walk (2 blocks)
  oc, _ = compress_attention(qc, kc, vc, 32, 16, backend="mosaic", interpret=INTERPRET)
  np.testing.assert_allclose(f32(oc), ref.compressed_attention(f32(qc), f32(kc), f32(vc), 32, 16)[0],
                             atol=TOL, rtol=TOL)


@pytest.mark.parametrize("g,dk,dv", [(16, 128, 128), (4, 64, 64), (16, 192, 128)],
                         ids=["G16_128x128", "G4_64x64", "G16_192x128"])
def test_kv_ring_lowers_for_cuda(monkeypatch, g, dk, dv):
  """KV_RING through the CUDA lowering's checks (barrier counts, TMA shapes, shared memory); the
  traced program changes exactly where d_k = d_v (ring_applies)."""
  monkeypatch.setattr(mgpu, "KV_RING", False)
  plain = _select_jaxpr(g, dk, dv, backend="mosaic")
  monkeypatch.setattr(mgpu, "KV_RING", True)
  monkeypatch.setattr(mgpu, "RING_MIN_DIM", 64)
  _select_lowered(g, dk, dv, backend="mosaic")
  assert (_select_jaxpr(g, dk, dv, backend="mosaic") != plain) == (dk == dv)


def test_kv_ring_is_logged(caplog):
  """The select_attention log line says when the Mosaic forward runs the ring: 128/128 yes, 64/64
  and 192/128 no (each shape logs once: distinct sequence lengths here)."""
  import logging
  for (dk, dv, t), ring in (((128, 128, 301), True), ((64, 64, 302), False),
                            ((192, 128, 303), False)):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pallas_kernels"):
      _select_jaxpr(16, dk, dv, t=t, backend="mosaic")
    assert "backend=mosaic" in caplog.text
    assert ("K/V ring" in caplog.text) == ring, (dk, dv, caplog.text)


def test_kv_ring_default_rule():
  """On by default where it raises occupancy and was measured faster (d_k = d_v >= 128); not at
  64/64 (the 8k training layer: no occupancy change, random lists 3-4% slower), nor d_k != d_v,
  nor with OVERLAP."""
  assert mgpu.KV_RING and mgpu.RING_MIN_DIM == 128
  assert mgpu.ring_applies(128, 128) and mgpu.ring_applies(256, 256)
  assert not mgpu.ring_applies(64, 64) and not mgpu.ring_applies(192, 128)
  assert not mgpu.ring_applies(128, 128, overlap=True)


# OVERLAP: the forward issues S_{j+1} and P_j V_j together and runs the softmax of S_{j+1} while
# P_j V_j is in flight (three K/V slots). Union walks of up to 8 blocks (T = 450), tiles with one
# block, G = 16 / 8 / 4, d_k != d_v; gradients through select_attention use its lse.
OVERLAP_CASES = [(1, 450, 16, 1, 64, 64, 6), (1, 150, 16, 1, 192, 128, 5),
                 (2, 130, 8, 2, 128, 64, 3), (1, 90, 4, 1, 64, 128, 2)]


@pytest.mark.parametrize("case", OVERLAP_CASES,
                         ids=[f"G{c[2] // c[3]}_{c[4]}x{c[5]}_T{c[1]}" for c in OVERLAP_CASES])
def test_overlap_forward_matches_reference(monkeypatch, case):
  monkeypatch.setattr(mgpu, "OVERLAP", True)
  b, t, h, kh, dk, dv, n = case
  assert mgpu.overlap_applies(64 // (h // kh), dk, dv, interpret=True)
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  maps = C.tile_maps(idx, mgpu.tiling_for(h // kh, 64))
  o, lse = mgpu.forward(q, k, v, maps, block_size=64, scale=dk ** -0.5, interpret=INTERPRET)
  _assert_select_matches(o, lse, q, k, v, idx)
  if case is OVERLAP_CASES[0]:
    dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    ours = lambda q, k, v: select_attention(q, k, v, idx, 64, backend="mosaic", interpret=INTERPRET)
    _assert_grads_match(ours, lambda q, k, v: ref.select_attention(q, k, v, idx, 64), (q, k, v),
                        do, dlse)


def test_overlap_lowers_for_cuda_where_it_applies(monkeypatch):
  """OVERLAP changes the lowered program where three K/V slots fit and tiles hold several tokens;
  at 256/256 (two slots fit) and G = 64 (one token a tile) the call runs the plain forward."""
  cases = ((16, 64, 64), (8, 192, 128), (16, 256, 256), (64, 64, 64))
  plain = {c: _select_jaxpr(*c, backend="mosaic") for c in cases}
  assert all("wait_n=1" not in text for text in plain.values())
  monkeypatch.setattr(mgpu, "OVERLAP", True)
  assert mgpu.overlap_slots(64, 64) == 3 and mgpu.overlap_slots(256, 256) == 0
  for c in cases:
    applies = c[0] < 64 and mgpu.overlap_slots(c[1], c[2]) >= 3
    _select_lowered(*c, backend="mosaic")  # lowers for CUDA either way
    text = _select_jaxpr(*c, backend="mosaic")
    assert (text != plain[c]) == applies and ("wait_n=1" in text) == applies, c


@pytest.mark.parametrize("kernel", ["forward", "overlap", "ring", "dq", "dkv"])
@pytest.mark.parametrize("lean", [True, False], ids=["lean_smem", "separate_smem"])
def test_kernels_are_race_free_in_the_interpreter(monkeypatch, kernel, lean):
  """Mosaic GPU's interpreter with race detection (it also checks reads through another RefUnion
  group than the last write, which the plain interpreter does not: there each union member has
  its own buffer): the forward, the overlapped forward, dq and dK/dV at G = 8 (8 tokens a tile)
  with short lists and tiles of one block, with and without LEAN_SMEM. A review found that
  writing dK/dV's result staging before the last row copy was waited for, or skipping that wait,
  fails this test. (The kernels run interpreted on a GPU machine too: interpret=True.)"""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  params = mgpu.plgpu.InterpretGPUParams
  monkeypatch.setattr(mgpu.plgpu, "InterpretGPUParams", lambda: params(detect_races=True))
  monkeypatch.setattr(mgpu, "LEAN_SMEM", lean)
  monkeypatch.setattr(mgpu, "OVERLAP", kernel == "overlap")
  monkeypatch.setattr(mgpu, "KV_RING", kernel == "ring")
  monkeypatch.setattr(mgpu, "RING_MIN_DIM", 64)
  b, t, h, kh, dk, dv, n = 1, 200, 8, 1, 64, 64, 3
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  maps = C.tile_maps(idx, mgpu.tiling_for(h // kh, 64))
  lse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  delta = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  scale = dk ** -0.5
  fwd = lambda: mgpu.forward(q, k, v, maps, block_size=64, scale=scale, interpret=True)
  run = {"forward": fwd, "overlap": fwd, "ring": fwd,  # OVERLAP / KV_RING (set above) pick it
         "dq": lambda: mgpu.dq(q, k, v, maps, do, lse, delta, block_size=64, scale=scale,
                               interpret=True),
         "dkv": lambda: mgpu.dkv_partials(q, k, v, idx, do, lse, delta, chunk_entries=24,
                                          scale=scale, interpret=True)}[kernel]
  jax.block_until_ready(run())
  assert not gpu_callbacks.get_races().races_found, f"{kernel}: a race in the interpreter"


def test_deep_prologue_within_short_lists(monkeypatch):
  """G = 64 (one token a tile, every step causally masked, the list the token's own n entries)
  with a prologue deeper than the list (FWD_SLOTS - 1 > n): exact, and lowers for CUDA."""
  monkeypatch.setattr(mgpu, "FWD_SLOTS", 6)
  b, t, h, kh, dk, dv, n = 1, 200, 64, 1, 64, 64, 3
  rng = np.random.default_rng(_seed())
  q, k, v, idx, _ = _inputs(rng, b, t, h, kh, dk, dv, n)
  maps = C.tile_maps(idx, mgpu.tiling_for(h // kh, 64))
  o, lse = mgpu.forward(q, k, v, maps, block_size=64, scale=dk ** -0.5, interpret=INTERPRET)
  _assert_select_matches(o, lse, q, k, v, idx)
  _select_lowered(64, 64, 64, kh=1, t=200, n=3, backend="mosaic")  # and through the lowering


LOWER_CASES = [(g, dk, dv) for g in (4, 8, 16, 32)
               for dk, dv in ((64, 64), (128, 128), (192, 128), (192, 192), (256, 256))]
LOWER_CASES += [(64, 64, 64), (64, 192, 128)]  # one token a tile (the every-step causal mask)


@pytest.mark.parametrize("g,dk,dv", LOWER_CASES, ids=[f"G{g}_{dk}x{dv}" for g, dk, dv in LOWER_CASES])
def test_lowers_for_cuda(g, dk, dv):
  """value_and_grad of select_attention(backend="mosaic") lowers for CUDA (Mosaic GPU layout
  inference, wgmma operand and TMA shape checks, barrier counts and the shared-memory limit run at
  lowering); dK/dV is the Mosaic kernel exactly where dkv_supports says so, else the Triton one."""
  import re
  text = _select_lowered(g, dk, dv, backend="mosaic")
  assert not re.search(r"nsa_select_(fwd|dq)", text), "forward and dq must be the Mosaic kernels"
  triton_dkv = re.search(r"nsa_select_dkv(?!_reduce)", text) is not None
  assert triton_dkv == (not mgpu.dkv_supports(g, dk, dv)[0]), (g, dk, dv)
  assert "nsa_select_dkv_reduce" in text or triton_dkv


# ----------------------------------------------------------------------------- compression

# (b, t, h, kh, dk, dv): two key blocks of 64 compressed keys at T=1100 (l=32, d=16: Nc = 67);
# G = 4 with d_k != d_v
CMP_CASES = [(1, 1100, 16, 1, 64, 64), (2, 300, 8, 2, 192, 128)]


def _cmp_inputs(rng, b, t, h, kh, dk, dv, l=32, d=16):
  nc = (t - l) // d + 1
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  return f(b, t, h, dk), f(b, nc, kh, dk), f(b, nc, kh, dv), f(b, t, h, dv)


@pytest.mark.parametrize("case", CMP_CASES, ids=[f"G{c[2] // c[3]}_{c[4]}x{c[5]}_T{c[1]}"
                                                 for c in CMP_CASES])
def test_cmp_forward_matches_reference(case):
  b, t, h, kh, dk, dv = case
  rng = np.random.default_rng(_seed())
  q, kc, vc, _ = _cmp_inputs(rng, b, t, h, kh, dk, dv)
  o, lse = compress_attention(q, kc, vc, 32, 16, backend="mosaic", interpret=INTERPRET)
  ro, rlse, _ = ref.compressed_attention(f32(q), f32(kc), f32(vc), 32, 16)
  assert o.shape == (b, t, h, dv) and o.dtype == q.dtype
  np.testing.assert_allclose(f32(o), ro, atol=TOL, rtol=TOL)
  fin = jnp.isfinite(rlse)
  assert bool(jnp.all(jnp.isfinite(lse) == fin)) and not bool(jnp.all(fin))  # early tokens see none
  np.testing.assert_allclose(jnp.where(fin, lse, 0.0), jnp.where(fin, rlse, 0.0), atol=1e-3, rtol=1e-4)


def test_cmp_gradients_through_compress_attention():
  b, t, h, kh, dk, dv = 1, 200, 16, 2, 64, 128
  rng = np.random.default_rng(_seed())
  q, kc, vc, do = _cmp_inputs(rng, b, t, h, kh, dk, dv)
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  ours = lambda q, kc, vc: compress_attention(q, kc, vc, 32, 16, backend="mosaic",
                                              interpret=INTERPRET)
  theirs = lambda q, kc, vc: ref.compressed_attention(q, kc, vc, 32, 16)[:2]
  _assert_grads_match(ours, theirs, (q, kc, vc), do, dlse, names=("q", "k_cmp", "v_cmp"))


def test_cmp_refusals_name_the_problem():
  q = jnp.zeros((1, 64, 16, 64), jnp.bfloat16)
  kc = jnp.zeros((1, 3, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="segment ids"):
    compress_attention(q, kc, kc, 32, 16, jnp.zeros((1, 64), jnp.int32), backend="mosaic")
  with pytest.raises(ValueError, match="bfloat16"):
    compress_attention(f32(q), f32(kc), f32(kc), 32, 16, backend="mosaic")
  with pytest.raises(ValueError, match="multiples of 64"):
    compress_attention(q[..., :32], kc[..., :32], kc, 32, 16, backend="mosaic")
  with pytest.raises(ValueError, match="backend='cuda'"):
    compress_attention(q, kc, kc, 32, 16, backend="cuda")


def test_cmp_lowers_for_cuda():
  b, t, h, kh, dk, dv = 1, 1000, 64, 4, 192, 128
  nc = (t - 32) // 16 + 1
  sd = jax.ShapeDtypeStruct
  args = (sd((b, t, h, dk), jnp.bfloat16), sd((b, nc, kh, dk), jnp.bfloat16),
          sd((b, nc, kh, dv), jnp.bfloat16))

  def f(q, kc, vc):
    def loss(q, kc, vc):
      o, lse = compress_attention(q, kc, vc, 32, 16, backend="mosaic")
      return jnp.sum(f32(o)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.value_and_grad(loss, (0, 1, 2))(q, kc, vc)

  text = _cuda_text(f, args)
  for name in ("nsa_cmp_dq", "nsa_cmp_dkv"):  # the Triton backward
    assert name in text, f"{name} missing from the lowered module"


# ----------------------------------------------------------------------------- whole op

def test_whole_op_pallas_mosaic_matches_reference(caplog, monkeypatch):
  """ops.nsa_attention(implementation="pallas-mosaic"): Mosaic GPU compression and selection
  kernels inside the op (block indices given, selector="aux", so bf16 rounding cannot change the
  selection),
  forward and gradients of every input; with segment ids the compression branch falls back to
  Triton, said, and the selection branch stays Mosaic GPU (SEGMENT_IDS, on by default; off:
  Triton, said)."""
  import logging
  from nsa_jax import ops
  from nsa_jax.config import NSAConfig
  rng = np.random.default_rng(_seed())
  b, t, h, kv, dk, dv = 1, 300, 16, 1, 64, 64
  cfg = NSAConfig(num_heads=h, num_kv_heads=kv, head_dim=dk, head_dim_v=dv, cmp_block=32,
                  cmp_stride=16, sel_block=64, num_selected=3, window=128, selector="aux")
  nc = cfg.num_cmp_blocks(t)
  shapes = [(b, t, h, dk), (b, nc, kv, dk), (b, nc, kv, dv), (b, t, kv, dk), (b, t, kv, dv),
            (b, t, kv, dk), (b, t, kv, dv)]
  args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes]
  args.append(jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, h, 3)), jnp.float32)))
  idx = _inputs(rng, b, t, h, kv, dk, dv, cfg.num_selected)[3]
  w = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)

  def run(impl, a, seg=None):
    op = lambda *a: f32(ops.nsa_attention(*a, cfg, segment_ids=seg, implementation=impl,
                                          block_idx=idx))
    o, vjp = jax.vjp(op, *a)
    return o, vjp(w)

  with caplog.at_level(logging.INFO, logger="nsa_jax"):
    o, grads = run("pallas-mosaic", args)
  assert "compress branch: Mosaic GPU" in caplog.text and "select branch: Mosaic GPU" in caplog.text
  ro, rgrads = run("reference", [f32(x) for x in args])
  # elementwise: a scalar sum over 300 x 16 x 64 outputs would add up their bf16 roundings
  np.testing.assert_allclose(o, ro, atol=TOL, rtol=TOL)
  names = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")
  for name, a, r in zip(names, grads, rgrads):
    scale = float(jnp.max(jnp.abs(r)))
    assert float(jnp.max(jnp.abs(f32(a) - r))) <= TOL * max(scale, 1.0), f"d{name}"
  caplog.clear()
  seg = jnp.asarray(np.repeat([[0] * 150 + [1] * 150], b, 0), jnp.int32)
  for on in (True, False):
    monkeypatch.setattr(mgpu, "SEGMENT_IDS", on)
    ops.log_once.cache_clear()  # logged once per message and process
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nsa_jax"):
      jax.eval_shape(lambda *a: run("pallas-mosaic", a, seg), *args)
    assert "compress branch: Triton" in caplog.text and "segment ids" in caplog.text
    assert ("select branch: Mosaic GPU" in caplog.text) == on, caplog.text
    assert ("select branch: Triton" in caplog.text) == (not on), caplog.text


# ----------------------------------------------------------------------------- automatic choice

def test_auto_backend_rule(monkeypatch):
  """select_attention(backend="auto") picks Mosaic GPU exactly where it was measured faster on the
  H200 (compiled; G = 16 and G = 4 with head dims <= 128; with segment ids too, SEGMENT_IDS on by
  default) and says why otherwise."""
  from pallas_kernels.select_attention import auto_backend
  bf = jnp.bfloat16
  shapes = lambda h, kh, dk, dv: ((1, 512, h, dk), (1, 512, kh, dk), (1, 512, kh, dv))
  assert auto_backend(*shapes(16, 1, 64, 64), 64, False, bf, False)[0] == "mosaic"
  assert auto_backend(*shapes(16, 1, 64, 64), 64, True, bf, False)[0] == "mosaic"
  # with ids only where that was timed (G = 16, T <= STATIC_UNION_MAX_T, head dims <= 64)
  for args in (shapes(16, 4, 64, 64), shapes(16, 1, 128, 128),
               ((1, 9000, 16, 64), (1, 9000, 1, 64), (1, 9000, 1, 64))):
    be, reason = auto_backend(*args, 64, True, bf, False)
    assert be == "triton" and "measured faster only at G=16" in reason, (args, reason)
  monkeypatch.setattr(mgpu, "SEGMENT_IDS", False)  # the ids' case in the refusals below
  assert auto_backend(*shapes(16, 4, 64, 64), 64, False, bf, False)[0] == "mosaic"
  assert auto_backend(*shapes(16, 4, 128, 128), 64, False, bf, False)[0] == "mosaic"
  assert auto_backend(*shapes(16, 1, 128, 128), 64, False, bf, False)[0] == "mosaic"
  # The reason names the card the rule was measured on, and says so when this is another one.
  why = auto_backend(*shapes(16, 1, 64, 64), 64, False, bf, False)[1]
  kind = jax.devices()[0].device_kind
  assert "on the H200" in why and (("not re-measured" in why) == ("H200" not in kind)), why
  for args, why in [((shapes(16, 1, 64, 64), 64, False, bf, True), "interpreted"),
                    ((shapes(16, 1, 192, 128), 64, False, bf, False), "head dims <= 128"),
                    ((shapes(16, 1, 128, 256), 64, False, bf, False), "head dims <= 128"),
                    ((shapes(16, 4, 192, 128), 64, False, bf, False), "head dims <= 128"),
                    ((shapes(16, 2, 64, 64), 64, False, bf, False), "G=8"),
                    ((shapes(16, 1, 64, 64), 64, True, bf, False), "SEGMENT_IDS is off"),
                    ((shapes(16, 1, 64, 64), 32, False, bf, False), "l' = 64"),
                    ((shapes(16, 1, 64, 64), 64, False, jnp.float32, False), "bfloat16")]:
    be, reason = auto_backend(*args[0], *args[1:])
    assert be == "triton" and why in reason, (args, be, reason)


def test_op_logs_which_dkv_kernels_run(caplog, monkeypatch):
  """implementation="pallas" logs the selection's dK/dV kernels under the Mosaic forward: the
  Mosaic partials without ids, with ids only with DKV_SEGMENT_IDS (else Triton, said why)."""
  import logging
  import types
  from nsa_jax import ops
  cfg = types.SimpleNamespace(num_heads=16, num_kv_heads=1, sel_block=64)
  q, kv = jnp.zeros((1, 128, 16, 64), jnp.bfloat16), jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  seg = jnp.zeros((1, 128), jnp.int32)

  def logged(ids, dkv_ids):
    monkeypatch.setattr(mgpu, "DKV_SEGMENT_IDS", dkv_ids)
    ops.log_once.cache_clear()  # logged once per message and process
    caplog.clear()
    with caplog.at_level(logging.INFO):
      ops._auto_select_backend(q, kv, kv, cfg, ids, False)
    return caplog.text

  assert "select branch: Mosaic GPU" in logged(None, False)
  assert "dK/dV: Mosaic GPU partials" in logged(None, False)
  assert "dK/dV: Triton, segment ids: select_attention_mgpu.DKV_SEGMENT_IDS is off" in logged(
      seg, False)
  assert "dK/dV: Mosaic GPU partials" in logged(seg, True)


AUTO_CASES = [(1, None, True, False), (4, (16, 5.0), True, False), (4, (16, 0.0), False, False),
              (1, None, True, True), (4, (16, 5.0), True, True)]


@pytest.mark.parametrize("kh,switch,mosaic,docs", AUTO_CASES,
                         ids=["G16_mosaic_union", "G4_mosaic_union", "G4_triton_branch",
                              "G16_mosaic_union_docs", "G4_mosaic_union_docs"])
def test_auto_cond_matches_reference(kh, switch, mosaic, docs):
  """backend="auto" where Mosaic GPU applies: a lax.cond between a Triton tile and Mosaic's 64-row
  union tile (G = 16: the per-token tile vs 4 tokens; G = 4: Triton's 4-token tile vs 16 tokens,
  switched on the 16-token tiles' mean union; a 0 switch takes the Triton branch); "docs": with
  packed documents (SEGMENT_IDS, on by default: the Mosaic union branch takes the ids; auto does
  not pick this with ids, where only the static union tile at 8k was timed, but the cond is
  exact with them). Here in the interpreters, reached through
  _select_auto directly since auto picks Triton when interpreted: forward and gradients against
  the reference."""
  from pallas_kernels import select_attention as sk
  b, t, h, dk, dv, n = 1, 200, 16, 64, 64, 4
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  assert bool(C.use_union(idx, switch)) == mosaic, "T=200 has 4 blocks: unions are small"
  g = h // kh
  tilings = (C.default_tiling(g, 64), mgpu.tiling_for(g, 64))
  if g == 16:
    assert C.clustered_tiling(g, 64) == tilings[1]
  seg = jnp.zeros((b, t), jnp.int32)
  if docs:
    seg = _doc_ids(rng, b, t, 70)
    # the bound must matter: some (token, picked block) pairs hold an earlier document
    starts = ref.document_starts(seg)[:, :, None, None]
    assert bool(jnp.any((idx >= 0) & (idx * 64 < starts))), "no block holds an earlier document"
    assert mgpu.SEGMENT_IDS
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  ours = lambda q, k, v: sk._select_auto(q, k, v, idx, seg, 64, dk ** -0.5, tilings, docs,
                                         INTERPRET, True, "mosaic", switch)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64, seg if docs else None)
  o, _ = ours(q, k, v)
  np.testing.assert_allclose(f32(o), theirs(f32(q), f32(k), f32(v))[0], atol=TOL, rtol=TOL)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)


@pytest.mark.parametrize("kh", [1, 4], ids=["G16_cond", "G4_cond"])
def test_auto_lowers_for_cuda(kh):
  """value_and_grad of backend="auto" at d = 64 lowers for CUDA with the Mosaic GPU kernels in it,
  beside the Triton kernels of the other lax.cond branch (G = 16: per-token tile, past
  STATIC_UNION_MAX_T; G = 4: 4-token union tile)."""
  import re
  from pallas_kernels import select_attention as sk
  text = _select_lowered(16 // kh, 64, 64, kh=kh, t=sk.STATIC_UNION_MAX_T + 64, backend="auto")
  assert re.search(r"nsa_select_(fwd|dq)", text), "the Triton branch of the lax.cond is missing"
  assert "stablehlo.case" in text


def test_auto_short_sequences_run_the_union_tile_without_the_cond():
  """G = 16 up to STATIC_UNION_MAX_T: backend="auto" (where Mosaic GPU applies) is the Mosaic
  union tile alone, no lax.cond and no Triton forward / dq kernel (the backward's dK/dV reduce
  stays Triton; the cond measured 2.9-3.5 ms a 12-layer 8k step); G = 4 keeps its cond."""
  import re
  from pallas_kernels import select_attention as sk
  text = _select_lowered(16, 64, 64, kh=1, t=sk.STATIC_UNION_MAX_T, backend="auto")
  assert "stablehlo.case" not in text and not re.search(r"nsa_select_(fwd|dq)", text)
  assert "stablehlo.case" in _select_lowered(4, 64, 64, kh=4, backend="auto")
  # head dims above STATIC_UNION_MAX_DIM (the union tile alone was measured at d = 64 only) keep
  # the cond, with the Mosaic union branch beside the Triton per-token one
  assert sk.static_union(16, sk.STATIC_UNION_MAX_T, 64, 64)
  assert not sk.static_union(16, sk.STATIC_UNION_MAX_T + 1, 64, 64)
  assert not sk.static_union(16, 300, 128, 128) and not sk.static_union(4, 300, 64, 64)
  text = _select_lowered(16, 128, 128, kh=1, backend="auto")
  assert "stablehlo.case" in text and re.search(r"nsa_select_(fwd|dq)", text)


# ----------------------------------------------------------------------------- two warpgroups

# (b, t, h, kh, dk, dv, n, pingpong): G = 16 (8 tokens a 128-row tile), G = 8 (16 tokens); d_k !=
# d_v; T not a multiple of the tile; with and without the consumers' ping-pong barrier
WS_CASES = [(1, 150, 16, 1, 192, 128, 5, True), (2, 140, 16, 2, 64, 64, 3, False),
            (1, 200, 16, 2, 128, 64, 4, True)]


@pytest.mark.parametrize("case", WS_CASES,
                         ids=[f"G{c[2] // c[3]}_{c[4]}x{c[5]}_T{c[1]}_pp{int(c[7])}" for c in WS_CASES])
def test_ws_forward_matches_reference(case):
  """The warp-specialised forward (a producer warpgroup issuing the TMA copies, two consumer
  warpgroups of 64 rows each over one 128-row union tile) against the reference."""
  b, t, h, kh, dk, dv, n, pingpong = case
  rng = np.random.default_rng(_seed())
  q, k, v, idx, _ = _inputs(rng, b, t, h, kh, dk, dv, n)
  maps = C.tile_maps(idx, mgpu.ws_tiling_for(h // kh, 64))
  o, lse = mgpu.ws_forward(q, k, v, maps, block_size=64, scale=dk ** -0.5, pingpong=pingpong,
                           interpret=INTERPRET)
  _assert_select_matches(o, lse, q, k, v, idx)


def test_ws_gradients_through_select_attention():
  """select_attention(backend="mosaic") with the 128-row tiling: the two-warpgroup forward, then
  the 64-row Mosaic dq (its maps rebuilt in the backward) and dK/dV, against the reference."""
  b, t, h, kh, dk, dv, n = 1, 140, 16, 1, 128, 64, 4
  rng = np.random.default_rng(_seed())
  q, k, v, idx, do = _inputs(rng, b, t, h, kh, dk, dv, n)
  dlse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
  til = mgpu.ws_tiling_for(h // kh, 64)
  ours = lambda q, k, v: select_attention(q, k, v, idx, 64, backend="mosaic", tiling=til,
                                          interpret=INTERPRET)
  theirs = lambda q, k, v: ref.select_attention(q, k, v, idx, 64)
  _assert_grads_match(ours, theirs, (q, k, v), do, dlse)


WS_LOWER = [(g, dk, dv) for g in (8, 16, 32) for dk, dv in ((64, 64), (128, 128), (192, 128),
                                                            (192, 192))]


@pytest.mark.parametrize("g,dk,dv", WS_LOWER, ids=[f"G{g}_{dk}x{dv}" for g, dk, dv in WS_LOWER])
def test_ws_lowers_for_cuda(g, dk, dv):
  """value_and_grad through the two-warpgroup forward lowers for CUDA (three warpgroups, register
  reallocation, P from registers, the shared-memory limit with ws_slots(dk, dv) slots)."""
  _select_lowered(g, dk, dv, backend="mosaic", tiling=mgpu.ws_tiling_for(g, 64))
  assert mgpu.ws_slots(dk, dv) >= 2


def test_ws_refusals_name_the_problem():
  q = jnp.zeros((1, 64, 16, 256), jnp.bfloat16)
  kv = jnp.zeros((1, 64, 1, 256), jnp.bfloat16)
  idx = jnp.zeros((1, 64, 1, 2), jnp.int32)
  with pytest.raises(ValueError, match="two K/V slots do not fit"):
    select_attention(q, kv, kv, idx, 64, backend="mosaic", tiling=mgpu.ws_tiling_for(16, 64))
  ok, why = mgpu.ws_supports((1, 64, 16, 64), (1, 64, 4, 64), (1, 64, 4, 64), 64, False,
                             jnp.bfloat16)
  assert not ok and "G=4" in why
  # segment ids: the two-warpgroup forward takes none (it would ignore them), with SEGMENT_IDS on
  assert mgpu.SEGMENT_IDS and mgpu.supports((1, 64, 16, 64), (1, 64, 1, 64), (1, 64, 1, 64), 64,
                                            True, jnp.bfloat16)[0]
  with pytest.raises(ValueError, match="two-warpgroup forward"):
    select_attention(q[..., :64], kv[..., :64], kv[..., :64], idx, 64,
                     jnp.zeros((1, 64), jnp.int32), backend="mosaic",
                     tiling=mgpu.ws_tiling_for(16, 64))
