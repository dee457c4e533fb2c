"""Cached decoding: token-by-token logits equal the parallel forward pass (NSA and dense, GQA groups
of 1, 2 and 16, across compression/selection block and window-ring boundaries, every NSA option),
prefill + decode equals decoding from the first token, the cache refuses to overflow, sampling
filters, and the Pallas decode kernels (interpret mode) equal the plain-JAX decode math: split-K
attention, and the fused compression branch + top-n (block indices equal to the plain-JAX
selection); both lower for CUDA."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nsa_jax import ModelConfig, NSAConfig, decode, decode_math, reference, sampling
from nsa_jax.model import TransformerLM
try:
  from tests.gpu_mode import INTERPRET, ON_GPU
  from tests.near_ties import redraw
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from gpu_mode import INTERPRET, ON_GPU
  from near_ties import redraw

SEED = int.from_bytes(os.urandom(4), "little")
VOCAB = 64


def fresh_key(i=0):
  print(f"seed={SEED}")
  return jax.random.fold_in(jax.random.key(SEED), i)


def tiny_model(attention="nsa", heads=4, kv_heads=2, n_layers=2, layer_attention=None, head_dim=8,
               **nsa):
  # l=8, d=4, l'=16, n=4 (1 initial + 2 local + 1 chosen), w=12: a 90-token run crosses 21
  # compression blocks, 6 selection blocks (so top-n really chooses) and wraps the window ring.
  head_dim_v = nsa.pop("head_dim_v", None)
  base = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=4, window=12)
  base.update(nsa)
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=n_layers, n_heads=heads,
                    n_kv_heads=kv_heads, head_dim=head_dim, head_dim_v=head_dim_v,
                    ffn_dim=64, max_seq_len=128, attention=attention,
                    layer_attention=layer_attention, nsa=NSAConfig(**base))
  return TransformerLM(cfg, rngs=nnx.Rngs(params=SEED % 100_000))


def parallel_logits(model, tokens):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, tokens)


def decode_all(model, tokens, prompt_len, max_len):
  """Prefill tokens[:, :prompt_len], then feed the rest one by one; logits [B, T, V]."""
  params, prefill_fn, step_fn = decode.jit_decode(model)
  logits, cache = prefill_fn(params, tokens[:, :prompt_len], max_len)
  out = [logits]
  for i in range(prompt_len, tokens.shape[1]):
    step_logits, cache = step_fn(params, cache, tokens[:, i])
    out.append(step_logits[:, None])
  return jnp.concatenate(out, axis=1), cache


def assert_close(got, want, what, tol=3e-5):
  got, want = np.asarray(got), np.asarray(want)
  err = np.abs(got - want).max()
  scale = max(1.0, np.abs(want).max())
  assert err <= tol * scale, f"{what}: max |decode - parallel| = {err:.3g} (seed={SEED})"


@pytest.mark.parametrize("attention,heads,kv_heads", [
    ("nsa", 4, 4), ("nsa", 16, 1), ("dense", 4, 4), ("dense", 16, 1)])
def test_token_by_token_equals_parallel(attention, heads, kv_heads):
  """GQA groups of 1 and 16 (the mixed-layer test below covers 2)."""
  model = tiny_model(attention, heads, kv_heads, n_layers=1)
  tokens = jax.random.randint(fresh_key(1), (2, 90), 0, VOCAB)
  got, _ = decode_all(model, tokens, prompt_len=1, max_len=100)
  assert_close(got, parallel_logits(model, tokens), f"{attention} H={heads} K={kv_heads}")


@pytest.mark.parametrize("opts", [
    {"shared_kv": True, "score_alignment": "literal"},
    {"gating": "sum", "compression": "mean", "selector": "quest"},
    {"branches": ("slc",), "num_init_blocks": 0, "num_local_blocks": 1},
    {"branches": ("cmp", "win"), "head_dim_v": 12, "cmp_block": 16, "cmp_stride": 8,
     "sel_block": 32, "window": 40}])
def test_nsa_options_decode_like_parallel(opts):
  model = tiny_model(n_layers=1, **opts)
  tokens = jax.random.randint(fresh_key(2), (1, 75), 0, VOCAB)
  got, _ = decode_all(model, tokens, prompt_len=3, max_len=75)
  assert_close(got, parallel_logits(model, tokens), f"options {opts}")


def test_mixed_layers_and_prefill_then_decode_equals_full_decode():
  """A dense + NSA model: prefill of 37 tokens (mid-block) then decoding equals decoding all of it
  from the first token, logits and every cache array."""
  model = tiny_model(layer_attention=("dense", "nsa"))
  tokens = jax.random.randint(fresh_key(3), (3, 60), 0, VOCAB)
  from_prompt, cache_a = decode_all(model, tokens, prompt_len=37, max_len=64)
  from_start, cache_b = decode_all(model, tokens, prompt_len=1, max_len=64)
  assert_close(from_prompt, from_start, "prefill+decode vs full decode")
  assert_close(from_prompt, parallel_logits(model, tokens), "prefill+decode vs parallel")
  assert int(cache_a.pos) == int(cache_b.pos) == 60
  for a, b in zip(jax.tree.leaves(cache_a.layers), jax.tree.leaves(cache_b.layers)):
    assert_close(a, b, "cache arrays")


def test_cache_refuses_to_overflow():
  model = tiny_model(n_layers=1)
  tokens = jax.random.randint(fresh_key(4), (1, 12), 0, VOCAB)
  with pytest.raises(ValueError, match="does not fit a cache of max_len=10"):
    decode.prefill(model, tokens, max_len=10)
  with pytest.raises(ValueError, match="max_seq_len"):
    decode.init_cache(model, 1, max_len=1000)
  params, prefill_fn, step_fn = decode.jit_decode(model)
  _, cache = prefill_fn(params, tokens[:, :9], 10)
  # The cache shards on its batch axis (a 1-device mesh here: checks the specs, not the speed-up).
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
  cache = jax.device_put(cache, decode.cache_shardings(cache, mesh))
  assert cache.layers[0].k_slc.sharding.spec == jax.sharding.PartitionSpec("data")
  decode.check_room(cache, 1)
  logits, cache = step_fn(params, cache, tokens[:, 9])
  assert np.all(np.isfinite(logits))
  with pytest.raises(ValueError, match="KV cache overflow: 10 tokens cached"):
    decode.decode_step(model, cache, tokens[:, 10])  # eager: checks before computing anything
  with pytest.raises(ValueError, match="overflow"):
    decode.check_room(cache, 1)
  # Under jit the step cannot raise: it must not return plausible logits either.
  logits, _ = step_fn(params, cache, tokens[:, 10])
  assert np.all(np.isnan(logits))


def test_sampling_filters():
  logits = jax.random.normal(fresh_key(5), (4, 50)) * 3
  greedy = sampling.sample(fresh_key(6), logits, temperature=0.0)
  np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))
  keys = jax.random.split(fresh_key(7), 100)
  draw = jax.vmap(lambda k: sampling.sample(k, logits, temperature=1.0, top_k=3))(keys)
  top3 = np.asarray(jax.lax.top_k(logits, 3)[1])
  assert all(np.isin(np.asarray(draw)[:, r], top3[r]).all() for r in range(4))
  probs = np.asarray(jax.nn.softmax(logits, -1))
  draw = np.asarray(jax.vmap(lambda k: sampling.sample(k, logits, top_p=0.5))(keys))
  for r in range(4):
    order = np.argsort(-probs[r])
    keep = order[:np.searchsorted(np.cumsum(probs[r][order]), 0.5) + 1]  # smallest set >= p
    assert np.isin(draw[:, r], keep).all()
  # Plain temperature sampling reaches beyond the top 3 somewhere in 100 draws per row.
  draw = np.asarray(jax.vmap(lambda k: sampling.sample(k, logits, temperature=2.0))(keys))
  assert not all(np.isin(draw[:, r], top3[r]).all() for r in range(4))


def test_sampling_refuses_bad_settings_and_survives_a_tiny_temperature():
  """A NaN temperature passed `temperature < 0` and sampled token 0; a temperature below ~1e-38
  overflowed logits / temperature to +-inf (token 0 again); at temperature 0 top_p / top_k went
  unchecked, and a negative top_k was silently off (review of 2026-12-05)."""
  logits = jnp.asarray([[1.0, 2.0, 0.5], [0.3, -1.0, 0.2]])
  for kw, what in ((dict(temperature=float("nan")), "temperature=nan"),
                   (dict(temperature=-1.0), "temperature=-1.0"),
                   (dict(temperature=0.0, top_p=5.0), "top_p=5.0"),
                   (dict(temperature=0.0, top_p=float("nan")), "top_p=nan"),
                   (dict(top_k=-2), "top_k=-2"), (dict(top_k=1.5), "top_k=1.5")):
    with pytest.raises(ValueError, match=rf"{what}: must be"):
      sampling.sample(fresh_key(20), logits, **kw)
  keys = jax.random.split(fresh_key(21), 200)
  for t in (1e-39, 1e-45, 1e-30):
    draw = np.asarray(jax.vmap(lambda k: sampling.sample(k, logits, temperature=t))(keys))
    assert (draw == np.asarray([1, 0])).all(), (t, np.unique(draw))
  np.testing.assert_array_equal(sampling.sample(fresh_key(22), logits, top_k=np.int64(1)), [1, 0])


def test_out_of_vocabulary_ids_are_refused_by_prefill_and_eager_steps():
  """model(tokens) refused them, but prefill / decode_step embedded them (NaN logits for an id >=
  vocab_size, the last row for -1)."""
  model = tiny_model(n_layers=1)
  tokens = jax.random.randint(fresh_key(23), (2, 6), 0, VOCAB)
  _, cache = decode.prefill(model, tokens, 8)
  for bad in (VOCAB, -1):
    with pytest.raises(ValueError, match=rf"token ids span .*vocab_size={VOCAB}"):
      decode.prefill(model, tokens.at[0, 3].set(bad), 8)
    with pytest.raises(ValueError, match=rf"token ids span .*vocab_size={VOCAB}"):
      decode.decode_step(model, cache, jnp.asarray([1, bad]))
  decode.decode_step(model, cache, jnp.asarray([1, VOCAB - 1]))  # in range: decodes
  # a token batch that is not the cache's failed with an unclear TypeError; refused under jit too
  params, _, step_fn = decode.jit_decode(model)
  for fn in (lambda c, x: decode.decode_step(model, c, x), lambda c, x: step_fn(params, c, x)):
    with pytest.raises(ValueError, match=r"token holds 3 ids but the cache holds 2 sequences"):
      fn(cache, jnp.asarray([1, 2, 3]))


def test_pallas_decode_kernels_fall_back_where_they_do_not_take_the_shape(caplog):
  """The split-K kernels refuse head dims that are not multiples of 16 and blocks under 16 tokens;
  the step then runs those branches in plain JAX (logged) instead of raising, and equals the
  plain-JAX step (interpret mode runs the kernels' own shape checks)."""
  import logging
  caplog.set_level(logging.INFO, logger="nsa_jax")
  for kw in (dict(head_dim=8), dict(head_dim=16, head_dim_v=8, sel_block=8, cmp_block=8,
                                     cmp_stride=4)):
    model = tiny_model(n_layers=1, window=64, **kw)
    tokens = jax.random.randint(fresh_key(24), (1, 12), 0, VOCAB)
    _, cache = decode.prefill(model, tokens[:, :10], 64)
    want, _ = decode.decode_step(model, cache, tokens[:, 10])
    got, _ = decode.decode_step(model, cache, tokens[:, 10],
                                **decode.pallas_decode_kernels(interpret=True))
    assert_close(got, want, f"kernels refused, plain JAX ({kw})", tol=1e-6)
  assert "Pallas decode kernel not used for the selection cache" in caplog.text
  assert "Pallas decode kernel not used for the compressed cache" in caplog.text


@pytest.mark.parametrize("heads,kv_heads,dk,dv,splits", [(16, 1, 32, 16, 4), (4, 2, 48, 32, 2)])
def test_pallas_decode_kernel_interpret_matches_plain_jax(heads, kv_heads, dk, dv, splits):
  from pallas_kernels import decode_attention as kern
  b, block, n, s = 2, 16, 4, 160
  k1, k2, k3, k4 = jax.random.split(fresh_key(8), 4)
  q = jax.random.normal(k1, (b, kv_heads, heads // kv_heads, dk))
  k = jax.random.normal(k2, (b, kv_heads, s, dk))
  v = jax.random.normal(k3, (b, kv_heads, s, dv))
  for t in (5, 77, 150):  # inside block 0, mid-cache, last (partly written) block
    cur = t // block
    # distinct blocks <= cur, ascending, -1 padding when fewer than n are eligible
    perm = jax.random.permutation(jax.random.fold_in(k4, t), cur + 1)[:n]
    idx = jnp.pad(perm, (0, n - perm.shape[0]), constant_values=-1).astype(jnp.int32)
    if t != 5:  # the kernel walks every slot: empty slots (-1) may sit anywhere
      idx = jax.random.permutation(jax.random.fold_in(k4, t + 1), idx)
    idx = jnp.broadcast_to(idx, (b, kv_heads, n))
    want_o, want_lse = decode_math.select_decode(q, k, v, idx, t, block)
    got_o, got_lse = kern.select_decode(q, k, v, idx, t, block, blocks_per_split=n // splits,
                                        interpret=INTERPRET)
    assert_close(got_o, want_o, f"kernel o at t={t}", tol=1e-5)
    assert_close(got_lse, want_lse, f"kernel lse at t={t}", tol=1e-5)
  # Contiguous prefix mode (compressed cache and window ring): slots 0..t, logits of the same pass.
  k64, v64 = k[:, :, :128], v[:, :, :128]
  for t in (-1, 0, 63, 100, 127):
    want_o, want_lse = decode_math.attend(q, k64, v64, jnp.arange(128) <= t)
    got_o, got_lse, logits = kern.prefix_decode(q, k64, v64, t, blocks_per_split=1,
                                                return_logits=True, interpret=INTERPRET)
    assert_close(got_o, want_o, f"prefix o at t={t}", tol=1e-5)
    if t < 0:
      assert np.all(np.asarray(got_lse) == -np.inf)
      continue
    assert_close(got_lse, want_lse, f"prefix lse at t={t}", tol=1e-5)
    want_logits = jnp.einsum("bkgd,bksd->bkgs", q, k64) * dk ** -0.5
    assert_close(logits[..., :t + 1], want_logits[..., :t + 1], f"prefix logits at t={t}", tol=1e-5)


def test_select_window_kernel_interpret_matches_plain_jax():
  """Selection + window ring in one launch (interpret mode) against the two plain-JAX branches,
  with empty slots, a ring not yet full (t < W) and a wrapped one."""
  from pallas_kernels import decode_attention as kern
  b, kh, g, dk, dv, block, n, s, w = 2, 2, 4, 32, 16, 16, 4, 160, 64
  k1, k2, k3, k4, k5 = jax.random.split(fresh_key(11), 5)
  q = jax.random.normal(k1, (b, kh, g, dk))
  k = jax.random.normal(k2, (b, kh, s, dk))
  v = jax.random.normal(k3, (b, kh, s, dv))
  kw = jax.random.normal(k4, (b, kh, w, dk))
  vw = jax.random.normal(k5, (b, kh, w, dv))
  for t in (20, 150):
    idx = jnp.broadcast_to(jnp.array([0, -1, t // block, -1], jnp.int32), (b, kh, n))
    live = min(t, w - 1)
    got = kern.select_window_decode(q, k, v, idx, t, kw, vw, live, block, blocks_per_split=1,
                                    window_blocks_per_split=2, interpret=INTERPRET)
    want_s = decode_math.select_decode(q, k, v, idx, t, block)
    want_w = decode_math.window_decode(q, kw, vw, t, w)
    for x, y, what in zip(got, (*want_s, *want_w), ("o_slc", "lse_slc", "o_win", "lse_win")):
      assert_close(x, y, f"{what} at t={t}", tol=1e-5)


@pytest.mark.parametrize("in_walk", [False, True])
def test_decode_with_pallas_kernels_interpret_equals_parallel(in_walk, monkeypatch):
  """The whole decode step with all three split-K kernels (interpret mode) against the parallel
  pass: 70 cached tokens, so the compressed cache (15 blocks) and the window ring are live; with
  in_walk, the block scores come from the compressed walk's band sums (scores_in_walk=True)."""
  model = tiny_model(n_layers=1, heads=16, kv_heads=1, head_dim=16, window=64)
  tokens = jax.random.randint(fresh_key(9), (1, 74), 0, VOCAB)
  params, prefill_fn, _ = decode.jit_decode(model)
  kernels = decode.pallas_decode_kernels(interpret=INTERPRET)
  kernels["cmp_select_fn"] = functools.partial(kernels["cmp_select_fn"], scores_in_walk=in_walk)
  from pallas_kernels import decode_select
  calls, real = [], decode_select._band_topn
  monkeypatch.setattr(decode_select, "_band_topn", lambda *a, **k: calls.append(1) or real(*a, **k))
  _, step_fn = params, jax.jit(lambda p, c, x: decode.decode_step(
      nnx.merge(nnx.graphdef(model), p), c, x, check=False, **kernels))
  logits, cache = prefill_fn(params, tokens[:, :70], 74)
  out = [logits]
  for i in range(70, 74):
    step_logits, cache = step_fn(params, cache, tokens[:, i])
    out.append(step_logits[:, None])
  assert bool(calls) == in_walk, "the band-sum path ran where it should not, or not where it should"
  assert_close(jnp.concatenate(out, 1), parallel_logits(model, tokens), "pallas decode")


@pytest.mark.parametrize("heads,kv_heads,dk,dv,align,in_walk", [
    (16, 1, 32, 16, "overlap", False), (4, 2, 16, 32, "literal", False),
    (16, 1, 32, 16, "overlap", True), (4, 2, 16, 32, "literal", True),
    (16, 1, 32, 16, "overlap", "default"), (4, 2, 16, 32, "literal", "default"),
    (16, 1, 32, 16, "overlap", "topn_loop")])
def test_fused_compression_topn_decode_matches_plain_jax(heads, kv_heads, dk, dv, align, in_walk):
  """pallas_kernels.decode_select (interpret mode): o_cmp equal to decode_math.compressed_decode and
  block indices equal to the plain-JAX scores + top-n, at positions inside the first selection
  block, across top-n chunks (16 blocks of 16 tokens) and at the end of the cache; with in_walk,
  the scores come from the decode walk's band sums (scores_in_walk=True: two launches);
  False: the three-kernel path with Eq. 9's band matmuls (scores_head_first=False); "default":
  the shipped keywords (the head sum first); "topn_loop": that with the top-n rounds looped."""
  from pallas_kernels import decode_select
  cfg = NSAConfig(num_heads=heads, num_kv_heads=kv_heads, head_dim=dk, head_dim_v=dv, cmp_block=8,
                  cmp_stride=4, sel_block=16, num_selected=5, window=16, score_alignment=align)
  b, s_slc, nc = 2, 512, 128
  ns = s_slc // cfg.sel_block
  positions = (3, 11, 40, 263, 300, 511)

  def make(i):
    k1, k2, k3 = jax.random.split(fresh_key(10 + 1000 * i), 3)
    return (jax.random.normal(k1, (b, kv_heads, heads // kv_heads, dk)),
            jax.random.normal(k2, (b, kv_heads, nc, dk)), jax.random.normal(k3, (b, kv_heads, nc, dv)))
  fused = jax.jit(lambda q, kc, vc, t: decode_math.cmp_select_with(
      functools.partial(decode_select.compressed_select_decode, interpret=INTERPRET,
                        **{False: {"scores_head_first": False}, True: {"scores_in_walk": True},
                           "default": {}, "topn_loop": {"topn_loop": True}}[in_walk]),
      q, kc, vc, t, ns, cfg))
  assert_cmp_select_matches_plain(fused, well_posed(make, positions, ns, cfg), positions, ns, cfg)


def well_posed(make, positions, ns, cfg, tries=20):
  """make(i) -> (q, kc, vc), draw i: the first draw whose top-n decision is not a float32
  near-tie at any of the positions (kept and dropped blocks within 1e-5 relative,
  reference.topn_cut_margin). The kernels sum Eq. 9 in another order than plain JAX, so such a
  cut has two right answers and an exact index check would be a coin flip."""
  plain = jax.jit(lambda q, kc, vc, t: decode_math.compressed_decode(q, kc, vc, t, cfg))

  def margin(qkv):
    out = float("inf")
    for t in positions:
      scores = decode_math.nsa_block_scores(plain(*qkv, jnp.int32(t))[2], ns, cfg)  # [B, K, Ns]
      out = min(out, reference.topn_cut_margin(
          scores[:, None], jnp.full((1, 1), t // cfg.sel_block), jnp.zeros((1, 1), jnp.int32), cfg))
    return out

  return redraw(make, margin, tries, what=f"draws (seed={SEED})")


def assert_cmp_select_matches_plain(fused, qkv, positions, ns, cfg):
  """fused(q, kc, vc, t) -> (o_cmp, block_idx) equals decode_math's compression branch and its
  plain-JAX scores + top-n at every position."""
  plain = jax.jit(lambda q, kc, vc, t: decode_math.compressed_decode(q, kc, vc, t, cfg))
  for t in positions:
    o, idx = fused(*qkv, jnp.int32(t))
    want_o, _, p_cmp = plain(*qkv, jnp.int32(t))
    want_idx = decode_math.select_blocks_decode(decode_math.nsa_block_scores(p_cmp, ns, cfg),
                                                jnp.int32(t), cfg)
    assert_close(o, want_o, f"fused o_cmp at t={t}", tol=1e-5)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx),
                                  err_msg=f"block indices at t={t} (seed={SEED})")


@pytest.mark.parametrize("l,d,lp,align,g,kh,nc,bps", [
    (8, 4, 16, "overlap", 3, 1, 256, 2),     # splits of two steps: the max changes across steps
    (8, 4, 16, "literal", 16, 1, 320, 3),    # 5 steps (not a power of two), uneven splits
    (8, 4, 32, "literal", 2, 2, 256, 1),     # l'/d = 8: 8 selection blocks a step (padded to 16)
    (4, 2, 4, "overlap", 1, 1, 192, 2),      # l'/d = 2: 32 selection blocks a step
])
def test_band_scores_in_walk_geometries(l, d, lp, align, g, kh, nc, bps):
  """compressed_select_decode(scores_in_walk=True) (interpreter) against the plain-JAX scores
  and top-n over block geometries, multi-step splits and positions from before the first
  compressed block to the end of the cache (found by a review: only r = 4, one step a split was
  tested)."""
  from pallas_kernels import decode_select
  cfg = NSAConfig(num_heads=g * kh, num_kv_heads=kh, head_dim=32, head_dim_v=16, cmp_block=l,
                  cmp_stride=d, sel_block=lp, num_selected=5, window=16, score_alignment=align)
  b, s_slc = 2, nc * d
  ns = s_slc // lp
  assert decode_select.band_supports((b, kh, nc, 32), ns, l, d, lp, align)[0]
  positions = sorted({0, l - 1, l, 7 * lp + 3, s_slc // 2 + 5, s_slc - 1})

  def make(i):
    k1, k2, k3 = jax.random.split(fresh_key(13 + 1000 * i), 3)
    return (jax.random.normal(k1, (b, kh, g, 32)) * 2, jax.random.normal(k2, (b, kh, nc, 32)),
            jax.random.normal(k3, (b, kh, nc, 16)))
  fused = jax.jit(lambda q, kc, vc, t: decode_select.compressed_select_decode(
      q, kc, vc, t, decode_math.num_visible_cmp(t, cfg), num_sel_blocks=ns, block=l, stride=d,
      sel_block=lp, num_selected=5, alignment=align, blocks_per_split=bps, scores_in_walk=True,
      interpret=INTERPRET)[::2])
  assert_cmp_select_matches_plain(fused, well_posed(make, positions, ns, cfg), positions, ns, cfg)


def test_band_supports_refuses_a_band_reaching_two_steps_back():
  """Literal alignment with l'/d = 64 and l/d >= 3 reaches more than one 64-slot step back (a
  review measured wrong scores there); band_supports refuses it, so the three-kernel path runs."""
  from pallas_kernels import decode_select
  ok, why = decode_select.band_supports((1, 1, 1024, 32), 16, 3, 1, 64, "literal")
  assert not ok and "reaches 65 slots back" in why
  assert decode_select.band_supports((1, 1, 1024, 32), 16, 3, 1, 64, "overlap")[0]
  ok, why = decode_select.band_supports((1, 1, 128, 32), 64, 8, 4, 16, "overlap")
  assert not ok and "do not cover" in why


def test_decode_kernels_lower_for_cuda():
  from pallas_kernels import decode_attention as kern
  from pallas_kernels import decode_select
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  b, kh, g, dk, dv, s_slc, nc = 2, 4, 16, 192, 128, 8192, 512
  q, kc, vc = spec(b, kh, g, dk), spec(b, kh, nc, dk), spec(b, kh, nc, dv)
  ks, vs = spec(b, kh, s_slc, dk), spec(b, kh, s_slc, dv)

  def step(q, kc, vc, ks, vs):
    t = jnp.int32(s_slc - 1)
    o_c, _, idx = decode_select.compressed_select_decode(
        q, kc, vc, t, jnp.int32(nc - 1), num_sel_blocks=s_slc // 64, block=32, stride=16,
        sel_block=64, num_selected=16)
    o_s, _ = kern.select_decode(q, ks, vs, idx, t, 64)
    o_s2, _, o_w, _ = kern.select_window_decode(q, ks, vs, idx, t, ks[:, :, :512], vs[:, :, :512],
                                                jnp.int32(511), 64)
    _, _, idx2 = decode_select.compressed_select_decode(
        q, kc, vc, t, jnp.int32(nc - 1), num_sel_blocks=s_slc // 64, block=32, stride=16,
        sel_block=64, num_selected=16, scores_in_walk=True)
    # the band-matmul scores and the looped top-n must lower too (a lowering error raises here)
    _, _, idx3 = decode_select.compressed_select_decode(
        q, kc, vc, t, jnp.int32(nc - 1), num_sel_blocks=s_slc // 64, block=32, stride=16,
        sel_block=64, num_selected=16, scores_head_first=False, topn_loop=True)
    return o_c, o_s, o_s2, o_w, idx2, idx3

  abstract = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
  with jax.sharding.use_abstract_mesh(abstract):
    text = jax.jit(step).trace(q, kc, vc, ks, vs).lower(lowering_platforms=("cuda",)).as_text()
  for name in ("nsa_decode_attention", "nsa_decode_scores", "nsa_decode_topn",
               "nsa_decode_select_window", "nsa_decode_band_topn"):
    assert name in text, f"{name} missing from the CUDA lowering"


def test_generate_stops_each_row_at_its_stop_token():
  """experiments.generate(stop_token=...): a row keeps what it sampled up to and including its
  first stop token, holds the stop token after it, and sampling ends after the chunk in which
  every row stopped; the tokens before the stop are those of the run without a stop token (the
  same greedy decode)."""
  from experiments import generate as gen
  model = tiny_model("dense", n_layers=1)
  prompt = np.asarray(jax.random.randint(fresh_key(7), (2, 5), 0, VOCAB), np.int32)
  full = gen.generate(model, prompt, 24, temperature=0.0, chunk=4)
  # row 0's third new token (its first occurrence) stops it; row 1 stops where that id first
  # turns up in its own row, or never
  stop = int(full[0, 2]) if int(full[0, 2]) not in full[0, :2] else int(full[0, 0])
  streamed = []
  got = gen.generate(model, prompt, 24, temperature=0.0, chunk=4, stop_token=stop,
                     on_tokens=streamed.append)
  np.testing.assert_array_equal(np.concatenate(streamed, axis=1), got)
  for r in range(2):
    hits = np.flatnonzero(full[r] == stop)
    end = hits[0] + 1 if hits.size else full.shape[1]
    np.testing.assert_array_equal(got[r, :min(end, got.shape[1])], full[r, :min(end, got.shape[1])])
    assert (got[r, end:] == stop).all()
  first_stops = [np.flatnonzero(full[r] == stop) for r in range(2)]
  if all(h.size for h in first_stops):  # both rows stopped: ends with the chunk of the later stop
    last = max(h[0] for h in first_stops)  # column; column 0 is the prefill's token
    assert got.shape[1] == (min(24, 1 + 4 * -(-last // 4)) if last else 1), got.shape
  else:
    assert got.shape[1] == 24
