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


def _case(t, mean_len, cuts):
  """(seed, q, k, v, seg, most documents a row): float32, B = 2, 4 q / 2 KV heads of 16, fresh
  random inputs, random document cuts plus fixed ones at `cuts` (so at least len(cuts) + 1
  documents a row: caps below the count stay above 1)."""
  seed = int.from_bytes(np.random.bytes(4), "little")
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (2, t, 4, 16))
  k, v = (jax.random.normal(kk, (2, t, 2, 16)) for kk in ks[1:3])
  pos = jnp.arange(t)[None]
  seg = _random_docs(ks[3], 2, t, mean_len) + 100 * sum((pos >= c).astype(jnp.int32) for c in cuts)
  return seed, q, k, v, seg, int(cp.documents_per_row(seg).max())


def test_offsets_and_lengths_match_a_brute_force_walk():
  """Documents of 1 token, a row of one document, ids that do not start at 0 or come back to an
  earlier value (a new run is a new document); -1 padding past a row's last run; runs past the
  cap dropped (callers check the count first), without touching the other rows."""
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
  # past the cap: dropped, and offsets[:, M] stays -1 (jax packs every row's starts together, so
  # a fifth start here would shift the rows after it)
  assert list(offsets[4]) == [0, 10, 11, 20, -1] and list(seqlen[4]) == [10, 1, 9, 1]


def test_cap_from_the_environment(monkeypatch):
  monkeypatch.delenv(cp.ENV, raising=False)
  assert cp.packed_cap() == 0
  monkeypatch.setenv(cp.ENV, " 64 ")
  assert cp.packed_cap() == 64
  for bad in ("yes", "-3", "1.5"):
    monkeypatch.setenv(cp.ENV, bad)
    with pytest.raises(ValueError, match="NSA_CUDNN_PACKED=.*non-negative integer"):
      cp.packed_cap()


def test_dense_cap_and_its_precedence(monkeypatch):
  """set_dense_cap reaches dense layers only; NSA_CUDNN_PACKED, where set (0 included), decides for
  both; bad caps are refused with the fix."""
  monkeypatch.setattr(cp, "_dense_cap", 0)
  monkeypatch.delenv(cp.ENV, raising=False)
  cp.set_dense_cap(12)
  assert cp.packed_cap(dense=True) == 12 and cp.packed_cap() == 0
  assert cp.cap_source(dense=True) == "the dense cap (data.cudnn_packed_cap)"
  monkeypatch.setenv(cp.ENV, "0")
  assert cp.packed_cap(dense=True) == 0 and cp.cap_source(dense=True) == cp.ENV
  monkeypatch.setenv(cp.ENV, "5")
  assert cp.packed_cap(dense=True) == 5 and cp.packed_cap() == 5
  for bad in (-1, 2.0, True, "4"):
    with pytest.raises(ValueError, match="set_dense_cap.*non-negative int"):
      cp.set_dense_cap(bad)


def test_auto_cap_rules():
  """"auto": the most documents in a row, rounded up to a multiple of 4; our kernels (0) above
  AUTO_MAX_DOCS or where the workspace would exceed its share of the device's memory."""
  q = (8, 8192, 16, 64)
  cap, why = cp.auto_cap(9, 16, q)
  assert cap == 12 and "at most 9 documents a row in 16 batches" in why and "cap 12" in why
  assert cp.auto_cap(4, 16, q)[0] == 4 and cp.auto_cap(1, 16, q)[0] == 4
  assert cp.auto_cap(cp.AUTO_MAX_DOCS, 16, q)[0] == cp.AUTO_MAX_DOCS
  cap, why = cp.auto_cap(cp.AUTO_MAX_DOCS + 1, 16, q)
  assert cap == 0 and "more than 16" in why
  ws = cp.workspace_bytes(q, 12)
  assert ws == 8 * 8 * 12 * 8192 * 16 * 64
  assert cp.auto_cap(9, 16, q, memory_bytes=8 * ws)[0] == 12
  cap, why = cp.auto_cap(9, 16, q, memory_bytes=8 * ws - 1)
  assert cap == 0 and "--config.data.cudnn_packed_cap=12 to use it anyway" in why


def test_dense_backend_follows_the_dense_cap(monkeypatch, caplog):
  """On a (pretended) Hopper GPU, set_dense_cap sends dense layers with ids to the packed call and
  leaves the window branch on our kernels; cap 0 restores the kernels."""
  monkeypatch.setattr(cp, "_dense_cap", 0)
  monkeypatch.delenv(cp.ENV, raising=False)
  monkeypatch.delenv("NSA_WINDOW_BACKEND", raising=False)
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (True, ""))
  bf = jnp.zeros((1, 64, 4, 32), jnp.bfloat16)
  v = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
  seg = jnp.zeros((1, 64), jnp.int32)
  assert ops.dense_backend(bf, v, seg)[0] == "pallas"
  cp.set_dense_cap(8)
  impl, why = ops.dense_backend(bf, v, seg)
  assert impl == "cudnn-packed" and "data.cudnn_packed_cap)=8" in why
  assert ops.window_backend(bf, v, seg) == "triton" and ops.dense_backend(bf, v)[0] == "cudnn"
  cp.set_dense_cap(0)
  assert ops.dense_backend(bf, v, seg)[0] == "pallas"


def _stand_in(calls):
  """A stand-in for jax's private cuDNN call: it applies jax's own packing of the offsets and
  lengths (`_fix_seqlen_offsets`: every row's segments packed together, offsets in elements of the
  flattened BTNH arrays, q and kv strides apart) and attends causally inside the segments they
  describe (float32, GQA by repeating K/V heads), with cuDNN's window (pos - w, pos]; a token in
  no segment attends nowhere (zeros)."""
  def fake(q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale, mask_type,
           qkv_layout, sliding_window_length):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    assert bias is None and mask is None and qkv_layout == "BTNH"
    assert mask_type == fa.MaskType.PADDING_CAUSAL
    calls.append(sliding_window_length)
    b, t, h, d = q.shape
    kh = k.shape[2]
    assert q_offsets.shape[1] > 2, "the tests use caps above 1 (jax packs only then)"
    qs, ks, qo, ko = fa._fix_seqlen_offsets(q_seqlen, kv_seqlen, q_offsets, kv_offsets, q, k)

    def doc_of_tokens(seqlen, offsets, stride):
      tok = jnp.arange(b * t)  # global token index in the flattened [B * T] stream
      seqlen, offsets = seqlen.reshape(-1), offsets.reshape(-1)[:seqlen.size]
      first = offsets // stride
      inside = ((tok[None] >= first[:, None]) & (tok[None] < first[:, None] + seqlen[:, None])
                & (seqlen[:, None] > 0) & (offsets[:, None] >= 0))  # [segments, B * T]
      return jnp.where(inside.any(0), jnp.argmax(inside, axis=0), -1).reshape(b, t)

    qdoc = doc_of_tokens(qs, qo, h * d)
    kdoc = doc_of_tokens(ks, ko, kh * d)
    pos = jnp.arange(t)
    allowed = ((qdoc[:, :, None] == kdoc[:, None, :]) & (qdoc[:, :, None] >= 0)
               & (pos[:, None] >= pos[None, :])[None])
    if sliding_window_length is not None:
      allowed &= (pos[:, None] - pos[None, :] < sliding_window_length)[None]
    rep = h // kh
    kk, vv = (jnp.repeat(x.astype(jnp.float32), rep, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk) * scale
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv).astype(q.dtype)
  return fake


def test_stand_in_sees_a_cut_row_shift_the_rows_after_it(monkeypatch):
  """The stand-in is faithful to jax's packing: offsets with a stray start in a row's last slot
  (the bug a review found in packed_params) give wrong answers in the next row, which fits."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  fake = _stand_in([])
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (2, 16, 2, 8)) for kk in ks)
  seq = jnp.array([[4, 4, 4], [8, 8, -1]])
  good = jnp.array([[0, 4, 8, -1], [0, 8, -1, -1]])
  bad = good.at[0, 3].set(12)
  run = lambda off: fake(q, k, v, None, None, seq, seq, off, off, scale=0.5,
                         mask_type=fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
                         sliding_window_length=None)
  assert not np.allclose(run(good)[1], run(bad)[1])


@pytest.mark.skipif(ON_GPU, reason="the stand-in replaces the real cuDNN call (tested below)")
@pytest.mark.parametrize("window", [None, 5])
def test_packed_attention_wiring_and_fallback(monkeypatch, window):
  """packed_attention hands cuDNN offsets and lengths that give the reference's document-masked
  attention (whole documents and a window of 5 tokens), and when some row holds more documents
  than the cap the fallback computes the whole call (never a cut document)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  calls = []
  monkeypatch.setattr(fa, "dot_product_attention", _stand_in(calls))
  t = 48
  seed, q, k, v, seg, n = _case(t, 6, (15, 30))
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
  monkeypatch.setattr(ops, "on_gpu", lambda: False)
  assert ops.window_backend(bf, v, seg) == "xla" and ops.dense_backend(bf, v, seg)[0] == "xla"
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (True, ""))
  ops.log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="nsa_jax"):
    assert ops.window_backend(bf, v, seg) == "cudnn-packed"
    assert ops.dense_backend(bf, v, seg)[0] == "cudnn-packed"
    assert ops.window_backend(bf, v) == "cudnn" and ops.dense_backend(bf, v)[0] == "cudnn"
    assert ops.window_backend(bf, v, seg, allow_cudnn=False) == "triton"
  assert "NSA_CUDNN_PACKED=16" in caplog.text and "backward workspace ~0.0 GiB" in caplog.text
  monkeypatch.setenv("NSA_WINDOW_BACKEND", "triton")
  with caplog.at_level(logging.WARNING, logger="nsa_jax"):
    assert ops.window_backend(bf, v, seg) == "triton"
  assert "the window branch follows NSA_WINDOW_BACKEND" in caplog.text
  monkeypatch.delenv("NSA_WINDOW_BACKEND")
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
  monkeypatch.delenv(cp.ENV)
  with pytest.raises(ValueError, match="needs its document cap: set NSA_CUDNN_PACKED"):
    ops.window_attention(bf, v, v, 8, seg, backend="cudnn-packed")
  monkeypatch.setenv(cp.ENV, "16")
  with pytest.raises(ValueError, match="compute capability 8.0"):
    ops.window_attention(bf, v, v, 8, seg, backend="cudnn-packed")


@pytest.mark.skipif(ON_GPU, reason="the stand-in replaces the real cuDNN call (tested below)")
def test_ops_paths_through_the_packed_call(monkeypatch):
  """ops.window_attention(backend="cudnn-packed") and dense_attention (with "auto" resolving to
  the packed call) give the reference's document-masked attention with a non-default scale, with
  the cap above and below the documents a row (the fallback: our kernels, interpreted here)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  calls = []
  monkeypatch.setattr(fa, "dot_product_attention", _stand_in(calls))
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (True, ""))
  monkeypatch.setattr(ops, "dense_backend", lambda q, v, s=None: ("cudnn-packed", "test"))
  seed, q, k, v, seg, n = _case(64, 12, (20, 41))
  scale = 0.3
  for cap in (n + 2, n - 1):
    monkeypatch.setenv(cp.ENV, str(cap))
    calls.clear()
    got = jax.jit(lambda q, k, v, s: ops.window_attention(q, k, v, 7, s, scale,
                                                          backend="cudnn-packed"))(q, k, v, seg)
    np.testing.assert_allclose(got, reference.window_attention(q, k, v, 7, seg, scale)[0],
                               atol=2e-5, rtol=2e-5, err_msg=f"window, cap {cap}, seed {seed}")
    assert calls == [7]
    got = jax.jit(lambda q, k, v, s: ops.dense_attention(q, k, v, s, scale))(q, k, v, seg)
    np.testing.assert_allclose(got, reference.dense_causal_attention(q, k, v, seg, scale)[0],
                               atol=2e-5, rtol=2e-5, err_msg=f"dense, cap {cap}, seed {seed}")
    assert calls == [7, None]


@pytest.mark.skipif(ON_GPU, reason="the stand-in replaces the real cuDNN call (tested below)")
def test_dense_layers_through_the_dense_cap(monkeypatch):
  """dense_attention's "auto" with set_dense_cap (no NSA_CUDNN_PACKED): the packed call with the
  cap where the rows fit, our kernels (interpreted) where one does not; both the reference's
  document-masked attention."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  calls = []
  monkeypatch.setattr(fa, "dot_product_attention", _stand_in(calls))
  monkeypatch.setattr(cp, "_dense_cap", 0)
  monkeypatch.delenv(cp.ENV, raising=False)
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (True, ""))
  # the rule's choice on a GPU (test_dense_backend_follows_the_dense_cap), the fallback
  # interpreted on this CPU
  monkeypatch.setattr(ops, "dense_backend", lambda q, v, s=None: ("cudnn-packed", "test"))
  seed, q, k, v, seg, n = _case(48, 10, (17,))
  with pytest.raises(ValueError, match="needs its document cap: nsa_jax.cudnn_packed.set_dense_cap"):
    ops.dense_attention(q, k, v, seg)
  for cap in (n + 1, n - 1):
    cp.set_dense_cap(cap)
    calls.clear()
    got = jax.jit(lambda q, k, v, s: ops.dense_attention(q, k, v, s))(q, k, v, seg)
    np.testing.assert_allclose(got, reference.dense_causal_attention(q, k, v, seg)[0],
                               atol=2e-5, rtol=2e-5, err_msg=f"cap {cap}, seed {seed}")
    assert calls == [None]  # traced once: the lax.cond holds both branches
  # ids that come back to an earlier value: another document, on the packed call as on the others
  cp.set_dense_cap(n + 4)
  back = jnp.where((jnp.arange(48) >= 30)[None], 0, seg)
  got = jax.jit(lambda q, k, v, s: ops.dense_attention(q, k, v, s))(q, k, v, back)
  np.testing.assert_allclose(got, reference.dense_causal_attention(q, k, v, back)[0],
                             atol=2e-5, rtol=2e-5, err_msg=f"ids back to 0, seed {seed}")


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


def test_cap_report_on_training_batches():
  """The training loop's line on how NSA_CUDNN_PACKED's cap fits the data (logged on a GPU with
  document masking): counts from the data pipeline's own segment ids; a warning naming the
  batches that fall back and the cap that would hold them."""
  from nsa_jax.training.data import segment_ids
  eos = 0
  rows = np.array([[5, 0, 5, 5, 0, 5, 5, 5],    # 3 documents (the end token belongs to its own)
                   [5, 5, 5, 5, 5, 5, 5, 5]])   # 1
  many = np.array([[0, 0, 0, 0, 0, 5, 5, 5],    # 6
                   [5, 5, 5, 5, 5, 5, 5, 5]])
  batches = [segment_ids(rows, eos), segment_ids(many, eos)]
  level, msg = cp.cap_report(batches, 3)
  assert level == logging.WARNING
  assert "max 6, mean 2.8; 1 of 2 batches hold a row above the cap" in msg
  assert "raise NSA_CUDNN_PACKED to 6 or more" in msg
  level, msg = cp.cap_report(batches, 6)
  assert level == logging.INFO and "0 of 2 batches" in msg and "Fix" not in msg


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's packed layout runs on a Hopper GPU only")
def test_cudnn_packed_on_corpus_documents_gpu():
  """The real call on the training data's own document ids (the embedded corpus at T = 8192 with
  document masking, the rows with the most documents of the first batches) against the float32
  reference, forward and gradients, with the error also checked on each document's first 64
  tokens alone (where attending across a document start would show most)."""
  from configs import sweep_nsa_vs_dense
  from nsa_jax.training import data as data_lib
  cfg = sweep_nsa_vs_dense.get_config("gpu")
  cfg.data.document_mask = True
  t = 8192
  cfg.data.seq_len = t
  eos = data_lib.document_end_id(cfg.data)
  it = data_lib.BatchIterator(data_lib.make_sources(cfg.data)["train"], split="train",
                              global_batch=8, seq_len=t, seed=0, vocab_size=cfg.model.vocab_size,
                              eos_id=eos)
  segs = np.concatenate([it.batch(i)["segment_ids"] for i in range(4)])
  counts = np.asarray(cp.documents_per_row(jnp.asarray(segs)))
  seg = jnp.asarray(segs[np.argsort(-counts)[:2]])
  n = int(cp.documents_per_row(seg).max())
  assert n >= 2, f"the corpus rows hold {counts.max()} documents: nothing to separate"
  seed = int.from_bytes(np.random.bytes(4), "little")
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k, v = (jax.random.normal(kk, (2, t, nh, 64), jnp.bfloat16)
             for kk, nh in zip(ks[:3], (4, 1, 1)))
  ct = jax.random.normal(ks[3], (2, t, 4, 64), jnp.float32)

  def run(f):
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * ct)
    o = jax.jit(f)(q, k, v).astype(jnp.float32)
    return (o,) + tuple(g.astype(jnp.float32) for g in jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))

  want = run(lambda q, k, v: reference.dense_causal_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), seg)[0])
  got = run(lambda q, k, v: cp.packed_attention(q, k, v, seg, None, n))
  pos = jnp.arange(t)[None]
  start = jnp.concatenate([jnp.ones((2, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  last_start = jax.lax.cummax(jnp.where(start, pos, 0), axis=1)
  near = (pos - last_start < 64)[:, :, None, None]
  for name, a, r in zip(("o", "dq", "dk", "dv"), got, want):
    scale = jnp.maximum(jnp.max(jnp.abs(r)), 1.0)
    err = float(jnp.max(jnp.abs(a - r)) / scale)
    err_near = float(jnp.max(jnp.where(near, jnp.abs(a - r), 0)) / scale)
    assert err < 3e-2 and err_near < 3e-2, (
        f"{name}: {err:.3g} overall, {err_near:.3g} near document starts ({n} documents a row, "
        f"seed {seed})")
