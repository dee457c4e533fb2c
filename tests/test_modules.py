"""NNX modules and the LM: shapes, layer-level causality, module options, training smoke, and use from
Linen through nnx.bridge."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from nsa_jax import ModelConfig, NSAConfig, reference
from nsa_jax.attention import DenseAttention, NSAAttention
from nsa_jax.model import TransformerLM

# On a GPU (scripts/gpu_tests.sh) float32 matmuls run in IEEE float32, not TF32, so the float32
# tolerances below mean the same as on the CPU (importing gpu_mode sets that).
try:
  import tests.gpu_mode  # noqa: F401
except ImportError:  # run from inside tests/
  import gpu_mode  # noqa: F401

SEED = int.from_bytes(os.urandom(4), "little")


def fresh_key(i=0):
  print(f"seed={SEED}")
  return jax.random.fold_in(jax.random.key(SEED), i)


def small_nsa(**kw):
  base = dict(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=6, cmp_block=8, cmp_stride=4,
              sel_block=16, num_selected=3, window=12)
  base.update(kw)
  return NSAConfig(**base)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("opts", [{}, {"shared_kv": True}, {"gating": "sum"},
                                  {"compression": "mean"}, {"branches": ("cmp", "win")},
                                  {"selector": "quest"}])
def test_nsa_layer_is_causal_and_finite(impl, opts):
  """Layer-level causality: d y_t / d x_s == 0 exactly for every s > t (all branches, phi, gates)."""
  cfg = small_nsa(**opts)
  layer = NSAAttention(16, cfg, rngs=nnx.Rngs(int(SEED % 1000)))
  t, probe = 45, 20
  x = jax.random.normal(fresh_key(1), (1, t, 16))
  w = jax.random.normal(fresh_key(2), (16,))

  def y_at(x):
    return layer(x, implementation=impl)[0, probe] @ w

  g = jax.jit(jax.grad(y_at))(x)
  assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(g[0, probe + 1:]) == 0.0), "output at t depends on inputs after t"
  assert np.any(np.asarray(g[0, :probe + 1]) != 0.0)


def test_nsa_layer_respects_segments():
  cfg = small_nsa()
  layer = NSAAttention(16, cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(fresh_key(3), (1, 40, 16))
  seg = jnp.asarray([[0] * 17 + [1] * 23])
  w = jax.random.normal(fresh_key(4), (16,))
  g = jax.jit(jax.grad(lambda x: layer(x, segment_ids=seg, implementation="reference")[0, 30] @ w))(x)
  assert np.all(np.asarray(g[0, :17]) == 0.0), "second document sees the first"
  assert np.all(np.asarray(g[0, 31:]) == 0.0)


def test_nsa_layer_impls_agree():
  cfg = small_nsa()
  layer = NSAAttention(16, cfg, rngs=nnx.Rngs(1))
  x = jax.random.normal(fresh_key(5), (2, 50, 16))
  a = jax.jit(lambda x: layer(x, implementation="reference"))(x)
  b = jax.jit(lambda x: layer(x, implementation="xla"))(x)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_layer_aux_reports_blocks_and_gates():
  cfg = small_nsa()
  layer = NSAAttention(16, cfg, rngs=nnx.Rngs(2))
  x = jax.random.normal(fresh_key(6), (1, 40, 16))
  _, aux = layer(x, implementation="reference", return_aux=True)
  assert aux["block_idx"].shape == (1, 40, 2, 3)
  assert aux["gates"].shape == (1, 40, 4, 3)
  assert float(aux["gates"].min()) > 0.0 and float(aux["gates"].max()) < 1.0


def test_layer_aux_q_and_selection_keys_rebuild_the_selection_branch():
  """The q and selection keys the aux output carries (the needle diagnosis reads attention mass
  from them) are the ones the selection branch attends with: its softmax weights over the
  selected keys, applied to the selection values, give the branch's output."""
  from experiments.needle_eval import selected_key_mass
  cfg = small_nsa(sel_block=8, num_selected=4)
  layer = NSAAttention(16, cfg, rngs=nnx.Rngs(3))
  x = jax.random.normal(fresh_key(16), (1, 40, 16))
  _, aux = layer(x, implementation="reference", return_aux=True)
  v = np.asarray(layer._project(x.astype(layer.dtype))[2]["slc"][1])[0]  # [T, K, d_v]
  q, k, idx = (np.asarray(aux[n])[0] for n in ("q", "k_slc", "block_idx"))
  want = np.asarray(aux["outputs"]["slc"])[0]  # [T, H, d_v]
  for t in (5, 22, 39):
    w = np.stack([selected_key_mass(q[t], k, idx[t], t, cfg.sel_block, [j], cfg.head_dim ** -0.5)
                  for j in range(40)])  # [keys, H]
    for h in range(cfg.num_heads):
      got = w[:, h] @ v[:, h // (cfg.num_heads // cfg.num_kv_heads)]
      np.testing.assert_allclose(got, want[t, h], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("selector", ["nsa", "quest"])
def test_select_edit_replaces_the_layers_own_choice(selector):
  """NSAAttention's select_edit (an intervention): the identity edit changes nothing; an edit's
  blocks are the ones the selection branch reads (its output equals the reference selection
  attention on those blocks, and aux reports them); the parameters still get finite gradients."""
  cfg = small_nsa(sel_block=8, num_selected=3, selector=selector)
  layer = NSAAttention(16, cfg, rngs=nnx.Rngs(4))
  x = jax.random.normal(fresh_key(17), (2, 40, 16))
  y0, aux0 = layer(x, implementation="reference", return_aux=True)
  y1, aux1 = layer(x, implementation="reference", return_aux=True, select_edit=lambda i: i)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
  np.testing.assert_array_equal(np.asarray(aux1["block_idx"]), np.asarray(aux0["block_idx"]))
  # an edit: from query 24 on, the lowest-numbered block above 0 becomes block 1 (any valid list
  # will do: the op must read exactly what the edit wrote)
  t = jnp.arange(40)[None, :, None, None]
  moved = jnp.where((t >= 24) & (aux0["block_idx"] == jnp.min(jnp.where(
      aux0["block_idx"] > 0, aux0["block_idx"], 99), -1, keepdims=True)), 1, aux0["block_idx"])
  edit = lambda i: jnp.sort(jnp.where(i >= 0, moved, -1), -1)  # noqa: E731
  want_idx = np.asarray(edit(aux0["block_idx"]))
  assert (want_idx != np.asarray(aux0["block_idx"])).any(), "the edit must change some list"
  for impl in ("reference", "xla"):
    y2, aux2 = layer(x, implementation=impl, return_aux=True, select_edit=edit)
    np.testing.assert_array_equal(np.asarray(aux2["block_idx"]), want_idx)
    v_slc = layer._project(x.astype(layer.dtype))[2]["slc"][1]
    want, _ = reference.select_attention(aux2["q"], aux2["k_slc"], v_slc, jnp.asarray(want_idx),
                                         cfg.sel_block)
    np.testing.assert_allclose(np.asarray(aux2["outputs"]["slc"]), np.asarray(want), rtol=1e-5,
                               atol=1e-5, err_msg=impl)
  assert not np.allclose(np.asarray(y2), np.asarray(y0)), "the edited blocks changed nothing"
  g = jax.grad(lambda m: jnp.sum(m(x, implementation="xla", select_edit=edit) ** 2))(layer)
  leaves = jax.tree.leaves(nnx.state(g, nnx.Param))
  assert leaves and all(np.isfinite(np.asarray(v)).all() for v in leaves)


def test_select_edits_are_refused_where_they_cannot_apply():
  cfg = tiny_model_cfg("nsa", layer_attention=("dense", "nsa"))
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, 32), jnp.int32)
  ident = lambda i: i  # noqa: E731
  # (against return_aux's logits: both walk the layers in the Python loop, so bitwise equal)
  np.testing.assert_array_equal(np.asarray(model(tokens, select_edits={1: ident})),
                                np.asarray(model(tokens, return_aux=True)[0]))
  with pytest.raises(ValueError, match=r"key 0, which is not an NSA layer.*among \[1\]"):
    model(tokens, select_edits={0: ident})
  with pytest.raises(ValueError, match="key 2, which is not an NSA layer"):
    model(tokens, select_edits={2: ident})
  with pytest.raises(ValueError, match="does not combine with return_selector_loss"):
    model(tokens, select_edits={1: ident}, return_selector_loss=True)
  with pytest.raises(ValueError, match=r"select_edit returned \(1, 32\).*Fix: return an edited"):
    model(tokens, select_edits={1: lambda i: i[..., 0, 0]})
  # with remat the edit is bound, not passed to jax.checkpoint as an argument (it is no array)
  remat = TransformerLM(tiny_model_cfg("nsa", layer_attention=("dense", "nsa"), remat=True),
                        rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(remat(tokens, select_edits={1: ident})),
                                np.asarray(remat(tokens, return_aux=True)[0]))
  layer = NSAAttention(16, small_nsa(branches=("cmp", "win")), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no selection branch"):
    layer(jnp.zeros((1, 16, 16)), select_edit=ident)


def test_selection_from_layer_hands_that_layers_blocks_to_later_nsa_layers():
  """ModelConfig.selection_from_layer (not the paper): the later NSA layers read the source
  layer's blocks. Checked against the paper's model (same parameters) with those blocks forced
  into the later layers by select_edits (the blocks arrive through the edit, not through the
  carried selection): loss and parameter gradients equal, with and without remat and whatever
  layer_loop says."""
  kinds = ("nsa", "dense", "nsa", "nsa")
  cfg = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
             ffn_dim=64, max_seq_len=96, layer_attention=kinds,
             nsa=small_nsa(sel_block=8, num_selected=5, implementation="xla"))
  tokens = jax.random.randint(fresh_key(31), (2, 64), 0, 64)  # 8 blocks: 2 of 5 slots scored
  plain = TransformerLM(ModelConfig(**cfg), rngs=nnx.Rngs(3))
  _, aux = plain(tokens, return_aux=True)
  idx0 = aux[0]["block_idx"]
  assert any((np.asarray(aux[i]["block_idx"]) != np.asarray(idx0)).any() for i in (2, 3)), \
      "the later layers already chose layer 0's blocks: the test would prove nothing"
  forced = {i: (lambda _: idx0) for i in (2, 3)}
  weights = jax.random.normal(fresh_key(32), (2, 64, 64))

  def loss(m, **kw):
    return jnp.sum(m(tokens, **kw) * weights)

  want, want_g = nnx.value_and_grad(lambda m: loss(m, select_edits=forced))(plain)
  # the loss sums terms of both signs: its float32 error scales with the sum of their sizes
  loss_atol = 1e-6 * float(jnp.sum(jnp.abs(plain(tokens) * weights)))
  for extra in ({}, {"remat": True}, {"layer_loop": "scan"}):
    shared = TransformerLM(ModelConfig(**cfg, selection_from_layer=0, **extra), rngs=nnx.Rngs(3))
    got, got_g = nnx.value_and_grad(loss)(shared)
    np.testing.assert_allclose(float(got), float(want), rtol=0, atol=loss_atol, err_msg=str(extra))
    for a, b in zip(jax.tree.leaves(nnx.state(got_g, nnx.Param)),
                    jax.tree.leaves(nnx.state(want_g, nnx.Param))):
      # float32 through four layers, summed in other orders (measured on an H100: 4e-6)
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5,
                                 err_msg=str(extra))
  _, got_aux = shared(tokens, return_aux=True)
  for i in (0, 2, 3):
    np.testing.assert_array_equal(np.asarray(got_aux[i]["block_idx"]), np.asarray(idx0))
  # a source in the middle: the layers before it keep their own choice
  mid = TransformerLM(ModelConfig(**cfg, selection_from_layer=2), rngs=nnx.Rngs(3))
  _, mid_aux = mid(tokens, return_aux=True)
  np.testing.assert_array_equal(np.asarray(mid_aux[0]["block_idx"]), np.asarray(idx0))
  np.testing.assert_array_equal(np.asarray(mid_aux[3]["block_idx"]),
                                np.asarray(mid_aux[2]["block_idx"]))
  # refusals: blocks for a dense layer or an aux-selector layer; cached decoding
  h = jnp.zeros((2, 64, 32))
  with pytest.raises(ValueError, match="block_idx was given for a dense layer"):
    shared.blocks[1](h, block_idx=idx0)
  aux_layer = NSAAttention(32, small_nsa(sel_block=8, num_selected=5, selector="aux"),
                           rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="selector='aux'.*Fix"):
    aux_layer(h, block_idx=idx0)
  from nsa_jax import decode
  with pytest.raises(ValueError, match="selection_from_layer=0: cached decoding.*Fix"):
    decode.init_cache(shared, 2, 64)


def test_dense_layer_aux_q_and_k_rebuild_its_output():
  """The q and k a dense layer's aux carries are the ones it attends with (causal softmax)."""
  layer = DenseAttention(16, 4, 2, 8, 6, rngs=nnx.Rngs(4))
  x = jax.random.normal(fresh_key(17), (1, 30, 16))
  y, aux = layer(x, return_aux=True)
  np.testing.assert_allclose(np.asarray(y), np.asarray(layer(x)), rtol=1e-6, atol=1e-6)
  v = np.asarray(layer._project(x)[2])[0]  # [T, K, d_v]
  q, k = np.asarray(aux["q"])[0], np.asarray(aux["k"])[0]
  logits = np.einsum("thd,shd->hts", q, np.repeat(k, 2, axis=1)) * 8 ** -0.5
  logits = np.where(np.tril(np.ones((30, 30), bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum("hts,shd->thd", p, np.repeat(v, 2, axis=1)).reshape(1, 30, 24)
  np.testing.assert_allclose(np.asarray(layer.o_proj(jnp.asarray(o, jnp.float32))), np.asarray(y),
                             rtol=1e-4, atol=1e-5)


def test_bad_layer_input_is_reported():
  layer = NSAAttention(16, small_nsa(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="expects x"):
    layer(jnp.zeros((1, 10, 15)))
  with pytest.raises(ValueError, match="num_kv_heads"):
    DenseAttention(16, 6, 4, 8, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="NSAConfig"):
    NSAAttention(16, {"num_heads": 4}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"implementation='cudnnn'.*expected one of"):
    DenseAttention(16, 4, 2, 8, implementation="cudnnn", rngs=nnx.Rngs(0))  # when built


@pytest.mark.parametrize("kind", ["nsa", "dense"])
def test_layer_inputs_are_checked_before_use(kind):
  """Each bad input gets a message naming it and the fix, not a jax error from deep inside RoPE
  or the positions (these used to be `sub got incompatible shapes`, `tuple index out of range`,
  `index can't contain negative values`, `array split does not result in an equal division`);
  an integer x used to be cast silently. Allowed as before: float positions (RoPE interpolation),
  positions [1, T] shared by the batch, boolean segment ids. Segment ids must now be [B, T] in
  both layers (the NSA op always required it; dense broadcast a [1, T] row)."""
  make = ((lambda dk: NSAAttention(16, small_nsa(head_dim=dk), rngs=nnx.Rngs(0))) if kind == "nsa"
          else (lambda dk: DenseAttention(16, 4, 2, dk, rngs=nnx.Rngs(0))))
  layer = make(8)
  x = jax.random.normal(fresh_key(3), (2, 40, 16))
  with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 39\), expected .*\(2, 40\)"):
    layer(x, segment_ids=jnp.zeros((2, 39), jnp.int32))
  with pytest.raises(ValueError, match=r"segment_ids has shape \(40,\)"):
    layer(x, segment_ids=jnp.zeros((40,), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids has dtype float32; document ids .*integers"):
    layer(x, segment_ids=jnp.zeros((2, 40), jnp.float32))  # the ops' own check and message
  with pytest.raises(ValueError, match=r"positions has shape \(2, 39\)"):
    layer(x, positions=jnp.zeros((2, 39), jnp.int32))
  with pytest.raises(ValueError, match=r"positions has shape \(40,\)"):
    layer(x, positions=jnp.arange(40))
  shared = layer(x, positions=jnp.arange(40)[None] + 7)  # one row for the batch: broadcast
  np.testing.assert_array_equal(shared, layer(x, positions=jnp.broadcast_to(jnp.arange(40) + 7,
                                                                             (2, 40))))
  seg = jnp.broadcast_to(jnp.arange(40) >= 20, (2, 40))  # booleans: two documents
  np.testing.assert_array_equal(layer(x, segment_ids=seg),
                                layer(x, segment_ids=seg.astype(jnp.int32)))
  with pytest.raises(ValueError, match="empty sequence.*at least one token"):
    layer(jnp.zeros((2, 0, 16)))
  with pytest.raises(ValueError, match="floating-point x, got int32"):
    layer(jnp.ones((2, 40, 16), jnp.int32))
  with pytest.raises(ValueError, match="head_dim=7: .*RoPE.*even head_dim"):
    make(7)
  y = layer(x, positions=jnp.broadcast_to(jnp.arange(40) * 0.5, (2, 40)))
  assert y.shape == (2, 40, 16) and bool(jnp.all(jnp.isfinite(y)))


def test_lm_checks_token_ids():
  """Ids must be integers inside the vocabulary: an id past it used to give finite logits (a zero
  embedding row), a float id was truncated. Checked where the ids are concrete; under jit too
  for the dtype."""
  cfg = tiny_model_cfg("nsa")
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  v = cfg.vocab_size
  for bad, lo, hi in ((jnp.full((1, 8), v), v, v), (jnp.full((1, 8), -1), -1, -1)):
    with pytest.raises(ValueError, match=rf"token ids span \[{lo}, {hi}\] but vocab_size={v}"):
      model(bad)
  with pytest.raises(ValueError, match="integer ids, got dtype float32"):
    model(jnp.full((1, 8), 3.7))
  with pytest.raises(ValueError, match="integer ids, got dtype float32"):
    jax.jit(lambda t: model(t))(jnp.full((1, 8), 3.0))
  # ids closed over by a trace are still concrete: checked, and valid ones trace (a jnp.min there
  # gave a tracer and a ConcretizationTypeError)
  past, zeros = jnp.arange(v + 1)[None], jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=rf"token ids span \[0, {v}\]"):
    jax.jit(lambda: model(past))()
  assert jax.jit(lambda: model(zeros))().shape == (1, 8, v)
  ok = jnp.asarray(np.random.default_rng(SEED).integers(0, v, (2, 8)), jnp.int32)
  np.testing.assert_allclose(np.asarray(model(ok)), np.asarray(jax.jit(lambda t: model(t))(ok)),
                             rtol=1e-5, atol=1e-5)  # valid ids pass eagerly and under jit


def test_dense_layer_matches_reference_attention():
  layer = DenseAttention(16, 4, 2, 8, rngs=nnx.Rngs(0))
  x = jax.random.normal(fresh_key(7), (2, 33, 16))
  seg = jnp.asarray([[0] * 10 + [1] * 23, [0] * 33])
  a = jax.jit(lambda x: layer(x, segment_ids=seg, implementation="xla"))(x)
  b = jax.jit(lambda x: layer(x, segment_ids=seg, implementation="reference"))(x)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dense_implementation_setting_reaches_the_layers():
  """model.dense_implementation picks the dense layers' kernels: "pallas" (the window kernels
  with w = T, interpreted here) gives the "xla" model's logits with packed documents; a value
  that does not exist is refused with the choices."""
  kw = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
            ffn_dim=64, max_seq_len=96, attention="dense")
  tokens = jax.random.randint(fresh_key(3), (2, 70), 0, 64)
  seg = jnp.asarray([[0] * 25 + [1] * 45, [0] * 69 + [1]])
  logits = {}
  for impl in ("xla", "pallas"):
    model = TransformerLM(ModelConfig(**kw, dense_implementation=impl), rngs=nnx.Rngs(0))
    assert all(b.attn.implementation == impl for b in model.blocks)
    logits[impl] = jax.jit(lambda t: model(t, segment_ids=seg))(tokens)
    jaxpr = str(jax.make_jaxpr(lambda t: model(t, segment_ids=seg))(tokens))
    assert ("pallas_call" in jaxpr) == (impl == "pallas")
  np.testing.assert_allclose(np.asarray(logits["pallas"]), np.asarray(logits["xla"]),
                             rtol=2e-4, atol=2e-4)
  with pytest.raises(ValueError, match="dense_implementation.*'flash'"):
    ModelConfig(**kw, dense_implementation="flash")


def tiny_model_cfg(attention, **kw):
  return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     ffn_dim=64, max_seq_len=96, attention=attention,
                     nsa=small_nsa(num_selected=3), **kw)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_lm_trains_on_a_fixed_batch(attention):
  model = TransformerLM(tiny_model_cfg(attention), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(fresh_key(8), (2, 65), 0, 64)
  logits = model(tokens[:, :-1])
  assert logits.shape == (2, 64, 64) and logits.dtype == jnp.float32
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, tokens):
    def loss_fn(m):
      lg = m(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(lg, tokens[:, 1:]).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    finite = jax.tree.reduce(lambda a, g: a & jnp.all(jnp.isfinite(g)), grads, True)
    opt.update(model, grads)
    return loss, finite

  losses = []
  for _ in range(8):
    loss, finite = step(model, opt, tokens)
    assert bool(finite)
    losses.append(float(loss))
  assert abs(losses[0] - np.log(64)) < 1.0, losses[0]
  assert losses[-1] < losses[0] - 0.5, losses


def test_lm_mixed_layers_and_bf16():
  # The Python layer loop, which return_aux always takes, so the two logits agree bitwise (the
  # default scanned loop rounds bf16 differently in eager mode; tests/test_scan_layers.py)
  cfg = tiny_model_cfg("nsa", layer_attention=("dense", "nsa"), dtype="bfloat16",
                       layer_loop="python")
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  assert isinstance(model.blocks[0].attn, DenseAttention)
  assert isinstance(model.blocks[1].attn, NSAAttention)
  assert model.blocks[1].attn.q_proj.kernel[...].dtype == jnp.float32  # params stay float32
  tokens = jax.random.randint(fresh_key(9), (1, 40), 0, 64)
  logits = model(tokens)
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
  logits_aux, auxes = model(tokens, return_aux=True)
  np.testing.assert_array_equal(np.asarray(logits_aux), np.asarray(logits))
  assert set(auxes[0]) == {"q", "k"}  # dense layer: q and k after RoPE
  assert auxes[0]["q"].shape == (1, 40, 4, 8) and auxes[0]["k"].shape == (1, 40, 2, 8)
  assert auxes[1]["block_idx"].shape == (1, 40, 2, 3) and auxes[1]["gates"].shape == (1, 40, 4, 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_hot_embedding_matches_the_gather(dtype, monkeypatch):
  """The small-vocabulary one-hot embedding (model.ONE_HOT_EMBED_MAX_VOCAB) gives the gather's
  rows exactly and the same table gradient (a matmul instead of a scatter-add), tokens repeated."""
  from nsa_jax import model as model_mod
  cfg = tiny_model_cfg("dense", dtype=dtype)
  model = TransformerLM(cfg, rngs=nnx.Rngs(int(SEED % 1000)))
  tokens = jax.random.randint(fresh_key(10), (2, 48), 0, 8)  # 8 of 64 ids: many repeats
  # small-integer cotangents: both table gradients are exact sums even in bf16, so equal
  cot = jax.random.randint(fresh_key(11), (2, 48, cfg.d_model), -4, 5).astype(jnp.float32)

  def rows_and_grad(limit):
    monkeypatch.setattr(model_mod, "ONE_HOT_EMBED_MAX_VOCAB", limit)
    f = lambda m: jnp.sum(m.embed_tokens(tokens).astype(jnp.float32) * cot)
    return model.embed_tokens(tokens), nnx.grad(f)(model).embed.embedding[...]

  (x1, g1), (x0, g0) = rows_and_grad(1024), rows_and_grad(0)
  # which path ran: a matmul and no gather below the limit, a gather above it
  prims = lambda limit: (monkeypatch.setattr(model_mod, "ONE_HOT_EMBED_MAX_VOCAB", limit),
                         str(jax.make_jaxpr(lambda tk: model.embed_tokens(tk))(tokens)))[1]
  assert "dot_general" in prims(1024) and "gather" not in prims(1024)
  assert "gather" in prims(0) and "dot_general" not in prims(0)
  np.testing.assert_array_equal(np.asarray(x1, np.float32), np.asarray(x0, np.float32))
  np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))
  assert float(jnp.abs(g0).sum()) > 0 and float(jnp.abs(g1[8:]).max()) == 0.0  # unused ids
  # narrow token dtypes must not wrap the one-hot classes (uint8 3 vs class 259)
  monkeypatch.setattr(model_mod, "ONE_HOT_EMBED_MAX_VOCAB", 1024)
  np.testing.assert_array_equal(np.asarray(model.embed_tokens(tokens.astype(jnp.uint8))),
                                np.asarray(x1))


@pytest.mark.parametrize("mode,layer_kind,opts", [
    ("all", "nsa", {}), ("all", "nsa", {"shared_kv": True}), ("all", "nsa", {"num_kv_heads": 1}),
    ("all", "nsa", {"gating": "sum"}), ("all", "dense", {}), ("kv", "nsa", {}),
    ("kv", "dense", {})])
def test_fused_projection_matches_separate_matmuls(mode, layer_kind, opts, monkeypatch):
  """attention.FUSE_PROJ ("all": query, K/V and gate projections as one matmul, kernels
  concatenated per KV head; "kv": the K/V ones) gives the separate Linear layers' ("none")
  output and gradients (float32, d_k != d_v, G = 2 and 4), and the matmuls really merge (the
  jaxpr's dot_general count drops by the number of projections folded in)."""
  from nsa_jax import attention as attn_mod
  cfg = small_nsa(**opts)
  if layer_kind == "nsa":
    layer = NSAAttention(16, cfg, rngs=nnx.Rngs(int(SEED % 1000)))
    n_kv, n_gate = (2 if cfg.shared_kv else 6), int(cfg.gating == "sigmoid")
    merged = n_kv + n_gate if mode == "all" else n_kv - 1
  else:
    layer = DenseAttention(16, 4, 2, 8, 6, implementation="xla", rngs=nnx.Rngs(int(SEED % 1000)))
    merged = 2 if mode == "all" else 1
  x = jax.random.normal(fresh_key(12), (2, 37, 16))
  cot = jax.random.normal(fresh_key(13), (2, 37, 16))
  impl = dict(implementation="xla")

  def run(m):
    monkeypatch.setattr(attn_mod, "FUSE_PROJ", m)
    f = lambda mod, x: jnp.sum(mod(x, **impl) * cot)
    y = layer(x, **impl)
    gm, gx = nnx.grad(f, argnums=(0, 1))(layer, x)
    dots = str(jax.make_jaxpr(lambda x: layer(x, **impl))(x)).count("dot_general")
    return y, gm, gx, dots

  y1, gm1, gx1, dots1 = run(mode)
  y0, gm0, gx0, dots0 = run("none")
  assert dots0 - dots1 == merged, (dots0, dots1)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gx1), np.asarray(gx0), rtol=1e-4, atol=1e-5)
  leaves1, leaves0 = jax.tree.leaves(nnx.state(gm1)), jax.tree.leaves(nnx.state(gm0))
  assert len(leaves1) == len(leaves0)
  for a, b in zip(leaves1, leaves0):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # every projection gets a gradient (none dropped by the split), the gate's bias included
  names = ("shared",) if layer_kind == "nsa" and cfg.shared_kv else ("cmp", "slc", "win")
  projs = ([gm1.k_proj[n].kernel for n in names] + [gm1.v_proj[n].kernel for n in names]
           if layer_kind == "nsa" else [gm1.k_proj.kernel, gm1.v_proj.kernel])
  projs.append(gm1.q_proj.kernel)
  if layer_kind == "nsa" and cfg.gating == "sigmoid":
    projs += [gm1.gate.kernel, gm1.gate.bias]
  assert all(float(jnp.abs(p[...]).max()) > 0 for p in projs)


@pytest.mark.parametrize("layer_kind", ["nsa", "dense"])
def test_fused_projection_keeps_the_compute_dtype(layer_kind, monkeypatch):
  """bfloat16 compute with float32 parameters (the training configs): the fused projections
  come out in bfloat16 like the separate Linear layers' (a fused matmul that skipped the casts
  would run in float32), with the same values up to bf16 rounding; gate bias nonzero."""
  from nsa_jax import attention as attn_mod
  if layer_kind == "nsa":
    layer = NSAAttention(16, small_nsa(), dtype="bfloat16", rngs=nnx.Rngs(int(SEED % 1000)))
    layer.gate.bias[...] = jax.random.normal(fresh_key(15), layer.gate.bias[...].shape)
  else:
    layer = DenseAttention(16, 4, 2, 8, 6, dtype="bfloat16", implementation="xla",
                           rngs=nnx.Rngs(int(SEED % 1000)))
  x = jax.random.normal(fresh_key(14), (2, 21, 16)).astype(jnp.bfloat16)
  outs = {}
  for m in ("all", "none"):
    monkeypatch.setattr(attn_mod, "FUSE_PROJ", m)
    outs[m] = jax.tree.leaves(layer._project(x))
  assert len(outs["all"]) == len(outs["none"])
  for a, b in zip(outs["all"], outs["none"]):
    assert a.dtype == b.dtype == jnp.bfloat16 and a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2,
                               atol=2e-2)


def test_fused_projection_mode_on_a_tensor_parallel_mesh(monkeypatch):
  """Where the mesh's tensor axis does not divide the KV heads, the per-KV-head reshape cannot
  carry the projections' sharding, so every mode runs as "none" there; where it divides them,
  and without a tensor axis, FUSE_PROJ applies. A bad mode is refused by name."""
  from jax.sharding import AbstractMesh, AxisType
  from nsa_jax import attention as attn_mod
  auto = (AxisType.Auto, AxisType.Auto)
  assert attn_mod.fuse_mode(1) == "all"
  with jax.sharding.use_abstract_mesh(AbstractMesh((2, 2), ("data", "tensor"), axis_types=auto)):
    assert attn_mod.fuse_mode(1) == "none" and attn_mod.fuse_mode(3) == "none"
    assert attn_mod.fuse_mode(2) == attn_mod.fuse_mode(4) == "all"
    monkeypatch.setattr(attn_mod, "FUSE_PROJ", "kv")
    assert attn_mod.fuse_mode(2) == "kv" and attn_mod.fuse_mode(1) == "none"
  monkeypatch.setattr(attn_mod, "FUSE_PROJ", "all")
  with jax.sharding.use_abstract_mesh(AbstractMesh((4, 1), ("data", "tensor"), axis_types=auto)):
    assert attn_mod.fuse_mode(1) == "all"
  monkeypatch.setattr(attn_mod, "FUSE_PROJ", "qkv")
  with pytest.raises(ValueError, match="FUSE_PROJ='qkv': not one of"):
    attn_mod.fuse_mode(1)


def test_lm_rejects_too_long_input():
  model = TransformerLM(tiny_model_cfg("dense"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_seq_len"):
    model(jnp.zeros((1, 97), jnp.int32))


def test_every_param_has_logical_axes():
  model = TransformerLM(tiny_model_cfg("nsa"), rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  for path, var in jax.tree.leaves_with_path(params, is_leaf=lambda v: isinstance(v, nnx.Variable)):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == var[...].ndim, (path, names)


def test_nsa_layer_from_linen_via_bridge():
  cfg = small_nsa()

  class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(16)(x)
      y = nnx.bridge.to_linen(NSAAttention, 16, cfg)(x, implementation="reference")
      return x + y

  net = LinenNet()
  x = jax.random.normal(fresh_key(10), (1, 40, 16))
  variables = net.init(jax.random.key(0), x)
  y = net.apply(variables, x)
  assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
  # The NNX layer's parameters live in the Linen variable tree and get gradients.
  grads = jax.grad(lambda v: jnp.sum(net.apply(v, x) ** 2))(variables)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) > 10 and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)


def test_phi_reads_position_encoding():
  """phi is an MLP over the whole block with a learned position encoding: permuting the keys inside
  a block changes the compressed key (mean pooling would not)."""
  cfg = small_nsa()
  layer = NSAAttention(16, cfg, rngs=nnx.Rngs(3))
  k = jax.random.normal(fresh_key(11), (1, 16, 2, 8))
  params = layer.phi_k.params()
  a = reference.mlp_compress(k, params, 8, 4)
  b = reference.mlp_compress(k[:, ::-1], params, 8, 4)
  assert not np.allclose(np.asarray(a[:, 0]), np.asarray(b[:, -1]))
  m = reference.mean_compress(k, 8, 4)
  mr = reference.mean_compress(k[:, ::-1], 8, 4)
  np.testing.assert_allclose(np.asarray(m[:, 0]), np.asarray(mr[:, -1]), rtol=1e-5, atol=1e-6)
