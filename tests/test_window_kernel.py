"""Pallas sliding-window kernels (pallas_kernels.window_attention; interpret mode on CPU, compiled
by scripts/gpu_tests.sh) against nsa_jax.reference.window_attention, forward and gradients; the
window branch's backend rule in nsa_jax.ops; the whole op with the window kernels; CUDA lowering.

Fresh random inputs every run; the seed is in every failure message.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import ops, reference
from pallas_kernels import compress_attention as ca
from pallas_kernels import window_attention as wk
from pallas_kernels.compress_attention import CmpTiling
try:
  from tests.gpu_mode import INTERPRET, ON_GPU
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from gpu_mode import INTERPRET, ON_GPU

jax.config.update("jax_default_matmul_precision", "highest")


def _seed():
  return int.from_bytes(os.urandom(4), "little")


def _close(a, b, tol, what, seed):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  err = np.max(np.abs(a - b), initial=0.0)
  scale = max(1.0, np.max(np.abs(b), initial=0.0))
  assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol * scale:.3g} (seed {seed})"


def _segments(key, b, t, docs=3):
  """`docs` contiguous documents per row at random cut points (some may be empty)."""
  cuts = jnp.sort(jax.random.randint(key, (b, docs - 1), 1, t), axis=-1)
  return jnp.sum(jnp.arange(t)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)


def _case(seed, b, t, h, kv, dk, dv, use_seg, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (b, t, h, dk), dtype)
  k = jax.random.normal(ks[1], (b, t, kv, dk), dtype)
  v = jax.random.normal(ks[2], (b, t, kv, dv), dtype)
  seg = _segments(ks[3], b, t) if use_seg else None
  w_o = jax.random.normal(ks[4], (b, t, h, dv))
  w_l = jax.random.normal(ks[5], (b, t, h))
  return q, k, v, seg, w_o, w_l


def _outputs_and_grads(ours, ref, q, k, v, w_o, w_l):
  @jax.jit  # one program: interpreted kernels run eagerly are much slower
  def run(q, k, v):
    (o, lse), vjp = jax.vjp(ours, q, k, v)
    (ro, rlse), ref_vjp = jax.vjp(ref, q, k, v)
    # lse's cotangent is exercised too; o's in each function's output dtype
    return ((o, lse, vjp((w_o.astype(o.dtype), w_l))),
            (ro, rlse, ref_vjp((w_o.astype(ro.dtype), w_l))))
  return run(q, k, v)


# Small key tiles: T of a few hundred then has dK/dV programs whose query walk has unmasked
# inner tiles on both sides of the band, and forward / dq walks that start past key 0.
SMALL = dataclasses.replace(wk.WINDOW_TILING, rows=16, block_k=16, bwd_block_k=16, bwd_rows=32)


@pytest.mark.parametrize("g,kv,t,dk,dv,window,use_seg,tiling", [
    (1, 2, 70, 32, 16, 16, True, None),
    (2, 2, 130, 16, 32, 40, False, None),
    (4, 2, 301, 32, 32, 64, False, SMALL),
    (16, 1, 260, 32, 16, 48, False, SMALL),
    (16, 1, 200, 16, 16, 33, True, SMALL),
    (3, 1, 200, 32, 32, 100, False, SMALL),  # G = 3: padded head rows
    (4, 1, 90, 16, 16, 500, True, None),  # window past T: the whole causal past
    (1, 1, 150, 16, 16, 1, False, SMALL),  # w = 1: each query sees only itself
    (4, 1, 301, 16, 16, 64, False, dataclasses.replace(SMALL, bwd_unmasked_tiles=False)),
    # 8 rows (G = 1): the tile wraps copies of its rows up to 16, which only the mask drops.
    (1, 2, 160, 16, 16, 24, False, dataclasses.replace(SMALL, bwd_rows=8)),
    # dq and dK/dV with their own tiles.
    (4, 2, 328, 32, 16, 70, True, dataclasses.replace(SMALL, dq_block_k=32, dkv_rows=16)),
    # dq added atomically by the dK/dV programs (no dq kernel): G = 3 and T past the last tile
    # give copied rows, which must not add to their real rows
    (3, 1, 200, 32, 16, 100, True, dataclasses.replace(SMALL, bwd_fused_dq=True)),
    (4, 2, 301, 32, 32, 64, False, dataclasses.replace(SMALL, bwd_fused_dq=True, dkv_rows=16)),
    (16, 1, 260, 64, 32, 48, False, dataclasses.replace(SMALL, bwd_fused_dq=True, bwd_rows=64)),
])
def test_window_kernels_match_reference(g, kv, t, dk, dv, window, use_seg, tiling):
  seed = _seed()
  q, k, v, seg, w_o, w_l = _case(seed, 1 if g > 1 else 2, t, g * kv, kv, dk, dv, use_seg)
  ours = lambda q, k, v: wk.window_attention(q, k, v, window, seg, interpret=INTERPRET,
                                             tiling=tiling)
  ref = lambda q, k, v: reference.window_attention(q, k, v, window, seg)
  (o, lse, grads), (ro, rlse, rgrads) = _outputs_and_grads(ours, ref, q, k, v, w_o, w_l)
  _close(o, ro, 1e-5, "o", seed)
  _close(lse, rlse, 1e-5, "lse", seed)
  for name, a, r in zip(("dq", "dk", "dv"), grads, rgrads):
    _close(a, r, 1e-4, name, seed)


def test_cudnn_forward_backend_matches_reference():
  """backend="cudnn-fwd": cuDNN's sliding-window forward (its float32 softmax statistics feed the
  Triton backward). On a GPU compiled in bfloat16, d_k != d_v (cuDNN pads d_v); off a GPU the
  interpreted Triton forward stands in for cuDNN, which checks the VJP wiring."""
  seed = _seed()
  dtype = jnp.bfloat16 if ON_GPU else jnp.float32
  t, window = (1000, 256) if ON_GPU else (130, 40)
  q, k, v, _, w_o, w_l = _case(seed, 1, t, 8, 2, 64, 32, False, dtype)
  ours = lambda q, k, v: wk.window_attention(q, k, v, window, interpret=INTERPRET,
                                             backend="cudnn-fwd")
  ref = lambda q, k, v: reference.window_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                   window)
  (o, lse, grads), (ro, rlse, rgrads) = _outputs_and_grads(ours, ref, q, k, v, w_o, w_l)
  tol_o, tol_g = (2e-2, 3e-2) if ON_GPU else (1e-5, 1e-4)
  _close(o, ro, tol_o, "o", seed)
  _close(lse, rlse, 1e-3 if ON_GPU else 1e-5, "lse", seed)
  for name, a, r in zip(("dq", "dk", "dv"), grads, rgrads):
    _close(a, r, tol_g, name, seed)


def test_window_backend_rule_and_override(monkeypatch, caplog):
  """ops.window_backend on a (pretended) GPU: cuDNN's whole sliding window where it applies, the
  Pallas kernels for segment ids, float32 or allow_cudnn=False, the plain-JAX path (warned) for
  what the kernels refuse, the kernels for d_k != d_v; NSA_WINDOW_BACKEND forces a choice where it can apply and is refused
  when unknown; off a GPU the banded plain-JAX path."""
  bf, f32 = jnp.zeros((1, 8, 4, 32), jnp.bfloat16), jnp.zeros((1, 8, 4, 32), jnp.float32)
  v = jnp.zeros((1, 8, 1, 32), jnp.bfloat16)
  seg = jnp.zeros((1, 8), jnp.int32)
  monkeypatch.delenv("NSA_WINDOW_BACKEND", raising=False)
  monkeypatch.setattr(ops, "on_gpu", lambda: False)
  assert ops.window_backend(bf, v) == "xla"  # no GPU
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  ops.log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="nsa_jax"):
    assert ops.window_backend(bf, v) == "cudnn"
    assert ops.window_backend(bf, v, seg) == "triton"
    assert ops.window_backend(f32, v.astype(jnp.float32)) == "triton"
    assert ops.window_backend(bf, v, allow_cudnn=False) == "triton"
    # d_k != d_v: cuDNN would pad d_v, the kernels were faster (192/128 at 64k on an H100); where
    # the kernels refuse the head dims, cuDNN with the padding rather than plain JAX
    assert ops.window_backend(bf, v[..., :16]) == "triton"
    assert ops.window_backend(bf[..., :24], v[..., :16]) == "cudnn"
    assert ops.window_backend(bf, v[..., :16], allow_cudnn=False) == "triton"
    assert ops.window_backend(f32[..., :24], v[..., :16].astype(jnp.float32)) == "xla"  # warned
  assert "triton (segment ids)" in caplog.text and "triton (dtype float32)" in caplog.text
  assert "d_k=32 != d_v=16: cuDNN would pad d_v" in caplog.text
  # shapes / dtypes the kernels refuse: the plain-JAX path, with a warning (it took any shape)
  odd, v_odd = jnp.zeros((1, 8, 4, 40), jnp.float32), jnp.zeros((1, 8, 1, 40), jnp.float32)
  with caplog.at_level(logging.WARNING, logger="nsa_jax"):
    assert ops.window_backend(odd, v_odd, seg) == "xla"
    assert ops.window_backend(f32, v) == "xla"  # float32 q, bfloat16 v
  assert "uses plain JAX" in caplog.text and "d_k=40" in caplog.text
  assert "dtypes float32 and bfloat16" in caplog.text
  o = ops.window_attention(odd, v_odd, v_odd, 3, seg)
  np.testing.assert_allclose(o, reference.window_attention(odd, v_odd, v_odd, 3, seg)[0])
  for forced in ("triton", "cudnn-fwd"):
    monkeypatch.setenv("NSA_WINDOW_BACKEND", forced)
    assert ops.window_backend(bf, v) == forced
    assert not ops._window_flat(bf, v, None)[0]
    assert ops.window_backend(bf, v, seg) == "triton"  # cuDNN cannot take segment ids
  for forced in ("cudnn", "cudnn-fwd"):  # forcing a cuDNN backend with d_k != d_v
    monkeypatch.setenv("NSA_WINDOW_BACKEND", forced)
    assert ops.window_backend(bf, v[..., :16]) == forced
  monkeypatch.setenv("NSA_WINDOW_BACKEND", "flash")
  with pytest.raises(ValueError, match="NSA_WINDOW_BACKEND='flash': expected one of"):
    ops.window_backend(bf, v)


@pytest.mark.parametrize("use_seg", [True, False])
def test_whole_op_with_window_kernels_matches_reference(use_seg):
  """nsa_attention(implementation="pallas") with the window branch on the Pallas window kernels
  (win_backend="triton", what a GPU runs with segment ids or float32): the output and the
  gradients of q, k_win, v_win and the gates equal the reference's."""
  from tests.test_compress_kernels import whole_op_case
  seed = _seed()
  ks = jax.random.split(jax.random.key(seed), 10)
  cfg, args = whole_op_case(ks)
  cfg = dataclasses.replace(cfg, branches=("win",))  # only the window branch differs here
  b, t, h = args[0].shape[:3]
  seg = _segments(ks[8], b, t) if use_seg else None
  w = jax.random.normal(ks[9], (b, t, h, cfg.dim_v))

  @jax.jit
  def run():  # the output itself (a float32 sum over it rounds beyond 1e-5) and 4 gradients
    def outs(fn):
      call = lambda q, kw, vw, g: fn(q, *args[1:5], kw, vw, g)
      o, vjp = jax.vjp(call, *[args[i] for i in (0, 5, 6, 7)])
      return o, vjp(w.astype(o.dtype))
    return (outs(lambda *a: ops._pallas_nsa(*a, cfg, seg, None, False, kernels="triton",
                                            win_backend="triton")),
            outs(lambda *a: ops.nsa_attention(*a, cfg, segment_ids=seg,
                                              implementation="reference")))

  (o, grads), (ro, rgrads) = run()
  _close(o, ro, 1e-5, "o", seed)
  for name, a, r in zip(("q", "k_win", "v_win", "gates"), grads, rgrads):
    _close(a, r, 1e-4, "d" + name, seed)


@pytest.mark.parametrize("h,kv,dk,dv,use_seg,fused", [
    (64, 4, 128, 128, False, False), (64, 4, 192, 128, True, False), (16, 1, 64, 64, True, False),
    (8, 8, 64, 32, False, False), (64, 4, 128, 128, False, True), (12, 4, 64, 32, True, True)])
def test_window_kernels_lower_for_cuda(h, kv, dk, dv, use_seg, fused):
  """Forward and backward lower to CUDA for an abstract H100 (no GPU needed): every kernel is in
  the program, under its own name (with bwd_fused_dq the dK/dV kernel adds dq and no dq kernel
  runs)."""
  t, window = 1024, 512
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  args = (spec(1, t, h, dk), spec(1, t, kv, dk), spec(1, t, kv, dv), spec(1, t, dt=jnp.int32))

  def grad(q, k, v, seg):
    tiling = dataclasses.replace(wk.WINDOW_TILING, bwd_fused_dq=fused)
    f = lambda q, k, v: jnp.sum(wk.window_attention(q, k, v, window, seg if use_seg else None,
                                                    tiling=tiling)[0].astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  names = ("nsa_win_fwd", "nsa_win_dkv_dq_atomic") if fused else ("nsa_win_fwd", "nsa_win_dq",
                                                                  "nsa_win_dkv")
  for name in names:
    assert name in text, f"{name} missing from the CUDA lowering"
  assert "nsa_cmp_" not in text
  assert ("nsa_win_dq" in text.replace("nsa_win_dkv_dq", "")) == (not fused)


def test_bad_inputs_raise_with_the_fix():
  q, k, v = jnp.zeros((1, 32, 4, 16)), jnp.zeros((1, 32, 2, 16)), jnp.zeros((1, 32, 2, 16))
  seg = jnp.zeros((1, 32), jnp.int32)
  run = lambda *a, **kw: wk.window_attention(*a, interpret=True, **kw)
  for bad in (0, -3, True, 2.0, None):
    with pytest.raises(ValueError, match="window=.*expected a positive static integer"):
      run(q, k, v, bad)
  with pytest.raises(ValueError, match="expected 'triton' or 'cudnn-fwd'"):
    run(q, k, v, 8, backend="cudnn")
  with pytest.raises(ValueError, match=r"cudnn-fwd\] does not take segment ids.*backend='triton'"):
    run(q, k, v, 8, seg, backend="cudnn-fwd")
  with pytest.raises(ValueError, match="do not match q"):
    run(q, k[:, :16], v[:, :16], 8)
  with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
    run(q, jnp.zeros((1, 32, 3, 16)), jnp.zeros((1, 32, 3, 16)), 8)
  with pytest.raises(ValueError, match="d_v=8: needs a multiple of 16"):
    run(q, k, jnp.zeros((1, 32, 2, 8)), 8)
  with pytest.raises(TypeError, match="segment_ids has dtype float32"):
    run(q, k, v, 8, seg.astype(jnp.float32))
  with pytest.raises(ValueError, match="window backend 'flash'"):
    ops.window_attention(q, k, v, 8, backend="flash")
  with pytest.raises(TypeError, match="segment_ids has dtype float32"):  # as the kernels
    ops.window_attention(q, k, v, 8, seg.astype(jnp.float32), backend="xla")
  with pytest.raises(ValueError, match="'cudnn' does not take segment ids"):  # not dropped
    ops.window_attention(q, k, v, 8, seg, backend="cudnn")
  with pytest.raises(ValueError, match="window backend ''"):
    ops.window_attention(q, k, v, 8, backend="")
  for bad in (0, "8"):  # every backend checks the window first
    with pytest.raises(ValueError, match="expected a positive static integer"):
      ops.window_attention(q, k, v, bad, backend="xla")
  o, _ = run(q, k, v, np.int64(8))  # NumPy integers are taken
  np.testing.assert_array_equal(o, run(q, k, v, 8)[0])
  with pytest.raises(ValueError, match=r"each must be \[batch, time, heads, head_dim\]"):
    run(q[0], k, v, 8)
  with pytest.raises(ValueError, match="batch, time and heads must be >= 1"):
    run(q[:, :0], k[:, :0], v[:, :0], 8)
  with pytest.raises(ValueError, match="dtypes float32, bfloat16, bfloat16.*cast them"):
    run(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), 8)
  with pytest.raises(ValueError, match="tiling.rows=24: .*power of two"):
    run(q, k, v, 8, tiling=dataclasses.replace(wk.WINDOW_TILING, rows=24))
  with pytest.raises(TypeError, match="expected a pallas_kernels.compress_attention.CmpTiling"):
    run(q, k, v, 8, tiling={"rows": 64})
  np.testing.assert_array_equal(run(q, k, v, 8, list(np.asarray(seg[0])[None]))[0],
                                run(q, k, v, 8, seg)[0])  # a list of ids is taken


@pytest.mark.parametrize("g,kv,t,dk,dv", [(4, 2, 150, 32, 16), (16, 1, 97, 16, 16)])
def test_dense_attention_pallas_matches_reference_with_documents(g, kv, t, dk, dv):
  """ops.dense_attention(implementation="pallas"): full causal attention through the window
  kernels (w = T) with packed documents, d_k != d_v, GQA, T off the tiles; forward and gradients
  against the dense reference (float32, fresh inputs)."""
  seed = _seed()
  q, k, v, seg, w_o, _ = _case(seed, 2, t, g * kv, kv, dk, dv, True)
  ours = lambda q, k, v: ops.dense_attention(q, k, v, seg, implementation="pallas")
  ref = lambda q, k, v: reference.dense_causal_attention(q, k, v, seg)[0]

  @jax.jit
  def run(q, k, v):
    o, vjp = jax.vjp(ours, q, k, v)
    ro, rvjp = jax.vjp(ref, q, k, v)
    return o, vjp(w_o), ro, rvjp(w_o)
  o, grads, ro, rgrads = run(q, k, v)
  _close(o, ro, 1e-5, "o", seed)
  for name, a, r in zip(("dq", "dk", "dv"), grads, rgrads):
    _close(a, r, 1e-4, name, seed)
  # the documents are isolated: changing the first document's keys leaves the others' outputs
  first = seg == 0
  k2 = jnp.where(first[:, :, None, None], k + 1.0, k)
  o2 = jax.jit(ours)(q, k2, v)
  later = np.asarray(~first)
  np.testing.assert_allclose(np.asarray(o2)[later], np.asarray(o)[later], rtol=1e-5, atol=1e-5)


def test_dense_backend_rule(monkeypatch, caplog):
  """ops.dense_backend on a (pretended) GPU: cuDNN for 16-bit inputs (d_v padded where it
  differs), the Pallas kernels with segment ids, the explicit-mask path (warned) where the kernels
  refuse the head dims; XLA off a GPU and for float32; an unknown implementation is refused."""
  from nsa_jax import cudnn_packed
  monkeypatch.setattr(cudnn_packed, "_dense_cap", 0)  # no packed layout (test_cudnn_packed.py)
  monkeypatch.delenv(cudnn_packed.ENV, raising=False)
  bf = jnp.zeros((1, 8, 4, 32), jnp.bfloat16)
  v = jnp.zeros((1, 8, 1, 32), jnp.bfloat16)
  seg = jnp.zeros((1, 8), jnp.int32)
  monkeypatch.setattr(ops, "on_gpu", lambda: False)
  assert ops.dense_backend(bf, v, seg)[0] == "xla"
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  from pallas_kernels import compress_fold as cf
  monkeypatch.setattr(cf, "_device_capability", lambda: (9, 0))
  assert ops.dense_backend(bf, v) == ("cudnn", "16-bit inputs")
  assert ops.dense_backend(bf, v[..., :16]) == ("cudnn", "16-bit inputs, d_k=32 != d_v=16: the "
                                                "smaller zero-padded")
  # where cuDNN would not take the padded head dim (here: before Hopper), our kernels; where
  # neither takes it, XLA
  monkeypatch.setattr(cf, "_device_capability", lambda: (8, 0))
  be, why = ops.dense_backend(bf, v[..., :16])
  assert be == "pallas" and "compute capability (8, 0)" in why
  assert ops.dense_backend(bf[..., :24], v[..., :40])[0] == "xla"
  assert ops.dense_backend(bf, v, seg)[0] == "pallas"
  assert ops.dense_backend(bf.astype(jnp.float32), v.astype(jnp.float32), seg)[0] == "pallas"
  assert ops.dense_backend(bf.astype(jnp.float32), v.astype(jnp.float32))[0] == "xla"
  odd, v_odd = jnp.zeros((1, 8, 4, 40), jnp.bfloat16), jnp.zeros((1, 8, 1, 40), jnp.bfloat16)
  be, why = ops.dense_backend(odd, v_odd, seg)
  assert be == "cudnn" and "O(T^2)" in why and "d_k=40" in why
  with pytest.raises(ValueError, match=r"implementation='flash': expected one of \('auto'"):
    ops.dense_attention(bf, v, v, implementation="flash")
  # asked for by name: the kernels refusing the head dims is an error naming the fix
  with pytest.raises(ValueError, match=r"d_k=40.*Fix: model.dense_implementation='auto'"):
    ops.dense_attention(odd, v_odd, v_odd, implementation="pallas")


def test_dense_cudnn_asked_for_without_a_gpu_runs_xla_with_a_warning(caplog, monkeypatch):
  """A model trained with dense_implementation="cudnn" evaluated on a CPU: XLA, warned. (No GPU
  is pretended, so that on a GPU too this tests the CPU case instead of calling cuDNN with
  float32, which it refuses.)"""
  monkeypatch.setattr(ops, "on_gpu", lambda: False)
  q, k, v, seg, _, _ = _case(_seed(), 1, 24, 4, 2, 16, 16, True)
  ops.log_once.cache_clear()
  with caplog.at_level(logging.WARNING, logger="nsa_jax"):
    o = ops.dense_attention(q, k, v, seg, implementation="cudnn")
  assert "cuDNN asked for, but there is no GPU" in caplog.text
  np.testing.assert_allclose(o, reference.dense_causal_attention(q, k, v, seg)[0], rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("dk,dv", [(32, 16), (16, 32)])
def test_dense_cudnn_pads_unequal_head_dims(monkeypatch, dk, dv):
  """implementation="cudnn" with d_k != d_v zero-pads the smaller (as the window branch does):
  checked off a GPU by standing XLA in for cuDNN (and pretending a GPU), against the reference;
  with d_k < d_v the padded q must keep the scale d_k ** -0.5."""
  seed = _seed()
  q, k, v, seg, _, _ = _case(seed, 1, 40, 4, 2, dk, dv, True)
  real = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda *a, implementation=None, **kw: real(*a, **kw))
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  for s in (None, seg):
    o = ops.dense_attention(q, k, v, s, implementation="cudnn")
    assert o.shape == (1, 40, 4, dv)
    _close(o, reference.dense_causal_attention(q, k, v, s)[0], 1e-5, "o", seed)


def _split_documents(key, b, t, ids=4, max_run=25):
  """Runs of 1..max_run tokens, each given one of `ids` ids at random: documents that recur after
  others (non-contiguous ids) and several short documents per kernel tile."""
  kl, ki = jax.random.split(key)
  runs = jax.random.randint(kl, (b, t), 1, max_run + 1)
  starts = jnp.cumsum(runs, axis=1) - runs  # run r starts at starts[r]
  run_of = jnp.sum(jnp.arange(t)[None, :, None] >= starts[:, None, :], axis=-1) - 1
  run_ids = jax.random.randint(ki, (b, t), 0, ids)
  return jnp.take_along_axis(run_ids, run_of, axis=1).astype(jnp.int32)


def _check_documents(seed, q, k, v, seg, w_o, w_l, window, tiling):
  """The window kernels with segment ids against the reference, forward and gradients."""
  t = q.shape[1]
  ours = lambda q, k, v: wk.window_attention(q, k, v, window, seg, interpret=INTERPRET,
                                             tiling=tiling)
  ref = lambda q, k, v: reference.window_attention(q, k, v, min(window, t), seg)
  (o, lse, grads), (ro, rlse, rgrads) = _outputs_and_grads(ours, ref, q, k, v, w_o, w_l)
  _close(o, ro, 1e-5, "o", seed)
  _close(lse, rlse, 1e-5, "lse", seed)
  for name, a, r in zip(("dq", "dk", "dv"), grads, rgrads):
    _close(a, r, 1e-4, name, seed)


@pytest.mark.parametrize("window,g,kv", [(10 ** 6, 4, 1), (100, 1, 2)])
def test_window_kernels_skip_the_mask_inside_one_document(window, g, kv):
  """With segment ids the dK/dV kernel skips the mask on the query tiles that lie wholly in the
  key tile's one document (compress_attention.unmasked_ends; bwd_unmasked_with_ids, on by
  default), and the forward and dq kernels compare ids only before each one-document tile's run
  (seg_unmasked_steps). Long documents, so that such tiles exist (checked: the test would
  otherwise not reach the unmasked path), against the reference, forward and gradients; then
  with both switches off (every tile compares ids)."""
  seed = _seed()
  b, t = 2, 230
  q, k, v, _, w_o, w_l = _case(seed, b, t, g * kv, kv, 32, 16, False)
  seg = _split_documents(jax.random.key(seed + 1), b, t, ids=3, max_run=120)
  tq, bk = ca.tile_shape(g, SMALL.dkv_rows or SMALL.bwd_rows)[0], SMALL.bwd_block_k
  kc, vc, bseg, bpure = wk._layout(k, v, seg, SMALL)
  ends = ca.unmasked_ends(seg, bseg, bpure, nc=t, block=1, stride=1, tq=tq, bk=bk)[:, ::bk]
  first = -(-(jnp.arange(ends.shape[1]) * bk + bk - 1) // tq)
  cap = jnp.minimum(t // tq, (jnp.arange(ends.shape[1]) * bk + window) // tq)
  assert int(jnp.sum(jnp.minimum(ends, cap[None]) - first[None] > 0)) > 0, seed
  _check_documents(seed, q, k, v, seg, w_o, w_l, window, SMALL)
  _check_documents(seed, q, k, v, seg, w_o, w_l, window, dataclasses.replace(
      SMALL, bwd_unmasked_with_ids=False, seg_unmasked_steps=False))


def test_dq_warps_rule(monkeypatch):
  """The dq kernel's warps: 4 for the window kernels (w < T) at small heads (16-bit, heads <= 64,
  tiles of <= 128 rows), where measured; the backward's 8 for the compression kernels (window 0),
  w = T, larger heads, float32 and larger tiles; an explicit dq_num_warps wins. And the dq
  pallas_call gets what the rule says: 4 at w < T, 8 at w = T."""
  assert ca.dq_warps(CmpTiling(), 16, 64, 64, 2, 512, 8192) == ca.SMALL_HEAD_WINDOW_DQ_WARPS == 4
  assert ca.dq_warps(CmpTiling(), 16, 64, 64, 2, 0, 8192) == 8  # compression kernels
  assert ca.dq_warps(CmpTiling(), 16, 64, 64, 2, 8192, 8192) == 8  # w = T: not measured
  assert ca.dq_warps(CmpTiling(), 16, 128, 128, 2, 512, 8192) == 8
  assert ca.dq_warps(CmpTiling(), 16, 192, 128, 2, 512, 65536) == 8
  assert ca.dq_warps(CmpTiling(), 16, 64, 64, 4, 512, 8192) == 8  # float32
  assert ca.dq_warps(CmpTiling(bwd_rows=256), 16, 64, 64, 2, 512, 8192) == 8
  assert ca.dq_warps(CmpTiling(dq_num_warps=2), 16, 192, 128, 2, 0, 8192) == 2
  assert ca.dq_warps(CmpTiling(dq_num_warps=8), 16, 64, 64, 2, 512, 8192) == 8
  seen = []
  real = ca.plgpu.CompilerParams
  monkeypatch.setattr(ca.plgpu, "CompilerParams", lambda **kw: seen.append(kw) or real(**kw))
  q = jnp.zeros((1, 64, 16, 64), jnp.bfloat16)
  k = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  for window, warps in ((16, 4), (64, 8)):
    seen.clear()
    jax.jit(jax.grad(lambda q: jnp.sum(wk.window_attention(q, k, k, window, interpret=True)[0]
                                       .astype(jnp.float32)))).trace(q)
    assert len(seen) == 3 and seen[1]["num_warps"] == warps, (window, seen)


@pytest.mark.parametrize("window,g,kv", [(10 ** 6, 4, 1), (40, 1, 2)])
def test_window_kernels_take_ids_as_run_bounds(window, g, kv):
  """CmpTiling.seg_bounds: the forward and dq kernels take each row's run start as its document's
  first key instead of comparing ids. Ids that never recur (each run's start as its id, several
  documents a tile): against the reference, forward and gradients. Ids that recur: each run is its
  own document (reference.document_runs, as on every path), so the output equals the reference's
  on the runs and differs from attention that compares the raw ids (checked: the recurring ids
  matter for these inputs)."""
  seed = _seed()
  b, t = 2, 230
  q, k, v, _, w_o, w_l = _case(seed, b, t, g * kv, kv, 32, 16, False)
  seg = _split_documents(jax.random.key(seed + 1), b, t)
  runs = ca.run_starts(seg)
  tiling = dataclasses.replace(SMALL, seg_bounds=True)
  _check_documents(seed, q, k, v, runs, w_o, w_l, window, tiling)
  o = wk.window_attention(q, k, v, window, seg, interpret=INTERPRET, tiling=tiling)[0]
  ref_runs = reference.window_attention(q, k, v, min(window, t), runs)[0]
  ref_ids = reference.masked_attention(q, k, v, reference.window_mask(seg, min(window, t)))[0]
  _close(o, ref_runs, 1e-5, "o (recurring ids)", seed)
  assert float(jnp.max(jnp.abs(ref_runs - ref_ids))) > 1e-2, seed


@pytest.mark.parametrize("window,g,kv,tiling", [
    (10 ** 6, 4, 1, SMALL),  # w = T: dense causal attention with document ids (ops.dense_attention)
    (40, 1, 2, SMALL),
    (10 ** 6, 3, 1, dataclasses.replace(SMALL, bwd_fused_dq=True)),
    (10 ** 6, 16, 1, None),
])
def test_window_kernels_skip_other_documents_exactly(window, g, kv, tiling):
  """With segment ids the kernels start each query tile's key walk at its documents' first
  position and end each key tile's query walk at its documents' last (compress_attention.
  doc_bounds). Many short documents whose ids recur later in the row (each run its own document:
  the kernels take the ids as document runs, as the reference does) against the reference."""
  seed = _seed()
  b, t = 2, 230
  q, k, v, _, w_o, w_l = _case(seed, b, t, g * kv, kv, 32, 16, False)
  seg = _split_documents(jax.random.key(seed + 1), b, t)
  _check_documents(seed, q, k, v, seg, w_o, w_l, window, tiling)
