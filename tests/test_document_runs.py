"""Segment ids: each contiguous run of one id is a document (reference.document_runs), on every
path, eagerly and under jit. An id that comes back later in a row (here 4, 9, 4) must give what
the same ids as three documents (0, 1, 2) give, forward and gradients, up to float32 summation
order: the paths that compare ids would otherwise let the two runs of id 4 see each other, while
the GPU kernels that take each row's document start (the Mosaic selection kernels, cuDNN's packed
layout) would not.

Every test draws a fresh seed, printed in the failure message; NSA_TEST_SEED=<seed> replays it.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import ops, reference
from nsa_jax.config import NSAConfig

B, T = 2, 96
CFG = dict(num_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=16, cmp_block=8, cmp_stride=4,
           sel_block=16, num_selected=3, window=16)


def fresh_seed():
  replay = os.environ.get("NSA_TEST_SEED")
  return int(replay) if replay else int.from_bytes(os.urandom(4), "little")


def reused_and_runs():
  """([B, T] ids 4 | 9 | 4 with the boundaries inside blocks, the same as runs 0 | 1 | 2)."""
  reused = np.full((B, T), 4, np.int32)
  runs = np.zeros((B, T), np.int32)
  for row, (a, b) in enumerate(((37, 51), (21, 70))):
    reused[row, a:b], runs[row, a:b], runs[row, b:] = 9, 1, 2
  return jnp.asarray(reused), jnp.asarray(runs)


def test_document_runs_by_hand():
  got = reference.document_runs(np.array([[5, 5, 2, 2, 5, 5, 5], [0] * 7, [1, 2, 3, 3, 2, 2, 1]]))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, [[0, 0, 1, 1, 2, 2, 2], [0] * 7, [0, 1, 2, 2, 3, 3, 4]])
  np.testing.assert_array_equal(reference.document_runs(np.array([[True, True, False, True]])),
                                [[0, 0, 1, 2]])
  np.testing.assert_array_equal(reference.document_runs(np.array([[7], [3]])), [[0], [0]])
  reused, runs = reused_and_runs()
  np.testing.assert_array_equal(reference.document_runs(reused), runs)
  np.testing.assert_array_equal(jax.jit(reference.document_runs)(reused), runs)
  np.testing.assert_array_equal(reference.document_runs(runs), runs)  # idempotent
  # the kernels' own copy (pallas_kernels does not import nsa_jax) and their id intake
  from pallas_kernels import _common
  np.testing.assert_array_equal(_common.document_runs(reused), runs)
  seg, has_seg = _common.segment_ids_int32(reused, B, T, "test")
  assert has_seg and seg.dtype == jnp.int32
  np.testing.assert_array_equal(seg, runs)


def _value_and_grads(fn, arrays, jit):
  """fn(*arrays) [.., D] -> (output, gradients of a fixed random projection of it)."""
  out = fn(*arrays)
  w = jnp.asarray(np.random.default_rng(0).standard_normal(out.shape), jnp.float32)
  vg = jax.value_and_grad(lambda *xs: jnp.sum(fn(*xs) * w), argnums=tuple(range(len(arrays))))
  return out, (jax.jit(vg) if jit else vg)(*arrays)[1]


def _assert_same(got, want, seed):
  """Equal up to float32 summation order: the same program on the same documents, bitwise equal
  on a CPU; on a GPU the XLA path's K/V gradients (scatter-adds) differ by ~3e-7 between two calls
  (an H100, 2026-12-07). Reading the reused id as one document moves outputs by O(1)."""
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    b = np.asarray(b)
    finite = np.abs(b[np.isfinite(b)])  # an lse of a row that sees nothing is -inf: the infinities
    scale = max(1.0, finite.max()) if finite.size else 1.0  # must match, not set the tolerance
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * scale,
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("impl", ["reference", "xla", "pallas-triton"])
def test_nsa_reused_id_is_another_document(impl, jit):
  seed = fresh_seed()
  cfg = NSAConfig(**CFG, implementation=impl)
  rng = np.random.default_rng(seed)
  nc, kh, d = cfg.num_cmp_blocks(T), cfg.num_kv_heads, cfg.head_dim
  shapes = [(B, T, cfg.num_heads, d), (B, nc, kh, d), (B, nc, kh, d)] + [(B, T, kh, d)] * 4
  arrays = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
  arrays.append(jax.nn.sigmoid(jnp.asarray(rng.standard_normal((B, T, cfg.num_heads, 3)),
                                           jnp.float32)))
  reused, runs = reused_and_runs()
  got, want = (_value_and_grads(
      lambda *xs, s=s: ops.nsa_attention(*xs, cfg, segment_ids=s), arrays, jit)
      for s in (reused, runs))
  _assert_same(got, want, seed)


def _dense_inputs(seed):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((B, T, h, 16)), jnp.float32) for h in (4, 2, 2)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_dense_reused_id_is_another_document(impl, jit):
  seed = fresh_seed()
  arrays = _dense_inputs(seed)
  reused, runs = reused_and_runs()
  got, want = (_value_and_grads(
      lambda *xs, s=s: ops.dense_attention(*xs, s, implementation=impl), arrays, jit)
      for s in (reused, runs))
  _assert_same(got, want, seed)
  # The distinction matters for these inputs: comparing the raw ids lets the two runs of id 4
  # see each other and moves the last run's outputs.
  merged, _ = reference.masked_attention(*arrays, reference.causal_mask(reused), None)
  assert not np.allclose(merged, got[0], atol=1e-3), f"seed {seed}"


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_window_reused_id_is_another_document(backend):
  seed = fresh_seed()
  arrays = _dense_inputs(seed)
  reused, runs = reused_and_runs()
  got, want = (_value_and_grads(
      lambda *xs, s=s: ops.window_attention(*xs, 40, s, backend=backend), arrays, True)
      for s in (reused, runs))
  _assert_same(got, want, seed)


def test_segment_ids_of_the_wrong_shape_are_named():
  q, k, v = _dense_inputs(0)
  for fn in (lambda s: ops.dense_attention(q, k, v, s),
             lambda s: ops.window_attention(q, k, v, 16, s)):
    with pytest.raises(ValueError, match=r"segment_ids has shape \(96,\), expected \(2, 96\).*Fix"):
      fn(jnp.zeros((T,), jnp.int32))


def test_kernels_and_aux_selector_take_reused_ids_as_runs():
  """Called directly (not through nsa_jax.ops, which converts first), the kernels' intake and the
  aux selector's scores take reused ids as runs too: the window, compression, selection and top-n
  kernels and aux_selector.scores_and_loss give what the run ids give."""
  from nsa_jax import aux_selector
  from pallas_kernels import compress_attention as ca
  from pallas_kernels import select_attention as sa
  from pallas_kernels import select_topn as st
  from pallas_kernels import window_attention as wk
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  cfg = NSAConfig(**CFG, selector="aux")
  nc = cfg.num_cmp_blocks(T)
  draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = draw(B, T, 4, 16), draw(B, T, 2, 16), draw(B, T, 2, 16)
  kc, vc, w_q, w_k = draw(B, nc, 2, 16), draw(B, nc, 2, 16), draw(16, 8), draw(16, 8)
  reused, runs = reused_and_runs()
  lse = ca.compress_attention(q, kc, vc, 8, 4, runs, interpret=True)[1]
  topn = lambda s: st.select_topn(q, kc, lse, block=8, stride=4, sel_block=16, num_selected=3,
                                  segment_ids=s, interpret=True)
  idx = topn(runs)
  for name, fn in (
      ("window", lambda s: wk.window_attention(q, k, v, 40, s, interpret=True)),
      ("compression", lambda s: ca.compress_attention(q, kc, vc, 8, 4, s, interpret=True)),
      ("selection", lambda s: sa.select_attention(q, k, v, idx, 16, s, interpret=True)),
      ("top-n", topn),
      ("aux selector", lambda s: aux_selector.scores_and_loss(q, k, w_q, w_k, cfg, s, chunk=48))):
    got, want = fn(reused), fn(runs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      _assert_same(a, b, f"{seed} ({name})")


def test_host_ids_of_any_width_and_lists_are_runs_everywhere():
  """numpy ids are compared at their own width before jax sees them: ids 7 and 7 + 2**32 are two
  documents (jax without x64 would wrap both to 7 and merge them, silently). Nested lists work on
  every entry point: the ops (NSA, dense, window), the reference op and the Flax layers; T = 1
  and T = 0 host ids keep their shape."""
  from flax import nnx
  from nsa_jax.attention import DenseAttention, NSAAttention
  seed = fresh_seed()
  q, k, v = _dense_inputs(seed)
  _, runs = reused_and_runs()
  wide = np.asarray(runs, np.int64) * 2**32 + 7  # every run's id is 7 modulo 2**32
  lst = np.asarray(runs).tolist()
  want = ops.dense_attention(q, k, v, runs)
  for ids in (wide, lst):
    _assert_same(ops.dense_attention(q, k, v, ids), want, seed)
    _assert_same(ops.window_attention(q, k, v, 40, ids), ops.window_attention(q, k, v, 40, runs),
                 seed)
  # the difference is real: one document for every token moves the later runs' outputs
  assert not np.allclose(ops.dense_attention(q, k, v, None), want, atol=1e-3), f"seed {seed}"
  np.testing.assert_array_equal(reference.segment_runs(wide, (B, T)), runs)
  cfg = NSAConfig(**CFG, implementation="xla")
  rng = np.random.default_rng(seed)
  nc, kh, d = cfg.num_cmp_blocks(T), cfg.num_kv_heads, cfg.head_dim
  nsa_in = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
            [(B, T, cfg.num_heads, d), (B, nc, kh, d), (B, nc, kh, d)] + [(B, T, kh, d)] * 4]
  nsa_in.append(jnp.full((B, T, cfg.num_heads, 3), 0.5))
  want_nsa = ops.nsa_attention(*nsa_in, cfg, segment_ids=runs)
  for ids in (wide, lst):  # the op and the reference called directly
    _assert_same(ops.nsa_attention(*nsa_in, cfg, segment_ids=ids), want_nsa, seed)
    _assert_same(reference.nsa_attention(*nsa_in, cfg, segment_ids=ids), want_nsa, seed)
  for one in (np.zeros((2, 1), np.int64), [[3], [4]], np.zeros((2, 0), np.int64)):  # T = 1, 0
    got = reference.segment_runs(one, np.shape(one))
    assert got.shape == np.shape(one) and not np.any(got)
  one_token = [a[:, :1] for a in (q, k, v)]
  _assert_same(ops.dense_attention(*one_token, [[5], [6]]), ops.dense_attention(*one_token), seed)
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, 16)), jnp.float32)
  for layer in (NSAAttention(16, NSAConfig(**CFG), rngs=nnx.Rngs(0)),
                DenseAttention(16, 4, 2, 8, rngs=nnx.Rngs(0))):
    y = layer(x, segment_ids=runs)
    for ids in (wide, lst):
      _assert_same(layer(x, segment_ids=ids), y, seed)


def test_dense_and_window_name_mismatched_q_k_v():
  """q and k / v of different lengths used to run silently on the default (XLA) path, or fail
  inside jax's broadcasting; the same check now names the tensors and the fix for both ops."""
  q, k, v = _dense_inputs(0)
  short = (k[:, :T // 2], v[:, :T // 2])
  for name, fn in (("dense_attention", lambda *a: ops.dense_attention(*a)),
                   ("window_attention", lambda *a: ops.window_attention(*a, 16))):
    with pytest.raises(ValueError, match=name + r": q \(2, 96, 4, 16\), k \(2, 48.*Fix"):
      fn(q, *short)
    with pytest.raises(ValueError, match=name + r": q has head dim 16 but k has 8"):
      fn(q, k[..., :8], v)
    with pytest.raises(ValueError, match=name + r": 4 query heads do not divide into 3 KV"):
      fn(q, jnp.concatenate([k, k[:, :, :1]], 2), jnp.concatenate([v, v[:, :, :1]], 2))
    with pytest.raises(ValueError, match=name + r": k must be \[batch, time, heads"):
      fn(q, k[..., 0], v)
