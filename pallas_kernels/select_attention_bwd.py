"""Backward kernels of the selected-block attention (Pallas Triton-lowered).

dq: the forward's tiles again (query tile x its selected blocks), recomputing p from the saved lse.
dK/dV: KV-block-centric over the inverse selection map. `_common.inverse_lists` sorts the
(block, query) entries once per step and cuts each block's entry list into work items of at most
`chunk_entries` entries (block 0, chosen by every query, would otherwise serialise on one SM). Each
program keeps one block's K/V in registers and gathers bwd_tokens x G query rows per step.
Deterministic mode writes one float32 partial per work item and sums a block's items in a fixed order
(`_reduce_kernel`); the other mode atomically adds into float32 buffers (faster, not bitwise stable).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

LOG2E = math.log2(math.e)


def _whole(*shape):
  """BlockSpec of batch bb's whole array on a (x, group, batch) grid."""
  return pl.BlockSpec((None, *shape), lambda i, j, bb: (bb,) + (0,) * len(shape))


def _params(tiling):
  return plgpu.CompilerParams(num_warps=tiling.bwd_num_warps, num_stages=tiling.bwd_num_stages)


# ----------------------------------------------------------------------------- dq

def _dq_step(accs, qs, dos, lse2, delta, vis, ks, vs, scale):
  """dq accumulators += dS @ K for one key step (p recomputed from the saved base-2 lse)."""
  s = C.dot_pieces(qs, ks) * (scale * LOG2E)
  p = jnp.where(vis, jnp.exp2(s - lse2[:, None]), 0.0)
  ds = (p * (C.dot_pieces(dos, vs) - delta[:, None])).astype(ks[0].dtype)
  return tuple(a + plgpu.dot(ds, kp) for a, kp in zip(accs, ks))


def _dq_union_kernel(ub_ref, bits_ref, cnt_ref, seg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                     delta_ref, dq_ref, *, tq, g, m, t, h, kh, block_size, bk, dk_pieces, dv_pieces,
                     scale, has_seg, bps):
  tile, kk = pl.program_id(0), pl.program_id(1)
  tok, pos, row = C.tile_rows(tile, kk, tq=tq, g=g, m=m, t=t, h=h)
  qs, dos = C.load_pieces(q_ref, row, dk_pieces), C.load_pieces(do_ref, row, dv_pieces)
  lse2, delta = lse_ref[row] * LOG2E, delta_ref[row]
  seg_q = seg_ref[pos] if has_seg else None
  cnt = cnt_ref[0]
  kv = functools.partial(C.kv_steps, kk=kk, k_ref=k_ref, v_ref=v_ref, seg_ref=seg_ref, bk=bk,
                         block_size=block_size, t=t, kh=kh, dk_pieces=dk_pieces,
                         dv_pieces=dv_pieces, has_seg=has_seg)

  def body(i, accs):
    for j in range(bps):  # bps blocks a step: independent loads, one running sum
      blk, rows_on = C.union_block(ub_ref, bits_ref, cnt, i, j, bps, tok)
      for kpos, ks, vs, seg_k in kv(blk):
        accs = _dq_step(accs, qs, dos, lse2, delta, C.visible(rows_on, pos, kpos, seg_q, seg_k),
                        ks, vs, scale)
    return accs

  accs = lax.fori_loop(0, (cnt + bps - 1) // bps, body,
                       tuple(jnp.zeros((m, sz), jnp.float32) for _, sz in dk_pieces))
  for (off, _), a in zip(dk_pieces, accs):
    C.store_rows(dq_ref, row, off, (a * scale).astype(dq_ref.dtype))


def _dq_shared_kernel(com_ref, ccnt_ref, priv_ref, pcnt_ref, seg_ref, q_ref, k_ref, v_ref, do_ref,
                      lse_ref, delta_ref, dq_ref, *, tq, g, m, t, h, kh, block_size, bk, dk_pieces,
                      dv_pieces, scale, has_seg):
  tile, kk = pl.program_id(0), pl.program_id(1)
  toks = []
  for i in range(tq):
    _, pos, row = C.tile_rows(tile * tq + i, kk, tq=1, g=g, m=m, t=t, h=h)
    toks.append((pos, row, C.load_pieces(q_ref, row, dk_pieces), C.load_pieces(do_ref, row, dv_pieces),
                 lse_ref[row] * LOG2E, delta_ref[row], seg_ref[pos] if has_seg else None))
  on = jnp.ones((m,), jnp.bool_)
  kv = functools.partial(C.kv_steps, kk=kk, k_ref=k_ref, v_ref=v_ref, seg_ref=seg_ref, bk=bk,
                         block_size=block_size, t=t, kh=kh, dk_pieces=dk_pieces,
                         dv_pieces=dv_pieces, has_seg=has_seg)

  def step(accs, tok, kpos, ks, vs, seg_k):
    pos, _, qs, dos, lse2, delta, seg_q = tok
    return _dq_step(accs, qs, dos, lse2, delta, C.visible(on, pos, kpos, seg_q, seg_k), ks, vs, scale)

  def common_body(u, all_accs):
    for kpos, ks, vs, seg_k in kv(com_ref[u]):
      all_accs = tuple(step(a, tok, kpos, ks, vs, seg_k) for a, tok in zip(all_accs, toks))
    return all_accs

  zero = tuple(jnp.zeros((m, sz), jnp.float32) for _, sz in dk_pieces)
  all_accs = lax.fori_loop(0, ccnt_ref[0], common_body, tuple(zero for _ in toks))
  for i, tok in enumerate(toks):
    def private_body(u, accs, i=i, tok=tok):
      for kpos, ks, vs, seg_k in kv(priv_ref[i, u]):
        accs = step(accs, tok, kpos, ks, vs, seg_k)
      return accs
    accs = lax.fori_loop(0, pcnt_ref[i], private_body, all_accs[i])
    for (off, _), a in zip(dk_pieces, accs):
      C.store_rows(dq_ref, tok[1], off, (a * scale).astype(dq_ref.dtype))


def _dq(q, k, v, seg, maps, do, lse, delta, *, block_size, scale, tiling, has_seg, interpret):
  b, t, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  g, tq = h // kh, tiling.tokens_per_tile
  shared = tiling.mode == "shared"
  kernel = functools.partial(
      _dq_shared_kernel if shared else _dq_union_kernel, tq=tq, g=g,
      m=C.rows_of(g, 1 if shared else tq), t=t, h=h, kh=kh, block_size=block_size,
      bk=tiling.block_k, dk_pieces=C.dim_pieces(dk), dv_pieces=C.dim_pieces(dv), scale=scale,
      has_seg=has_seg, **({} if shared else {"bps": tiling.dq_blocks_per_step}))
  dq = pl.pallas_call(
      kernel,
      grid=(maps[0].shape[1], kh, b),
      in_specs=C.map_specs(maps) + [
          _whole(t), _whole(t * h, dk), _whole(t * kh, dk), _whole(t * kh, dv), _whole(t * h, dv),
          _whole(t * h), _whole(t * h)],
      out_specs=_whole(t * h, dk),
      out_shape=jax.ShapeDtypeStruct((b, t * h, dk), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
      interpret=interpret,
      name=f"nsa_select_dq_{tiling.mode}{tq}",
  )(*maps, seg, q.reshape(b, t * h, dk), k.reshape(b, t * kh, dk), v.reshape(b, t * kh, dv),
    do.reshape(b, t * h, dv), lse.reshape(b, t * h), delta.reshape(b, t * h))
  return dq.reshape(b, t, h, dk)


# ----------------------------------------------------------------------------- dK / dV

def _dkv_kernel(iblk_ref, istart_ref, iend_ref, tokens_ref, seg_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, *out_refs, tq, g, m, t, h, kh, block_size, n_entries,
                dk_pieces, dv_pieces, scale, has_seg, atomic):
  w, kk = pl.program_id(0), pl.program_id(1)
  blk, e0, e1 = iblk_ref[w], istart_ref[w], iend_ref[w]
  kpos, krow = C.key_rows(blk, 0, kk, bk=block_size, block_size=block_size, t=t, kh=kh)
  ks = C.load_pieces(k_ref, krow, dk_pieces)
  vs = C.load_pieces(v_ref, krow, dv_pieces)
  seg_k = seg_ref[jnp.minimum(kpos, t - 1)] if has_seg else None
  r = lax.iota(jnp.int32, m)
  slot, head, row_ok = r // g, r % g, r < tq * g

  def body(i, carry):
    dks, dvs = carry
    e = e0 + i * tq + slot
    live = row_ok & (e < e1)
    pos = tokens_ref[jnp.minimum(e, n_entries - 1)]
    row = pos * h + kk * g + head
    qs = C.load_pieces(q_ref, row, dk_pieces)
    dos = C.load_pieces(do_ref, row, dv_pieces)
    seg_q = seg_ref[pos] if has_seg else None
    s = C.dot_pieces(qs, ks) * (scale * LOG2E)
    vis = C.visible(live, pos, kpos, seg_q, seg_k)
    p = jnp.where(vis, jnp.exp2(s - (lse_ref[row] * LOG2E)[:, None]), 0.0)
    pb = p.astype(dos[0].dtype)
    dvs = tuple(a + plgpu.dot(pb, dp_, trans_a=True) for a, dp_ in zip(dvs, dos))
    ds = (p * (C.dot_pieces(dos, vs) - delta_ref[row][:, None])).astype(qs[0].dtype)
    dks = tuple(a + plgpu.dot(ds, qp, trans_a=True) for a, qp in zip(dks, qs))
    return dks, dvs

  init = (tuple(jnp.zeros((block_size, s_), jnp.float32) for _, s_ in dk_pieces),
          tuple(jnp.zeros((block_size, s_), jnp.float32) for _, s_ in dv_pieces))
  dks, dvs = lax.fori_loop(0, C.cdiv(e1 - e0, tq), body, init)
  dk_ref, dv_ref = out_refs[-2:]  # aliased inputs come first when atomic
  if atomic:
    # The float32 buffers are padded to whole blocks, so every key row is distinct and in range:
    # no mask (the CPU interpreter has no masked atomics) and no duplicate rows.
    prow = kpos * kh + kk
    for (off, size), a in zip(dk_pieces, dks):
      C.atomic_add_rows(dk_ref, prow, off, a * scale)
    for (off, size), a in zip(dv_pieces, dvs):
      C.atomic_add_rows(dv_ref, prow, off, a)
  else:
    for (off, size), a in zip(dk_pieces, dks):
      dk_ref[:, pl.ds(off, size)] = a * scale
    for (off, size), a in zip(dv_pieces, dvs):
      dv_ref[:, pl.ds(off, size)] = a


def _reduce_kernel(first_ref, nitems_ref, dkp_ref, dvp_ref, dk_ref, dv_ref, *, t, kh, block_size,
                   dk_pieces, dv_pieces):
  """dK/dV of block j = the fixed-order sum of its work items' partials (deterministic)."""
  j, kk = pl.program_id(0), pl.program_id(1)
  first = first_ref[j]
  kpos, krow = C.key_rows(j, 0, kk, bk=block_size, block_size=block_size, t=t, kh=kh)
  # Keys past T (last block) reread and rewrite key T-1: identical duplicates, no masked store.
  local = jnp.minimum(kpos, t - 1) - j * block_size
  for src, dst, pieces in ((dkp_ref, dk_ref, dk_pieces), (dvp_ref, dv_ref, dv_pieces)):
    for off, size in pieces:
      acc = lax.fori_loop(0, nitems_ref[j], lambda i, a: a + src[first + i, local, pl.ds(off, size)],
                          jnp.zeros((block_size, size), jnp.float32))
      C.store_rows(dst, krow, off, acc.astype(dst.dtype))


def _dkv(q, k, v, block_idx, seg, do, lse, delta, *, block_size, scale, tiling, has_seg, interpret,
         deterministic):
  b, t, h, dk = q.shape
  kh, dv, n = k.shape[2], v.shape[3], block_idx.shape[3]
  g, tq = h // kh, tiling.bwd_tokens
  nb = C.cdiv(t, block_size)
  tokens, iblk, istart, iend, first, nitems = C.inverse_lists(block_idx, nb, tiling.chunk_entries)
  nw = iblk.shape[-1]
  kernel = functools.partial(
      _dkv_kernel, tq=tq, g=g, m=C.rows_of(g, tq), t=t, h=h, kh=kh, block_size=block_size,
      n_entries=t * n, dk_pieces=C.dim_pieces(dk), dv_pieces=C.dim_pieces(dv), scale=scale,
      has_seg=has_seg, atomic=not deterministic)
  item_spec = pl.BlockSpec((None, None, nw), lambda i, j, bb: (bb, j, 0))
  in_specs = [item_spec, item_spec, item_spec,
              pl.BlockSpec((None, None, t * n), lambda i, j, bb: (bb, j, 0)),
              _whole(t), _whole(t * h, dk), _whole(t * kh, dk), _whole(t * kh, dv),
              _whole(t * h, dv), _whole(t * h), _whole(t * h)]
  args = [iblk, istart, iend, tokens, seg, q.reshape(b, t * h, dk), k.reshape(b, t * kh, dk),
          v.reshape(b, t * kh, dv), do.reshape(b, t * h, dv), lse.reshape(b, t * h),
          delta.reshape(b, t * h)]
  if deterministic:
    part = lambda d: pl.BlockSpec((None, None, None, block_size, d), lambda i, j, bb: (bb, j, i, 0, 0))
    out_specs = [part(dk), part(dv)]
    out_shape = [jax.ShapeDtypeStruct((b, kh, nw, block_size, dk), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, nw, block_size, dv), jnp.float32)]
    aliases = {}
  else:
    tp = nb * block_size  # padded to whole blocks
    out_specs = [_whole(tp * kh, dk), _whole(tp * kh, dv)]
    out_shape = [jax.ShapeDtypeStruct((b, tp * kh, dk), jnp.float32),
                 jax.ShapeDtypeStruct((b, tp * kh, dv), jnp.float32)]
    in_specs += out_specs
    args += [jnp.zeros(s.shape, s.dtype) for s in out_shape]
    aliases = {len(args) - 2: 0, len(args) - 1: 1}
  dkx, dvx = pl.pallas_call(
      kernel, grid=(nw, kh, b), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, compiler_params=_params(tiling), interpret=interpret,
      name="nsa_select_dkv" + ("" if deterministic else "_atomic"),
  )(*args)
  if not deterministic:
    unpad = lambda x, like: x.reshape(b, -1, kh, x.shape[-1])[:, :t].astype(like.dtype)
    return unpad(dkx, k), unpad(dvx, v)
  return reduce_partials(first, nitems, dkx, dvx, k, v, block_size=block_size, interpret=interpret)


def reduce_partials(first, nitems, dkx, dvx, k, v, *, block_size, interpret):
  """dK, dV [B,T,K,D] in k/v's dtype from the float32 work-item partials [B,K,W,l',D], summed per
  block in item order (deterministic)."""
  b, t, kh, dk = k.shape
  dv, nb, nw = v.shape[3], first.shape[-1], dkx.shape[2]
  reduce = functools.partial(_reduce_kernel, t=t, kh=kh, block_size=block_size,
                             dk_pieces=C.dim_pieces(dk), dv_pieces=C.dim_pieces(dv))
  blk_spec = pl.BlockSpec((None, None, nb), lambda i, j, bb: (bb, j, 0))
  part_in = lambda d: pl.BlockSpec((None, None, nw, block_size, d), lambda i, j, bb: (bb, j, 0, 0, 0))
  dk_, dv_ = pl.pallas_call(
      reduce, grid=(nb, kh, b), in_specs=[blk_spec, blk_spec, part_in(dk), part_in(dv)],
      out_specs=[_whole(t * kh, dk), _whole(t * kh, dv)],
      out_shape=[jax.ShapeDtypeStruct((b, t * kh, dk), k.dtype),
                 jax.ShapeDtypeStruct((b, t * kh, dv), v.dtype)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
      name="nsa_select_dkv_reduce",
  )(first, nitems, dkx, dvx)
  return dk_.reshape(k.shape), dv_.reshape(v.shape)


def delta_of(o, do, dlse):
  """rowsum(o * do) - dlse [B,T,H] float32: d lse / d logit = p, so the lse cotangent folds into
  delta (dS = P * (dP - delta))."""
  return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1) - dlse.astype(jnp.float32)


def backward(q, k, v, block_idx, seg, maps, o, lse, do, dlse, *, block_size, scale, tiling,
             has_seg, interpret, deterministic):
  """(dq, dk, dv) of select_attention given the cotangents of o and lse."""
  delta = delta_of(o, do, dlse)
  do = do.astype(q.dtype)
  common = dict(block_size=block_size, scale=scale, tiling=tiling, has_seg=has_seg, interpret=interpret)
  dq = _dq(q, k, v, seg, maps, do, lse, delta, **common)
  dk, dv = _dkv(q, k, v, block_idx, seg, do, lse, delta, deterministic=deterministic, **common)
  return dq, dk, dv
