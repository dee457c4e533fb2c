"""NSA selected-block attention forward as a Mosaic GPU kernel (Hopper: TMA copies, wgmma).

Experimental backend `select_attention(..., backend="mosaic")`: this forward plus the Triton-lowered
backward kernels of select_attention_bwd.py (the same "union" tile maps), under one custom VJP.
Written 2026-11-30 without GPU time left: it is checked against the reference in Mosaic GPU's CPU
interpreter and by lowering for CUDA, but its speed on the H200 is NOT measured yet, so nothing
selects it automatically (`bench_kernels --plan mosaic` is prepared for that measurement).

Tile: 64 rows = tq tokens x the G query heads of one KV group (tq = 64 / G, G in 4..64), the
wgmma minimum. The program walks the union of its tokens' selected blocks (l' = 64 keys each):
  1. TMA the block's K [64, d_k] and V [64, d_v] into shared memory (two slots: block j+1 is in
     flight while block j is computed);
  2. S = Q K^T on the matrix unit (wgmma, float32 accumulator);
  3. rows whose token did not pick the block, and keys after the row's token (inside its own
     block), get -inf; online softmax in base 2 (a fully masked row keeps l = 0: o = 0, lse = -inf);
  4. P (bfloat16, staged through shared memory) times V on the matrix unit, added to the running
     output in registers.
Layout: q is regrouped to [B, K, T*G, d_k] (tokens x heads of a group contiguous; free when K = 1),
k / v to [B, K, T', d] with T' padded to whole blocks (zeros, never visible: causally after every
real query). No segment ids (the Triton backend handles them).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import _common as C

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
ROWS = 64          # wgmma's M
BLOCK = 64         # l' (keys per selected block) this kernel handles
SWIZZLE = 128      # bytes: 64 bfloat16 columns per swizzled row


def supports(q_shape, k_shape, v_shape, block_size, has_seg, dtype):
  """(ok, reason): whether the Mosaic GPU forward handles this call."""
  b, t, h, dk = q_shape
  kh, dv = k_shape[2], v_shape[3]
  if has_seg:
    return False, "segment ids are not implemented in the Mosaic GPU kernel (use backend='triton')"
  if block_size != BLOCK:
    return False, f"block_size={block_size}: the Mosaic GPU kernel handles l' = {BLOCK} only"
  if dk % 64 or dv % 64 or max(dk, dv) > 256:
    return False, f"d_k={dk}, d_v={dv}: need multiples of 64 up to 256 (128-byte swizzled rows)"
  if h % kh:
    return False, f"{h} query heads not a multiple of {kh} KV heads"
  g = h // kh
  if ROWS % g or not 4 <= g <= 64:
    return False, (f"G={g}: the 64-row tile needs G in (4, 8, 16, 32, 64) (64 / G tokens a tile, "
                   "at most 16)")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False, f"dtype {dtype}: the Mosaic GPU kernel takes bfloat16 or float16"
  return True, "ok"


def tiling_for(g, block_size):
  """The union tiling whose maps this forward consumes (and the Triton backward reuses)."""
  import dataclasses
  return dataclasses.replace(C.default_tiling(g, block_size), mode="union",
                             tokens_per_tile=ROWS // g, blocks_per_step=1)


def _kernel(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, g, tq, t,
            dk, dv, scale, dtype):
  (q_s, k_s, v_s, p_s, o_s, lse_s), (q_bar, k_bar, v_bar) = scoped
  tile, kk, b = lax.axis_index("tile"), lax.axis_index("group"), lax.axis_index("batch")
  rows = pl.ds(tile * ROWS, ROWS)
  plgpu.copy_gmem_to_smem(q_ref.at[b, kk, rows], q_s, q_bar.at[0])
  cnt = cnt_ref[b, tile, kk, 0]

  def fetch(j, slot):
    blk = ub_ref[b, tile, kk, j]
    keys = pl.ds(blk * BLOCK, BLOCK)
    plgpu.copy_gmem_to_smem(k_ref.at[b, kk, keys], k_s.at[slot], k_bar.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[b, kk, keys], v_s.at[slot], v_bar.at[slot])

  @pl.when(cnt > 0)
  def _():
    fetch(0, 0)

  wg = plgpu.Layout.WGMMA
  r_id = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK), 0, layout=wg)
  c_id = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK), 1, layout=wg)
  tok = r_id // g                           # the row's token within the tile
  pos = tile * tq + tok                     # its position
  plgpu.barrier_wait(q_bar.at[0])

  def body(j, carry):
    acc, m_i, l_i = carry
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < cnt)
    def _():
      fetch(j + 1, 1 - slot)  # that slot's last readers (block j-1's wgmmas) have finished

    blk = ub_ref[b, tile, kk, j]
    bits = bits_ref[b, tile, kk, j]
    plgpu.barrier_wait(k_bar.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_s, k_s.at[slot].T)
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((ROWS, BLOCK), jnp.float32)) * (scale * LOG2E)
    on = (lax.shift_right_logical(jnp.broadcast_to(bits, (ROWS, BLOCK)), tok) & 1) == 1
    s = jnp.where(on & (blk * BLOCK + c_id <= pos), s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing visible yet stays at 0
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    p_s[...] = p.astype(dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(v_bar.at[slot])

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_s, v_s.at[slot])
      return acc_ref[...]
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pl.run_scoped(
        pv, plgpu.ACC((ROWS, dv), jnp.float32))
    return acc, m_new, l_i

  init = (plgpu.layout_cast(jnp.zeros((ROWS, dv), jnp.float32), wg),
          plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), wg.reduce(1)),
          plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), wg.reduce(1)))
  acc, m_i, l_i = lax.fori_loop(0, cnt, body, init)
  seen = l_i > 0.0
  l_safe = jnp.where(seen, l_i, 1.0)
  o_s[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
  lse_s[...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, kk, rows])
  plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, kk, rows])
  plgpu.wait_smem_to_gmem(0)


def forward(q, k, v, maps, *, block_size, scale, interpret=False):
  """(o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32) from the union maps of `tiling_for(G, l')`."""
  ok, why = supports(q.shape, k.shape, v.shape, block_size, False, q.dtype)
  if not ok:
    raise ValueError(f"select_attention[mosaic] does not support this call: {why}")
  ub, bits, cnt = maps
  b, t, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  g = h // kh
  tq = ROWS // g
  nt = C.cdiv(t, tq)
  tp = max(nt * tq, C.cdiv(t, BLOCK) * BLOCK)   # tokens: whole tiles and whole key blocks
  pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
  qg = pad(q).reshape(b, tp, kh, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, kh, tp * g, dk)
  kg, vg = pad(k).transpose(0, 2, 1, 3), pad(v).transpose(0, 2, 1, 3)   # [B, K, T', d]
  tr = lambda d: (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(SWIZZLE))
  dtype = q.dtype

  def entry(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    pl.run_scoped(
        lambda *s: _kernel(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, s, g=g,
                           tq=tq, t=t, dk=dk, dv=dv, scale=scale, dtype=dtype),
        (plgpu.SMEM((ROWS, dk), dtype, transforms=tr(dk)),
         plgpu.SMEM((2, BLOCK, dk), dtype, transforms=tr(dk)),
         plgpu.SMEM((2, BLOCK, dv), dtype, transforms=tr(dv)),
         plgpu.SMEM((ROWS, BLOCK), dtype, transforms=tr(BLOCK)),
         plgpu.SMEM((ROWS, dv), dtype, transforms=tr(dv)),
         plgpu.SMEM((ROWS,), jnp.float32)),
        (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_barriers=2)))

  params = plgpu.InterpretGPUParams() if interpret else None
  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, kh, tp * g, dv), dtype),
                jax.ShapeDtypeStruct((b, kh, tp * g), jnp.float32)),
      grid=(nt, kh, b), grid_names=("tile", "group", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=params,
  )(ub, bits, cnt, qg, kg, vg)
  o = o.reshape(b, kh, tp, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, tp, h, dv)[:, :t]
  lse = lse.reshape(b, kh, tp, g).transpose(0, 2, 1, 3).reshape(b, tp, h)[:, :t]
  return o, lse
