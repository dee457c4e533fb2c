"""The auxiliary-loss block selector (selector="aux", nsa_jax.aux_selector): scores, loss and
chosen blocks against a literal float64 loop; the loss trains only the gate and goes down; the
three op implementations agree on given blocks; training logs the selector loss; bad uses are
clear errors."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nsa_jax import ModelConfig, NSAConfig, aux_selector, decode, ops, reference
from nsa_jax.model import TransformerLM

SEED = int.from_bytes(os.urandom(4), "little")


def key(i):
  print(f"seed={SEED}")
  return jax.random.fold_in(jax.random.key(SEED), i)


def cfg_for(**kw):
  base = dict(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=8, cmp_block=8, cmp_stride=4,
              sel_block=16, num_selected=4, window=16, num_local_blocks=1, selector="aux",
              aux_dim=4)
  base.update(kw)
  return NSAConfig(**base)


def inputs(b=2, t=128, cfg=None, seg=False):
  cfg = cfg or cfg_for()
  ks = jax.random.split(key(0), 4)
  q = jax.random.normal(ks[0], (b, t, cfg.num_heads, cfg.head_dim))
  k = jax.random.normal(ks[1], (b, t, cfg.num_kv_heads, cfg.head_dim))
  w_q = jax.random.normal(ks[2], (cfg.head_dim, cfg.aux_dim)) * 0.5
  w_k = jax.random.normal(ks[3], (cfg.head_dim, cfg.aux_dim)) * 0.5
  segment_ids = None
  if seg:  # documents of 50 and 78 tokens in row 0, one document in row 1
    segment_ids = jnp.stack([jnp.where(jnp.arange(t) < 50, 0, 1), jnp.zeros(t, jnp.int32)])
  return q, k, w_q, w_k, segment_ids


def literal(q, k, w_q, w_k, cfg, segment_ids):
  """Per (row, query, head) float64 loop of the module docstring's definitions."""
  q, k, w_q, w_k = (np.asarray(x, np.float64) for x in (q, k, w_q, w_k))
  b, t, h, dk = q.shape
  kh, lb = k.shape[2], cfg.sel_block
  g, ns = h // kh, -(-t // lb)
  seg = np.zeros((b, t), int) if segment_ids is None else np.asarray(segment_ids)
  scores = np.zeros((b, t, kh, ns))
  kl = np.zeros((b, t))
  for bi in range(b):
    kbar = np.stack([k[bi, j * lb:(j + 1) * lb].mean(axis=0) for j in range(ns)])  # [Ns, K, Dk]
    for ti in range(t):
      start = min(s for s in range(ti + 1) if seg[bi, s] == seg[bi, ti] and
                  all(seg[bi, s:ti + 1] == seg[bi, ti]))
      allowed = [j for j in range(ns) if start // lb <= j < ti // lb]
      kls = []
      for hi in range(h):
        kg = hi // g
        if not allowed:
          kls.append(0.0)
          continue
        lg = np.array([(q[bi, ti, hi] @ w_q) @ (kbar[j, kg] @ w_k) for j in allowed])
        lg = lg / np.sqrt(w_q.shape[1])
        pp = np.exp(lg - lg.max())
        pp /= pp.sum()
        for j, p in zip(allowed, pp):
          scores[bi, ti, kg, j] += p
        keys = [s for s in range(start, ti + 1)]
        att = np.array([q[bi, ti, hi] @ k[bi, s, kg] for s in keys]) * dk ** -0.5
        pa = np.exp(att - att.max())
        pa /= pa.sum()
        mass = np.array([sum(p for s, p in zip(keys, pa) if s // lb == j) for j in allowed])
        pt = mass / mass.sum()
        kls.append(float(np.sum(np.where(pt > 0, pt * (np.log(np.where(pt > 0, pt, 1)) -
                                                        np.log(pp)), 0))))
      kl[bi, ti] = np.mean(kls)
  return scores, kl


@pytest.mark.parametrize("seg", [False, True])
def test_select_matches_literal_loop(seg):
  cfg = cfg_for()
  q, k, w_q, w_k, segment_ids = inputs(cfg=cfg, seg=seg)
  scores, kl, _ = jax.jit(functools.partial(aux_selector.scores_and_loss, cfg=cfg, chunk=48))(
      q, k, w_q, w_k, segment_ids=segment_ids)
  want_scores, want_kl = literal(q, k, w_q, w_k, cfg, segment_ids)
  np.testing.assert_allclose(np.asarray(kl), want_kl, rtol=1e-4, atol=1e-6,
                             err_msg=f"loss, seed={SEED}")
  np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-4, atol=1e-6,
                             err_msg=f"scores, seed={SEED}")
  assert np.all(want_kl >= 0) and want_kl.max() > 0
  # The chosen blocks are NSA's top-n rules (forced blocks, documents) on those scores.
  b, t = q.shape[:2]
  idx, kl2 = aux_selector.select(q, k, w_q, w_k, cfg, segment_ids=segment_ids, chunk=48)
  want_idx = reference.select_blocks(scores, cfg, reference._segments(segment_ids, b, t))
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx), err_msg=f"seed={SEED}")
  # the same function eagerly and under jit: only the fusion's float order differs (on the H200
  # 4e-6 relative, 2 float32 ulps of 0.06, failed rtol=1e-6 once)
  np.testing.assert_allclose(np.asarray(kl2), np.asarray(kl), rtol=2e-5, atol=1e-7)


def test_selector_loss_trains_only_the_gate_and_goes_down():
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, max_seq_len=128, attention="nsa", nsa=cfg_for())
  model = TransformerLM(cfg, rngs=nnx.Rngs(params=SEED % 10_000))
  tokens = jax.random.randint(key(1), (2, 128), 0, 64)
  graphdef, state = nnx.split(model)

  def sel_loss(st):
    return jnp.mean(nnx.merge(graphdef, st)(tokens, return_selector_loss=True)[1])

  grads = jax.grad(sel_loss)(state)
  moved = {jax.tree_util.keystr(p) for p, g in jax.tree_util.tree_leaves_with_path(grads)
           if float(jnp.max(jnp.abs(g))) > 0}
  assert moved and all("aux_w" in p for p in moved), moved
  # Adam on the selector loss alone, the gate's parameters only.
  gate = {p: x for p, x in zip(*[[jax.tree_util.keystr(p) for p, _ in
                                  jax.tree_util.tree_leaves_with_path(state)],
                                 jax.tree_util.tree_leaves(state)]) if "aux_w" in p}
  assert len(gate) == 2
  q, k, w_q, w_k, _ = inputs(cfg=cfg.nsa)
  loss = lambda w: jnp.mean(aux_selector.select(q, k, w[0], w[1], cfg.nsa)[1])
  w = (w_q, w_k)
  opt = optax.adam(3e-2)
  st = opt.init(w)
  step = jax.jit(lambda w, st: (lambda l, g: (l,) + (lambda u, s: (optax.apply_updates(w, u), s))(
      *opt.update(g, st, w)))(*jax.value_and_grad(loss)(w)))
  first = None
  for _ in range(60):
    value, w, st = step(w, st)
    first = float(value) if first is None else first
  assert float(loss(w)) < 0.7 * first, (first, float(loss(w)), SEED)


@pytest.mark.parametrize("selector", ["aux", "nsa"])
def test_given_blocks_give_the_same_output_on_every_path(selector):
  """Blocks given to the op (the "aux" gate's, or an override of the NSA selector's own choice:
  NSAAttention's select_edit) are what every implementation reads; the selector then does not
  matter. 8 blocks of 16 with n = 4 (2 forced): the gate's picks differ from NSA's own."""
  b, t = 1, 128
  ks = jax.random.split(key(2), 8)
  q = jax.random.normal(ks[0], (b, t, 4, 16))
  cfg = cfg_for(head_dim=16, head_dim_v=16, selector=selector)
  n = lambda i, s: jax.random.normal(ks[i], s)
  nc = (t - cfg.cmp_block) // cfg.cmp_stride + 1
  args = (q, n(1, (b, nc, 2, 16)), n(2, (b, nc, 2, 16)), n(3, (b, t, 2, 16)), n(4, (b, t, 2, 16)),
          n(5, (b, t, 2, 16)), n(6, (b, t, 2, 16)), jax.nn.sigmoid(n(7, (b, t, 4, 3))))
  idx, _ = aux_selector.select(q, args[3], n(1, (16, 4)), n(2, (16, 4)), cfg)
  outs = {impl: np.asarray(jax.jit(lambda *a, impl=impl: ops.nsa_attention(
      *a, cfg, implementation=impl, block_idx=idx))(*args)) for impl in ("reference", "xla",
                                                                         "pallas")}
  for impl in ("xla", "pallas"):
    np.testing.assert_allclose(outs[impl], outs["reference"], rtol=2e-5, atol=2e-5,
                               err_msg=f"{impl} (seed={SEED})")
  if selector != "aux":
    aux_out = ops.nsa_attention(*args, cfg_for(head_dim=16, head_dim_v=16), block_idx=idx,
                                implementation="reference")
    np.testing.assert_allclose(outs["reference"], np.asarray(aux_out), rtol=1e-6, atol=1e-6)
    own, aux = ops.nsa_attention(*args, cfg, implementation="reference", return_aux=True)
    assert (np.asarray(aux["block_idx"]) != np.asarray(idx)).any(), (
        f"the gate chose NSA's own blocks everywhere (seed={SEED}): nothing to override")
    assert not np.allclose(np.asarray(own), outs["reference"], atol=1e-4), (
        f"the given blocks were ignored (seed={SEED})")


def test_bad_uses_are_clear_errors():
  with pytest.raises(ValueError, match="num_local_blocks"):
    cfg_for(num_local_blocks=0)
  with pytest.raises(ValueError, match="aux_loss_weight"):
    cfg_for(aux_loss_weight=-1.0)
  q, k, *_ = inputs(b=1, t=32)
  t = 32
  nc = (t - 8) // 4 + 1
  z = lambda *s: jnp.zeros(s)
  args = (q, z(1, nc, 2, 8), z(1, nc, 2, 8), k, z(1, t, 2, 8), k, z(1, t, 2, 8), z(1, t, 4, 3))
  with pytest.raises(ValueError, match="needs block_idx"):
    reference.nsa_attention(*args, cfg_for())
  with pytest.raises(ValueError, match="no selection branch to use it"):
    reference.nsa_attention(*args, cfg_for(selector="nsa", branches=("cmp", "win")),
                            block_idx=jnp.zeros((1, t, 2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"block_idx has shape \(1, 32, 2, 3\)"):
    reference.nsa_attention(*args, cfg_for(selector="nsa"),
                            block_idx=jnp.zeros((1, t, 2, 3), jnp.int32))
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, max_seq_len=64, attention="nsa", nsa=cfg_for())
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="selector='aux'"):
    decode.prefill(model, jnp.zeros((1, 8), jnp.int32), 16)


def test_training_logs_the_selector_loss(tmp_path):
  from tests.test_train import small_config
  from nsa_jax.training import train
  c = small_config(num_steps=3)
  c.model.nsa.selector = "aux"
  c.model.nsa.num_selected = 4
  train.train_and_evaluate(c, str(tmp_path))
  recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  sel = [r["train/selector_loss"] for r in recs if "train/selector_loss" in r]
  assert sel and all(np.isfinite(sel)) and max(sel) > 0, recs[:2]
