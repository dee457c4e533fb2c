"""nsa_jax.reference against the literal oracle (tests/literal_nsa.py), plus causality, document
boundaries, limits, the Eq. 9 hand-worked example and NaN-freeness. CPU, float32, small shapes,
fresh random inputs each run (set NSA_TEST_SEED=<seed> to replay a failure; the seed is printed).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import reference
from nsa_jax.config import BRANCHES, NSAConfig

try:
  from tests import literal_nsa
except ImportError:  # pytest's default rootdir-less import puts tests/ itself on sys.path
  import literal_nsa

# float32 reference vs float64 oracle on O(1) values summed over a few hundred terms.
RTOL, ATOL = 1e-4, 2e-5
# Score gaps below this (but nonzero) are float32 near-ties: either choice is right there.
NEAR_TIE = 1e-5


def draw_seed():
  env = os.environ.get("NSA_TEST_SEED")
  return int(env) if env else int.from_bytes(os.urandom(4), "little")


@pytest.fixture
def rng():
  seed = draw_seed()
  print(f"NSA_TEST_SEED={seed}")  # pytest shows this when the test fails
  return np.random.default_rng(seed)


def assert_close(got, want, what, seed, rtol=RTOL, atol=ATOL):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape} (seed {seed})"
  err = np.max(np.abs(got - want), initial=0.0)
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                             err_msg=f"{what}: max abs err {err:.3g} (NSA_TEST_SEED={seed})")


def random_segments(rng, b, t):
  """[B, T] int32: 2-4 documents per row with random (not block-aligned) boundaries."""
  seg = np.zeros((b, t), np.int32)
  for bi in range(b):
    cuts = rng.choice(np.arange(1, t), size=min(int(rng.integers(1, 4)), t - 1), replace=False)
    for c in cuts:
      seg[bi, c:] += 1
  return seg


def oracle_kwargs(cfg: NSAConfig):
  return dict(l=cfg.cmp_block, d=cfg.cmp_stride, lsel=cfg.sel_block, n=cfg.num_selected,
              w=cfg.window, n_init=cfg.num_init_blocks, n_local=cfg.num_local_blocks,
              alignment=cfg.score_alignment, branches=cfg.branches)


def random_nsa_inputs(rng, cfg: NSAConfig, b, t):
  """Float32 numpy inputs of reference.nsa_attention in argument order (q, k_cmp, ..., gates)."""
  kh, dk, dv, nc = cfg.num_kv_heads, cfg.head_dim, cfg.dim_v, cfg.num_cmp_blocks(t)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return (f(b, t, cfg.num_heads, dk), f(b, nc, kh, dk), f(b, nc, kh, dv), f(b, t, kh, dk),
          f(b, t, kh, dv), f(b, t, kh, dk), f(b, t, kh, dv),
          rng.uniform(size=(b, t, cfg.num_heads, 3)).astype(np.float32))


# ----------------------------------------------------------------------------- oracle cases

@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  b: int
  t: int
  kh: int  # KV heads
  g: int  # query heads per KV group
  dk: int
  dv: int
  l: int
  d: int
  lsel: int
  n: int
  w: int
  n_init: int = 1
  n_local: int = 2
  alignment: str = "overlap"
  seg: bool = False

  def cfg(self):
    return NSAConfig(num_heads=self.kh * self.g, num_kv_heads=self.kh, head_dim=self.dk,
                     head_dim_v=self.dv, cmp_block=self.l, cmp_stride=self.d, sel_block=self.lsel,
                     num_selected=self.n, window=self.w, num_init_blocks=self.n_init,
                     num_local_blocks=self.n_local, score_alignment=self.alignment,
                     implementation="reference")


CASES = [
    # the paper's l, d, l' ratios; T = 330 is not a multiple of l' = 64
    Case("paper_blocks_overlap", 1, 330, 1, 4, 16, 8, 32, 16, 64, 4, 40),
    Case("paper_blocks_literal_docs", 1, 330, 1, 4, 16, 8, 32, 16, 64, 4, 40, alignment="literal",
         seg=True),
    Case("overlap_docs_b2", 2, 100, 2, 2, 8, 6, 8, 4, 16, 5, 12, seg=True),
    Case("literal_b2", 2, 70, 2, 2, 8, 6, 4, 2, 8, 5, 12, alignment="literal"),
    Case("l_eq_lsel_eq_d_g1", 1, 37, 3, 1, 6, 6, 4, 4, 4, 5, 8, seg=True),
    Case("g4_stride2_literal_docs", 1, 50, 1, 4, 4, 8, 8, 2, 8, 4, 5, alignment="literal", seg=True),
    Case("g16_docs", 1, 100, 1, 16, 8, 4, 16, 8, 32, 3, 20, seg=True),
    Case("t_below_l", 2, 11, 2, 2, 8, 4, 16, 8, 16, 3, 4),
    Case("one_local_no_init_docs", 1, 45, 2, 2, 6, 4, 4, 2, 8, 2, 6, n_init=0, n_local=1,
         alignment="literal", seg=True),
    Case("two_init_three_local_docs", 1, 64, 2, 1, 6, 5, 8, 4, 8, 6, 16, n_init=2, n_local=3,
         seg=True),
    Case("nothing_forced", 1, 48, 1, 2, 6, 4, 4, 2, 8, 3, 6, n_init=0, n_local=0),
]


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def case(request):
  """Inputs of one case and the oracle's answer on them (computed once: the oracle is slow)."""
  c = request.param
  seed = draw_seed()
  rng = np.random.default_rng(seed)
  cfg = c.cfg()
  inputs = random_nsa_inputs(rng, cfg, c.b, c.t)
  seg = random_segments(rng, c.b, c.t) if c.seg else None
  o, aux = literal_nsa.nsa_attention(*inputs, **oracle_kwargs(cfg), segment_ids=seg)
  ns = cfg.num_sel_blocks(c.t)
  extra = dict(
      p_random=rng.uniform(size=(c.b, c.t, cfg.num_heads, cfg.num_cmp_blocks(c.t))),
      idx_random=rng.integers(-1, ns, size=(c.b, c.t, c.kh, c.n)).astype(np.int32))
  return dict(c=c, cfg=cfg, seed=seed, inputs=inputs, seg=seg, o=o, aux=aux, **extra)


# Jitted entry points: one compile per shape is much cheaper than eager op-by-op dispatch.
compressed_attention = jax.jit(reference.compressed_attention, static_argnums=(3, 4))
selection_scores = jax.jit(reference.selection_scores, static_argnums=(1, 2, 3))
select_blocks = jax.jit(reference.select_blocks, static_argnums=(1,))
select_attention = jax.jit(reference.select_attention, static_argnums=(4,))
window_attention = jax.jit(reference.window_attention, static_argnums=(3,))
dense_causal_attention = jax.jit(reference.dense_causal_attention)
nsa_attention = jax.jit(reference.nsa_attention, static_argnames=("cfg", "return_aux"))


def jseg(data):
  return None if data["seg"] is None else jnp.asarray(data["seg"])


def test_compressed_attention_matches_oracle(case):
  q, k_cmp, v_cmp = case["inputs"][:3]
  cfg, aux, seed = case["cfg"], case["aux"], case["seed"]
  o, lse, p = compressed_attention(jnp.asarray(q), jnp.asarray(k_cmp), jnp.asarray(v_cmp),
                                             cfg.cmp_block, cfg.cmp_stride, jseg(case))
  assert_close(o, aux["outputs"]["cmp"], "o_cmp", seed)
  assert_close(p, aux["p_cmp"], "p_cmp", seed)
  want_lse = aux["lse_cmp"]
  lse = np.asarray(lse)
  assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse)), f"lse -inf pattern (seed {seed})"
  fin = np.isfinite(want_lse)
  assert_close(lse[fin], want_lse[fin], "lse_cmp", seed)


def test_selection_scores_match_oracle(case):
  """Eq. 9 + Eq. 10 on arbitrary non-negative p_cmp (not only softmax rows)."""
  c, cfg, seed = case["c"], case["cfg"], case["seed"]
  p = case["p_random"]
  got = selection_scores(jnp.asarray(p, jnp.float32), c.kh, c.t, cfg)
  want = literal_nsa.selection_scores(p.astype(np.float32), c.kh, c.t, c.l, c.d, c.lsel,
                                      c.alignment)
  assert_close(got, want, "selection scores", seed)


def test_select_blocks_matches_oracle_exactly(case):
  """Same float32 scores in, so the block indices must agree exactly (no tolerance)."""
  c, cfg, seed = case["c"], case["cfg"], case["seed"]
  p = np.asarray(compressed_attention(*(jnp.asarray(x) for x in case["inputs"][:3]),
                                                c.l, c.d, jseg(case))[2])
  scores = np.asarray(selection_scores(jnp.asarray(p), c.kh, c.t, cfg))
  got = np.asarray(select_blocks(jnp.asarray(scores), cfg, jseg(case)))
  want, _ = literal_nsa.select_blocks(scores, c.lsel, c.n, c.n_init, c.n_local, case["seg"])
  bad = np.argwhere(np.any(got != want, axis=-1))
  assert bad.size == 0, (f"block indices differ at (b, t, kv) {bad[:5].tolist()}: got "
                         f"{[got[tuple(i)].tolist() for i in bad[:3]]}, want "
                         f"{[want[tuple(i)].tolist() for i in bad[:3]]} (seed {seed})")


def test_select_attention_matches_oracle(case):
  """Oracle-chosen blocks, and random indices with -1 slots, repeats and future blocks."""
  c, seed = case["c"], case["seed"]
  q, _, _, k, v = (jnp.asarray(x) for x in case["inputs"][:5])
  for name, idx in (("oracle blocks", case["aux"]["block_idx"]), ("random blocks",
                                                                  case["idx_random"])):
    o, lse = select_attention(q, k, v, jnp.asarray(idx, jnp.int32), c.lsel, jseg(case))
    o_w, lse_w = literal_nsa.select_attention(*case["inputs"][:1], *case["inputs"][3:5], idx,
                                              c.lsel, case["seg"])
    assert_close(o, o_w, f"o_slc with {name}", seed)
    lse = np.asarray(lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_w)), f"lse_slc -inf pattern ({name})"
    assert_close(lse[np.isfinite(lse_w)], lse_w[np.isfinite(lse_w)], f"lse_slc {name}", seed)


def test_window_attention_matches_oracle(case):
  c, seed = case["c"], case["seed"]
  q, k, v = case["inputs"][0], case["inputs"][5], case["inputs"][6]
  o, lse = window_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), c.w,
                                      jseg(case))
  o_w, lse_w = literal_nsa.window_attention(q, k, v, c.w, case["seg"])
  assert_close(o, o_w, "o_win", seed)
  assert_close(lse, lse_w, "lse_win", seed)


def test_nsa_attention_matches_oracle(case):
  """The whole op, end to end from (q, compressed k/v, raw k/v, gates) to o and block indices."""
  c, cfg, seed, aux_w = case["c"], case["cfg"], case["seed"], case["aux"]
  o, aux = nsa_attention(*(jnp.asarray(x) for x in case["inputs"]), cfg=cfg,
                                   segment_ids=jseg(case), return_aux=True)
  got_idx, want_idx = np.asarray(aux["block_idx"]), aux_w["block_idx"]
  near = (aux_w["margin"] > 0) & (aux_w["margin"] <= NEAR_TIE)
  assert near.mean() < 0.02, f"too many float32 near-ties to check selection ({near.sum()})"
  bad = np.argwhere(np.any(got_idx != want_idx, axis=-1) & ~near)
  assert bad.size == 0, (f"block indices differ at (b, t, kv) {bad[:5].tolist()}: got "
                         f"{[got_idx[tuple(i)].tolist() for i in bad[:3]]}, want "
                         f"{[want_idx[tuple(i)].tolist() for i in bad[:3]]} (seed {seed})")
  o_w, outs_w = case["o"], aux_w["outputs"]
  if near.any():  # where float32 may break a near-tie either way, follow the reference's choice
    o_w, aux_w = literal_nsa.nsa_attention(*case["inputs"], **oracle_kwargs(cfg),
                                           segment_ids=case["seg"], block_idx=got_idx)
    outs_w = aux_w["outputs"]
  assert_close(o, o_w, "nsa o", seed)
  for name in BRANCHES:
    assert_close(aux["outputs"][name], outs_w[name], f"branch {name}", seed)
