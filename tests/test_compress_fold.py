"""The compression branch as one causal attention on folded queries (pallas_kernels.compress_fold)
against the reference (o, lse, gradients), and the whole Pallas op with the fold feeding the top-n
kernel.

On a CPU the fold runs through XLA attention ("xla"); the cuDNN call itself is checked on the
H200 by `experiments.bench_nsa --check` (scripts/h200_kernels.sh cmpfold).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import ops, reference
from pallas_kernels import compress_fold as cmp_fold
from nsa_jax.config import NSAConfig

try:
  from tests.gpu_mode import ON_GPU
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from gpu_mode import ON_GPU

jax.config.update("jax_default_matmul_precision", "highest")


def _seed():
  return int.from_bytes(os.urandom(4), "little")


def _inputs(seed, b, t, h, kv, dk, dv, l, d):
  ks = jax.random.split(jax.random.key(seed), 4)
  nc = 0 if t < l else (t - l) // d + 1
  return (jax.random.normal(ks[0], (b, t, h, dk)), jax.random.normal(ks[1], (b, nc, kv, dk)),
          jax.random.normal(ks[2], (b, nc, kv, dv)), jax.random.normal(ks[3], (b, t, h, dv)))


# T aligned and not with the stride, T < l (no block), T = l (one block), GQA with K > 1 (the fold
# transposes), d_k < d_v and d_k > d_v (padding), l = d (no overlap).
@pytest.mark.parametrize("b,t,h,kv,dk,dv,l,d", [
    (2, 100, 4, 2, 16, 8, 32, 16), (1, 64, 2, 1, 8, 8, 8, 4), (2, 37, 6, 3, 16, 24, 8, 8),
    (1, 20, 2, 1, 8, 8, 32, 16), (1, 32, 4, 1, 8, 8, 32, 16), (1, 161, 16, 1, 8, 8, 32, 16),
    (1, 90, 8, 4, 24, 16, 16, 4), (1, 1100, 2, 1, 8, 8, 16, 16),  # Nc = 68, padded to 128
])
def test_fold_matches_reference(b, t, h, kv, dk, dv, l, d):
  seed = _seed()
  q, kc, vc, w = _inputs(seed, b, t, h, kv, dk, dv, l, d)
  o, lse = cmp_fold.compressed_attention(q, kc, vc, l, d, implementation="xla")
  ro, rlse, _ = reference.compressed_attention(q, kc, vc, l, d)
  assert o.shape == ro.shape and lse.shape == rlse.shape and lse.dtype == jnp.float32
  np.testing.assert_allclose(o, ro, atol=2e-5, err_msg=f"o (seed {seed})")
  assert np.array_equal(np.isfinite(lse), np.isfinite(rlse)), f"-inf pattern (seed {seed})"
  np.testing.assert_allclose(np.where(np.isfinite(rlse), lse, 0), np.where(np.isfinite(rlse), rlse, 0),
                             atol=2e-5, err_msg=f"lse (seed {seed})")
  if kc.shape[1] == 0:
    return
  loss = lambda f: (lambda q, kc, vc: jnp.sum(f(q, kc, vc)[0] * w))
  g = jax.grad(loss(lambda *a: cmp_fold.compressed_attention(*a, l, d, implementation="xla")),
               (0, 1, 2))(q, kc, vc)
  rg = jax.grad(loss(lambda *a: reference.compressed_attention(*a, l, d)), (0, 1, 2))(q, kc, vc)
  for name, a, r in zip(("dq", "dk_cmp", "dv_cmp"), g, rg):
    np.testing.assert_allclose(a, r, atol=3e-5 * max(1.0, float(jnp.max(jnp.abs(r)))),
                               err_msg=f"{name} (seed {seed})")


def test_fold_layout_mutation_is_caught(monkeypatch):
  """With K > 1 the folded head order must be KV-head major (cuDNN's GQA mapping): a
  position-major fold (the KV-head and position axes left unswapped) gives a wrong output, and
  unfold inverts the right one exactly."""
  seed = _seed()
  l, d, kv = 8, 4, 2
  q, kc, vc, _ = _inputs(seed, 1, 64, 4, kv, 8, 8, l, d)
  ro = reference.compressed_attention(q, kc, vc, l, d)[0]
  good = cmp_fold.fold_queries(q, l, d, kc.shape[1], kv)
  back = cmp_fold.unfold(good, q.shape[1], l, d, kv, 0.0)
  np.testing.assert_array_equal(back[:, l - 1:], q[:, l - 1:])
  assert np.all(back[:, :l - 1] == 0)

  def position_major(q, block, stride, num_cmp, kv_heads):
    b, t, h, dim = q.shape
    qs = jnp.pad(q[:, block - 1:], ((0, 0), (0, num_cmp * stride - (t - block + 1)), (0, 0),
                                     (0, 0)))
    return qs.reshape(b, num_cmp, stride * h, dim)

  monkeypatch.setattr(cmp_fold, "fold_queries", position_major)
  o = cmp_fold.compressed_attention(q, kc, vc, l, d, implementation="xla")[0]
  assert float(jnp.max(jnp.abs(o - ro))) > 1e-2, f"wrong head order not caught (seed {seed})"


def test_auto_rule_picks_fold_only_where_measured(monkeypatch):
  """ops._auto_cmp_backend on a (pretended) Hopper GPU: the thresholds and every refusal."""
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  bf = jnp.bfloat16
  pick = lambda nc, dk, dv, dtype=bf, seg=None: ops._auto_cmp_backend(
      jnp.zeros((1, 8, 4, dk), dtype), jnp.zeros((1, nc, 1, dv), dtype), seg)
  monkeypatch.setattr(cmp_fold, "_device_capability", lambda: (9, 0))
  assert ops.FOLD_CUDNN_BACKWARD is True  # the default since its GPU gradient check
  assert pick(ops.FOLD_MIN_BLOCKS, 128, 128) == "cudnn"
  assert pick(ops.FOLD_MIN_BLOCKS - 1, 128, 128) == "triton"
  assert pick(ops.FOLD_FWD_MIN_BLOCKS, 192, 128) == "cudnn-fwd"  # d_v padded: never
  monkeypatch.setattr(ops, "FOLD_CUDNN_BACKWARD", False)
  assert pick(ops.FOLD_MIN_BLOCKS, 128, 128) == "cudnn-fwd"
  assert pick(ops.FOLD_FWD_MIN_BLOCKS, 192, 128) == "cudnn-fwd"
  assert pick(ops.FOLD_FWD_MIN_BLOCKS - 1, 192, 128) == "triton"
  assert pick(4095, 128, 128, jnp.float32) == "triton"
  assert pick(4095, 320, 320) == "triton"
  assert pick(4095, 64, 64, seg=jnp.zeros((1, 8), jnp.int32)) == "triton"
  monkeypatch.setattr(cmp_fold, "_device_capability", lambda: (8, 0))  # A100: not measured
  assert pick(4095, 128, 128) == "triton"
  monkeypatch.setattr(cmp_fold, "CHECKED_JAX", (0, 99))
  monkeypatch.setattr(cmp_fold, "_device_capability", lambda: (9, 0))
  ok, why = cmp_fold.supports(64, 64, bf, False)
  assert not ok and "checked with jax 0.99" in why


def test_supports_reasons(monkeypatch):
  assert cmp_fold.supports(64, 64, jnp.bfloat16, False, (9, 0)) == (True, "ok")
  ok, why = cmp_fold.supports(64, 64, jnp.bfloat16, True)
  assert not ok and "segment ids" in why
  ok, why = cmp_fold.supports(64, 64, jnp.float32, False)
  assert not ok and "float32" in why
  ok, why = cmp_fold.supports(320, 64, jnp.bfloat16, False, (9, 0))
  assert not ok and "320" in why
  monkeypatch.setattr(cmp_fold, "_device_capability", lambda: None)  # no GPU (also on a GPU)
  ok, why = cmp_fold.supports(64, 64, jnp.bfloat16, False, None)
  assert not ok and "compute capability None" in why
  with pytest.raises(ValueError, match="k_cmp has 8 blocks, expected 5 for T=100"):
    q, kc, vc, _ = _inputs(0, 1, 100, 2, 1, 8, 8, 8, 4)
    cmp_fold.compressed_attention(q, kc[:, :8], vc[:, :8], 32, 16, implementation="xla")


@pytest.mark.parametrize("g,kv,t,dk,dv", [(4, 2, 90, 32, 16), (16, 1, 70, 16, 16)])
def test_cudnn_forward_triton_backward_matches_reference(g, kv, t, dk, dv):
  """compress_attention(backend="cudnn"): the fold's forward (XLA attention off a GPU) with the
  Triton backward kernels on its o and lse, lse's cotangent included."""
  from pallas_kernels.compress_attention import compress_attention
  seed = _seed()
  l, d = 16, 8
  q, kc, vc, w = _inputs(seed, 1, t, g * kv, kv, dk, dv, l, d)
  wl = jax.random.normal(jax.random.key(seed + 1), (1, t, g * kv))
  fin = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)

  def loss(fn):
    def f(q, kc, vc):
      o, lse = fn(q, kc, vc)
      return jnp.sum(o * w) + jnp.sum(fin(lse) * wl)
    return f

  hyb = lambda q, kc, vc: compress_attention(q, kc, vc, l, d, interpret=True, backend="cudnn")
  ref = lambda q, kc, vc: reference.compressed_attention(q, kc, vc, l, d)[:2]
  (o, lse), (ro, rlse) = hyb(q, kc, vc), ref(q, kc, vc)
  np.testing.assert_allclose(o, ro, atol=2e-5, err_msg=f"o (seed {seed})")
  np.testing.assert_allclose(fin(lse), fin(rlse), atol=2e-5, err_msg=f"lse (seed {seed})")
  g1 = jax.grad(loss(hyb), (0, 1, 2))(q, kc, vc)
  g2 = jax.grad(loss(ref), (0, 1, 2))(q, kc, vc)
  for name, a, r in zip(("dq", "dk_cmp", "dv_cmp"), g1, g2):
    np.testing.assert_allclose(a, r, atol=1e-4 * max(1.0, float(jnp.max(jnp.abs(r)))),
                               err_msg=f"{name} (seed {seed})")
  with pytest.raises(ValueError, match="segment ids"):
    compress_attention(q, kc, vc, l, d, jnp.zeros((1, t), jnp.int32), interpret=True,
                       backend="cudnn")


@pytest.mark.parametrize("cmp_backend", ["fold-xla", "cudnn-fwd"])
def test_whole_op_with_fold_matches_reference(cmp_backend, monkeypatch):
  """The Pallas op (interpreted on a CPU) with the fold's lse feeding the top-n kernel: same block
  indices as the reference, same output and gradients. On a GPU (scripts/gpu_tests.sh) the
  kernels run compiled and the fold's forward still goes through XLA attention: these float32
  inputs are not cuDNN's (bf16/fp16), whose fold `bench_nsa --check` checks on the H200."""
  from pallas_kernels import compress_attention as ca
  from tests.test_compress_kernels import whole_op_case
  if ON_GPU:
    real = ca._cudnn_forward  # its last argument, interpret, picks XLA attention for the fold
    monkeypatch.setattr(ca, "_cudnn_forward", lambda *a: real(*a[:-1], True))
  seed = _seed()
  ks = jax.random.split(jax.random.key(seed), 9)
  cfg, args = whole_op_case(ks)
  w = jax.random.normal(ks[8], args[0].shape[:3] + (cfg.dim_v,))

  def run(fn):
    def f(*a):
      o, aux = fn(*a)
      return jnp.sum(o * w), aux["block_idx"]
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(8)), has_aux=True))(*args)

  fold = lambda *a: ops._pallas_nsa(*a, cfg, None, None, True, kernels="triton",
                                    cmp_backend=cmp_backend)
  ref = lambda *a: reference.nsa_attention(*a, cfg, return_aux=True)
  (val, idx), grads = run(fold)
  (rval, ridx), rgrads = run(ref)
  assert np.array_equal(idx, ridx), f"block indices differ (seed {seed})"
  # the loss sums 6400 terms of size ~1 that cancel to ~0.3: tolerance on the terms' scale
  # (rtol 1e-5 alone failed once, seed 1041248938: 5.0e-6 off, 1.7e-5 relative)
  np.testing.assert_allclose(val, rval, rtol=1e-5, atol=1e-4, err_msg=f"loss (seed {seed})")
  for name, a, r in zip(("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"),
                        grads, rgrads):
    np.testing.assert_allclose(a, r, atol=1e-4 * max(1.0, float(jnp.max(jnp.abs(r)))),
                               err_msg=f"d{name} (seed {seed})")


def test_fold_refuses_segment_ids_and_cpu_auto_keeps_kernels():
  cfg = NSAConfig(num_heads=2, num_kv_heads=1, head_dim=8, head_dim_v=8, cmp_block=8,
                  cmp_stride=4, sel_block=8, num_selected=3, window=8)
  q = jnp.zeros((1, 32, 2, 8))
  kc = jnp.zeros((1, cfg.num_cmp_blocks(32), 1, 8))
  kv = jnp.zeros((1, 32, 1, 8))
  gates = jnp.ones((1, 32, 2, 3))
  seg = jnp.zeros((1, 32), jnp.int32)
  for backend in ("fold-xla", "cudnn"):  # refused before any kernel runs
    with pytest.raises(ValueError, match="segment ids"):
      ops._pallas_nsa(q, kc, kc, kv, kv, kv, kv, gates, cfg, seg, None, False, kernels="triton",
                      cmp_backend=backend)
  assert ops._auto_cmp_backend(q.astype(jnp.bfloat16), kc, None) == "triton"  # not on a GPU



def test_pallas_kernels_never_import_nsa_jax():
  """The README's layering rule: pallas_kernels/ (kernels, the cuDNN fold) imports nothing from
  nsa_jax, so the kernels can be vendored alone."""
  import ast
  import pathlib
  root = pathlib.Path(__file__).resolve().parents[1] / "pallas_kernels"
  bad = []
  for path in sorted(root.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "nsa_jax"]
  assert not bad, f"pallas_kernels imports nsa_jax: {bad}"
