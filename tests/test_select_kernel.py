"""Tests of the Pallas selected-block attention kernels (pallas_kernels/select_attention*.py).

CPU only: the kernels run in Pallas interpret mode against nsa_jax.reference.select_attention
(forward, lse, and dq/dk/dv incl. the lse cotangent) on fresh random inputs; every kernel is also
lowered for CUDA through an abstract H100-class device (catches Triton lowering errors without a GPU);
the XLA index maps are checked against brute force. Seeds come from os.urandom and are printed.
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
from pallas_kernels.select_attention import BACKENDS, select_attention, supports
try:
  from tests.gpu_mode import INTERPRET, ON_GPU
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from gpu_mode import INTERPRET, ON_GPU


# On a GPU the same tests run the compiled kernels in bf16 (against the float32 reference of the same
# bf16 values); on the CPU they run interpreted in float32 with tight tolerances.
DTYPE, TOL = (jnp.bfloat16, 3e-2) if ON_GPU else (jnp.float32, 5e-5)


def _seed():
  s = int(os.environ.get("NSA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
  print(f"seed={s}")
  return s


def _block_idx(rng, b, t, kh, n, bs, empty):
  """Random ascending block lists, causal (block <= current), -1 padded; some rows short if empty."""
  idx = np.full((b, t, kh, n), -1, np.int32)
  for bb in range(b):
    for tt in range(t):
      for k in range(kh):
        cand = np.arange(tt // bs + 1)
        m = min(n, len(cand))
        if empty:
          m = int(rng.integers(1, m + 1))
        idx[bb, tt, k, :m] = np.sort(rng.choice(cand, m, replace=False))
  return jnp.asarray(idx)


def _inputs(rng, b, t, h, kh, dk, dv, n, bs, seg, empty=True):
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  sid = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32) if seg else None
  return (f(b, t, h, dk), f(b, t, kh, dk), f(b, t, kh, dv), _block_idx(rng, b, t, kh, n, bs, empty),
          sid, f(b, t, h, dv), f(b, t, h))


# (name, b, t, h, kh, dk, dv, n, block, segments, tiling, deterministic[, "full": no short lists])
CASES = [
    ("G16_shared_dk!=dv_seg", 1, 27, 16, 1, 48, 32, 2, 16, True,
     C.SelectTiling(tokens_per_tile=4, mode="shared", block_k=16, bwd_tokens=2, chunk_entries=8), True),
    ("G16_default_atomic", 1, 21, 16, 1, 32, 16, 2, 16, False, None, False),
    ("G4_union_T%l'", 1, 29, 8, 2, 32, 16, 3, 16, False, None, True),
    ("G2_padded_rows_bk8_seg", 1, 26, 4, 2, 16, 32, 2, 16, True,
     C.SelectTiling(tokens_per_tile=1, block_k=8, bwd_tokens=4, chunk_entries=16), True),
    ("G1_union16_seg", 1, 30, 2, 2, 32, 16, 2, 16, True, None, True),
    # Several blocks a forward (and dq) step: T=70 and n=5 give tokens several loop steps and an
    # odd tail; with full lists, tokens 64-69 fill all 5 slots, so a missing tail mask counts slot
    # 4 twice.
    ("G16_2blocks_a_step_odd_n", 1, 70, 16, 1, 32, 16, 5, 16, True,
     C.SelectTiling(block_k=16, blocks_per_step=2, dq_blocks_per_step=2), True, "full"),
    ("G16_union4_2blocks_a_step", 1, 70, 16, 1, 32, 16, 5, 16, False,
     C.SelectTiling(tokens_per_tile=4, block_k=16, blocks_per_step=2), True),
    ("G4_union2_3blocks_a_step", 1, 70, 8, 2, 32, 16, 5, 16, False,
     C.SelectTiling(tokens_per_tile=2, block_k=16, blocks_per_step=3, dq_blocks_per_step=3), True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_matches_reference(case):
  _, b, t, h, kh, dk, dv, n, bs, seg, tiling, det, *full = case
  rng = np.random.default_rng(_seed())
  q, k, v, idx, sid, do, dl = _inputs(rng, b, t, h, kh, dk, dv, n, bs, seg, empty=not full)
  if ON_GPU and tiling is not None and tiling.block_k < 16:
    tiling = dataclasses.replace(tiling, block_k=16)  # compiled dots need >= 16 keys per step
  q, k, v = (x.astype(DTYPE) for x in (q, k, v))
  ker = lambda q, k, v: select_attention(q, k, v, idx, bs, sid, interpret=INTERPRET, tiling=tiling,
                                         deterministic=det)
  f32 = lambda x: x.astype(jnp.float32)
  rf = lambda q, k, v: ref.select_attention(f32(q), f32(k), f32(v), idx, bs, sid)

  def loss(fn):
    def inner(q, k, v):
      o, lse = fn(q, k, v)
      return jnp.sum(f32(o) * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dl)
    return inner

  (o1, l1), (o2, l2) = rf(q, k, v), ker(q, k, v)
  np.testing.assert_allclose(f32(o2), o1, atol=TOL, rtol=TOL)
  assert bool(jnp.all(jnp.isfinite(l1) == jnp.isfinite(l2)))  # empty rows: lse = -inf in both
  np.testing.assert_allclose(jnp.where(jnp.isfinite(l1), l2, 0), jnp.where(jnp.isfinite(l1), l1, 0),
                             atol=TOL, rtol=TOL)
  g1 = jax.grad(loss(rf), (0, 1, 2))(q, k, v)
  g2 = jax.grad(loss(ker), (0, 1, 2))(q, k, v)
  for name, a, c in zip("qkv", g2, g1):
    assert bool(jnp.all(jnp.isfinite(f32(a)))), f"d{name} not finite"
    scale = float(jnp.max(jnp.abs(c))) + 1e-6  # bf16 grads: error relative to the largest entry
    np.testing.assert_allclose(f32(a) / scale, f32(c) / scale, atol=TOL, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("tiling", [None, C.SelectTiling(tokens_per_tile=4, block_k=16)],
                         ids=["per_token", "union4"])
def test_repeated_and_future_blocks_count_as_the_reference(tiling):
  """A list that repeats a block, names blocks after the token or holds values below -1 (not
  what top-n produces; a caller may pass them): the reference counts a repeated block once and
  sees nothing of a later block; the kernels must agree (forward and lse), not attend twice."""
  rng = np.random.default_rng(_seed())
  b, t, h, kh, d, n, bs = 1, 70, 8, 2, 32, 4, 16
  q, k, v, _, _, _, _ = _inputs(rng, b, t, h, kh, d, d, n, bs, False)
  nb = -(-t // bs)
  idx = rng.integers(-3, nb, (b, t, kh, n)).astype(np.int32)
  idx[..., 1] = idx[..., 0]  # every list repeats its first slot
  idx = jnp.asarray(idx)
  assert bool(jnp.any(idx * bs > jnp.arange(t)[None, :, None, None]))
  o, lse = select_attention(q, k, v, idx, bs, interpret=INTERPRET, tiling=tiling)
  ro, rl = ref.select_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                v.astype(jnp.float32), idx, bs)
  np.testing.assert_allclose(o.astype(jnp.float32), ro, atol=TOL, rtol=TOL)
  fin = jnp.isfinite(rl)
  assert bool(jnp.all(jnp.isfinite(lse) == fin))
  np.testing.assert_allclose(jnp.where(fin, lse, 0), jnp.where(fin, rl, 0), atol=TOL, rtol=TOL)


def test_index_maps_match_brute_force():
  rng = np.random.default_rng(_seed())
  b, t, kh, n, bs = 1, 50, 2, 4, 16
  idx = _block_idx(rng, b, t, kh, n, bs, empty=True)
  x = np.asarray(idx)
  for tq in (2, 4):
    ub, bits, cnt = map(np.asarray, C.tile_union(idx, tq))
    com, ccnt, priv, pcnt = map(np.asarray, C.tile_shared(idx, tq))
    for bb in range(b):
      for it in range(ub.shape[1]):
        for k in range(kh):
          lists = [set(x[bb, min(it * tq + i, t - 1), k][x[bb, min(it * tq + i, t - 1), k] >= 0])
                   for i in range(tq)]
          real = [lists[i] if it * tq + i < t else set() for i in range(tq)]
          union = sorted(set().union(*real))
          assert list(ub[bb, it, k, :cnt[bb, it, k, 0]]) == union
          for u, blk in enumerate(union):
            assert bits[bb, it, k, u] == sum(1 << i for i, s in enumerate(real) if blk in s)
          common = set.intersection(*lists)
          assert list(com[bb, it, k, :ccnt[bb, it, k, 0]]) == sorted(common)
          for i in range(tq):
            assert list(priv[bb, it, k, i, :pcnt[bb, it, k, i]]) == sorted(lists[i] - common)
  nb = -(-t // bs)
  tokens, iblk, s0, s1, first, nitems = map(np.asarray, C.inverse_lists(idx, nb, 5))
  for bb in range(b):
    for k in range(kh):
      for j in range(nb):
        want = sorted(tt for tt in range(t) if j in x[bb, tt, k])
        items = range(first[bb, k, j], first[bb, k, j] + nitems[bb, k, j])
        got = [int(tokens[bb, k, e]) for w in items for e in range(s0[bb, k, w], s1[bb, k, w])]
        assert all(iblk[bb, k, w] == j and s1[bb, k, w] - s0[bb, k, w] <= 5 for w in items)
        assert got == want


def test_search_sorted_matches_numpy_and_the_index_maps_have_no_loops():
  """C.search_sorted (the index maps' binary search, unrolled) equals np.searchsorted on sorted
  lists with repeats, both sides, odd lengths; and the maps' programs contain no while loop (on
  the GPU each loop iteration was its own kernel launches) and only unstable sorts."""
  rng = np.random.default_rng(_seed())
  for size in (1, 7, 64, 129, 1000):
    a = np.sort(rng.integers(0, size // 2 + 2, size)).astype(np.int32)
    v = rng.integers(-1, size // 2 + 4, 257).astype(np.int32)
    for side in ("left", "right"):
      np.testing.assert_array_equal(np.asarray(C.search_sorted(a, v, side)),
                                    np.searchsorted(a, v, side))
  idx = _block_idx(rng, 2, 50, 2, 4, 16, empty=True)
  for fn in (lambda i: C.tile_union(i, 4), lambda i: C.inverse_lists(i, 4, 5),
             lambda i: C.tile_shared(i, 4), lambda i: C.mean_union(i, 4)):
    text = jax.jit(fn).lower(idx).as_text()
    assert "stablehlo.while" not in text  # jnp.searchsorted's: 1-2
    # value-only integer sorts need no stability (XLA adds an index operand for a stable one)
    assert "is_stable = true" not in text and "stablehlo.sort" in text


_H100 = dict(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)

# Every kernel: fwd/dq in union (tq 1 and 4) and shared modes, dK/dV deterministic (+ reduce) and atomic.
LOWERINGS = [
    ("union1_det", 16, 1, 128, 128, C.SelectTiling(), True, True),
    ("union4_atomic_192", 8, 2, 192, 128, C.SelectTiling(tokens_per_tile=4, block_k=32), False, True),
    ("shared4_det", 32, 2, 128, 64, C.SelectTiling(tokens_per_tile=4, mode="shared"), True, False),
    ("union16_G1_256", 4, 4, 256, 128, C.SelectTiling(tokens_per_tile=16, bwd_tokens=64), True, False),
    ("union1_2blocks", 16, 1, 192, 128, C.SelectTiling(blocks_per_step=2, dq_blocks_per_step=2),
     True, True),
    ("union4_2blocks", 16, 1, 128, 128, C.SelectTiling(tokens_per_tile=4, blocks_per_step=2), True,
     False),
]


@pytest.mark.parametrize("case", LOWERINGS, ids=[c[0] for c in LOWERINGS])
def test_lowers_for_cuda(case):
  _, h, kh, dk, dv, tiling, det, seg = case
  b, t, n, bs = 1, 300, 16, 64
  sd = jax.ShapeDtypeStruct
  args = (sd((b, t, h, dk), jnp.bfloat16), sd((b, t, kh, dk), jnp.bfloat16),
          sd((b, t, kh, dv), jnp.bfloat16), sd((b, t, kh, n), jnp.int32), sd((b, t), jnp.int32))

  def f(q, k, v, idx, sid):
    def loss(q, k, v):
      o, lse = select_attention(q, k, v, idx, bs, sid if seg else None, tiling=tiling,
                                deterministic=det)
      return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

  mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(**_H100))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  kernels = ["nsa_select_fwd", "nsa_select_dq", "nsa_select_dkv"] + ([] if not det else ["reduce"])
  for name in kernels:
    assert name in text, f"{name} missing from the lowered module"


def test_supports_and_errors():
  assert supports((1, 128, 16, 192), (1, 128, 4, 192), (1, 128, 4, 128), 16, 64) == (True, "ok")
  assert not supports((1, 128, 6, 64), (1, 128, 4, 64), (1, 128, 4, 64), 16, 64)[0]  # H % K
  assert not supports((1, 128, 4, 72), (1, 128, 4, 72), (1, 128, 4, 64), 16, 64)[0]  # d % 16
  assert not supports((1, 128, 4, 64), (1, 128, 4, 64), (1, 128, 4, 64), 16, 48)[0]  # block 2^k
  assert not supports((1, 128, 4, 64), (1, 128, 4, 64), (1, 128, 4, 64), 16, 64, "cuda")[0]
  assert "triton" in BACKENDS
  q = jnp.zeros((1, 32, 4, 40), jnp.float32)
  with pytest.raises(ValueError, match="d_k=40"):
    select_attention(q, q, q, jnp.zeros((1, 32, 4, 2), jnp.int32), 16, interpret=INTERPRET)
  q = jnp.zeros((1, 32, 4, 32), jnp.float32)
  idx = jnp.zeros((1, 32, 4, 2), jnp.int32)
  with pytest.raises(ValueError, match="dtypes differ"):
    select_attention(q, q.astype(jnp.bfloat16), q, idx, 16, interpret=INTERPRET)
  with pytest.raises(ValueError, match="block_k"):
    select_attention(q, q, q, idx, 16, tiling=C.SelectTiling(block_k=8))  # compiled: >= 16 keys
  with pytest.raises(ValueError, match="mode"):
    select_attention(q, q, q, idx, 16, interpret=INTERPRET, tiling=C.SelectTiling(mode="bogus"))


def test_mean_union_matches_brute_force():
  rng = np.random.default_rng(_seed())
  b, t, kh, n, bs = 2, 57, 2, 5, 8
  idx = _block_idx(rng, b, t, kh, n, bs, empty=True)
  x = np.asarray(idx)
  sizes = [len({int(v) for i in range(4) for v in x[bb, 4 * it + i, k] if v >= 0})
           for bb in range(b) for it in range(t // 4) for k in range(kh)]
  np.testing.assert_allclose(float(C.mean_union(idx, 4)), np.mean(sizes), rtol=1e-6)
  # Subsampled estimate: 14 tiles, at most ~4 wanted -> every 14 // 4 = 3rd tile.
  sub = [len({int(v) for i in range(4) for v in x[bb, 4 * it + i, k] if v >= 0})
         for bb in range(b) for it in range(0, t // 4, 3) for k in range(kh)]
  np.testing.assert_allclose(float(C.mean_union(idx, 4, max_tiles=4)), np.mean(sub), rtol=1e-6)


@pytest.mark.parametrize("shared", [True, False])
def test_default_tiling_switches_on_shared_blocks(shared, monkeypatch):
  """G=16, no tiling given: the 4-token union tile runs when neighbouring tokens share their lists,
  the per-token tile otherwise; both match the reference, forward and gradients."""
  rng = np.random.default_rng(_seed())
  b, t, h, kh, dk, dv, n, bs = 1, 72, 16, 1, 32, 16, 3, 16
  q, k, v, idx, _, do, dl = _inputs(rng, b, t, h, kh, dk, dv, n, bs, False, empty=False)
  if shared:  # every token of a 4-token tile uses the list of the tile's first token (causal)
    idx = jnp.repeat(idx[:, ::4], 4, axis=1)[:, :t]
  else:  # T=72 has only 5 blocks, so random lists overlap a lot: lower the switch below them
    monkeypatch.setattr(C, "UNION_SWITCH", 0.5)
  picked = float(C.mean_union(idx, 4)) <= C.UNION_SWITCH * n
  assert picked == shared, float(C.mean_union(idx, 4))
  assert C.clustered_tiling(16, bs).tokens_per_tile == 4 and C.clustered_tiling(8, bs) is None
  q, k, v = (x.astype(DTYPE) for x in (q, k, v))
  f32 = lambda x: x.astype(jnp.float32)
  ker = lambda q, k, v: select_attention(q, k, v, idx, bs, interpret=INTERPRET)
  rf = lambda q, k, v: ref.select_attention(f32(q), f32(k), f32(v), idx, bs)
  loss = lambda fn: lambda q, k, v: jnp.sum(f32(fn(q, k, v)[0]) * do)
  assert "cond" in str(jax.make_jaxpr(ker)(q, k, v))
  np.testing.assert_allclose(f32(ker(q, k, v)[0]), rf(q, k, v)[0], atol=TOL, rtol=TOL)
  for name, a, c in zip("qkv", jax.grad(loss(ker), (0, 1, 2))(q, k, v),
                        jax.grad(loss(rf), (0, 1, 2))(q, k, v)):
    scale = float(jnp.max(jnp.abs(c))) + 1e-6
    np.testing.assert_allclose(f32(a) / scale, f32(c) / scale, atol=TOL, rtol=0, err_msg=f"d{name}")


def test_default_tiles_launch_parameters():
  """G = 16's per-token tile (16 rows) launches its forward and dq kernels with 2 warps (measured
  faster); the union tiles built from it, and every other G, keep 4; Triton's and Mosaic's G = 16
  union tiles stay the same tiling (the lax.cond's switch relies on that)."""
  from pallas_kernels import select_attention_mgpu as mgpu
  per_token = C.default_tiling(16, 64)
  assert (per_token.tokens_per_tile, per_token.num_warps, per_token.bwd_num_warps) == (1, 2, 4)
  assert C.rows_of(16, per_token.tokens_per_tile) == 16
  assert C.clustered_tiling(16, 64).num_warps == 4
  assert mgpu.tiling_for(16, 64) == C.clustered_tiling(16, 64)
  assert mgpu.tiling_for(4, 64).num_warps == 4
  for g in (1, 2, 4, 8, 32, 64):
    assert C.default_tiling(g, 64).num_warps == 4, g


@pytest.mark.parametrize("shared", [True, False])
def test_automatic_choice_runs_the_tile_it_picked(shared, monkeypatch):
  """Both tiles are exact, so a swapped lax.cond would pass the test above: mark the union tile's
  forward output and check that exactly the calls whose predicate says "union" carry the mark."""
  from pallas_kernels import select_attention as sa
  rng = np.random.default_rng(_seed())
  b, t, h, kh, dk, dv, n, bs = 1, 72, 16, 1, 16, 16, 3, 16
  q, k, v, idx, _, _, _ = _inputs(rng, b, t, h, kh, dk, dv, n, bs, False, empty=False)
  if shared:
    idx = jnp.repeat(idx[:, ::4], 4, axis=1)[:, :t]
  else:
    monkeypatch.setattr(C, "UNION_SWITCH", 0.5)
  real_forward = sa.forward

  def marked(*args, tiling, **kw):
    o, lse = real_forward(*args, tiling=tiling, **kw)
    return (o + 1000.0 if tiling.tokens_per_tile == C.UNION_TOKENS else o), lse

  monkeypatch.setattr(sa, "forward", marked)
  o, _ = select_attention(q, k, v, idx, bs, interpret=INTERPRET)
  assert bool(jnp.all(o > 500.0)) == shared and bool(jnp.all(o < 500.0)) != shared


@pytest.mark.parametrize("static", [True, False])
def test_auto_with_segment_ids_runs_the_union_tile_alone(static, monkeypatch):
  """backend="auto" with segment ids at G = 16, T <= STATIC_UNION_MAX_T, head dims <=
  STATIC_UNION_MAX_DIM (the 8k training layer with packed documents, where the Mosaic kernels
  refuse the ids): with STATIC_UNION_IDS the Triton 4-token union tile runs alone (no lax.cond;
  the union tile's forward marked, every token carries the mark), else the cond as before; both
  match the reference, forward and gradients. backend="triton" and calls without ids keep the
  cond, and so does a T past the limit."""
  from pallas_kernels import select_attention as sa
  monkeypatch.setattr(sa, "STATIC_UNION_IDS", static)
  rng = np.random.default_rng(_seed())
  b, t, h, kh, dk, dv, n, bs = 1, 72, 16, 1, 32, 16, 3, 16
  q, k, v, idx, sid, do, dl = _inputs(rng, b, t, h, kh, dk, dv, n, bs, True, empty=False)
  q, k, v = (x.astype(DTYPE) for x in (q, k, v))
  f32 = lambda x: x.astype(jnp.float32)
  call = lambda sid, backend="auto": lambda q, k, v: select_attention(
      q, k, v, idx, bs, sid, backend=backend, interpret=INTERPRET)
  # the lax.cond's custom VJP (_select_auto); the tile alone is _select's
  cond = lambda fn: "_select_auto" in str(jax.make_jaxpr(fn)(q, k, v))
  assert cond(call(sid)) != static
  assert cond(call(sid, "triton")) and cond(call(None))
  rf = lambda q, k, v: ref.select_attention(f32(q), f32(k), f32(v), idx, bs, sid)
  ker = call(sid)
  np.testing.assert_allclose(f32(ker(q, k, v)[0]), rf(q, k, v)[0], atol=TOL, rtol=TOL)
  loss = lambda fn: lambda q, k, v: jnp.sum(f32(fn(q, k, v)[0]) * do)
  for name, a, c in zip("qkv", jax.grad(loss(ker), (0, 1, 2))(q, k, v),
                        jax.grad(loss(rf), (0, 1, 2))(q, k, v)):
    scale = float(jnp.max(jnp.abs(c))) + 1e-6
    np.testing.assert_allclose(f32(a) / scale, f32(c) / scale, atol=TOL, rtol=0, err_msg=f"d{name}")
  if static:  # the tile that ran: the union tile's forward, marked
    real_forward = sa.forward

    def marked(*args, tiling, **kw):
      o, lse = real_forward(*args, tiling=tiling, **kw)
      return (o + 1000.0 if tiling.tokens_per_tile == C.UNION_TOKENS else o), lse

    monkeypatch.setattr(sa, "forward", marked)
    assert bool(jnp.all(f32(call(sid)(q, k, v)[0]) > 500.0))
    monkeypatch.setattr(sa, "STATIC_UNION_MAX_T", 64)  # T = 72 past it: the cond again
    assert cond(call(sid))


@pytest.mark.parametrize("segment_ids_on", [False, True])
def test_auto_with_segment_ids_lowers_the_union_tile_alone_for_cuda(segment_ids_on, monkeypatch):
  """The compiled form of the rule above (8k-layer head dims, abstract H100): with segment ids no
  stablehlo.case and the union tile's kernels; past STATIC_UNION_MAX_T the case again. With
  select_attention_mgpu.SEGMENT_IDS off that tile is Triton's; on (the default) it is Mosaic GPU's
  forward and dq, with the Mosaic dK/dV partials taking the ids (DKV_SEGMENT_IDS, the default: a
  Triton reduce, no Triton dK/dV kernel)."""
  import re
  from pallas_kernels import select_attention as sa
  from pallas_kernels import select_attention_mgpu as mgpu
  assert mgpu.SEGMENT_IDS and mgpu.DKV_SEGMENT_IDS  # the defaults
  monkeypatch.setattr(mgpu, "SEGMENT_IDS", segment_ids_on)
  sd = jax.ShapeDtypeStruct

  def text(t):
    args = (sd((1, t, 16, 64), jnp.bfloat16), sd((1, t, 1, 64), jnp.bfloat16),
            sd((1, t, 1, 64), jnp.bfloat16), sd((1, t, 1, 16), jnp.int32), sd((1, t), jnp.int32))

    def f(q, k, v, idx, sid):
      def loss(q, k, v):
        o, lse = select_attention(q, k, v, idx, 64, sid, backend="auto")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
      return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(**_H100))
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

  short = text(300)
  assert "stablehlo.case" not in short
  if segment_ids_on:
    assert "mosaic_gpu" in short and "nsa_select_dkv_reduce" in short
    assert not re.search(r"nsa_select_dkv(?!_reduce)", short)
    assert "nsa_select_fwd" not in short and "nsa_select_dq" not in short
  else:
    assert "mosaic_gpu" not in short
    assert "nsa_select_fwd_union4" in short and "nsa_select_dq_union4" in short
  assert "stablehlo.case" in text(sa.STATIC_UNION_MAX_T + 64)


def test_op_logs_the_union_tile_alone_with_segment_ids(caplog, monkeypatch):
  """implementation="pallas" logs which selection kernels run: with segment ids at the 8k layer's
  shapes, the Triton union tile alone (STATIC_UNION_IDS); not without ids, past
  STATIC_UNION_MAX_T, at G = 8 or with the switch off (what select_attention runs then: the cond)."""
  import logging
  import types
  from nsa_jax import ops
  from pallas_kernels import select_attention as sa
  seg = jnp.zeros((1, 128), jnp.int32)

  def logged(ids, heads=16):
    cfg = types.SimpleNamespace(num_heads=heads, num_kv_heads=1, sel_block=64)
    q, kv = jnp.zeros((1, 128, heads, 64), jnp.bfloat16), jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    ops.log_once.cache_clear()  # logged once per message and process
    caplog.clear()
    with caplog.at_level(logging.INFO):
      assert ops._auto_select_backend(q, kv, kv, cfg, ids, True) == "auto"
    return "union tiles only: segment ids" in caplog.text

  assert logged(seg) and not logged(None) and not logged(seg, heads=8)
  monkeypatch.setattr(sa, "STATIC_UNION_MAX_T", 64)
  assert not logged(seg)
  monkeypatch.setattr(sa, "STATIC_UNION_MAX_T", 8192)
  monkeypatch.setattr(sa, "STATIC_UNION_IDS", False)
  assert not logged(seg)


def test_bad_lists_raise_or_count_as_the_reference():
  """From an audit: float block indices (truncated, 1.5 -> block 1) and float segment ids raise;
  indices so large that idx * l' wraps in int32 are ignored as in the reference (not wrapped onto
  a real block); xla.select_attention refuses a block_idx of the wrong shape or dtype."""
  from nsa_jax import xla
  b, t, h, kh, d, bs = 1, 32, 1, 1, 16, 16
  key = jax.random.split(jax.random.key(5), 3)
  q, k, v = (jax.random.normal(kk, (b, t, x, d)) for kk, x in zip(key, (h, kh, kh)))
  good = jnp.zeros((b, t, kh, 2), jnp.int32).at[..., 1].set(-1)
  for bad in (2 ** 28 + 1, 2 ** 27, 2 ** 31 - 1):
    idx = good.at[..., 1].set(bad)
    o, lse = select_attention(q, k, v, idx, bs, interpret=INTERPRET)
    ro, rl = ref.select_attention(q, k, v, idx, bs)
    np.testing.assert_allclose(o, ro, atol=1e-5, rtol=1e-5, err_msg=f"index {bad}")
    np.testing.assert_allclose(lse, rl, atol=1e-5, rtol=1e-5, err_msg=f"index {bad}")
  with pytest.raises(TypeError, match="block_idx has dtype float32.*integers"):
    select_attention(q, k, v, good.astype(jnp.float32) + 0.5, bs, interpret=INTERPRET)
  with pytest.raises(TypeError, match="segment_ids has dtype float32"):
    select_attention(q, k, v, good, bs, jnp.zeros((b, t), jnp.float32), interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"segment_ids has shape \(1, 30\)"):
    select_attention(q, k, v, good, bs, jnp.zeros((b, t - 2), jnp.int32), interpret=INTERPRET)
  with pytest.raises(ValueError, match=r"block_idx has shape \(1, 30, 1, 2\), expected"):
    xla.select_attention(q, k, v, good[:, :30], bs)
  with pytest.raises(TypeError, match="block_idx has dtype float32"):
    xla.select_attention(q, k, v, good.astype(jnp.float32), bs)
