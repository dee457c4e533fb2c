"""The memory-sane plain-JAX path (nsa_jax.xla) against the dense reference, forward and gradients.

Every test draws a fresh seed, printed in the failure message; NSA_TEST_SEED=<seed> replays it.
Block indices must equal the reference's exactly; outputs and gradients agree to 1e-5 of the
largest reference value in float32 (2e-2 in bfloat16). Exact indices need a well-posed top-n:
inputs whose kept and dropped blocks score within TIE_MARGIN of each other (float32 rounding; the
XLA path sums Eq. 9 in another order) are redrawn with the next seed (`draw`).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import reference, xla
from nsa_jax.config import NSAConfig
try:
  from tests.near_ties import TIE_MARGIN, redraw
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from near_ties import TIE_MARGIN, redraw

INPUTS = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")


def fresh_seed():
  replay = os.environ.get("NSA_TEST_SEED")
  return int(replay) if replay else int.from_bytes(os.urandom(4), "little")


def make_inputs(seed, cfg, batch, t, dtype=jnp.float32):
  """Random NSA inputs (dict keyed like INPUTS) for config cfg and length t (numpy draws: no
  per-shape compiles)."""
  rng = np.random.default_rng(seed)
  nc, kh = cfg.num_cmp_blocks(t), cfg.num_kv_heads
  shapes = dict(q=(t, cfg.num_heads, cfg.head_dim), k_cmp=(nc, kh, cfg.head_dim),
                v_cmp=(nc, kh, cfg.dim_v), k_slc=(t, kh, cfg.head_dim), v_slc=(t, kh, cfg.dim_v),
                k_win=(t, kh, cfg.head_dim), v_win=(t, kh, cfg.dim_v), gates=(t, cfg.num_heads, 3))
  x = {n: rng.standard_normal((batch,) + shapes[n], np.float32) for n in INPUTS}
  x["gates"] = 1 / (1 + np.exp(-x["gates"]))
  return {n: jnp.asarray(v, dtype) for n, v in x.items()}


def reference_scores(x, cfg, seg):
  """The reference's block scores [B, T, K, Ns] for inputs x (NSA's Eq. 9 or Quest's)."""
  if cfg.selector == "quest":
    return reference.quest_scores(x["q"], x["k_slc"], cfg.sel_block, seg)
  _, _, p = reference.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg.cmp_block,
                                           cfg.cmp_stride, seg)
  return reference.selection_scores(p, cfg.num_kv_heads, x["q"].shape[1], cfg)


def draw(cfg, batch, t, docs, dtype=jnp.float32, tries=20):
  """(seed, inputs, segment ids) from a fresh seed, moving on to the next seed while the top-n
  decision is a near-tie (reference.selection_cut_margin < TIE_MARGIN): there either block is a
  right answer in float32, so exact index checks would be a coin flip. Where T has more
  selection blocks than n, also while no query has to choose (margin inf: the documents'
  boundaries left every query n or fewer eligible blocks), so that top-n is really tested."""
  first = fresh_seed()
  choice = cfg.num_sel_blocks(t) > cfg.num_selected

  def make(i):
    seed = (first + i) % 2 ** 32
    return seed, make_inputs(seed, cfg, batch, t, dtype), make_segments(seed, batch, t, docs)

  if "slc" not in cfg.branches or cfg.selector == "aux":
    return make(0)
  return redraw(make, lambda d: reference.selection_cut_margin(
      reference_scores(d[1], cfg, d[2]), cfg, d[2]), tries,
      accept=lambda m: m < float("inf") or not choice, what=f"seeds from {first}")


def make_segments(seed, batch, t, num_docs):
  """[B, T] ids of num_docs contiguous documents with random boundaries (None for one doc)."""
  if num_docs == 1:
    return None
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, t), num_docs - 1, replace=False))
    rows.append(np.searchsorted(cuts, np.arange(t), side="right") + 7)  # ids need not start at 0
  return jnp.asarray(np.stack(rows), jnp.int32)


def assert_close(name, got, want, seed, rtol):
  """max |got - want| <= rtol * max(1, max |want|), NaN-free; -inf must match -inf."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (name, got.shape, want.shape, seed)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{name} seed={seed}")
  fin = np.isfinite(want)
  assert np.all(np.isfinite(got[fin])), f"{name}: non-finite values, seed={seed}"
  err = np.max(np.abs(got[fin] - want[fin]), initial=0.0)
  bound = rtol * max(1.0, np.max(np.abs(want[fin]), initial=0.0))
  assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g} (seed={seed})"


def outputs_and_grads(fn, args, seed):
  """One compile for the forward outputs and the gradient of sum(fn(*args)[0] * R) with respect to
  every arg, R a fixed random tensor: the gradient checks every output element's backward pass.
  fn returns (o, rest); returns (o, rest, grads)."""
  def loss(*a):
    o, rest = fn(*a)
    r = jax.random.normal(jax.random.key(seed ^ 0x5EED), o.shape, jnp.float32)
    return jnp.sum(o.astype(jnp.float32) * r), (o, rest)
  (_, (o, rest)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                                     has_aux=True))(*args)
  return o, rest, grads


def cfg_of(g, **kw):
  base = dict(num_heads=2 * g, num_kv_heads=2, head_dim=16, head_dim_v=8, cmp_block=16,
              cmp_stride=8, sel_block=32, num_selected=5, window=40, query_chunk=64)
  base.update(kw)
  return NSAConfig(**base)


# ----------------------------------------------------------------------------- Eq. 9 band sum

@pytest.mark.parametrize("l,d,lp", [(16, 8, 32), (32, 16, 64), (16, 16, 16), (24, 8, 48),
                                    (16, 4, 16)])
@pytest.mark.parametrize("alignment", ["overlap", "literal"])
def test_banded_remap_equals_dense_weights(l, d, lp, alignment):
  seed = fresh_seed()
  cfg = cfg_of(1, cmp_block=l, cmp_stride=d, sel_block=lp, num_selected=3,
               score_alignment=alignment)
  for t in (l, 5 * lp - 3, 7 * lp):
    nc, ns = cfg.num_cmp_blocks(t), cfg.num_sel_blocks(t)
    p = np.random.default_rng(seed + t).uniform(size=(3, nc)).astype(np.float32)
    w = reference.cmp_to_sel_weights(nc, ns, l, d, lp, alignment)
    np.testing.assert_allclose(xla.cmp_to_sel_banded(jnp.asarray(p), ns, cfg), p @ w, rtol=1e-6,
                               atol=1e-6, err_msg=f"T={t} seed={seed}")


# ----------------------------------------------------------------------------- branch functions

def compare(fast, ref, args, seed, names, rtol=1e-5):
  """Forward outputs (o and the rest) and gradients of fast vs ref; returns both rests and fast's
  gradients."""
  o, rest, grads = outputs_and_grads(fast, args, seed)
  o_r, rest_r, grads_r = outputs_and_grads(ref, args, seed)
  assert o.dtype == o_r.dtype
  assert_close("o", o, o_r, seed, rtol)
  for name, gg, gw in zip(names, grads, grads_r):
    assert gg.dtype == gw.dtype
    assert_close(f"d{name}", gg, gw, seed, rtol)
  return rest, rest_r, grads


# T is chosen so that Ns > n: top-n really chooses among the blocks that are not forced.
CMP_CASES = [  # (G, T, docs, overrides)
    (1, 250, 3, dict()),
    (4, 260, 2, dict(selector="quest", query_chunk=40)),
]


@pytest.mark.parametrize("g,t,docs,over", CMP_CASES)
def test_compressed_attention_and_select(g, t, docs, over):
  cfg = cfg_of(g, **over)
  seed, x, seg = draw(cfg, 2, t, docs)

  def ref(q, kc, vc, ks):
    o, lse, p = reference.compressed_attention(q, kc, vc, cfg.cmp_block, cfg.cmp_stride, seg)
    if cfg.selector == "nsa":
      scores = reference.selection_scores(p, cfg.num_kv_heads, t, cfg)
    else:
      scores = reference.quest_scores(q, ks, cfg.sel_block, seg)
    return o, (lse, reference.select_blocks(scores, cfg, seg))

  def fast(q, kc, vc, ks):
    o, lse, idx = xla.compressed_attention_and_select(q, kc, vc, ks, cfg, seg)
    return o, (lse, idx)

  names = ("q", "k_cmp", "v_cmp", "k_slc")
  (lse, idx), (lse_r, idx_r), _ = compare(fast, ref, tuple(x[n] for n in names), seed, names)
  np.testing.assert_array_equal(idx, idx_r, err_msg=f"block_idx seed={seed}")
  assert_close("lse_cmp", lse, lse_r, seed, 1e-5)


@pytest.mark.parametrize("g,t,lp,chunk,docs", [(1, 150, 32, 64, 3), (16, 97, 16, 16, 1)])
def test_select_attention(g, t, lp, chunk, docs):
  """Arbitrary index lists: unsorted, repeated, -1 and out-of-range slots, future blocks."""
  seed = fresh_seed()
  cfg = cfg_of(g)
  x = make_inputs(seed, cfg, 2, t)
  seg = make_segments(seed, 2, t, docs)
  ns = -(-t // lp)
  idx = jnp.asarray(np.random.default_rng(seed + 3).integers(-1, ns + 1, (2, t, 2, 6)), jnp.int32)
  scale = 0.3  # a non-default scale must be honoured
  fast = lambda q, k, v: xla.select_attention(q, k, v, idx, lp, seg, scale, query_chunk=chunk)
  ref = lambda q, k, v: reference.select_attention(q, k, v, idx, lp, seg, scale)
  lse, lse_r, _ = compare(fast, ref, (x["q"], x["k_slc"], x["v_slc"]), seed, ("q", "k", "v"))
  assert_close("lse_slc", lse, lse_r, seed, 1e-5)


@pytest.mark.parametrize("g,t,window,chunk,docs", [(4, 130, 1, 32, 1), (16, 90, 500, 32, 2)])
def test_window_attention(g, t, window, chunk, docs):
  seed = fresh_seed()
  cfg = cfg_of(g)
  x = make_inputs(seed, cfg, 2, t)
  seg = make_segments(seed, 2, t, docs)
  fast = lambda q, k, v: xla.window_attention(q, k, v, window, seg, query_chunk=chunk)
  ref = lambda q, k, v: reference.window_attention(q, k, v, window, seg)
  lse, lse_r, _ = compare(fast, ref, (x["q"], x["k_win"], x["v_win"]), seed, ("q", "k", "v"))
  assert_close("lse_win", lse, lse_r, seed, 1e-5)


# ----------------------------------------------------------------------------- the whole op

NSA_CASES = [  # (G, T, docs, overrides): T never a multiple of l' or of the chunk
    (4, 260, 2, dict(score_alignment="literal", query_chunk=48)),
    (16, 330, 1, dict(num_kv_heads=1, num_heads=16, head_dim=24, head_dim_v=16, cmp_block=32,
                      cmp_stride=16, sel_block=64, num_selected=4, window=50, query_chunk=40)),
    (4, 250, 3, dict(selector="quest", branches=("slc", "win"))),
    (1, 230, 3, dict(branches=("slc",), query_chunk=256)),  # cmp feeds only the selector; C > T
    (4, 12, 2, dict()),  # T < l: no compressed block at all
]


def run_nsa(cfg, t, docs, dtype, rtol):
  seed, x, seg = draw(cfg, 2, t, docs, dtype)
  fast = lambda *a: xla.nsa_attention(*a, cfg=cfg, segment_ids=seg, return_aux=True)
  ref = lambda *a: reference.nsa_attention(*a, cfg=cfg, segment_ids=seg, return_aux=True)
  aux, aux_r, grads = compare(fast, ref, tuple(x[n] for n in INPUTS), seed, INPUTS, rtol)
  if cfg.branches == ("cmp", "slc", "win") and t >= cfg.cmp_block:
    for name, g in zip(INPUTS, grads):
      assert float(jnp.max(jnp.abs(g))) > 0, f"no gradient reaches {name} (seed={seed})"
  assert set(aux) == set(aux_r) and set(aux["outputs"]) == set(aux_r["outputs"])
  if "slc" in cfg.branches:
    np.testing.assert_array_equal(aux["block_idx"], aux_r["block_idx"], err_msg=f"seed={seed}")
  for name in aux_r["outputs"]:
    assert_close(f"o_{name}", aux["outputs"][name], aux_r["outputs"][name], seed, rtol)


@pytest.mark.parametrize("g,t,docs,over", NSA_CASES)
def test_nsa_attention_matches_reference(g, t, docs, over):
  run_nsa(cfg_of(g, **over), t, docs, jnp.float32, 1e-5)


def test_nsa_attention_bfloat16():
  """bf16 inputs (softmax in float32): outputs and gradients within bf16 rounding of the
  reference (measured worst case ~0.8% of the largest value)."""
  run_nsa(cfg_of(4, query_chunk=48), 250, 2, jnp.bfloat16, 2e-2)


def test_nsa_attention_rejects_bad_shapes():
  cfg = cfg_of(2)
  x = make_inputs(fresh_seed(), cfg, 1, 64)
  x["k_slc"] = x["k_slc"][:, :-1]
  with pytest.raises(ValueError, match="k_slc"):
    xla.nsa_attention(*(x[n] for n in INPUTS), cfg=cfg)


# ----------------------------------------------------------------------------- memory at long T

def test_long_sequence_memory_stays_linear():
  """At T=8192 the compiled forward+backward needs less scratch memory than a quarter of ONE [T, T]
  float32 tensor (measured: ~42 MB vs 268 MB), while the dense reference's forward alone needs more
  than one per head (~3.4 GB), so the measure does see [T, T] tensors."""
  t = 8192
  cfg = NSAConfig(num_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=16, cmp_block=32,
                  cmp_stride=16, sel_block=64, num_selected=8, window=256, query_chunk=128)
  nc = cfg.num_cmp_blocks(t)
  f32 = lambda *s: jax.ShapeDtypeStruct((1,) + s, jnp.float32)
  kh, dk = cfg.num_kv_heads, cfg.head_dim
  args = (f32(t, cfg.num_heads, dk), f32(nc, kh, dk), f32(nc, kh, dk), f32(t, kh, dk),
          f32(t, kh, dk), f32(t, kh, dk), f32(t, kh, dk), f32(t, cfg.num_heads, 3))
  tt_bytes = t * t * 4

  def scratch(impl, with_grad):
    fn = lambda *a: jnp.sum(impl(*a, cfg=cfg))
    fn = jax.grad(fn, argnums=tuple(range(len(INPUTS)))) if with_grad else fn
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    if stats is None:
      pytest.fail("compiled memory_analysis() unavailable on this backend")
    return stats.temp_size_in_bytes

  dense = scratch(reference.nsa_attention, with_grad=False)
  assert dense > cfg.num_heads * tt_bytes, f"reference scratch {dense / 1e6:.0f} MB"
  sparse = scratch(xla.nsa_attention, with_grad=True)
  assert sparse < tt_bytes / 4, (
      f"xla fwd+bwd scratch {sparse / 1e6:.0f} MB vs one [T, T] f32 {tt_bytes / 1e6:.0f} MB")


def test_draw_redraws_near_ties(monkeypatch):
  """draw() skips inputs whose top-n cut is a near-tie: with the margin forced below TIE_MARGIN
  for the first seed only, it returns the next seed; selection_cut_margin measures the kept vs
  dropped gap (a crafted tie reads 0, a clear cut its relative gap, a cut-free row inf)."""
  cfg = cfg_of(1, num_selected=2, num_init_blocks=0, num_local_blocks=1, sel_block=4, cmp_stride=4,
               cmp_block=4)
  scores = jnp.asarray([[[[0.5, 0.3, 0.3, 0.9]], [[0.5, 0.2, 0.4, 0.9]]]], jnp.float32)  # T=2
  # positions 0, 1 are in block 0: block 0 forced (local), the rest not eligible: no cut at all
  assert reference.selection_cut_margin(scores, cfg) == float("inf")
  s16 = jnp.tile(jnp.asarray([0.5, 0.3, 0.3, 0.9], jnp.float32), (1, 16, 1, 1))  # T=16
  # t in block 3: block 3 forced, one more from 0-2: 0.5 kept, 0.3 dropped: gap 0.4
  assert abs(reference.selection_cut_margin(s16, cfg) - 0.4) < 1e-6
  tie = s16.at[..., 0].set(0.3)  # blocks 0, 1, 2 all 0.3: a tie at the cut
  assert reference.selection_cut_margin(tie, cfg) == 0.0
  # a document starting at position 8 (block 2): its queries see blocks 2-3 only, block 3 (own)
  # forced, block 2 kept or not by n = 2: nothing dropped there; the first document's queries
  # (blocks 0-1) have no choice either
  docs = jnp.asarray([[0] * 8 + [1] * 8], jnp.int32)
  assert reference.selection_cut_margin(tie, cfg, docs) == float("inf")
  cfg1 = cfg_of(1, num_selected=1, num_init_blocks=0, num_local_blocks=1, sel_block=4,
                cmp_stride=4, cmp_block=4)
  s2 = jnp.tile(jnp.asarray([0.5, 0.3, 0.2, 0.9], jnp.float32), (1, 16, 1, 1))
  two = jnp.asarray([[0] * 4 + [1] * 12], jnp.int32)  # second document from block 1
  # n = 1: only the own block, which is forced: the rest is dropped, but nothing is contested
  assert reference.selection_cut_margin(s2, cfg1, two) == float("inf")
  cfg3 = cfg_of(1, num_selected=2, num_init_blocks=0, num_local_blocks=1, sel_block=4,
                cmp_stride=4, cmp_block=4)
  # n = 2 in the second document (blocks 1-3): block 3's queries keep 1 of blocks 1, 2
  # (0.3 kept, 0.2 dropped: gap 1/3); block 0's score 0.5 is outside that document
  assert abs(reference.selection_cut_margin(s2, cfg3, two) - 1 / 3) < 1e-6
  calls = []
  real = reference.selection_cut_margin
  monkeypatch.setattr(reference, "selection_cut_margin",
                      lambda *a: calls.append(1) or (0.0 if len(calls) == 1 else real(*a)))
  monkeypatch.setenv("NSA_TEST_SEED", "1234")
  seed, _, _ = draw(cfg_of(1), 1, 100, 1)
  assert seed == 1235 and len(calls) == 2
