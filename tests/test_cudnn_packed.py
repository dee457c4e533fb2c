"""nsa_jax/cudnn_packed.py: cuDNN's packed layout for packed documents (opt-in, NSA_CUDNN_PACKED).

Off a GPU the cuDNN call cannot run, so the CPU tests check what feeds it: the per-row offsets and
lengths against a brute-force walk, and the wiring (cap, window, fallback choice) through a
stand-in for jax's private call that attends by the offsets and lengths it is given, not by the
ids. On a GPU the real call is compared with the float32 reference, forward and gradients.
"""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import cudnn_packed as cp
from nsa_jax import ops, reference
try:
  from tests.gpu_mode import ON_GPU
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from gpu_mode import ON_GPU


def _random_docs(key, b, t, mean_len):
  cuts = jax.random.bernoulli(key, 1.0 / mean_len, (b, t))
  return jnp.cumsum(cuts.astype(jnp.int32), axis=1)


def test_offsets_and_lengths_match_a_brute_force_walk():
  """Documents of 1 token, a row of one document, ids that do not start at 0 or come back to an
  earlier value (a new run is a new document); -1 padding past a row's last run; runs past the
  cap dropped (callers check the count first)."""
  seg = np.concatenate([np.asarray(_random_docs(jax.random.key(5), 3, 40, 6)),
                        np.full((1, 40), 7, np.int32),
                        np.array([[3] * 10 + [4] + [3] * 9 + list(range(9, 29))], np.int32)])
  n = np.asarray(cp.documents_per_row(jnp.asarray(seg)))
  assert n[3] == 1 and n[4] == 23  # 3 runs, then 20 one-token documents
  for m in (int(n.max()), int(n.max()) + 5):
    seqlen, offsets = (np.asarray(x) for x in cp.packed_params(jnp.asarray(seg), m))
    assert seqlen.shape == (5, m) and offsets.shape == (5, m + 1)
    for b, row in enumerate(seg):
      starts = [0] + [i for i in range(1, 40) if row[i] != row[i - 1]]
      assert n[b] == len(starts)
      lens = list(np.diff(starts + [40]))
      assert list(offsets[b]) == starts + [-1] * (m + 1 - len(starts)), b
      assert list(seqlen[b]) == lens + [-1] * (m - len(lens)), b
  seqlen, offsets = (np.asarray(x) for x in cp.packed_params(jnp.asarray(seg), 4))
  assert list(offsets[4]) == [0, 10, 11, 20, 21] and list(seqlen[4]) == [10, 1, 9, 1]


def test_cap_from_the_environment(monkeypatch):
  monkeypatch.delenv(cp.ENV, raising=False)
  assert cp.packed_cap() == 0
  monkeypatch.setenv(cp.ENV, " 64 ")
  assert cp.packed_cap() == 64
  for bad in ("yes", "-3", "1.5"):
    monkeypatch.setenv(cp.ENV, bad)
    with pytest.raises(ValueError, match="NSA_CUDNN_PACKED=.*non-negative integer"):
      cp.packed_cap()


def _stand_in(calls):
  """A stand-in for jax's private cuDNN call: causal softmax attention inside the segments that
  the offsets and lengths describe (float32, GQA by repeating K/V heads), with cuDNN's window
  (pos - w, pos]; tokens outside every segment attend nowhere (zeros)."""
  def fake(q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale, mask_type,
           qkv_layout, sliding_window_length):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    assert bias is None and mask is None and qkv_layout == "BTNH"
    assert mask_type == fa.MaskType.PADDING_CAUSAL
    assert q_seqlen is kv_seqlen and q_offsets is kv_offsets
    calls.append(sliding_window_length)
    b, t, h, _ = q.shape
    pos = jnp.arange(t)
    m = q_seqlen.shape[1]
    inside = ((pos[None, None, :] >= q_offsets[:, :m, None])
              & (pos[None, None, :] < q_offsets[:, :m, None] + q_seqlen[:, :, None])
              & (q_seqlen[:, :, None] > 0))  # [B, M, T]
    doc = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1)  # [B, T]
    allowed = ((doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
               & (pos[:, None] >= pos[None, :])[None])
    if sliding_window_length is not None:
      allowed &= (pos[:, None] - pos[None, :] < sliding_window_length)[None]
    rep = h // k.shape[2]
    kk, vv = (jnp.repeat(x.astype(jnp.float32), rep, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk) * scale
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv).astype(q.dtype)
  return fake


@pytest.mark.skipif(ON_GPU, reason="the stand-in replaces the real cuDNN call (tested below)")
@pytest.mark.parametrize("window", [None, 5])
def test_packed_attention_wiring_and_fallback(monkeypatch, window):
  """packed_attention hands cuDNN offsets and lengths that give the reference's document-masked
  attention (whole documents and a window of 5 tokens), and when some row holds more documents
  than the cap the fallback computes the whole call (never a cut document)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  calls = []
  monkeypatch.setattr(fa, "dot_product_attention", _stand_in(calls))
  seed = int.from_bytes(np.random.bytes(4), "little")
  ks = jax.random.split(jax.random.key(seed), 4)
  b, t, h, kh, d = 2, 48, 4, 2, 16
  q = jax.random.normal(ks[0], (b, t, h, d))
  k = jax.random.normal(ks[1], (b, t, kh, d))
  v = jax.random.normal(ks[2], (b, t, kh, d))
  seg = _random_docs(ks[3], b, t, 6)
  n = int(cp.documents_per_row(seg).max())
  w = t if window is None else window
  ref = reference.window_attention(q, k, v, w, seg)[0]
  marker = lambda q, k, v, s: reference.window_attention(q, k, v, w, s)[0] + 100.0
  for cap, want in ((n, ref), (n + 3, ref), (n - 1, ref + 100.0)):
    out = jax.jit(lambda q, k, v, s: cp.packed_attention(q, k, v, s, window, cap,
                                                         fallback=marker))(q, k, v, seg)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5,
                               err_msg=f"cap {cap}, {n} documents, seed {seed}")
  assert calls and set(calls) == {window}
  # a window of T or more is no window
  calls.clear()
  jax.jit(lambda q, k, v, s: cp.packed_attention(q, k, v, s, t, n))(q, k, v, seg)
  assert calls == [None]
  with pytest.raises(ValueError, match="max_docs=0"):
    cp.packed_attention(q, k, v, seg, None, 0)


def test_backend_rules_pick_it_only_when_asked(monkeypatch, caplog):
  """With NSA_CUDNN_PACKED set on a (pretended) Hopper GPU, segment ids send dense layers and the
  window branch to cuDNN's packed layout; without ids, without the variable or where the packed
  call does not apply (said in a warning) the rules are unchanged; off a GPU nothing changes."""
  bf = jnp.zeros((1, 64, 4, 32), jnp.bfloat16)
  v = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
  seg = jnp.zeros((1, 64), jnp.int32)
  monkeypatch.delenv("NSA_WINDOW_BACKEND", raising=False)
  monkeypatch.setenv(cp.ENV, "16")
  assert ops.window_backend(bf, v, seg) == "xla" and ops.dense_backend(bf, v, seg)[0] == "xla"
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (True, ""))
  ops.log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="nsa_jax"):
    assert ops.window_backend(bf, v, seg) == "cudnn-packed"
    assert ops.dense_backend(bf, v, seg)[0] == "cudnn-packed"
    assert ops.window_backend(bf, v) == "cudnn" and ops.dense_backend(bf, v)[0] == "cudnn"
    assert ops.window_backend(bf, v, seg, allow_cudnn=False) == "triton"
  assert "NSA_CUDNN_PACKED=16" in caplog.text
  monkeypatch.delenv(cp.ENV)
  assert ops.window_backend(bf, v, seg) == "triton" and ops.dense_backend(bf, v, seg)[0] == "pallas"
  monkeypatch.setenv(cp.ENV, "16")
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (False, "compute capability 8.0"))
  ops.log_once.cache_clear()
  with caplog.at_level(logging.WARNING, logger="nsa_jax"):
    assert ops.window_backend(bf, v, seg) == "triton"
    assert ops.dense_backend(bf, v, seg)[0] == "pallas"
  assert caplog.text.count("compute capability 8.0") == 2
  with pytest.raises(ValueError, match="needs segment ids"):
    ops.window_attention(bf, v, v, 8, None, backend="cudnn-packed")


def test_applies_names_what_it_refuses():
  ok, why = cp.applies(jnp.zeros((1, 8, 2, 32), jnp.bfloat16), jnp.zeros((1, 8, 1, 32),
                       jnp.bfloat16), jnp.zeros((1, 8, 1, 32), jnp.bfloat16))
  if not ON_GPU:
    assert not ok and why == "no GPU"
  if ON_GPU:
    q = jnp.zeros((1, 8, 2, 32), jnp.float32)
    assert "16-bit" in cp.applies(q, q, q)[1]
    q = jnp.zeros((1, 8, 2, 36), jnp.bfloat16)
    assert "multiple of 8" in cp.applies(q, q, q)[1]


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's packed layout runs on a Hopper GPU only")
@pytest.mark.parametrize("window", [None, 64])
def test_cudnn_packed_matches_reference_on_gpu(window):
  """The real cuDNN call (bf16, GQA 8/2, documents of mean 100 tokens in T = 512) against the
  float32 reference: output and the gradients of q, k, v; and the fallback with a cap of 1."""
  seed = int.from_bytes(np.random.bytes(4), "little")
  ks = jax.random.split(jax.random.key(seed), 5)
  b, t, h, kh, d = 2, 512, 8, 2, 64
  q, k, v = (jax.random.normal(kk, (b, t, n, d), jnp.bfloat16)
             for kk, n in zip(ks[:3], (h, kh, kh)))
  ct = jax.random.normal(ks[3], (b, t, h, d), jnp.float32)
  seg = _random_docs(ks[4], b, t, 100)
  n = int(cp.documents_per_row(seg).max())
  w = t if window is None else window
  from pallas_kernels import window_attention as wk
  fb = lambda q, k, v, s: wk.window_attention(q, k, v, w, s)[0]

  def run(f):
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * ct)
    o = jax.jit(f)(q, k, v).astype(jnp.float32)
    return (o,) + tuple(g.astype(jnp.float32) for g in jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))

  want = run(lambda q, k, v: reference.window_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), w, seg)[0])
  for cap in (n, 1):
    got = run(lambda q, k, v: cp.packed_attention(q, k, v, seg, window, cap, fallback=fb))
    for name, a, r in zip(("o", "dq", "dk", "dv"), got, want):
      err = float(jnp.max(jnp.abs(a - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1.0))
      assert err < 3e-2, f"{name}: {err:.3g} (cap {cap}, {n} documents, seed {seed})"
