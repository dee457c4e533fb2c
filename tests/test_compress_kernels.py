"""Pallas compression-attention and top-n kernels (interpret mode on CPU) against nsa_jax.reference,
the whole op through ops.nsa_attention(implementation="pallas"), and CUDA lowering of each kernel.

Fresh random inputs every run; the seed is in every failure message.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np
import pytest

from nsa_jax import ops, reference
from nsa_jax.config import NSAConfig
from pallas_kernels.compress_attention import CmpTiling, compress_attention
from pallas_kernels import select_topn as topn_module
from pallas_kernels.select_topn import select_topn
try:
  from tests.gpu_mode import INTERPRET, ON_GPU
  from tests.near_ties import redraw
except ImportError:  # pytest's rootdir-less import puts tests/ itself on sys.path
  from gpu_mode import INTERPRET, ON_GPU
  from near_ties import redraw

jax.config.update("jax_default_matmul_precision", "highest")  # f32 reference on CPU, no bf16 passes


def _seed():
  return int.from_bytes(os.urandom(4), "little")


def _segments(key, b, t):
  """Two or three contiguous documents per row at random cut points."""
  cuts = jnp.sort(jax.random.randint(key, (b, 2), 1, t), axis=-1)
  pos = jnp.arange(t)[None, :]
  return ((pos >= cuts[:, :1]).astype(jnp.int32) + (pos >= cuts[:, 1:]).astype(jnp.int32))


def _close(a, b, tol, what, seed):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  fin = np.isfinite(b)
  assert np.array_equal(fin, np.isfinite(a)), f"{what}: -inf pattern differs (seed {seed})"
  err = np.max(np.abs(np.where(fin, a, 0.0) - np.where(fin, b, 0.0)), initial=0.0)
  scale = max(1.0, np.max(np.abs(np.where(fin, b, 0.0)), initial=0.0))
  assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol * scale:.3g} (seed {seed})"


# ----------------------------------------------------------------------------- compression

# Small key tiles so that T of a few hundred has key tiles whose dK/dV is split over several
# programs and query tiles that see a whole key tile (the dK/dV kernel skips the mask there).
SMALL = CmpTiling(block_k=16, bwd_block_k=16, bwd_rows=32, bwd_splits=3)


def _check_against_reference(ours, ref, q, kc, vc, w_o, w_l, seed):
  """Outputs (o, lse) and gradients of the kernels against the reference, float32 tolerances."""
  @jax.jit  # one compiled program: interpreted kernels run eagerly are much slower
  def outputs_and_grads(q, kc, vc):
    (o, lse), vjp = jax.vjp(ours, q, kc, vc)
    (ro, rlse), ref_vjp = jax.vjp(ref, q, kc, vc)
    cts = (w_o, jnp.where(jnp.isfinite(rlse), w_l, 0.0))  # lse's cotangent is exercised too
    return (o, lse, vjp(cts)), (ro, rlse, ref_vjp(cts))

  (o, lse, grads), (ro, rlse, ref_grads) = outputs_and_grads(q, kc, vc)
  _close(o, ro, 1e-5, "o", seed)
  _close(lse, rlse, 1e-5, "lse", seed)
  for name, a, r in zip(("dq", "dk_cmp", "dv_cmp"), grads, ref_grads):
    _close(a, r, 1e-4, name, seed)


@pytest.mark.parametrize("g,kv,t,use_seg,tiling", [
    (1, 2, 70, True, None), (4, 2, 90, False, None), (16, 1, 61, True, None),
    (4, 2, 300, False, SMALL), (16, 1, 260, False, SMALL), (3, 1, 200, False, SMALL),
    (2, 2, 240, True, SMALL), (4, 1, 301, False, CmpTiling(block_k=16, bwd_block_k=16, bwd_splits=1,
                                                            bwd_unmasked_tiles=False)),
    # 8 rows (G=1): the tile wraps copies of its rows up to 16, which only the mask drops.
    (1, 2, 160, False, CmpTiling(block_k=16, bwd_block_k=16, bwd_rows=8, bwd_splits=2)),
    # dq and dK/dV with their own tiles: dq walks 32 keys a step, dK/dV has 16-row tiles.
    # T = 328: 40 compressed blocks, padded to 64 only because dq's 32-key steps count in the
    # padding (16-key tiles alone would pad to 48), and dq walks two 32-key steps.
    (4, 2, 328, True, CmpTiling(block_k=16, dq_block_k=32, bwd_block_k=16, bwd_rows=32,
                                dkv_rows=16, bwd_splits=2)),
    # dq added atomically by the dK/dV programs (split three ways), G = 3: copied rows
    (3, 1, 200, True, dataclasses.replace(SMALL, bwd_fused_dq=True)),
])
def test_compress_attention_fwd_and_grads(g, kv, t, use_seg, tiling):
  seed = _seed()
  ks = jax.random.split(jax.random.key(seed), 7)
  b, dk, dv, l, d = 1, 32, 16, 16, 8
  nc = (t - l) // d + 1
  q = jax.random.normal(ks[0], (b, t, g * kv, dk))
  kc = jax.random.normal(ks[1], (b, nc, kv, dk))
  vc = jax.random.normal(ks[2], (b, nc, kv, dv))
  seg = _segments(ks[3], b, t) if use_seg else None
  w_o = jax.random.normal(ks[4], (b, t, g * kv, dv))
  w_l = jax.random.normal(ks[5], (b, t, g * kv))

  ours = lambda q, kc, vc: compress_attention(q, kc, vc, l, d, seg, interpret=INTERPRET, tiling=tiling)
  ref = lambda q, kc, vc: reference.compressed_attention(q, kc, vc, l, d, seg)[:2]

  _check_against_reference(ours, ref, q, kc, vc, w_o, w_l, seed)


def test_dkv_launch_rule(monkeypatch):
  """4 warps / 3 stages (8 / 3 where the unmasked path runs with segment ids) only where measured
  and known to fit (16-bit inputs, heads <= 64, tiles of <= 128 real rows, <= 64 keys); explicit
  dkv_* settings win; the rest keep the backward's launch; and the dK/dV pallas_call gets what
  the rule says: with ids (8, 3), with ids and the path off (4, 3)."""
  from pallas_kernels import compress_attention as ca
  assert ca.dkv_launch(CmpTiling(), 16, 64, 64, 2) == ca.SMALL_HEAD_DKV_LAUNCH == (4, 3)
  assert ca.dkv_launch(CmpTiling(), 16, 64, 64, 2, True) == ca.SMALL_HEAD_DKV_LAUNCH_IDS == (8, 3)
  assert ca.dkv_launch(CmpTiling(), 16, 128, 128, 2, True) == (8, 2)
  assert ca.dkv_launch(CmpTiling(dkv_num_warps=4), 16, 64, 64, 2, True) == (4, 3)
  assert ca.dkv_launch(CmpTiling(), 16, 192, 128, 2) == (8, 2)
  assert ca.dkv_launch(CmpTiling(), 16, 128, 128, 2) == (8, 2)
  assert ca.dkv_launch(CmpTiling(), 16, 64, 64, 4) == (8, 2)  # float32: twice the bytes a stage
  assert ca.dkv_launch(CmpTiling(bwd_rows=256), 16, 64, 64, 2) == (8, 2)  # did not fit (H200)
  assert ca.dkv_launch(CmpTiling(), 256, 64, 64, 2) == (8, 2)  # 256 padded heads: 256-row tiles
  assert ca.dkv_launch(CmpTiling(bwd_block_k=128), 16, 64, 64, 2) == (8, 2)
  assert ca.dkv_launch(CmpTiling(dkv_num_warps=8, dkv_num_stages=2), 16, 64, 64, 2) == (8, 2)
  assert ca.dkv_launch(CmpTiling(dkv_num_stages=1), 16, 192, 128, 2) == (8, 1)
  seen = {}
  real = ca.plgpu.CompilerParams

  def spy(**kw):
    seen.setdefault("params", []).append(kw)
    return real(**kw)
  monkeypatch.setattr(ca.plgpu, "CompilerParams", spy)
  q = jnp.zeros((1, 64, 16, 64), jnp.bfloat16)
  kc = jnp.zeros((1, 7, 1, 64), jnp.bfloat16)  # T = 64, l = 16, d = 8: 7 compressed blocks
  jax.jit(jax.grad(lambda q: jnp.sum(compress_attention(q, kc, kc, 16, 8, interpret=True)[0]
                                     .astype(jnp.float32)))).trace(q)
  assert {"num_warps": 4, "num_stages": 3} in seen["params"], seen  # the dK/dV call's launch
  seen.clear()
  seg = jnp.zeros((1, 64), jnp.int32).at[:, 40:].set(1)
  jax.jit(jax.grad(lambda q: jnp.sum(compress_attention(q, kc, kc, 16, 8, segment_ids=seg,
                                                        interpret=True)[0]
                                     .astype(jnp.float32)))).trace(q)
  assert {"num_warps": 8, "num_stages": 3} in seen["params"], seen  # ... with segment ids
  seen.clear()
  jax.jit(jax.grad(lambda q: jnp.sum(compress_attention(
      q, kc, kc, 16, 8, segment_ids=seg, interpret=True,
      tiling=CmpTiling(bwd_unmasked_with_ids=False))[0].astype(jnp.float32)))).trace(q)
  assert {"num_warps": 4, "num_stages": 3} in seen["params"], seen  # ids, the path off


# ----------------------------------------------------------------------------- top-n

TOPN_VARIANTS = ("CARRY_BOUNDS", "FIRST_FILL", "CARRY_VEC", "RANK_MERGE")


def _set_topn_variants(monkeypatch, variants):
  """"on": every optional code path of the top-n kernel forced on; "off": every one off;
  "rank_fill": the rank merge with FIRST_FILL (loop-free merge, matmul carry); "carry": the
  vector carry with the loop merge."""
  if variants == "default":  # what ships: every flag at its module default (the measured rules)
    return
  on = {"on": TOPN_VARIANTS, "off": (), "rank_fill": ("RANK_MERGE", "FIRST_FILL"),
        "carry": ("CARRY_VEC",), "two_pass": (), "two_pass_sliced": ("CARRY_VEC",),
        "head_first": (), "two_pass_head_first": ()}[variants]
  for name in TOPN_VARIANTS:
    monkeypatch.setattr(topn_module, name, name in on)
  # HEAD_FIRST: the head sum before the band (float32 band on the token rows, vector carry)
  monkeypatch.setattr(topn_module, "HEAD_FIRST", variants.endswith("head_first"))
  if variants == "two_pass_head_first":  # also the pick's rounds unrolled, fewer rows a program
    monkeypatch.setattr(topn_module, "PICK_LOOP", False)
    monkeypatch.setattr(topn_module, "PICK_ELEMS", 512)
  # TWO_PASS: scores to a buffer, then a pick kernel; "sliced" caps the buffer at 16 KB, so the
  # tests' sequences are walked in several token slices (the last one partly past T)
  monkeypatch.setattr(topn_module, "TWO_PASS", variants.startswith("two_pass"))
  if variants == "two_pass_sliced":
    monkeypatch.setattr(topn_module, "TWO_PASS_MAX_BYTES", 1 << 14)


def _topn_rule(vals, n):
  """reference.topn_blocks on candidate scores [rows, S] (block j = column j), every block
  eligible and none forced: the n best by (score desc, block asc), ascending, -1 for -inf and
  empty slots."""
  cfg = NSAConfig(num_heads=1, num_kv_heads=1, head_dim=16, num_selected=n, num_init_blocks=0,
                  num_local_blocks=0)
  rows, s = vals.shape
  cur, first = jnp.full((1, rows), s - 1), jnp.zeros((1, 1), jnp.int32)  # all eligible
  return np.asarray(reference.topn_blocks(jnp.asarray(vals)[None, :, None, :], cur, first,
                                          cfg))[0, :, 0]


@pytest.mark.parametrize("n,fill", [(1, False), (3, False), (5, False), (16, False), (16, True)])
@pytest.mark.parametrize("merge", ["_merge", "_rank_merge"])
def test_merges_keep_the_topn_rule_through_ties_and_infinities(n, fill, merge):
  """Both chunk merges, outside a kernel, after every chunk: scores drawn from {-inf, +inf, four
  small integers} so that ties (between chunks, inside a chunk, among forced +inf blocks) decide
  most slots, which random normal scores in the kernel tests almost never do."""
  rng = np.random.default_rng(_seed())
  rows, width, chunks = 64, 16, 5
  npad = 1 << (n - 1).bit_length()
  pool = np.array([-np.inf, np.inf, 0.0, 1.0, 2.0, 3.0], np.float32)
  vals = rng.choice(pool, size=(rows, chunks * width), p=[.15, .1, .2, .2, .2, .15])
  fn = jax.jit(functools.partial(getattr(topn_module, merge), n=n))
  a_val = jnp.full((rows, npad), -jnp.inf, jnp.float32)
  a_idx = jnp.full((rows, npad), -1, jnp.int32)
  c0 = 0
  if fill:  # FIRST_FILL's start: the first chunk is the list
    a_val, a_idx, c0 = jnp.asarray(vals[:, :width]), jnp.broadcast_to(
        jnp.arange(width, dtype=jnp.int32), (rows, width)), 1
  for ci in range(c0, chunks):
    j = jnp.broadcast_to(ci * width + jnp.arange(width, dtype=jnp.int32), (rows, width))
    a_val, a_idx = fn(a_val, a_idx, jnp.asarray(vals[:, ci * width:(ci + 1) * width]), j)
    got = np.asarray(topn_module._ascending(a_val, a_idx, n=n))[:, :n]
    want = _topn_rule(vals[:, :(ci + 1) * width], n)
    bad = np.argwhere((got != want).any(axis=1))
    assert bad.size == 0, (merge, ci, vals[bad[0, 0], :(ci + 1) * width], got[bad[0, 0]],
                           want[bad[0, 0]])
    assert np.all(np.asarray(a_val)[:, n:] == -np.inf) and np.all(np.asarray(a_idx)[:, n:] == -1)


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("n,kh,prow", [(1, 1, 8), (5, 2, 8), (16, 1, 8), (16, 2, 1)])
def test_two_pass_pick_keeps_the_topn_rule_through_ties_and_infinities(n, kh, prow, loop):
  """TWO_PASS's pick kernel (interpreted on CPU, compiled on a GPU) on score rows drawn from {-inf,
  +inf, four small integers}: the n best by (score desc, block asc) among the blocks up to the
  row's own (cur = its token // l'; later columns hold garbage, NaN here, and must be ignored),
  ascending, -1 for -inf and empty slots. Rounds unrolled and in a loop (PICK_LOOP, the
  default), 8 rows a program and 1 (what rows of >= PICK_ELEMS scores get)."""
  rng = np.random.default_rng(_seed())
  nsp, rows, tq, sel_block = 64, 32, 4, 2
  t = rows // kh + 3  # the last rows' tokens sit past T: clamped to T - 1
  pool = np.array([-np.inf, np.inf, 0.0, 1.0, 2.0, 3.0], np.float32)
  vals = rng.choice(pool, size=(1, rows, nsp), p=[.15, .05, .2, .2, .2, .2]).astype(np.float32)
  tile0 = 2  # the slice starts at token tile0 * tq
  tok = np.minimum(tile0 * tq + np.arange(rows) // kh, t - 1)
  cur = tok // sel_block
  garbage = np.arange(nsp)[None, None, :] > cur[None, :, None]
  vals_in = np.where(garbage, np.nan, vals).astype(np.float32)
  npad = 1 << (n - 1).bit_length()
  call = pl.pallas_call(
      functools.partial(topn_module._pick_kernel, rows=prow, kh=kh, t=t, tq=tq,
                        sel_block=sel_block, n=n, npad=npad, nsp=nsp, loop=loop),
      grid=(rows // prow, 1, 1),
      in_specs=[pl.BlockSpec((1,), lambda *_: (0,)),
                pl.BlockSpec((None, rows, nsp), lambda i, j, bb: (bb, 0, 0))],
      out_specs=pl.BlockSpec((None, rows, npad), lambda i, j, bb: (bb, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((1, rows, npad), jnp.int32), interpret=INTERPRET)
  got = np.asarray(call(jnp.array([tile0], jnp.int32), jnp.asarray(vals_in)))[0, :, :n]
  for r in range(rows):
    live = [(-vals[0, r, j], j) for j in range(cur[r] + 1) if vals[0, r, j] > -np.inf]
    want = sorted(j for _, j in sorted(live)[:n])
    want = want + [-1] * (n - len(want))
    assert got[r].tolist() == want, (r, vals[0, r, :cur[r] + 1], got[r], want)


def test_pick_elems_must_be_a_power_of_two(monkeypatch):
  monkeypatch.setattr(topn_module, "PICK_ELEMS", 3000)
  q, kc, lse = jnp.zeros((1, 64, 4, 16)), jnp.zeros((1, 7, 1, 16)), jnp.zeros((1, 64, 4))
  with pytest.raises(ValueError, match="PICK_ELEMS=3000.*power of two"):
    select_topn(q, kc, lse, block=16, stride=8, sel_block=16, num_selected=2, interpret=True)


def test_two_pass_slices_bound_the_buffer(monkeypatch):
  """The score buffer [B, tokens * K, NSP] float32 stays within TWO_PASS_MAX_BYTES: whole tiles of
  tokens per slice, all of T when it fits (so the "two_pass_sliced" variant above really walks
  several slices, and 64k at the paper's heads takes 4)."""
  assert topn_module.two_pass_slice(1, 65536, 4, 4, 1024) == 16384  # 256 MB / 16 KB a token
  assert topn_module.two_pass_slice(8, 8192, 4, 1, 128) == 8192  # the 8k layer: one slice
  monkeypatch.setattr(topn_module, "TWO_PASS_MAX_BYTES", 1 << 14)
  assert topn_module.two_pass_slice(2, 300, 4, 2, 16) == 64  # 256 B a token
  assert topn_module.two_pass_slice(2, 30, 4, 2, 16) == 32  # all of T, in whole tiles
  assert topn_module.two_pass_slice(2, 300, 4, 2, 4096) == 4  # at least one tile


def test_two_pass_default_rule_and_which_kernels_run(monkeypatch):
  """TWO_PASS by default from TWO_PASS_MIN_CHUNKS chunks a row (1 since 2026-12-03: every length,
  timed faster at each; 33 before) and not below; the flag overrides the rule both ways. Checked
  on the traced program: the two-pass path launches the scores and pick kernels, the merge path
  the one top-n kernel."""
  monkeypatch.setattr(topn_module, "TWO_PASS", None)
  assert topn_module.TWO_PASS_MIN_CHUNKS == 1
  assert all(topn_module.uses_two_pass(c) for c in (1, 8, 32, 33, 64, 128))
  monkeypatch.setattr(topn_module, "TWO_PASS_MIN_CHUNKS", 33)  # the rule itself, at the old line
  assert [topn_module.uses_two_pass(c) for c in (1, 8, 32, 33, 64, 128)] == [False] * 3 + [True] * 3
  h, dk, l, d, lp = 4, 16, 8, 4, 16

  def kernels(t):  # the kernel names in the traced program of select_topn at T = t
    f = lambda q, kc, lse: select_topn(q, kc, lse, block=l, stride=d, sel_block=lp, num_selected=4)
    text = str(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((1, t, h, dk), jnp.float32),
                                 jax.ShapeDtypeStruct((1, (t - l) // d + 1, 1, dk), jnp.float32),
                                 jax.ShapeDtypeStruct((1, t, h), jnp.float32)))
    return {k for k in ("nsa_select_topn_scores", "nsa_select_topn_pick") if k in text}

  both = {"nsa_select_topn_scores", "nsa_select_topn_pick"}
  assert kernels(33 * 16 * lp) == both and kernels(32 * 16 * lp) == set()  # 33 vs 32 chunks
  monkeypatch.setattr(topn_module, "TWO_PASS_MIN_CHUNKS", 1)  # the default: one chunk is enough
  seen, real = [], topn_module._topn_kernel  # HEAD_FIRST = None follows TWO_PASS
  monkeypatch.setattr(topn_module, "_topn_kernel", lambda *a, **k: seen.append(
      (k.get("two_pass", False), k["head_first"])) or real(*a, **k))
  assert kernels(16 * lp) == both and kernels(32 * 16 * lp) == both
  assert set(seen) == {(True, True)}, seen
  monkeypatch.setattr(topn_module, "TWO_PASS", False)
  seen.clear()
  assert kernels(16 * lp) == set() and set(seen) == {(False, False)}, seen
  monkeypatch.setattr(topn_module, "HEAD_FIRST", True)  # a set flag wins over the rule
  seen.clear()
  kernels(16 * lp)
  assert set(seen) == {(False, True)}, seen
  monkeypatch.setattr(topn_module, "HEAD_FIRST", None)
  monkeypatch.setattr(topn_module, "TWO_PASS", None)
  monkeypatch.setattr(topn_module, "_topn_kernel", real)
  monkeypatch.setattr(topn_module, "TWO_PASS_MIN_CHUNKS", 33)
  monkeypatch.setattr(topn_module, "TWO_PASS", False)
  assert kernels(33 * 16 * lp) == set()
  monkeypatch.setattr(topn_module, "TWO_PASS", True)
  assert kernels(32 * 16 * lp) == both


def test_select_topn_asks_the_rule_with_its_chunks_and_head_dim(monkeypatch):
  """select_topn passes the row's chunk count, d_k and n to chunk_paths (traced only)."""
  seen = []
  real = topn_module.chunk_paths
  monkeypatch.setattr(topn_module, "chunk_paths",
                      lambda c, dk, n: seen.append((c, dk, n)) or real(c, dk, n))
  t, h, dk, l, d, lp = 2304, 4, 32, 16, 8, 16  # 144 selection blocks: 9 chunks of 16
  nc = (t - l) // d + 1
  jax.eval_shape(lambda q, kc, lse: select_topn(q, kc, lse, block=l, stride=d, sel_block=lp,
                                                num_selected=4),
                 jax.ShapeDtypeStruct((1, t, h, dk), jnp.float32),
                 jax.ShapeDtypeStruct((1, nc, 1, dk), jnp.float32),
                 jax.ShapeDtypeStruct((1, t, h), jnp.float32))
  assert seen == [(9, dk, 4)]


def test_topn_paths_follow_the_measured_rule(monkeypatch):
  for name in ("CARRY_VEC", "RANK_MERGE"):
    monkeypatch.setattr(topn_module, name, None)
  lo, hi = topn_module.RANK_MERGE_CHUNKS
  dk = topn_module.CARRY_VEC_MIN_DK
  paths = topn_module.chunk_paths
  cv = topn_module.CARRY_VEC_MIN_CHUNKS
  assert lo <= cv <= hi
  assert paths(lo - 1, dk) == paths(hi + 1, dk) == (False, False)
  assert paths(cv, dk) == paths(hi, 2 * dk) == (True, True)
  assert paths(lo, dk) == paths(cv - 1, 2 * dk) == (False, True)  # short rows: no vector carry
  assert paths(cv, dk // 2) == (False, True)
  assert paths(cv, dk, n=topn_module.RANK_MERGE_MAX_N + 1) == (False, False)  # unmeasured n
  l0, l1 = topn_module.LONG_ROW_CHUNKS  # 64k rows: both paths only at the larger head dim
  big = topn_module.LONG_ROW_MIN_DK
  assert hi < l0 <= l1
  assert paths(l0, big) == paths(l1, 2 * big) == (True, True)
  assert paths(l0, big - 16) == paths(l1 + 1, big) == (False, False)
  assert paths(l1, big, n=topn_module.RANK_MERGE_MAX_N + 1) == (False, False)
  # the measured shapes themselves (topn_paths_h200.md): rows of 8 chunks (8k) at d_k 64 and 192,
  # 16 (16k) and 32 (32k) at 192, 64 (64k) at 192 and 128, 128 (128k, unmeasured) at 192
  assert paths(8, 64) == paths(8, 192) == (False, True)
  assert paths(16, 64) == (False, True) and paths(16, 192) == paths(32, 128) == (True, True)
  assert paths(64, 192) == (True, True) and paths(64, 128) == (False, False)
  assert paths(128, 192) == (False, False)
  monkeypatch.setattr(topn_module, "RANK_MERGE", False)  # a set flag wins over the rule
  assert paths(cv, dk) == (True, False)


@pytest.mark.parametrize("g,kv,t,l,d,lp,n,align,use_seg,n_local", [
    (4, 2, 300, 16, 8, 32, 5, "overlap", False, 2),
    (1, 3, 200, 16, 8, 32, 4, "literal", True, 2),
    (16, 1, 260, 32, 16, 64, 3, "overlap", True, 2),
    (8, 1, 333, 16, 8, 16, 6, "literal", False, 2),
    (16, 1, 400, 16, 8, 16, 4, "overlap", False, 2),  # G=16 over several 32-block chunks
    # n = 16 = the chunk width: the first chunk becomes the list without a merge
    (16, 1, 700, 16, 8, 16, 16, "overlap", True, 2),
    (4, 2, 600, 16, 8, 16, 16, "literal", False, 2),
    # fewer forced local blocks: the blocks a token only partly sees then count, so the
    # visibility mask (and its skipping on fully seen chunks) shows in the indices
    (16, 1, 400, 16, 8, 16, 4, "overlap", False, 0),
    (4, 2, 520, 32, 16, 64, 6, "overlap", False, 1),
    (2, 2, 300, 16, 8, 32, 5, "literal", True, 0),
    # literal alignment with l >= 3d: Eq. 9 carries two columns into the next chunk
    (4, 1, 700, 32, 8, 32, 5, "literal", False, 1),
    # l = d: nothing is carried
    (2, 2, 200, 8, 8, 16, 4, "overlap", False, 1),
    (2, 2, 200, 8, 8, 16, 4, "literal", True, 1),
])
@pytest.mark.parametrize("variants", ["default", "off", "on", "rank_fill", "carry", "two_pass",
                                      "two_pass_sliced", "head_first", "two_pass_head_first"])
def test_topn_equals_reference_selection(g, kv, t, l, d, lp, n, align, use_seg, n_local, variants,
                                         monkeypatch):
  _set_topn_variants(monkeypatch, variants)
  seed = _seed()
  ks = jax.random.split(jax.random.key(seed), 4)
  b, dk = 2, 32
  cfg = NSAConfig(num_heads=g * kv, num_kv_heads=kv, head_dim=dk, head_dim_v=None, cmp_block=l,
                  cmp_stride=d, sel_block=lp, num_selected=n, window=64, score_alignment=align,
                  num_local_blocks=n_local)
  nc = cfg.num_cmp_blocks(t)
  q = jax.random.normal(ks[0], (b, t, g * kv, dk))
  kc = jax.random.normal(ks[1], (b, nc, kv, dk))
  seg = _segments(ks[2], b, t) if use_seg else None
  _, lse, p = reference.compressed_attention(q, kc, kc, l, d, seg)
  scores = reference.selection_scores(p, kv, t, cfg)
  want = reference.select_blocks(scores, cfg, seg)
  got = jax.jit(lambda q, kc, lse, seg: select_topn(
      q, kc, lse, block=l, stride=d, sel_block=lp, num_selected=n, num_local=n_local,
      alignment=align, segment_ids=seg, interpret=INTERPRET))(q, kc, lse, seg)
  assert got.shape == want.shape and got.dtype == jnp.int32
  assert_same_selection(want, got, scores, seed)


@pytest.mark.parametrize("g,kv,elems", [(3, 2, 4096), (64, 1, 4096), (12, 1, 16)])
def test_topn_defaults_with_padded_heads_one_token_tiles_and_one_row_picks(g, kv, elems,
                                                                           monkeypatch):
  """The shipped top-n (TWO_PASS with HEAD_FIRST, looped pick) where the tile pads the group's
  heads (G = 3 -> 4 rows a token, G = 12 -> 16), holds one token (G = 64: tq = 1), and where
  the pick takes one row a program (PICK_ELEMS below a row's width), against the reference."""
  monkeypatch.setattr(topn_module, "PICK_ELEMS", elems)
  _topn_against_reference(g, kv, t=300, n=4)


@pytest.mark.parametrize("g,kv,dk,sliced", [(16, 1, 32, False), (4, 2, 32, False),
                                             (1, 2, 32, False), (16, 1, 32, True),
                                             (4, 1, 32, True), (16, 1, 128, False)])
def test_topn_128_row_tiles_match_reference(g, kv, dk, sliced, monkeypatch):
  """The scores kernel with 128-row tiles (the default for long rows at d_k = 128, G = 16: 8
  tokens of 16 heads; also 32 of 4, 128 of 1) against the reference, over several chunks; sliced:
  the score buffer capped so that TWO_PASS walks several token slices, as at 32k-64k."""
  if sliced:
    monkeypatch.setattr(topn_module, "TWO_PASS_MAX_BYTES", 1 << 14)
  _topn_against_reference(g, kv, t=600, n=5, dk=dk, rows=128)


def _topn_against_reference(g, kv, *, t, n, dk=32, **topn_kw):
  """select_topn (shipped flags, plus topn_kw) on fresh random inputs against the reference:
  B = 1, l = 16, d = 8, l' = 16."""
  seed = _seed()
  ks = jax.random.split(jax.random.key(seed), 2)
  b, l, d, lp = 1, 16, 8, 16
  cfg = NSAConfig(num_heads=g * kv, num_kv_heads=kv, head_dim=dk, cmp_block=l, cmp_stride=d,
                  sel_block=lp, num_selected=n, window=64)
  q = jax.random.normal(ks[0], (b, t, g * kv, dk))
  kc = jax.random.normal(ks[1], (b, cfg.num_cmp_blocks(t), kv, dk))
  _, lse, p = reference.compressed_attention(q, kc, kc, l, d)
  scores = reference.selection_scores(p, kv, t, cfg)
  want = reference.select_blocks(scores, cfg)
  got = jax.jit(lambda q, kc, lse: select_topn(q, kc, lse, block=l, stride=d, sel_block=lp,
                                               num_selected=n, interpret=INTERPRET,
                                               **topn_kw))(q, kc, lse)
  assert_same_selection(want, got, scores, seed)


def test_topn_default_rows_rule(monkeypatch):
  """128 rows only where measured faster (d_k = 128, G = 16, rows of >= 32 chunks, TWO_PASS);
  64 else; NSA_TOPN_ROWS forces a size and refuses one the kernel cannot tile; select_topn and
  supports() take the rule's choice when no rows are given, and the kernel's tile gets it."""
  monkeypatch.setattr(topn_module, "ROWS_ENV", None)
  monkeypatch.setattr(topn_module, "TWO_PASS", None)
  rule = topn_module.default_rows
  assert rule(64, 128, 16) == rule(32, 128, 16) == 128
  assert rule(31, 128, 16) == rule(64, 192, 16) == rule(64, 64, 16) == rule(64, 128, 4) == 64
  monkeypatch.setattr(topn_module, "TWO_PASS", False)
  assert rule(64, 128, 16) == 64
  monkeypatch.setattr(topn_module, "TWO_PASS", None)
  monkeypatch.setattr(topn_module, "ROWS_ENV", 32)
  assert rule(64, 128, 16) == rule(8, 64, 4) == 32
  for bad in ("8", "96", "x", "-64"):
    monkeypatch.setenv("NSA_TOPN_ROWS", bad)
    with pytest.raises(ValueError, match="NSA_TOPN_ROWS=.*power of two >= 16"):
      topn_module._rows_env()
  monkeypatch.setenv("NSA_TOPN_ROWS", "")
  assert topn_module._rows_env() is None
  monkeypatch.setattr(topn_module, "ROWS_ENV", None)
  seen = []
  real = topn_module.ca.tile_shape
  monkeypatch.setattr(topn_module.ca, "tile_shape",
                      lambda g, rows: seen.append(rows) or real(g, rows))
  for t, dk, h, want in ((32768, 128, 16, 128), (16384, 128, 16, 64), (32768, 192, 16, 64),
                         (32768, 128, 4, 64)):
    q = jax.ShapeDtypeStruct((1, t, h, dk), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((1, t // 16 - 1, 1, dk), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, t, h), jnp.float32)
    seen.clear()
    assert topn_module.supports(q.shape, kc.shape, 32, 16, 64) == (True, "ok")
    jax.eval_shape(lambda q, kc, lse: select_topn(q, kc, lse, block=32, stride=16, sel_block=64,
                                                  num_selected=16, interpret=True), q, kc, lse)
    assert seen and set(seen) == {want}, (t, dk, h, seen)


def assert_same_selection(want, got, scores, seed):
  """Block lists [B, T, K, n] equal the reference's, except where two blocks' scores tie to
  float32 rounding: the kernel sums Eq. 9's terms in another order than the reference, so scores
  ~1 ulp apart may rank either way (seed 653196340: 0.2871552 vs 0.28715527). Exact ties break
  the same way. A differing row must keep the same slots valid, the same order, no repeats, and
  swap only blocks whose reference scores agree to 1e-5 relative; at most 0.2% of the rows (at
  least 2) may differ at all."""
  want, got, scores = np.asarray(want), np.asarray(got), np.asarray(scores)
  rows = [tuple(r) for r in np.argwhere(np.any(want != got, axis=-1))]
  where = lambda r: f"row {r}: want {want[r]} got {got[r]} (seed {seed})"
  assert len(rows) <= max(2, want[..., 0].size // 500), f"{len(rows)} rows differ; first {where(rows[0])}"
  for r in rows:
    w, g = want[r], got[r]
    assert np.array_equal(w >= 0, g >= 0), "valid slots differ, " + where(r)
    wv, gv = w[w >= 0], g[g >= 0]
    assert len(set(gv.tolist())) == len(gv), "a block repeats, " + where(r)
    assert np.array_equal(np.argsort(wv, kind="stable"), np.argsort(gv, kind="stable")), \
        "order differs, " + where(r)
    lost, extra = sorted(set(wv.tolist()) - set(gv.tolist())), sorted(set(gv.tolist()) - set(wv.tolist()))
    assert lost, "same blocks in another order, " + where(r)
    np.testing.assert_allclose(np.sort(scores[r][extra]), np.sort(scores[r][lost]), rtol=1e-5,
                               atol=1e-7, err_msg="not a near-tie, " + where(r))


# ----------------------------------------------------------------------------- whole op

def whole_op_case(ks, dv=16, dtype=jnp.float32):
  """A small whole-op case (T=100, 4/2 heads, d_k = 32, d_v = dv, l=16, d=8, l'=16, n=4, w=24):
  cfg and the op's 8 inputs in dtype, drawn from keys ks[0..7]."""
  b, t, h, kv, dk = 1, 100, 4, 2, 32
  cfg = NSAConfig(num_heads=h, num_kv_heads=kv, head_dim=dk, head_dim_v=dv, cmp_block=16,
                  cmp_stride=8, sel_block=16, num_selected=4, window=24)
  nc = cfg.num_cmp_blocks(t)
  shapes = [(b, t, h, dk), (b, nc, kv, dk), (b, nc, kv, dv), (b, t, kv, dk), (b, t, kv, dv),
            (b, t, kv, dk), (b, t, kv, dv)]
  args = [jax.random.normal(k, s, dtype) for k, s in zip(ks, shapes)]
  args.append(jax.nn.sigmoid(jax.random.normal(ks[7], (b, t, h, 3))).astype(dtype))
  return cfg, args


def test_whole_op_pallas_matches_reference():
  """The whole op through the Pallas kernels (interpreter) against the reference: identical block
  indices, loss and gradients. Inputs whose top-n cut is a float32 near-tie (kept and dropped
  blocks within 1e-5 relative: the kernels sum Eq. 9 in another order) are redrawn."""
  first = _seed()
  b, t = 1, 100

  def make(i):
    seed = (first + i) % 2 ** 32
    ks = jax.random.split(jax.random.key(seed), 10)
    cfg, args = whole_op_case(ks)
    return seed, ks, cfg, args, _segments(ks[8], b, t)

  def margin(case):
    _, _, cfg, args, seg = case
    _, _, p = reference.compressed_attention(args[0], args[1], args[2], cfg.cmp_block,
                                             cfg.cmp_stride, seg)
    return reference.selection_cut_margin(
        reference.selection_scores(p, cfg.num_kv_heads, t, cfg), cfg, seg)

  seed, ks, cfg, args, seg = redraw(make, margin, what=f"seeds from {first}")
  h, dv = cfg.num_heads, cfg.dim_v
  w = jax.random.normal(ks[9], (b, t, h, dv))

  def run(impl):
    def f(*a):
      o, aux = ops.nsa_attention(*a, cfg, segment_ids=seg, implementation=impl, return_aux=True)
      return jnp.sum(o * w), aux["block_idx"]
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(8)), has_aux=True))(*args)

  (val, idx), grads = run("pallas")
  (rval, ridx), rgrads = run("reference")
  assert np.array_equal(idx, ridx), f"block indices differ (seed {seed})"
  _close(val, rval, 1e-5, "loss", seed)
  names = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")
  for name, a, r in zip(names, grads, rgrads):
    _close(a, r, 1e-4, "d" + name, seed)


# On the H200 (jax 0.11.2) XLA refused or aborted every layout but the window's at 64k
# (benchmarks/results/streams_h200.md); an abort would take the pytest worker with it, so the GPU
# runs only the window layouts. The interpreter (CI) runs all of them.
_XLA_REFUSES = pytest.mark.skipif(ON_GPU, reason="XLA 0.11.2 refuses or aborts cmp / slc "
                                  "streams and scheduling groups on the GPU (streams_h200.md)")


def _stream_case(ks, case):
  """whole_op_case with segment ids in float32 ("seg_f32": on a GPU the window branch runs the
  Pallas window kernels, not one flat cuDNN call), or without segment ids in bfloat16 with d_k = d_v ("bf16_equal_dims": on a GPU it is
  one cuDNN call, the only window call ops._on_stream puts on a stream there)."""
  if case == "seg_f32":
    return (*whole_op_case(ks), _segments(ks[8], 1, 100), 1e-6)
  cfg, args = whole_op_case(ks, dv=32, dtype=jnp.bfloat16)
  # the one-stream and stream runs execute the same kernels; cuDNN's backward may add in
  # another order between runs (bf16 outputs)
  return cfg, args, None, 2e-2 if ON_GPU else 1e-6


@pytest.mark.parametrize("streams,group,case", [
    ({"win": 1}, False, "seg_f32"),
    ({"win": 1}, False, "bf16_equal_dims"),
    pytest.param({"cmp": 2, "slc": 3, "win": 1}, False, "seg_f32", marks=_XLA_REFUSES),
    pytest.param({"win": 1, "slc": 2}, True, "seg_f32", marks=_XLA_REFUSES)])
def test_whole_op_on_branch_streams_equals_one_stream(streams, group, case, monkeypatch, caplog):
  """ops.BRANCH_STREAMS (NSA_BRANCH_STREAMS) wraps branches in compute_on("gpu_stream:N"): the
  lowering carries one stream annotation per chosen branch, and loss, block indices and every
  gradient equal the one-stream path (the interpreter ignores the annotation, so this checks the
  wrapping: arguments, outputs, gradients through compute_on, not the GPU's overlap). On a GPU a
  window call that is not one flat cuDNN call (segment ids here) stays on the default stream,
  with a warning: XLA 0.11.2 refused its nested jits inside a stream."""
  seed = _seed()
  ks = jax.random.split(jax.random.key(seed), 10)
  cfg, args, seg, tol = _stream_case(ks, case)
  w = jax.random.normal(ks[9], (1, 100, cfg.num_heads, cfg.dim_v))

  def runner():  # a fresh function each time: jit caches traces per function
    def f(*a):
      o, aux = ops.nsa_attention(*a, cfg, segment_ids=seg, implementation="pallas",
                                 return_aux=True)
      return jnp.sum(o.astype(jnp.float32) * w), aux["block_idx"]
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(8)), has_aux=True))
  monkeypatch.setattr(ops, "BRANCH_STREAMS", {})  # the baseline: one stream whatever the env says
  monkeypatch.setattr(ops, "STREAM_GROUP", False)
  assert "_xla_stream_annotation" not in runner().lower(*args).as_text()
  (val, idx), grads = runner()(*args)
  monkeypatch.setattr(ops, "BRANCH_STREAMS", streams)
  monkeypatch.setattr(ops, "STREAMS_OFF_GPU", True)
  monkeypatch.setattr(ops, "STREAM_GROUP", group)
  ops.log_once.cache_clear()  # log_once: let this test see the warning
  with caplog.at_level(logging.WARNING, logger="nsa_jax"):
    lowered = runner().lower(*args)
  text = lowered.as_text()
  assert ('_scheduling_group_id = "1"' in text) == group
  win_flat = case == "bf16_equal_dims" or not ON_GPU
  for branch, stream in streams.items():
    want = branch != "win" or win_flat
    assert (f'_xla_stream_annotation = "{stream}"' in text) == want, (
        f"{branch} on stream {stream}: annotation {'missing' if want else 'present'}")
  assert ("not applied to this call" in caplog.text) == (not win_flat)
  (sval, sidx), sgrads = lowered.compile()(*args)
  assert np.array_equal(idx, sidx)
  _close(sval, val, tol, "loss", seed)
  for name, a, r in zip(("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"),
                        sgrads, grads):
    _close(a, r, tol, "d" + name, seed)


def test_window_stream_only_for_one_flat_cudnn_call(monkeypatch, caplog):
  """On a GPU (on_gpu patched) the window branch counts as flat only for bf16/fp16, no segment
  ids and d_k == d_v (the rule's cuDNN, unpadded); a call that is not flat runs fn directly (no compute_on), with a warning."""
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  q = jnp.zeros((1, 8, 2, 32), jnp.bfloat16)
  v_eq, v_ne = jnp.zeros((1, 8, 1, 32), jnp.bfloat16), jnp.zeros((1, 8, 1, 16), jnp.bfloat16)
  seg = jnp.zeros((1, 8), jnp.int32)
  assert ops._window_flat(q, v_eq, None) == (True, "")
  flat, why = ops._window_flat(q, v_eq, seg)
  assert not flat and "plain JAX" in why
  assert not ops._window_flat(q.astype(jnp.float32), v_eq, None)[0]
  flat, why = ops._window_flat(q, v_ne, None)
  assert not flat and "d_k != d_v" in why  # the rule runs the Pallas kernels there
  monkeypatch.setenv("NSA_WINDOW_BACKEND", "cudnn")
  flat, why = ops._window_flat(q, v_ne, None)
  assert not flat and "pads d_v=16 to d_k=32" in why
  monkeypatch.delenv("NSA_WINDOW_BACKEND")
  monkeypatch.setattr(ops, "BRANCH_STREAMS", {"win": 3})
  ops.log_once.cache_clear()
  calls = []
  with caplog.at_level(logging.WARNING, logger="nsa_jax"):
    out = ops._on_stream("win", lambda x: calls.append(x) or x + 1, 1, flat=False, why="because")
  assert out == 2 and calls == [1]
  assert "win:3 not applied to this call: because" in caplog.text


def test_window_call_site_passes_its_flatness_to_the_stream_wrapper(monkeypatch):
  """nsa_attention hands _on_stream the window call's flatness (off a GPU: not flat, "plain
  JAX"), so a GPU run can keep such a call off the stream."""
  seen = {}
  real = ops._on_stream
  monkeypatch.setattr(ops, "_on_stream", lambda branch, fn, *a, **kw: (
      seen.setdefault(branch, kw), real(branch, fn, *a, **kw))[1])
  ks = jax.random.split(jax.random.key(_seed()), 10)
  cfg, args = whole_op_case(ks)
  jax.eval_shape(lambda *a: ops.nsa_attention(*a, cfg, implementation="pallas"), *args)
  assert seen["win"]["flat"] is False and "plain JAX" in seen["win"]["why"], seen


@pytest.mark.parametrize("spec,want", [("", {}), ("win:1", {"win": 1}),
                                       (" cmp:2 , win:1 ", {"cmp": 2, "win": 1})])
def test_branch_streams_parse(spec, want):
  assert ops._parse_streams(spec) == want


@pytest.mark.parametrize("spec", ["window:1", "win", "win:0", "win:x", "win:-1"])
def test_branch_streams_refuse_bad_entries(spec):
  with pytest.raises(ValueError, match="NSA_BRANCH_STREAMS entry .*branch:stream"):
    ops._parse_streams(spec)
  with pytest.raises(ValueError, match="names branch 'win' twice"):
    ops._parse_streams("win:1,cmp:2,win:3")


# ----------------------------------------------------------------------------- CUDA lowering

def _abstract_gpu():
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=(
      jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu",
                                  num_cores=132))))


@pytest.mark.parametrize("h,kv,dk,dv,use_seg,variants", [(64, 4, 192, 128, False, "off"),
                                                          (8, 8, 64, 32, True, "off"),
                                                          (64, 4, 192, 128, False, "on"),
                                                          (64, 4, 192, 128, False, "rank_fill"),
                                                          (64, 4, 128, 128, False, "two_pass"),
                                                          (8, 8, 64, 32, True, "two_pass_sliced"),
                                                          (64, 4, 128, 128, False, "head_first"),
                                                          (8, 8, 64, 32, True,
                                                           "two_pass_head_first")])
def test_kernels_lower_for_cuda(h, kv, dk, dv, use_seg, variants, monkeypatch):
  _set_topn_variants(monkeypatch, variants)
  t, l, d, lp = 1024, 32, 16, 64
  nc = (t - l) // d + 1
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  q, kc, vc = spec(1, t, h, dk), spec(1, nc, kv, dk), spec(1, nc, kv, dv)
  seg = spec(1, t, dt=jnp.int32)

  def fwd(q, kc, vc, seg):
    s = seg if use_seg else None
    o, lse = compress_attention(q, kc, vc, l, d, s)
    return o, select_topn(q, kc, lse, block=l, stride=d, sel_block=lp, num_selected=16,
                          segment_ids=s)

  def bwd(q, kc, vc, seg):
    s = seg if use_seg else None
    f = lambda q, kc, vc: jnp.sum(compress_attention(q, kc, vc, l, d, s)[0].astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1, 2))(q, kc, vc)

  topn_kernels = (("nsa_select_topn_scores", "nsa_select_topn_pick")
                  if variants.startswith("two_pass") else ("nsa_select_topn",))
  with _abstract_gpu():
    for fn, kernels in ((fwd, ("nsa_cmp_fwd",) + topn_kernels), (bwd, ("nsa_cmp_dq",
                                                                       "nsa_cmp_dkv"))):
      text = jax.jit(fn).trace(q, kc, vc, seg).lower(lowering_platforms=("cuda",)).as_text()
      for name in kernels:
        assert name in text, f"{name} missing from the CUDA lowering"


def test_bad_ids_and_shapes_raise_with_the_fix():
  """Inputs the kernels would silently misread (found by an audit): float segment ids (truncated:
  documents 0.0 and 0.5 merged), segment ids of the wrong shape, a k_cmp that does not match T, a
  transposed lse; each raises and names the problem, through the kernels and through the op."""
  b, t, h, kh, d, l, s = 2, 80, 4, 1, 16, 16, 8
  nc = (t - l) // s + 1
  key = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(key[0], (b, t, h, d))
  kc = jax.random.normal(key[1], (b, nc, kh, d))
  vc = jax.random.normal(key[2], (b, nc, kh, d))
  seg = jnp.asarray(np.repeat([[0, 1]], t // 2, axis=1).reshape(1, t).repeat(b, 0), jnp.int32)
  run = lambda **kw: compress_attention(q, kc, vc, l, s, interpret=INTERPRET, **kw)
  o, lse = run(segment_ids=seg)  # int ids: fine
  with pytest.raises(TypeError, match="segment_ids has dtype float32.*integers"):
    run(segment_ids=seg.astype(jnp.float32) / 2)
  with pytest.raises(ValueError, match=r"segment_ids has shape \(1, 80\), expected"):
    run(segment_ids=seg[:1])
  topn = lambda **kw: select_topn(kw.pop("q", q), kw.pop("kc", kc), kw.pop("lse", lse), block=l,
                                  stride=s, sel_block=32, num_selected=3, interpret=INTERPRET, **kw)
  assert topn(segment_ids=seg).shape == (b, t, kh, 3)
  with pytest.raises(TypeError, match="segment_ids has dtype"):
    topn(segment_ids=seg.astype(jnp.float32))
  with pytest.raises(ValueError, match="k_cmp has 6 compressed blocks, expected 9"):
    topn(kc=kc[:, :6])
  with pytest.raises(ValueError, match=r"lse has shape \(2, 4, 80\), expected"):
    topn(lse=lse.transpose(0, 2, 1))
  cfg = NSAConfig(num_heads=h, num_kv_heads=kh, head_dim=d, head_dim_v=d, cmp_block=l,
                  cmp_stride=s, sel_block=32, num_selected=3, window=16)
  kv = jax.random.normal(key[1], (b, t, kh, d))
  gates = jnp.ones((b, t, h, 3))
  with pytest.raises(TypeError, match="segment_ids has dtype float32"):
    ops.nsa_attention(q, kc, vc, kv, kv, kv, kv, gates, cfg, segment_ids=seg.astype(jnp.float32),
                      implementation="xla")
  # The op checks shapes before it picks a path: a 3-D q through "pallas" (what "auto" picks on a
  # GPU) used to fail inside the path choice with "not enough values to unpack".
  for impl in ("pallas", "xla", "reference"):
    with pytest.raises(ValueError, match=r"q must be \[batch, time, heads, head_dim\]"):
      ops.nsa_attention(q[..., 0], kc, vc, kv, kv, kv, kv, gates, cfg, implementation=impl)
    # an integer q gave a truncated integer output through "xla" and "reference"
    with pytest.raises(ValueError, match="q has dtype int32; NSA attention needs floating"):
      ops.nsa_attention(q.astype(jnp.int32), kc, vc, kv, kv, kv, kv, gates, cfg,
                        implementation=impl)


def test_topn_takes_every_shape_the_selection_and_compression_kernels_take():
  """A `block_idx` override (select_edit, selection_from_layer) skips the top-n, yet the whole op's
  Pallas check (ops._pallas_support) still asks the top-n about the shape: that costs nothing
  only while the top-n refuses no shape the other two kernels take. Checked over group sizes, head
  dims, lengths (both tile-row rules) and block geometries; a shape all three refuse is fine."""
  from pallas_kernels import select_attention as sk
  from pallas_kernels import compress_attention as ck
  taken = 0
  for g, kh, dk, t in itertools.product((1, 2, 3, 4, 8, 16, 32), (1, 4), (16, 64, 96, 128, 192, 256),
                                        (64, 1000, 4096, 65536)):
    for l, d, lp in ((32, 16, 64), (16, 8, 32), (64, 64, 64), (16, 16, 16), (32, 16, 128),
                     (32, 8, 64)):
      q, kv = (1, t, g * kh, dk), (1, t, kh, dk)
      kc = (1, max(0, (t - l) // d + 1), kh, dk)
      if not (sk.supports(q, kv, kv, 16, lp, "triton")[0] and ck.supports(q, kc, kc)[0]):
        continue
      taken += 1
      assert topn_module.supports(q, kc, l, d, lp) == (True, "ok"), (g, kh, dk, t, l, d, lp)
  assert taken > 500, taken  # the grid reached the kernels' supported shapes


def test_doc_bounds_and_runs_match_brute_force():
  """run_starts / run_lasts: the first / last position of each token's run of equal ids (ids that
  recur, are negative or one per row: every run is its own document); doc_bounds: the query lower
  bound per position (its run's start) and, per compressed block, its document's last position
  (-1 for mixed and padding blocks)."""
  from pallas_kernels import compress_attention as ca
  seed = _seed()
  rng = np.random.default_rng(seed)
  b, t, block, stride = 3, 97, 8, 4
  seg = rng.integers(-2, 3, (b, t))
  seg = np.where(rng.random((b, t)) < 0.7, np.maximum.accumulate(seg, axis=1), seg)
  seg[2] = 5  # one document
  seg_j = jnp.asarray(seg, jnp.int32)

  def run_of(r, i):  # brute force: walk out from i while the id stays the same
    lo, hi = i, i
    while lo > 0 and seg[r, lo - 1] == seg[r, i]:
      lo -= 1
    while hi < t - 1 and seg[r, hi + 1] == seg[r, i]:
      hi += 1
    return lo, hi

  starts, lasts = jax.jit(ca.run_starts)(seg_j), jax.jit(ca.run_lasts)(seg_j)
  want = [[run_of(r, i) for i in range(t)] for r in range(b)]
  np.testing.assert_array_equal(starts, [[w[0] for w in row] for row in want], err_msg=str(seed))
  np.testing.assert_array_equal(lasts, [[w[1] for w in row] for row in want], err_msg=str(seed))
  assert any(len(set(row)) < np.sum(row[1:] != row[:-1]) + 1 for row in seg), seed  # ids recur
  nc = ca.num_cmp_blocks(t, block, stride)
  ncp = nc + 5
  bseg, bpure = ca.block_meta(seg_j, ncp, block, stride)
  qlo, khi = ca.doc_bounds(seg_j, bpure, nc=nc, stride=stride, has_seg=True)
  np.testing.assert_array_equal(qlo, starts)
  for r in range(b):
    for j in range(ncp):
      toks = seg[r, j * stride:j * stride + block]
      pure = j < nc and np.all(toks == toks[0])
      assert khi[r, j] == (run_of(r, j * stride)[1] if pure else -1), (r, j, seed)


@pytest.mark.parametrize("block,stride,tq,bk", [(8, 4, 4, 2), (1, 1, 8, 4), (32, 16, 2, 1)])
def test_unmasked_ends_match_brute_force(block, stride, tq, bk):
  """compress_attention.unmasked_ends: per dK/dV key tile, the end of the run of query tiles from
  its first fully causal one on whose every query shares the key tile's one document (each block
  pure, all of one id, none padding). Brute force over ids that recur, are negative or one per row."""
  from pallas_kernels import compress_attention as ca
  seed = _seed()
  rng = np.random.default_rng(seed)
  b, t = 4, 157
  runs = rng.integers(1, 70, (b, t))
  run_of = np.stack([np.searchsorted(np.cumsum(r), np.arange(t), side="right") for r in runs])
  seg = np.take_along_axis(rng.integers(-2, 2, (b, t)), run_of, axis=1)
  seg[3] = 7  # one document
  nc = ca.num_cmp_blocks(t, block, stride)
  ncp = -(-(nc + 3) // bk) * bk
  seg_j = jnp.asarray(seg, jnp.int32)
  bseg, bpure = ca.block_meta(seg_j, ncp, block, stride)
  got = ca.unmasked_ends(seg_j, bseg, bpure, nc=nc, block=block, stride=stride, tq=tq, bk=bk)
  nonempty = 0
  for r in range(b):
    for j in range(ncp // bk):
      blocks = range(j * bk, j * bk + bk)
      pure = all(c < nc for c in blocks)
      if pure:
        toks = np.concatenate([seg[r, c * stride:c * stride + block] for c in blocks])
        pure = np.all(toks == toks[0])
      i = f = -(-((j * bk + bk - 1) * stride + block - 1) // tq)
      while pure and (i + 1) * tq <= t and np.all(seg[r, i * tq:(i + 1) * tq] == toks[0]):
        i += 1
      assert np.all(got[r, j * bk:(j + 1) * bk] == i), (r, j, got[r, j * bk], i, seed)
      nonempty += i > f
  assert nonempty > 0, seed  # the runs were reached


def _packed_case(seed, t, g, runs, l=8, d=4, b=2, kv=1, dk=32, dv=16):
  """Compression inputs with packed documents: runs of runs[0]..runs[1]-1 tokens, each given one
  of 3 ids (so ids recur after other documents); weights for the outputs' cotangents."""
  ks = jax.random.split(jax.random.key(seed), 7)
  nc = (t - l) // d + 1
  q = jax.random.normal(ks[0], (b, t, g * kv, dk))
  kc = jax.random.normal(ks[1], (b, nc, kv, dk))
  vc = jax.random.normal(ks[2], (b, nc, kv, dv))
  lens = jax.random.randint(ks[3], (b, t), *runs)
  starts = jnp.cumsum(lens, axis=1) - lens
  run_of = jnp.sum(jnp.arange(t)[None, :, None] >= starts[:, None, :], axis=-1) - 1
  seg = jnp.take_along_axis(jax.random.randint(ks[6], (b, t), 0, 3), run_of, axis=1)
  w_o = jax.random.normal(ks[4], (b, t, g * kv, dv))
  w_l = jax.random.normal(ks[5], (b, t, g * kv))
  return q, kc, vc, seg, w_o, w_l


def _packed_check(seed, tiling, q, kc, vc, seg, w_o, w_l, l=8, d=4):
  ours = lambda q, kc, vc: compress_attention(q, kc, vc, l, d, seg, interpret=INTERPRET,
                                              tiling=tiling)
  ref = lambda q, kc, vc: reference.compressed_attention(q, kc, vc, l, d, seg)[:2]
  _check_against_reference(ours, ref, q, kc, vc, w_o, w_l, seed)


@pytest.mark.parametrize("fused", [False, True])
def test_compress_kernels_skip_the_mask_inside_one_document(fused):
  """The dK/dV kernel's unmasked path with segment ids (unmasked_ends; bwd_unmasked_with_ids)
  in the compression kernels, and the forward / dq kernels' id split (seg_unmasked_steps): l = 8,
  d = 4, the query-tile walk split in 3 parts, with and without the fused dq. Long documents with
  recurring ids, so that runs exist (checked), against the reference."""
  from pallas_kernels import compress_attention as ca
  seed = _seed()
  t, g, l, d = 300, 4, 8, 4
  nc = (t - l) // d + 1
  q, kc, vc, seg, w_o, w_l = _packed_case(seed, t, g, (60, 200))
  tiling = CmpTiling(block_k=16, bwd_block_k=4, bwd_rows=16, rows=16, bwd_splits=3,
                     bwd_fused_dq=fused)
  tq, bk = ca.tile_shape(g, tiling.dkv_rows or tiling.bwd_rows)[0], tiling.bwd_block_k
  ncp = -(-nc // 16) * 16  # compress_attention pads to the lcm of the key steps (16 here)
  bseg, bpure = ca.block_meta(seg.astype(jnp.int32), ncp, l, d)
  ends = ca.unmasked_ends(seg.astype(jnp.int32), bseg, bpure, nc=nc, block=l, stride=d, tq=tq,
                          bk=bk)[:, ::bk]
  first = -(-((jnp.arange(ncp // bk) * bk + bk - 1) * d + l - 1) // tq)
  assert int(jnp.sum(jnp.minimum(ends, t // tq) > first[None])) > 0, seed  # the path is reached
  _packed_check(seed, tiling, q, kc, vc, seg, w_o, w_l)


def test_compress_kernels_take_ids_as_run_bounds():
  """CmpTiling.seg_bounds in the compression kernels: a block is in a row's document iff it
  starts at or after the row's run start (the causal test bounds its end), so blocks that
  straddle a start are out, as the id test's purity rule has it. Ids that never recur (each
  run's start as its id), short and long runs, l = 8, d = 4: against the reference, forward and
  gradients."""
  from pallas_kernels import compress_attention as ca
  seed = _seed()
  q, kc, vc, seg, w_o, w_l = _packed_case(seed, 300, 4, (3, 90))
  tiling = CmpTiling(block_k=16, bwd_block_k=4, bwd_rows=16, rows=16, bwd_splits=3,
                     seg_bounds=True)
  _packed_check(seed, tiling, q, kc, vc, ca.run_starts(seg.astype(jnp.int32)), w_o, w_l)


def test_compress_split_runs_start_inside_blocks_and_ids_recur():
  """The forward / dq id split (seg_unmasked_steps) at fixed runs (not drawn): run starts 129 and
  257 lie inside compressed blocks (l = 8, d = 4) right after a key step's boundary (16 blocks =
  64 tokens: 129 = 2 * 64 + 1, so the step from which ids can be skipped is the one after the
  block that straddles the start), and id 0 recurs (its second run starts at 257, its first at
  0: the run's start, not the id's first position, bounds the id-free steps). Checked: the runs'
  last tiles reach id-free steps; forward and gradients against the reference, with the split and
  without it."""
  from pallas_kernels import compress_attention as ca
  seed = _seed()
  t, g, l, d = 400, 4, 8, 4
  q, kc, vc, _, w_o, w_l = _packed_case(seed, t, g, (60, 200), b=1)
  bounds = [0, 57, 129, 257, t]  # ids 0, 1, 2, 0
  seg = jnp.asarray(np.repeat([0, 1, 2, 0], np.diff(bounds))[None], jnp.int32)
  tiling = CmpTiling(block_k=16, bwd_block_k=4, bwd_rows=16, rows=16, bwd_splits=2)
  tq, bk = ca.tile_shape(g, tiling.rows)[0], tiling.block_k
  for start, end in ((129, 257), (257, t)):
    last = (end - tq) // tq * tq + tq - 1  # the last position of the run's last whole tile
    steps = -(-ca.num_cmp_blocks(last + 1, l, d) // bk)
    mid = -(-(-(-start // d)) // bk)
    assert (start // d) % bk == 0 and start % d and mid < steps, (start, mid, steps)
  _packed_check(seed, tiling, q, kc, vc, seg, w_o, w_l)
  _packed_check(seed, dataclasses.replace(tiling, seg_unmasked_steps=False), q, kc, vc, seg, w_o,
                w_l)


@pytest.mark.parametrize("t,g", [(300, 4), (301, 3)])  # 301, G = 3: a partial last tile, padded heads
def test_compress_kernels_skip_other_documents_exactly(t, g):
  """Many short documents whose ids recur later in the row: the kernels' per-document loop bounds
  (doc_bounds) skip only keys and queries that the mask would drop. Forward and gradients against
  the reference; small tiles so that the bounds cut the walks."""
  seed = _seed()
  q, kc, vc, seg, w_o, w_l = _packed_case(seed, t, g, (8, 60))
  tiling = CmpTiling(block_k=16, bwd_block_k=16, bwd_rows=16, rows=16, bwd_splits=2)
  _packed_check(seed, tiling, q, kc, vc, seg, w_o, w_l)
