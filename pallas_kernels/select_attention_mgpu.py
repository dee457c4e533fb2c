"""NSA selected-block and compression attention forwards as one Mosaic GPU kernel (Hopper: TMA
copies, wgmma).

Backends `select_attention(..., backend="mosaic")` and
`compress_attention(..., backend="mosaic")`: these forwards; for the selection also a Mosaic GPU dq
(same tiles, P recomputed from the saved lse) and, for G >= 8, Mosaic GPU dK/dV partials over the
inverse selection lists (one work item = a block and a run of the queries that picked it; 64 query
rows gathered per step, one copy per token), summed per block by the Triton reduce kernel in a
fixed order (deterministic). G = 4's dK/dV and the compression backward stay Triton. Each backend
is one custom VJP. Checked against the reference compiled on the H200 and in Mosaic GPU's CPU
interpreter. On the H200 (2026-11-30, benchmarks/results/select_h200_mosaic*.md) the selection
kernels beat the Triton ones at head dims 64 and at G = 4 with clustered lists, and lost at G = 16
with head dims 128; since 2026-12-02 (LEAN_SMEM, then KV_RING) they win there too
(select_h200_mosaicab16*.md). select_attention(backend="auto") picks them where they won. The compression
forward lost (19.7 vs 14.4 ms at 64k, 192/128) and is only used on request
(implementation="pallas-mosaic").

The compression branch runs the same loop over contiguous blocks of 64 compressed keys (key i is
visible to position p iff i*d + l - 1 <= p), up to the last block its tile's last token sees.

Tile: 64 rows = tq tokens x the G query heads of one KV group (tq = 64 / G, G in 4..64), the
wgmma minimum. The program walks the union of its tokens' selected blocks (l' = 64 keys each):
  1. TMA the block's K [64, d_k] and V [64, d_v] into shared memory (FWD_SLOTS slots, 2 by default: block j+1 is in
     flight while block j is computed; at d_k = d_v >= 128 one ring of 3 buffers instead, KV_RING);
  2. S = Q K^T on the matrix unit (wgmma, float32 accumulator);
  3. rows whose token did not pick the block, and keys after the row's token (inside its own
     block), get -inf; online softmax in base 2 (a fully masked row keeps l = 0: o = 0, lse = -inf);
  4. P (bfloat16, staged through shared memory) times V on the matrix unit, added to the running
     output in registers.
Layout: q is regrouped to [B, K, T*G, d_k] (tokens x heads of a group contiguous; free when K = 1),
k / v to [B, K, T', d] with T' padded to whole blocks (zeros, never visible: causally after every
real query). Segment ids with SEGMENT_IDS (on by default; off: the Triton backend handles them):
the selection forward and dq mask keys before each row's document start (dK/dV with ids: Triton;
the two-warpgroup forward takes none).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

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
# Selection forward step (docs/SELECTION_SPEED_PLAN.md B1; benchmarks switch them, read when traced):
FAST_MASK = True   # the token's pick as a per-row bias, the causal mask on the last union entry only
                   # (forward and dq; dK/dV: column vectors, causal only on the block's own tokens)
REG_P = True       # P (forward) and dS (dq) as the wgmma's A operand straight from registers, not
                   # staged through SMEM; dq issues S and dP back to back with one wait (dK/dV:
                   # P^T and dS^T from registers, dV and dP^T with one wait)
# Pipeline depth (read when traced): K/V blocks in shared memory in the 64-row forward, the
# compression forward and dq (FWD_SLOTS), query-row steps in dK/dV (DKV_SLOTS). Step j computes
# slot j % S while blocks j+1 .. j+S-1 are in flight; it refills the slot that step j-1 used,
# whose wgmmas have finished. 2 (the default) measured fastest on the H200 at the 8k training
# layer: 3 and 4 were slower (`bench_kernels --plan mosaicslots`, select_h200_mosaicslots.md).
# Each is capped by shared memory (fwd_slots, dkv_slots).
FWD_SLOTS = 2
DKV_SLOTS = 2
# Selection forward with FlashAttention-3's intra-warpgroup overlap (read when traced): step j
# issues S_{j+1} = Q K_{j+1}^T and P_j V_j back to back and runs the softmax of S_{j+1} while
# P_j V_j is on the matrix unit (wgmma_accumulator_load(wait_n=1)). Needs P from registers on the
# GPU (REG_P) and three K/V slots (block j+2 loads while j+1 and j are in use; overlap_slots).
OVERLAP = False
# Shared memory per CTA, hence CTAs per SM (read when traced): the buffers that the GPU path does
# not use are not allocated (P / dS / P^T staging: REG_P keeps them in registers), and buffers with
# disjoint lifetimes share memory (plgpu.RefUnion): the forward's output tile with its query tile,
# dK/dV's float32 result staging with its query-row slots. At the 8k training layer (64/64) the
# forward's 57.6 KB (3 CTAs an SM; its 116 registers allow 4) become 40.3 KB, dK/dV's 91.1 KB
# (2 CTAs; 139 registers allow 3) 51.2 KB. False: the layouts as before 2026-12-02.
LEAN_SMEM = True
# The 64-row forward's K and V blocks in one ring of 3 shared-memory buffers instead of FWD_SLOTS
# slots of each (read when traced; where d_k = d_v >= RING_MIN_DIM and OVERLAP is off). K_j sits in buffer 2j % 3
# and V_j in (2j + 1) % 3: V_{j+1} is issued once S_j = Q K_j^T has been waited for (into K_j's
# buffer), K_{j+2} once P_j V_j has (into V_j's). At d = 128 the forward then needs 64 KB instead
# of 80 KB: 3 CTAs an SM instead of 2 (its 147 registers allow 3). Measured on the H200
# (2026-12-02, select_h200_mosaicring*.md, A/B twice): 64k, 128/128, G = 16 clustered forward
# 7.53 / 7.51 vs 8.31 / 8.32 ms, G = 4 14.09 / 13.82 vs 14.47 / 14.35; at the 8k layer (64/64,
# where occupancy does not change: registers allow 4 CTAs either way) clustered -2%, random +3-4%.
# So it applies from RING_MIN_DIM (d_k = d_v >= 128) only.
KV_RING = True
RING_MIN_DIM = 128
# Segment ids (packed documents) in the selection forward and dq (read when traced). Documents are
# contiguous runs (the kernels take ids as document runs, _common.segment_ids_int32), so key s is in query t's document and not
# after it iff doc_start(t) <= s <= t: the ids become a per-row lower bound. In an ascending union
# only the entries that start before the tile's last token's document start can hold keys under a
# row's bound (doc_maps counts them); those and the last entry get the mask. dK/dV with ids: the
# Mosaic partials with DKV_SEGMENT_IDS (below), else Triton; the two-warpgroup forward
# (ws_forward) takes no ids. On by default since 2026-12-07:
# at the 8k training layer (B = 8, 16/1 heads, 64/64, the op's own top-n lists) on an H100,
# benchmarks/select_doc_trial.py (benchmarks/results/seldoc_h100_s44/) timed forward / backward
# 2.03 / 3.95 ms against the Triton union tile's 2.65 / 4.58 (documents of mean 16384 tokens) and
# 1.53 / 3.51 against 2.30 / 3.67 (mean 4096); the masked 8k NSA LM trained at 294.9k tokens/s
# against 280.6k (steps 20-100, one run each, `bash scripts/h200_runs.sh segids`,
# benchmarks/results/segids_h100_s44/). Not yet timed on the H200. False: ids go to Triton.
SEGMENT_IDS = True
# Segment ids in the Mosaic dK/dV partials too (read when traced; G >= 8, with SEGMENT_IDS):
# each work item stops at its first token whose document starts after the block (those tokens'
# keys are all masked, so they add nothing), and masks keys before each token's document start
# from its first token whose document starts inside the block (dkv_doc_counts). Off: dK/dV with
# ids runs the Triton kernel. On by default since 2026-12-07 (forty-fifth session): at the 8k
# training layer on an H100 the selection's forward + backward took 5.08 vs 6.14 ms (documents of
# mean 16384 tokens) and 4.18 vs 5.26 ms (mean 4096) (benchmarks/select_doc_trial.py variant
# mosaic_dkv_ids, benchmarks/results/seldoc_dkv_h100_s44/); the compiled tests against the
# reference passed; the masked 8k NSA LM trained at 302.3k vs 292.7k and 306.6k vs 296.5k tokens/s
# (two H100s, either order, losses equal step by step; benchmarks/results/segids_dkv_h100_s45/).
# Not yet timed on the H200. "auto" sends ids to the Mosaic kernels only at the timed shape
# (select_attention.auto_backend), so this applies there and with backend="mosaic".
DKV_SEGMENT_IDS = True


def _staging(interpret):
  """Whether the P / dS / P^T staging buffers are allocated (used: interpreter or REG_P off)."""
  return interpret or not REG_P or not LEAN_SMEM


def _buffers(shared):
  """The buffers of a _shared allocation in order (both forms iterate by group)."""
  out = []
  for x in shared:
    out += list(x) if isinstance(x, (tuple, list)) else [x]
  return out


def _shared(*groups):
  """Buffer groups with disjoint lifetimes: one plgpu.RefUnion with LEAN_SMEM, else the groups
  side by side (a tuple). _buffers unpacks either to the groups' buffers in order."""
  return plgpu.RefUnion(*groups) if LEAN_SMEM else groups


def _check(h, kh, dk, dv, has_seg, dtype, what="Mosaic GPU kernel"):
  """(ok, reason) for what every Mosaic GPU kernel here needs: 64-row tiles of 64 / G tokens, head
  dims in 128-byte swizzled rows, 16-bit inputs; has_seg: segment ids given to a kernel (`what`)
  that takes none."""
  if has_seg:
    return False, f"segment ids are not implemented in the {what} (use backend='triton')"
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


def supports(q_shape, k_shape, v_shape, block_size, has_seg, dtype):
  """(ok, reason): whether the Mosaic GPU selection kernels handle this call (segment ids only
  with SEGMENT_IDS)."""
  if block_size != BLOCK:
    return False, f"block_size={block_size}: the Mosaic GPU kernel handles l' = {BLOCK} only"
  if has_seg and not SEGMENT_IDS:
    return False, ("segment ids: select_attention_mgpu.SEGMENT_IDS is off (set it True, or use "
                   "backend='triton')")
  return _check(q_shape[2], k_shape[2], q_shape[3], v_shape[3], False, dtype)


def _tiles(t, g, rows=ROWS):
  """(tokens a tile, tiles) for T tokens in tiles of `rows` rows = tokens x the G heads of a group."""
  tq = rows // g
  return tq, C.cdiv(t, tq)


def _rows_major(x, kh, tp):
  """[B,T,H,...] -> [B, K, tp*G, ...]: the G heads of a group token-major, T zero-padded to tp."""
  b, t, h = x.shape[:3]
  x = jnp.pad(x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))
  x = x.reshape(b, tp, kh, h // kh, *x.shape[3:]).swapaxes(1, 2)
  return x.reshape(b, kh, tp * (h // kh), *x.shape[4:])


def _from_rows_major(x, h, t):
  """Inverse of _rows_major: [B, K, tp*G, ...] -> [B, t, H, ...]."""
  b, kh, n = x.shape[:3]
  g = h // kh
  x = x.reshape(b, kh, n // g, g, *x.shape[3:]).swapaxes(1, 2)
  return x.reshape(b, n // g, h, *x.shape[4:])[:, :t]


def _blocks_major(x):
  """k or v [B,T,K,D] -> [B, K, T', D], T' padded with zeros to whole blocks of 64 keys (never
  visible: causally after every real query)."""
  t = x.shape[1]
  x = jnp.pad(x, ((0, 0), (0, C.cdiv(t, BLOCK) * BLOCK - t), (0, 0), (0, 0)))
  return x.transpose(0, 2, 1, 3)


def tiling_for(g, block_size):
  """The union tiling whose maps this forward consumes (and the Triton backward reuses)."""
  import dataclasses
  return dataclasses.replace(C.default_tiling(g, block_size), mode="union",
                             tokens_per_tile=ROWS // g, blocks_per_step=1, num_warps=4)


def _mm(a, b, shape):
  """a @ b on the matrix unit (wgmma, float32 accumulator of `shape`), waited for."""
  def f(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]
  return pl.run_scoped(f, plgpu.ACC(shape, jnp.float32))


def _mm_acc(acc, a, b, interpret):
  """acc + a @ b. On the GPU in place in the wgmma accumulator (no second float32 accumulator
  live: registers); the CPU interpreter lacks ACC.init, so there a fresh product is added."""
  if interpret:
    return acc + _mm(a, b, acc.shape)

  def f(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
  return pl.run_state(f)(plgpu.ACC.init(acc))


def _softmax_init(dv):
  """Online-softmax state of a 64-row tile in the wgmma layout: (acc, running max, running sum)."""
  wg = plgpu.Layout.WGMMA
  return (plgpu.layout_cast(jnp.zeros((ROWS, dv), jnp.float32), wg),
          plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), wg.reduce(1)),
          plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), wg.reduce(1)))


def _softmax_step(s, m_i, l_i):
  """One block of the online softmax on masked base-2 logits s: (p, alpha, m_new, l_new); a row
  with nothing visible yet keeps its max at -inf and uses 0 (p = 0, alpha = 1)."""
  m_new = jnp.maximum(m_i, s.max(axis=1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m_i - m_use)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
  return p, alpha, m_new, l_i * alpha + p.sum(axis=1)


def _store(acc, m_i, l_i, o_s, lse_s, o_dst, lse_dst, dtype):
  """o = acc / l, lse = ln of the sum (o = 0, lse = -inf where nothing was visible), through
  shared memory to o_dst / lse_dst."""
  seen = l_i > 0.0
  l_safe = jnp.where(seen, l_i, 1.0)
  o_s[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
  lse_s[...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_s, o_dst)
  plgpu.copy_smem_to_gmem(lse_s, lse_dst)
  plgpu.wait_smem_to_gmem(0)


def _causal_last_loop(body, cnt, init, nlo=None):
  """fori_loop of body(j, carry, causal) over an ascending union of cnt entries: no causal mask
  but at the last entry (the tiles' own block; see forward's precondition). nlo (documents,
  doc_maps): body also takes `lower`, the document lower bound, on entries 0 .. nlo-1 and the last."""
  if nlo is None:
    carry = lax.fori_loop(0, cnt - 1, functools.partial(body, causal=False), init)
    return lax.fori_loop(jnp.maximum(cnt - 1, 0), cnt, body, carry)
  m = jnp.clip(nlo, 0, jnp.maximum(cnt - 1, 0))
  carry = lax.fori_loop(0, m, functools.partial(body, causal=False, lower=True), init)
  carry = lax.fori_loop(m, cnt - 1, functools.partial(body, causal=False, lower=False), carry)
  return lax.fori_loop(jnp.maximum(cnt - 1, 0), cnt,
                       functools.partial(body, causal=True, lower=True), carry)


def _doc_bound(doc_refs, b, tile, kk, tq, pos):
  """(lo [ROWS, BLOCK]: each row's document start, nlo: the union entries that need it) from
  doc_maps' refs, or (None, None) without documents."""
  if doc_refs is None:
    return None, None
  lo_ref, nlo_ref = doc_refs
  tok = pos - tile * tq
  lo = pos * 0
  for i in range(tq):
    lo = jnp.where(tok == i, lo_ref[b, tile * tq + i], lo)
  return lo, nlo_ref[b, tile, kk, 0]


def doc_maps(seg, maps, t, tq):
  """The document bound's inputs: (lo [B, nT*tq] int32, each token's document start, tokens past T
  repeating token T-1's; nlo [B, nT, K, 1], per tile the union entries starting before its last
  token's document start: the ascending union's prefix that can hold keys under a row's bound).
  maps: tile_union's (ub, bits, cnt) of tq-token tiles."""
  from pallas_kernels.compress_attention import run_starts  # (that module imports this one)
  ub, _, cnt = maps
  b, nt = ub.shape[:2]
  lo = jnp.pad(run_starts(seg), ((0, 0), (0, nt * tq - t)), mode="edge")
  last = lo.reshape(b, nt, tq)[:, :, -1]  # the tile's largest start (starts never decrease)
  live = jnp.arange(ub.shape[-1], dtype=jnp.int32) < cnt
  nlo = jnp.sum(live & (ub * BLOCK < last[:, :, None, None]), axis=-1, keepdims=True)
  return lo, nlo.astype(jnp.int32)


class _Walk(NamedTuple):
  cnt: jax.Array          # key blocks the tile walks
  block_of: Callable      # j -> the j-th block's index
  visible: Callable       # (j, blk, c_id) -> [ROWS, BLOCK] bool
  row_picked: Callable | None  # j -> [ROWS] bool: the row's token picked entry j (selection)
  fetch: Callable         # (j, slot): TMA block j's K and V into the slot
  c_id: jax.Array         # [ROWS, BLOCK] column (key within the block)
  pos: jax.Array          # [ROWS, BLOCK] the row's token position


def _walk(blocks, b, tile, kk, *, g, tq, k_ref, v_ref, k_s, v_s, k_bar, v_bar, slots=2,
          min_count=0):
  """A query tile's walk over its key blocks (a _Walk), blocks 0 .. slots-2 already in flight
  (slot i holds block i; at least min_count blocks, even past the tile's count). `blocks`
  returns (count, block_of, visible, picked(j, tok) or None) for the tile (_select_blocks /
  _cmp_blocks); the walk's row_picked(j) is picked on the [ROWS] token slots."""
  wg = plgpu.Layout.WGMMA
  r_id = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK), 0, layout=wg)
  c_id = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK), 1, layout=wg)
  tok = r_id // g                           # the row's token within the tile
  pos = tile * tq + tok                     # its position
  cnt, block_of, visible, picked = blocks(b, tile, kk, tok, pos)
  row_picked = None
  if picked is not None:  # per row, not per element: the [ROWS] token slots in the row layout
    tok_row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=wg.reduce(1)) // g
    row_picked = functools.partial(picked, tok=tok_row)

  last = k_ref.shape[2] // BLOCK - 1

  def fetch(j, slot, clamp=False, which="kv"):
    blk = block_of(j)
    # clamp (the prologue's constant j only): a short compression walk (block_of(j) = j) would
    # name a block past the array when traced; pl.when never runs those fetches
    keys = pl.ds((jnp.minimum(blk, last) if clamp else blk) * BLOCK, BLOCK)
    if "k" in which:
      plgpu.copy_gmem_to_smem(k_ref.at[b, kk, keys], k_s.at[slot], k_bar.at[slot])
    if "v" in which:
      plgpu.copy_gmem_to_smem(v_ref.at[b, kk, keys], v_s.at[slot], v_bar.at[slot])

  _prologue(functools.partial(fetch, clamp=True), jnp.maximum(cnt, min_count), slots)
  return _Walk(cnt, block_of, visible, row_picked, fetch, c_id, pos)


def _prologue(fetch, cnt, slots):
  """Steps 0 .. slots-2 in flight before the loop, step i in slot i (those below cnt)."""
  for i in range(slots - 1):
    @pl.when(cnt > i)
    def _(i=i):
      fetch(i, i)


def _prefetch(fetch, j, cnt, slots):
  """Step j's refill: block j + slots - 1 into the slot block j - 1 used (its wgmmas are done);
  returns step j's own slot."""
  ahead = j + slots - 1

  @pl.when(ahead < cnt)
  def _():
    fetch(ahead, lax.rem(ahead, slots))
  return lax.rem(j, slots)


def _tile_start(blocks, q_ref, k_ref, v_ref, scoped, *, g, tq, slots, min_count=0, ring=False):
  """The forwards' tile set-up: the query tile's TMA issued and the walk's first blocks in flight.
  Returns the buffers (q_s, k_s, v_s, p_s, o_s, lse_s; the output tile shares the query tile's
  memory with LEAN_SMEM), the barriers (q, K, V), (batch, group, the tile's rows) and the _Walk.
  ring (KV_RING): `scoped` holds one buffer array [3, 64, d] and its 3 barriers, returned as both
  K's and V's; K_0 -> buffer 0, V_0 -> 1 and K_1 -> 2 go in flight (those below the tile's count),
  and the walk's fetch(j, buffer, which="k" or "v") issues one of block j's copies."""
  if ring:
    (qo_s, kv_s, p_s, lse_s), (q_bar, kv_bar) = scoped
    k_s, v_s, k_bar, v_bar = kv_s, kv_s, kv_bar, kv_bar
  else:
    (qo_s, k_s, v_s, p_s, lse_s), (q_bar, k_bar, v_bar) = scoped
  q_s, o_s = _buffers(qo_s)
  tile, kk, b = lax.axis_index("tile"), lax.axis_index("group"), lax.axis_index("batch")
  rows = pl.ds(tile * ROWS, ROWS)
  plgpu.copy_gmem_to_smem(q_ref.at[b, kk, rows], q_s, q_bar.at[0])
  walk = _walk(blocks, b, tile, kk, g=g, tq=tq, k_ref=k_ref, v_ref=v_ref, k_s=k_s, v_s=v_s,
               k_bar=k_bar, v_bar=v_bar, slots=1 if ring else slots,  # ring: its own prologue
               min_count=min_count)
  if ring:
    @pl.when(walk.cnt > 0)
    def _():
      walk.fetch(0, 0, clamp=True, which="k")
      walk.fetch(0, 1, clamp=True, which="v")

    @pl.when(walk.cnt > 1)
    def _():
      walk.fetch(1, 2, clamp=True, which="k")
  return (q_s, k_s, v_s, p_s, o_s, lse_s), (q_bar, k_bar, v_bar), (b, kk, rows), walk


def ring_applies(dk, dv, overlap=False):
  """Whether the 64-row forward runs with the K/V ring: KV_RING on, d_k = d_v >= RING_MIN_DIM
  (one buffer shape; below 128 the ring does not raise occupancy and measured no gain), not the
  OVERLAP kernel (which keeps its own slots)."""
  return KV_RING and dk == dv and dk >= RING_MIN_DIM and not overlap


def _kernel(blocks, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, g, tq, dv, scale, dtype,
            interpret, slots=2, ring=False, doc_refs=None):
  """One 64-row tile against the key blocks that `blocks(b, tile, kk, tok, pos)` names: it returns
  (count, block_of(j), visible(j, blk, c_id) -> [64, 64] bool, row_picked or None) for the tile
  (see forward / cmp_forward). With row_picked (the selection) and FAST_MASK, the pick is a row
  bias and the causal mask applies at the last union entry only. ring: K and V in one ring of
  3 buffers (KV_RING; scoped as _tile_start's ring form). doc_refs: doc_maps' (SEGMENT_IDS)."""
  (q_s, k_s, v_s, p_s, o_s, lse_s), (q_bar, k_bar, v_bar), (b, kk, rows), walk = _tile_start(
      blocks, q_ref, k_ref, v_ref, scoped, g=g, tq=tq, slots=slots, ring=ring)
  cnt, block_of, visible, row_picked, fetch, c_id, pos = walk
  lo, nlo = _doc_bound(doc_refs, b, lax.axis_index("tile"), kk, tq, pos)
  plgpu.barrier_wait(q_bar.at[0])
  row_picked = row_picked if FAST_MASK else None

  def body(j, carry, causal=True, lower=lo is not None):
    acc, m_i, l_i = carry
    if ring:  # K_j in buffer 2j % 3, V_j in (2j + 1) % 3
      kslot, vslot = lax.rem(2 * j, 3), lax.rem(2 * j + 1, 3)
    else:
      kslot = vslot = _prefetch(fetch, j, cnt, slots)
    blk = block_of(j)
    plgpu.barrier_wait(k_bar.at[kslot])
    s = _mm(q_s, k_s.at[kslot].T, (ROWS, BLOCK))
    if ring:  # S_j is done with K_j's buffer: V_{j+1} goes there
      @pl.when(j + 1 < cnt)
      def _():
        fetch(j + 1, kslot, which="v")
    if row_picked is None:
      s = jnp.where(visible(j, blk, c_id), s * (scale * LOG2E), -jnp.inf)
    else:  # the token's pick as a row bias (one FMA an element); causal only where asked
      bias = jnp.where(row_picked(j), 0.0, -jnp.inf)
      s = s * (scale * LOG2E) + lax.broadcast_in_dim(bias, s.shape, [0])
      if causal:
        s = jnp.where(blk * BLOCK + c_id <= pos, s, -jnp.inf)
    if lower:  # keys before the row's document start
      s = jnp.where(blk * BLOCK + c_id >= lo, s, -jnp.inf)
    p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    plgpu.barrier_wait(v_bar.at[vslot])
    if REG_P and not interpret:  # P straight from registers (the interpreter's wgmma needs SMEM)
      p16 = p.astype(dtype)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_s.at[vslot])
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    else:
      p_s[...] = p.astype(dtype)
      plgpu.commit_smem()
      acc = _mm_acc(acc, p_s, v_s.at[vslot], interpret)
    if ring:  # P_j V_j is done with V_j's buffer: K_{j+2} goes there
      @pl.when(j + 2 < cnt)
      def _():
        fetch(j + 2, vslot, which="k")
    return acc, m_new, l_i

  if row_picked is None or tq == 1:  # (tq = 1: the token's own list, unsorted, -1 slots as 0)
    acc, m_i, l_i = lax.fori_loop(0, cnt, body, _softmax_init(dv))
  else:
    # The union is ascending and every token's blocks end at or before its own block, which all
    # tokens of a tile share (64 % tq == 0): only the last entry can hold keys after a token.
    # tile_union sorts only for tq > 1; with one token a tile (G = 64) every step is masked.
    acc, m_i, l_i = _causal_last_loop(body, cnt, _softmax_init(dv), nlo)
  _store(acc, m_i, l_i, o_s, lse_s, o_ref.at[b, kk, rows], lse_ref.at[b, kk, rows], dtype)


def _kernel_overlap(blocks, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, g, tq, dv, scale,
                    dtype, interpret, slots):
  """_kernel's selection walk (FAST_MASK: the pick as a row bias, the causal mask at the last
  union entry only) with S_{j+1} = Q K_{j+1}^T computed while P_j V_j runs (OVERLAP).

  Step j (0 <= j < n - 1, n = max(cnt, 1)): refill the slot of block j - 1 with block j + slots
  - 1; issue S_{j+1}, then P_j V_j into a fresh accumulator; wait for S_{j+1} only and run its
  online-softmax step; wait for P_j V_j; acc = acc * alpha_j + P_j V_j. Block 0's scores come
  before the loop and P_{n-1} V_{n-1} after it. A tile with an empty union (cnt = 0) walks block 0
  with every row masked (its bits are 0): o = 0, lse = -inf, as _kernel."""
  (q_s, k_s, v_s, p_s, o_s, lse_s), (q_bar, k_bar, v_bar), (b, kk, rows), walk = _tile_start(
      blocks, q_ref, k_ref, v_ref, scoped, g=g, tq=tq, slots=slots, min_count=1)
  cnt, block_of, _, row_picked, fetch, c_id, pos = walk
  n = jnp.maximum(cnt, 1)  # an empty union (ub = 0, bits = 0) walks block 0, every row masked

  def logits(j, s, causal):
    """Masked base-2 logits of union entry j: the token's pick as a row bias; causal if asked
    (only the last entry can hold keys after a row's token; on others the mask is a no-op)."""
    bias = jnp.where(row_picked(j), 0.0, -jnp.inf)
    s = s * (scale * LOG2E) + lax.broadcast_in_dim(bias, s.shape, [0])
    if causal:
      s = jnp.where(block_of(j) * BLOCK + c_id <= pos, s, -jnp.inf)
    return s

  def pv_issue(pv_ref, p16, slot):
    if interpret:  # the interpreter's wgmma takes its A operand from shared memory only
      p_s[...] = p16
      plgpu.commit_smem()
      plgpu.wgmma(pv_ref, p_s, v_s.at[slot])
    else:
      plgpu.wgmma(pv_ref, p16, v_s.at[slot])

  plgpu.barrier_wait(q_bar.at[0])
  plgpu.barrier_wait(k_bar.at[0])
  acc, m_i, l_i = _softmax_init(dv)
  p, alpha, m_i, l_i = _softmax_step(logits(0, _mm(q_s, k_s.at[0].T, (ROWS, BLOCK)), True),
                                     m_i, l_i)

  def body(j, carry, causal):
    acc, m_i, l_i, p16, alpha = carry
    cur, nxt = _prefetch(fetch, j, n, slots), lax.rem(j + 1, slots)
    plgpu.barrier_wait(k_bar.at[nxt])
    plgpu.barrier_wait(v_bar.at[cur])

    def step(s_ref, pv_ref):
      plgpu.wgmma(s_ref, q_s, k_s.at[nxt].T)
      pv_issue(pv_ref, p16, cur)
      s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_{j+1} done, P_j V_j in flight
      p, alpha_n, m_n, l_n = _softmax_step(logits(j + 1, s, causal), m_i, l_i)
      return plgpu.wgmma_accumulator_load(pv_ref, wait_n=0), p.astype(dtype), alpha_n, m_n, l_n
    pv, p16, alpha_n, m_n, l_n = pl.run_scoped(step, plgpu.ACC((ROWS, BLOCK), jnp.float32),
                                               plgpu.ACC((ROWS, dv), jnp.float32))
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_n, l_n, p16, alpha_n

  # Entries 1 .. n-2 need no causal mask; entry n-1 (the tiles' own block) does.
  carry = (acc, m_i, l_i, p.astype(dtype), alpha)
  carry = lax.fori_loop(0, n - 2, functools.partial(body, causal=False), carry)
  acc, m_i, l_i, p16, alpha = lax.fori_loop(jnp.maximum(n - 2, 0), n - 1,
                                            functools.partial(body, causal=True), carry)
  cur = lax.rem(n - 1, slots)
  plgpu.barrier_wait(v_bar.at[cur])

  def tail(pv_ref):
    pv_issue(pv_ref, p16, cur)
    return plgpu.wgmma_accumulator_load(pv_ref, wait_n=0)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pl.run_scoped(
      tail, plgpu.ACC((ROWS, dv), jnp.float32))
  _store(acc, m_i, l_i, o_s, lse_s, o_ref.at[b, kk, rows], lse_ref.at[b, kk, rows], dtype)


def overlap_slots(dk, dv):
  """K/V slots of the OVERLAP forward: max(3, FWD_SLOTS) capped by shared memory; 0 where three
  do not fit (that call runs _kernel)."""
  slots = _cap_slots(max(3, FWD_SLOTS), lambda s: _fwd_smem(dk, dv, s))
  return slots if slots >= 3 else 0  # _cap_slots keeps more than 2 only where they fit


def _run(blocks, maps, q, kg, vg, *, kh, nt, tq, scale, interpret, overlap=False, docs=None):
  """Launch the kernel over (tiles, groups, batch): o [B,T,H,Dv], lse [B,T,H] (q's T).
  overlap: the selection walk as _kernel_overlap (the caller checked it applies). docs: doc_maps'
  arrays (the selection with documents; not with overlap)."""
  b, t, h, dk = q.shape
  g, dv, dtype = h // kh, vg.shape[-1], q.dtype
  tp = nt * tq
  tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(SWIZZLE))
  slots = overlap_slots(dk, dv) if overlap else fwd_slots(dk, dv)
  ring = ring_applies(dk, dv, overlap)
  kernel = _kernel_overlap if overlap else functools.partial(_kernel, ring=ring)
  qo = _shared(plgpu.SMEM((ROWS, dk), dtype, transforms=tr),
               plgpu.SMEM((ROWS, dv), dtype, transforms=tr))
  p_st = plgpu.SMEM((ROWS, BLOCK), dtype, transforms=tr) if _staging(interpret) else None
  lse_st = plgpu.SMEM((ROWS,), jnp.float32)
  if ring:  # K and V in one ring of 3 buffers (_tile_start's ring form)
    scoped = ((qo, plgpu.SMEM((3, BLOCK, dk), dtype, transforms=tr), p_st, lse_st),
              (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=3)))
  else:
    scoped = ((qo, plgpu.SMEM((slots, BLOCK, dk), dtype, transforms=tr),
               plgpu.SMEM((slots, BLOCK, dv), dtype, transforms=tr), p_st, lse_st),
              (plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=slots),
               plgpu.Barrier(num_barriers=slots)))

  nm = len(maps)

  def entry(*refs):
    *map_refs, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    kw = {} if docs is None else {"doc_refs": tuple(map_refs[nm:])}
    pl.run_scoped(
        lambda *s: kernel(functools.partial(blocks, *map_refs[:nm]), q_ref, k_ref, v_ref, o_ref,
                          lse_ref, s, g=g, tq=tq, dv=dv, scale=scale, dtype=dtype,
                          interpret=interpret, slots=slots, **kw),
        *scoped)

  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, kh, tp * g, dv), dtype),
                jax.ShapeDtypeStruct((b, kh, tp * g), jnp.float32)),
      grid=(nt, kh, b), grid_names=("tile", "group", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*maps, *(docs or ()), _rows_major(q, kh, tp), kg, vg)
  return _from_rows_major(o, h, t), _from_rows_major(lse, h, t)


def _select_blocks(ub_ref, bits_ref, cnt_ref, b, tile, kk, tok, pos):
  """Selection: the union list of the tile; a row sees a block its token picked, causally.
  Also picked(j, tok): whether token slots tok (any shape) picked union entry j."""
  def picked(j, tok):
    bits = bits_ref[b, tile, kk, j]
    return (lax.shift_right_logical(jnp.broadcast_to(bits, tok.shape), tok) & 1) == 1

  def visible(j, blk, c_id):
    return picked(j, tok) & (blk * BLOCK + c_id <= pos)
  return cnt_ref[b, tile, kk, 0], lambda j: ub_ref[b, tile, kk, j], visible, picked


def _cmp_blocks(b, tile, kk, tok, pos, *, tq, t, nc, block, stride):
  """Compression: compressed keys 0 .. (what the tile's last token sees), 64 a step; key i is
  visible to position p iff i*d + l - 1 <= p (and i < Nc)."""
  from pallas_kernels.compress_attention import num_visible  # (that module imports this one)
  nv = num_visible(jnp.minimum(tile * tq + tq - 1, t - 1), block, stride, nc)

  def visible(j, blk, c_id):
    kidx = blk * BLOCK + c_id
    return (kidx * stride + (block - 1) <= pos) & (kidx < nc)
  return (nv + BLOCK - 1) // BLOCK, lambda j: j, visible, None


def forward(q, k, v, maps, *, block_size, scale, interpret=False, seg=None):
  """(o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32) from the union maps of `tiling_for(G, l')`.

  The maps must come from lists without blocks that start after their token (select_attention
  drops those first): with FAST_MASK the causal mask is applied at the last union entry only.
  seg: [B, T] int32 document ids, contiguous runs (SEGMENT_IDS; no OVERLAP walk then)."""
  ok, why = supports(q.shape, k.shape, v.shape, block_size, seg is not None, q.dtype)
  if not ok:
    raise ValueError(f"select_attention[mosaic] does not support this call: {why}")
  b, t, h, dk = q.shape
  kh = k.shape[2]
  tq, nt = _tiles(t, h // kh)
  docs = None if seg is None else doc_maps(seg, maps, t, tq)
  return _run(_select_blocks, maps, q, _blocks_major(k), _blocks_major(v), kh=kh, nt=nt, tq=tq,
              scale=scale, interpret=interpret, docs=docs,
              overlap=seg is None and overlap_applies(tq, dk, v.shape[3], interpret))


def forward_runs_ring(g, dk, dv, interpret=False):
  """Whether forward() runs the K/V ring for G query heads a group (its OVERLAP choice included):
  what select_attention's log line and the benchmarks' labels report."""
  return ring_applies(dk, dv, overlap_applies(_tiles(1, g)[0], dk, dv, interpret))


def overlap_applies(tq, dk, dv, interpret=False):
  """Whether forward() runs _kernel_overlap: OVERLAP on, FAST_MASK on, union tiles (tq > 1: an
  ascending union, causal at its last entry only), P from registers on the GPU (REG_P; the
  interpreter stages it in shared memory), and three K/V slots fit."""
  return (OVERLAP and FAST_MASK and tq > 1 and (REG_P or interpret)
          and overlap_slots(dk, dv) >= 3)


# ----------------------------------------------------------------------------- selection forward,
# two consumer warpgroups
# Measured on the H200 (2026-11-30, benchmarks/results/select_h200_mosaicws*.md): correct, but slower
# than the 64-row forward at every measured shape (64k G=16 clustered 9.42 vs 9.07 ms, random 29.6 vs
# 20.8; 8k layer 2.25 vs 1.36). At G=16 its 128 rows are 8 tokens, whose union of block lists is
# larger than 4 tokens', so each row does more work. The registry does not pick it.

WS_ROWS = 2 * ROWS        # a tile: two 64-row halves, one per consumer warpgroup
WS_SMEM = 220 * 1024      # bytes of shared memory the slots may fill up to (H200: 227 KiB a block)
WS_PINGPONG = True        # the consumers' ping-pong barrier by default (a benchmark switches it)


def ws_tiling_for(g, block_size):
  """The union tiling of the warp-specialised forward: 128 rows = 128 / G tokens (G >= 8)."""
  import dataclasses
  return dataclasses.replace(tiling_for(g, block_size), tokens_per_tile=WS_ROWS // g)


def ws_slots(dk, dv):
  """K/V slots the warp-specialised forward keeps in flight (0: does not fit)."""
  fixed = 2 * ROWS * (dk + dv) * 2 + 2 * ROWS * 4  # q and o halves (bf16), lse halves
  per_slot = BLOCK * (dk + dv) * 2
  return min(4, max(0, (WS_SMEM - fixed) // per_slot))


def ws_supports(q_shape, k_shape, v_shape, block_size, has_seg, dtype):
  """(ok, reason): whether the warp-specialised forward handles this call (G >= 8: at most 16
  tokens a 128-row tile; at least two K/V slots in shared memory; no segment ids)."""
  if has_seg:
    return False, ("segment ids are not implemented in the two-warpgroup forward (pass "
                   "tiling=None: the 64-row tile takes them)")
  ok, why = supports(q_shape, k_shape, v_shape, block_size, has_seg, dtype)
  if not ok:
    return ok, why
  g = q_shape[2] // k_shape[2]
  if g < 8:
    return False, f"G={g}: the 128-row tile would hold {WS_ROWS // g} tokens (at most 16)"
  if ws_slots(q_shape[3], v_shape[3]) < 2:
    return False, f"d_k={q_shape[3]}, d_v={v_shape[3]}: two K/V slots do not fit in shared memory"
  return True, "ok"


def _ws_kernel(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, g, tq,
               dv, scale, dtype, slots, pingpong, interpret):
  """A 128-row union tile with three warpgroups (FlashAttention-3's layout, applied to the
  union walk): warpgroup 2 only issues the TMA copies of the union's blocks, `slots` deep,
  refilling a slot once both consumers have released it; warpgroups 0 and 1 each own 64 rows
  (half the tile's tokens) and run the online softmax of _kernel over the same block sequence.
  With `pingpong`, a shared barrier orders the two consumers so that one's matrix products run
  while the other does its softmax."""
  (q_s, k_s, v_s, o_s, lse_s, *p_s), (q_bar, k_bar, v_bar), (k_free, v_free), sched = scoped
  wgi = lax.axis_index("wg")
  tile, kk, b = lax.axis_index("tile"), lax.axis_index("group"), lax.axis_index("batch")
  cnt = cnt_ref[b, tile, kk, 0]
  block_of = lambda j: ub_ref[b, tile, kk, j]

  def sync():  # both consumers reach this point (the ping-pong handshake)
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)

  @pl.when(wgi < 2)
  def _consumer():
    if not interpret:
      plgpu.set_max_registers(232, action="increase")
    rows = pl.ds(tile * WS_ROWS + wgi * ROWS, ROWS)
    q_w, o_w, lse_w = q_s.at[wgi], o_s.at[wgi], lse_s.at[wgi]
    plgpu.copy_gmem_to_smem(q_ref.at[b, kk, rows], q_w, q_bar.at[wgi])
    wg = plgpu.Layout.WGMMA
    r_id = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK), 0, layout=wg)
    c_id = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK), 1, layout=wg)
    tok = r_id // g + wgi * (ROWS // g)       # the row's token within the 128-row tile
    pos = tile * tq + tok
    plgpu.barrier_wait(q_bar.at[wgi])
    if pingpong:
      pl.when(wgi == 1)(sync)

    def body(j, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(j, slots)
      blk = block_of(j)
      plgpu.barrier_wait(k_bar.at[slot])

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_w, k_s.at[slot].T)
        if pingpong:
          sync()
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((ROWS, BLOCK), jnp.float32)) * (scale * LOG2E)
      plgpu.barrier_arrive(k_free.at[slot])
      bits = bits_ref[b, tile, kk, j]
      on = (lax.shift_right_logical(jnp.broadcast_to(bits, (ROWS, BLOCK)), tok) & 1) == 1
      s = jnp.where(on & (blk * BLOCK + c_id <= pos), s, -jnp.inf)
      p, alpha, m_new, l_i = _softmax_step(s, m_i, l_i)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(dtype)
      if pingpong:
        plgpu.barrier_arrive(sched)     # softmax done
      plgpu.barrier_wait(v_bar.at[slot])
      if pingpong:
        plgpu.barrier_wait(sched)       # the other consumer's products are issued
      if interpret:  # the interpreter's wgmma takes its A operand from shared memory only
        p_s[0].at[wgi][...] = p16
        acc = acc + _mm(p_s[0].at[wgi], v_s.at[slot], acc.shape)
      else:  # P straight from registers
        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_s.at[slot])
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(0, cnt, body, _softmax_init(dv))
    if pingpong:
      pl.when(wgi == 0)(sync)
    _store(acc, m_i, l_i, o_w, lse_w, o_ref.at[b, kk, rows], lse_ref.at[b, kk, rows], dtype)

  @pl.when(wgi == 2)
  def _producer():
    if not interpret:
      plgpu.set_max_registers(40, action="decrease")

    def fetch(j, slot, wait=False):  # wait: for both consumers to release the slot's K (V)
      keys = pl.ds(block_of(j) * BLOCK, BLOCK)
      if wait:
        plgpu.barrier_wait(k_free.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[b, kk, keys], k_s.at[slot], k_bar.at[slot])
      if wait:
        plgpu.barrier_wait(v_free.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, kk, keys], v_s.at[slot], v_bar.at[slot])

    for i in range(slots):
      pl.when(i < cnt)(functools.partial(fetch, i, i))

    @pl.loop(slots, jnp.maximum(cnt, slots))
    def _(j):
      fetch(j, lax.rem(j, slots), wait=True)  # the slot last held block j - slots


def ws_forward(q, k, v, maps, *, block_size, scale, pingpong=None, interpret=False):
  """forward() with 128-row tiles and two consumer warpgroups; `maps` from ws_tiling_for(G, l').
  pingpong: None = WS_PINGPONG."""
  pingpong = WS_PINGPONG if pingpong is None else pingpong
  ok, why = ws_supports(q.shape, k.shape, v.shape, block_size, False, q.dtype)
  if not ok:
    raise ValueError(f"select_attention[mosaic, two warpgroups] does not support this call: {why}")
  b, t, h, dk = q.shape
  kh, dv, dtype = k.shape[2], v.shape[3], q.dtype
  g = h // kh
  tq, nt = _tiles(t, g, WS_ROWS)
  slots = ws_slots(dk, dv)
  tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(SWIZZLE))

  def entry(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    pl.run_scoped(
        lambda *s: _ws_kernel(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, s,
                              g=g, tq=tq, dv=dv, scale=scale, dtype=dtype, slots=slots,
                              pingpong=pingpong, interpret=interpret),
        (plgpu.SMEM((2, ROWS, dk), dtype, transforms=tr),
         plgpu.SMEM((slots, BLOCK, dk), dtype, transforms=tr),
         plgpu.SMEM((slots, BLOCK, dv), dtype, transforms=tr),
         plgpu.SMEM((2, ROWS, dv), dtype, transforms=tr),
         plgpu.SMEM((2, ROWS), jnp.float32))
        + ((plgpu.SMEM((2, ROWS, BLOCK), dtype, transforms=tr),) if interpret else ()),
        (plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=slots),
         plgpu.Barrier(num_barriers=slots)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=slots),) * 2,
        plgpu.Barrier(num_arrivals=2),
        collective_axes="wg")

  o, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, kh, nt * tq * g, dv), dtype),
                jax.ShapeDtypeStruct((b, kh, nt * tq * g), jnp.float32)),
      grid=(nt, kh, b), grid_names=("tile", "group", "batch"),
      num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*maps, _rows_major(q, kh, nt * tq), _blocks_major(k), _blocks_major(v))
  return _from_rows_major(o, h, t), _from_rows_major(lse, h, t)


def cmp_supports(q_shape, kc_shape, vc_shape, has_seg, dtype):
  """(ok, reason): whether the Mosaic GPU compression forward handles this call."""
  if kc_shape[2] % BLOCK:   # kc/vc group-major [B, K, Ncp, D]
    return False, f"{kc_shape[2]} padded compressed keys: need a multiple of {BLOCK}"
  return _check(q_shape[2], kc_shape[1], q_shape[3], vc_shape[3], has_seg, dtype,
                "Mosaic GPU compression kernel")


def cmp_forward(q, kc, vc, *, nc, block, stride, scale, interpret=False):
  """Compression-branch forward: q [B,T,H,Dk], kc/vc group-major [B,K,Ncp,D] (Ncp a multiple of
  64, zero-padded past nc) -> (o [B,T,H,Dv], lse [B,T,H]) as compress_attention's."""
  ok, why = cmp_supports(q.shape, kc.shape, vc.shape, False, q.dtype)
  if not ok:
    raise ValueError(f"compress_attention[mosaic] does not support this call: {why}")
  b, t, h, _ = q.shape
  kh = kc.shape[1]
  tq, nt = _tiles(t, h // kh)
  blocks = functools.partial(_cmp_blocks, tq=tq, t=t, nc=nc, block=block, stride=stride)
  return _run(blocks, (), q, kc, vc, kh=kh, nt=nt, tq=tq, scale=scale, interpret=interpret)


# ----------------------------------------------------------------------------- selection dq

def _dq_kernel(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
               scoped, *, g, tq, dk, dv, scale, dtype, interpret, slots=2, doc_refs=None):
  """dq of one 64-row tile: for each union block, S = Q K^T, P = exp2(S - lse) on visible keys,
  dP = dO V^T, dS = P (dP - delta), dq += dS K (P and dS never leave the tile)."""
  (q_s, do_s, lse_s, delta_s, k_s, v_s, ds_s), (in_bar, k_bar, v_bar) = scoped
  tile, kk, b = lax.axis_index("tile"), lax.axis_index("group"), lax.axis_index("batch")
  rows = pl.ds(tile * ROWS, ROWS)
  plgpu.copy_gmem_to_smem(q_ref.at[b, kk, rows], q_s, in_bar.at[0])
  plgpu.copy_gmem_to_smem(do_ref.at[b, kk, rows], do_s, in_bar.at[1])
  plgpu.copy_gmem_to_smem(lse_ref.at[b, kk, rows], lse_s, in_bar.at[2])
  plgpu.copy_gmem_to_smem(delta_ref.at[b, kk, rows], delta_s, in_bar.at[3])
  wg = plgpu.Layout.WGMMA
  blocks = functools.partial(_select_blocks, ub_ref, bits_ref, cnt_ref)
  cnt, block_of, visible, row_picked, fetch, c_id, pos = _walk(
      blocks, b, tile, kk, g=g, tq=tq, k_ref=k_ref, v_ref=v_ref, k_s=k_s, v_s=v_s, k_bar=k_bar,
      v_bar=v_bar, slots=slots)
  lo, nlo = _doc_bound(doc_refs, b, tile, kk, tq, pos)
  for i in range(4):
    plgpu.barrier_wait(in_bar.at[i])
  lse2 = plgpu.load(lse_s, layout=wg.reduce(1)) * LOG2E
  lse2 = jnp.where(lse2 == -jnp.inf, 0.0, lse2)  # rows that saw nothing: every p is masked to 0
  delta = plgpu.load(delta_s, layout=wg.reduce(1))

  fast, regs = FAST_MASK, REG_P and not interpret

  def body(j, dq_acc, causal=True, lower=lo is not None):
    slot = _prefetch(fetch, j, cnt, slots)
    blk = block_of(j)
    plgpu.barrier_wait(k_bar.at[slot])
    if regs:  # S and dP issued back to back, one wait for both
      plgpu.barrier_wait(v_bar.at[slot])

      def both(refs):
        plgpu.wgmma(refs[0], q_s, k_s.at[slot].T)
        plgpu.wgmma(refs[1], do_s, v_s.at[slot].T)
      zeros = plgpu.layout_cast(jnp.zeros((ROWS, BLOCK), jnp.float32), wg)
      s, dp = pl.run_state(both)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
    else:
      s = _mm(q_s, k_s.at[slot].T, (ROWS, BLOCK))
    if fast:  # the token's pick folded into the row's shift (+inf: p = 0); causal where asked
      shift = jnp.where(row_picked(j), lse2, jnp.inf)
      p = jnp.exp2(s * (scale * LOG2E) - lax.broadcast_in_dim(shift, s.shape, [0]))
      if causal:
        p = jnp.where(blk * BLOCK + c_id <= pos, p, 0.0)
    else:
      p = jnp.where(visible(j, blk, c_id),
                    jnp.exp2(s * (scale * LOG2E) - lax.broadcast_in_dim(lse2, s.shape, [0])), 0.0)
    if lower:  # keys before the row's document start
      p = jnp.where(blk * BLOCK + c_id >= lo, p, 0.0)
    if not regs:
      plgpu.barrier_wait(v_bar.at[slot])
      dp = _mm(do_s, v_s.at[slot].T, (ROWS, BLOCK))
    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
    if regs:  # dS straight from registers
      ds16 = ds.astype(dtype)

      def dq_mm(acc_ref):
        plgpu.wgmma(acc_ref, ds16, k_s.at[slot])
      return pl.run_state(dq_mm)(plgpu.ACC.init(dq_acc))
    ds_s[...] = ds.astype(dtype)
    plgpu.commit_smem()
    return _mm_acc(dq_acc, ds_s, k_s.at[slot], interpret)

  init = plgpu.layout_cast(jnp.zeros((ROWS, dk), jnp.float32), wg)
  if fast and tq > 1:  # as in the forward: only the last (ascending) union entry can need the
    # causal mask (with tq = 1 the list is the token's own, unsorted: every step is masked)
    dq = _causal_last_loop(body, cnt, init, nlo)
  else:
    dq = lax.fori_loop(0, cnt, body, init)
  q_s[...] = (dq * scale).astype(dtype)  # q is no longer needed: its buffer stages dq
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, kk, rows])
  plgpu.wait_smem_to_gmem(0)


def dq(q, k, v, maps, do, lse, delta, *, block_size, scale, interpret=False, seg=None):
  """dq [B,T,H,Dk] of the selection (lse natural-log [B,T,H]; delta = rowsum(o * do) - dlse).
  Same precondition on the maps as forward(); seg as forward's."""
  ok, why = supports(q.shape, k.shape, v.shape, block_size, seg is not None, q.dtype)
  if not ok:
    raise ValueError(f"select_attention[mosaic] does not support this call: {why}")
  b, t, h, dk = q.shape
  kh, dv = k.shape[2], v.shape[3]
  g, dtype = h // kh, q.dtype
  tq, nt = _tiles(t, g)
  tp = nt * tq
  rows_major = functools.partial(_rows_major, kh=kh, tp=tp)
  tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(SWIZZLE))
  slots = fwd_slots(dk, dv, dq=True)

  docs = () if seg is None else doc_maps(seg, maps, t, tq)

  def entry(ub_ref, bits_ref, cnt_ref, *refs):
    *doc_refs, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
    pl.run_scoped(
        lambda *s: _dq_kernel(ub_ref, bits_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                              delta_ref, dq_ref, s, g=g, tq=tq, dk=dk, dv=dv, scale=scale,
                              dtype=dtype, interpret=interpret, slots=slots,
                              doc_refs=tuple(doc_refs) or None),
        (plgpu.SMEM((ROWS, dk), dtype, transforms=tr),
         plgpu.SMEM((ROWS, dv), dtype, transforms=tr),
         plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),
         plgpu.SMEM((slots, BLOCK, dk), dtype, transforms=tr),
         plgpu.SMEM((slots, BLOCK, dv), dtype, transforms=tr),
         plgpu.SMEM((ROWS, BLOCK), dtype, transforms=tr) if _staging(interpret) else None),
        (plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_barriers=slots),
         plgpu.Barrier(num_barriers=slots)))

  out = plgpu.kernel(
      entry, out_type=jax.ShapeDtypeStruct((b, kh, tp * g, dk), dtype),
      grid=(nt, kh, b), grid_names=("tile", "group", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*maps, *docs, rows_major(q), _blocks_major(k), _blocks_major(v), rows_major(do.astype(dtype)),
    rows_major(lse.astype(jnp.float32)), rows_major(delta.astype(jnp.float32)))
  return _from_rows_major(out, h, t)


# ----------------------------------------------------------------------------- selection dK / dV

SMEM_BYTES = 232448  # an H100/H200 block's shared memory


def _dkv_smem(dk, dv, slots):
  """Shared memory of the dK/dV kernel: K, V, `slots` slots of q/do/lse/delta, P^T, float32
  dK/dV staging (2 slots: 640 (d_k + d_v) + 9216 bytes). This and _fwd_smem count the separate
  buffers (LEAN_SMEM off): with LEAN_SMEM the kernels need less, so the slot caps and
  dkv_supports built on them are conservative (shapes measured and compiled with them only)."""
  return (384 + 128 * slots) * (dk + dv) + 512 * slots + 8192


def _fwd_smem(dk, dv, slots, dq=False):
  """Shared memory of the forward (q, K/V slots, P, o, lse) or dq (q, dO, lse, delta, K/V slots,
  dS) kernel."""
  rows = ROWS * (dk + dv) * 2 + 2 * ROWS * 4 if dq else ROWS * (dk + dv) * 2 + ROWS * 4
  return rows + slots * BLOCK * (dk + dv) * 2 + ROWS * BLOCK * 2


def _cap_slots(want, smem):
  """want slots (at least 2), fewer while smem(slots) bytes exceed shared memory."""
  slots = max(2, want)
  while slots > 2 and smem(slots) > SMEM_BYTES:
    slots -= 1
  return slots


def fwd_slots(dk, dv, dq=False):
  """FWD_SLOTS, capped where shared memory runs out (at least 2)."""
  return _cap_slots(FWD_SLOTS, lambda s: _fwd_smem(dk, dv, s, dq))


def dkv_slots(dk, dv):
  """DKV_SLOTS, capped where shared memory runs out (at least 2)."""
  return _cap_slots(DKV_SLOTS, lambda s: _dkv_smem(dk, dv, s))


def dkv_supports(g, dk, dv):
  """The dK/dV kernel gathers each token's G query rows with one copy into an 8-row-tiled buffer;
  its shared memory with two slots (_dkv_smem) must fit."""
  if g % 8 or ROWS % g:
    return False, f"G={g}: the Mosaic GPU dK/dV needs G in (8, 16, 32, 64)"
  need = _dkv_smem(dk, dv, 2)
  if need > SMEM_BYTES:
    return False, f"d_k + d_v = {dk + dv}: {need} bytes of shared memory (at most {SMEM_BYTES})"
  return True, "ok"


def _dkv_kernel(iblk_ref, istart_ref, iend_ref, tokens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, scoped, *, g, tq, n_entries, dk, dv, scale, dtype,
                interpret, slots=2, doc_refs=None):
  """One work item (a block and a run of the queries that picked it, see C.inverse_lists): K, V of
  the block stay in shared memory; each step gathers tq tokens x G heads = 64 query rows (one copy
  per token and tensor, DKV_SLOTS deep) and accumulates dV += P^T dO and dK += dS^T Q.
  doc_refs (DKV_SEGMENT_IDS): (lo [B, T] each token's document start, nplain and nlive [B, K, W]
  from dkv_doc_counts): the item ends after nlive entries and masks keys before each token's
  document start from entry nplain on (and in the causal steps)."""
  (k_s, v_s, rows_s, pt_s), (kv_bar, row_bars) = scoped
  # the float32 result staging reuses the query-row slots' memory (LEAN_SMEM)
  q_s, do_s, lse_s, delta_s, dkt_s, dvt_s = _buffers(rows_s)
  w, kk, b = lax.axis_index("item"), lax.axis_index("group"), lax.axis_index("batch")
  blk, e0, e1 = iblk_ref[b, kk, w], istart_ref[b, kk, w], iend_ref[b, kk, w]
  docs = doc_refs is not None
  if docs:
    lo_ref, nplain_ref, nlive_ref = doc_refs
    e1 = e0 + nlive_ref[b, kk, w]  # later entries' documents start after the block: no keys
    nplain = nplain_ref[b, kk, w]
  keys = pl.ds(blk * BLOCK, BLOCK)
  plgpu.copy_gmem_to_smem(k_ref.at[b, kk, keys], k_s, kv_bar.at[0])
  plgpu.copy_gmem_to_smem(v_ref.at[b, kk, keys], v_s, kv_bar.at[1])
  steps = (e1 - e0 + tq - 1) // tq

  def token(i, s):
    e = e0 + i * tq + s
    return tokens_ref[b, kk, jnp.minimum(e, n_entries - 1)], e < e1

  def fetch(i, slot):
    # Token s of step i -> rows [s*G, (s+1)*G) of the slot; all 4 tq copies of a step arrive on
    # the slot's one barrier (Mosaic GPU allows at most 32 barriers a group: 2*4*tq would be 64
    # at G = 8). lse / delta rows are G floats at 32- or 64-byte offsets: in-bounds plain bulk
    # copies (16-byte alignment), not tensor TMAs (128-byte aligned shared-memory addresses).
    for s in range(tq):
      pos, _ = token(i, s)
      src, dst, bar = pl.ds(pos * g, g), pl.ds(s * g, g), row_bars.at[slot]
      plgpu.copy_gmem_to_smem(q_ref.at[b, kk, src], q_s.at[slot, dst], bar)
      plgpu.copy_gmem_to_smem(do_ref.at[b, kk, src], do_s.at[slot, dst], bar)
      for ref, buf in ((lse_ref, lse_s), (delta_ref, delta_s)):
        plgpu.copy_gmem_to_smem(ref.at[b, kk, src], buf.at[slot, dst], bar,
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

  _prologue(fetch, steps, slots)

  wg = plgpu.Layout.WGMMA
  kp = blk * BLOCK + plgpu.broadcasted_iota(jnp.int32, (BLOCK, ROWS), 0, layout=wg)  # key position
  fast, regs = FAST_MASK, REG_P and not interpret
  if fast:
    col_vec = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=wg.reduce(0)) // g
  else:
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK, ROWS), 1, layout=wg) // g     # token slot
  plgpu.barrier_wait(kv_bar.at[0])
  plgpu.barrier_wait(kv_bar.at[1])

  def body(i, carry, causal=True, lower=docs):
    """One step of tq tokens. FAST_MASK: the tokens' positions and liveness as [ROWS] column
    vectors, liveness folded into the column's shift (+inf: P = 0), the causal compare only where
    asked; else [BLOCK, ROWS] masks. REG_P (on the GPU): P^T and dS^T straight from registers,
    dV and dP^T issued with one wait; else staged through SMEM. lower: keys before the token's
    document start get P = 0 (doc_refs)."""
    dk_acc, dv_acc = carry
    slot = _prefetch(fetch, i, steps, slots)
    plgpu.barrier_wait(row_bars.at[slot])
    ids = col_vec if fast else col  # the token slot of each column
    pos_c = jnp.zeros(ids.shape, jnp.int32)
    live_c = jnp.zeros(ids.shape, jnp.bool_)
    lo_c = jnp.zeros(ids.shape, jnp.int32) if lower else None
    for s in range(tq):
      pos, live = token(i, s)
      pos_c = jnp.where(ids == s, pos, pos_c)
      live_c = jnp.where(ids == s, live, live_c)
      if lower:
        lo_c = jnp.where(ids == s, lo_ref[b, pos], lo_c)
    st = _mm(k_s, q_s.at[slot].T, (BLOCK, ROWS)) * (scale * LOG2E)
    lse2 = plgpu.load(lse_s.at[slot], layout=wg.reduce(0)) * LOG2E
    if fast:
      shift = jnp.where(live_c & (lse2 != -jnp.inf), lse2, jnp.inf)
      pt = jnp.exp2(st - lax.broadcast_in_dim(shift, st.shape, [1]))
      if causal:
        pt = jnp.where(kp <= lax.broadcast_in_dim(pos_c, st.shape, [1]), pt, 0.0)
    else:
      lse2 = jnp.where(lse2 == -jnp.inf, 0.0, lse2)
      pt = jnp.where(live_c & (kp <= pos_c),
                     jnp.exp2(st - lax.broadcast_in_dim(lse2, st.shape, [1])), 0.0)
    if lower:
      lo_kt = lax.broadcast_in_dim(lo_c, st.shape, [1]) if fast else lo_c
      pt = jnp.where(kp >= lo_kt, pt, 0.0)
    if regs:
      pt16 = pt.astype(dtype)

      def dv_dpt(refs):
        plgpu.wgmma(refs[0], pt16, do_s.at[slot])
        plgpu.wgmma(refs[1], v_s, do_s.at[slot].T)
      zeros_t = plgpu.layout_cast(jnp.zeros((BLOCK, ROWS), jnp.float32), wg)
      dv_acc, dpt = pl.run_state(dv_dpt)((plgpu.ACC.init(dv_acc), plgpu.ACC.init(zeros_t)))
    else:
      pt_s[...] = pt.astype(dtype)
      plgpu.commit_smem()
      dv_acc = _mm_acc(dv_acc, pt_s, do_s.at[slot], interpret)
      dpt = _mm(v_s, do_s.at[slot].T, (BLOCK, ROWS))
    delta = plgpu.load(delta_s.at[slot], layout=wg.reduce(0))
    dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
    if regs:
      dst16 = dst.astype(dtype)

      def dk_mm(acc_ref):
        plgpu.wgmma(acc_ref, dst16, q_s.at[slot])
      return pl.run_state(dk_mm)(plgpu.ACC.init(dk_acc)), dv_acc
    pt_s[...] = dst.astype(dtype)  # P^T's wgmma has finished: its buffer takes dS^T
    plgpu.commit_smem()
    return _mm_acc(dk_acc, pt_s, q_s.at[slot], interpret), dv_acc

  zeros = lambda d: plgpu.layout_cast(jnp.zeros((BLOCK, d), jnp.float32), wg)
  if fast:
    # Entries are sorted by position and every position is >= the block's start (select_attention
    # drops later blocks), so keys after a token can only occur for the block's own <= 64 tokens,
    # the item's first entries: at most 64 / tq steps, and none when its first token is past the
    # block.
    first_pos, _ = token(0, 0)
    n_causal = jnp.where(first_pos < blk * BLOCK + BLOCK - 1, jnp.minimum(steps, BLOCK // tq), 0)
    carry = lax.fori_loop(0, n_causal, body, (zeros(dk), zeros(dv)))
    if docs:  # steps wholly before entry nplain need no document bound (entries ascend)
      m0 = jnp.clip(nplain // tq, n_causal, steps)  # (n_causal <= steps)
      carry = lax.fori_loop(n_causal, m0, functools.partial(body, causal=False, lower=False),
                            carry)
      dk_acc, dv_acc = lax.fori_loop(m0, steps, functools.partial(body, causal=False), carry)
    else:
      dk_acc, dv_acc = lax.fori_loop(n_causal, steps, functools.partial(body, causal=False),
                                     carry)
  else:
    dk_acc, dv_acc = lax.fori_loop(0, steps, body, (zeros(dk), zeros(dv)))
  dkt_s[...] = dk_acc * scale
  dvt_s[...] = dv_acc
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(dkt_s, dk_ref.at[b, kk, w])
  plgpu.copy_smem_to_gmem(dvt_s, dv_ref.at[b, kk, w])
  plgpu.wait_smem_to_gmem(0)


def _count_below(tokens, e0, e1, bound):
  """Per work item, how many of its entries tokens[e0:e1] (ascending) are < bound ([B, K, W]
  each): a lower-bound bisection, one gather a round."""
  n = tokens.shape[-1]
  lo, hi = e0, e1
  for _ in range(max(n, 1).bit_length() + 1):
    mid = (lo + hi) // 2
    v = jnp.take_along_axis(tokens, jnp.clip(mid, 0, n - 1), axis=-1)
    go = (mid < hi) & (v < bound)
    lo, hi = jnp.where(go, mid + 1, lo), jnp.where(go, hi, mid)
  return (lo - e0).astype(jnp.int32)


def dkv_doc_counts(seg, tokens, iblk, istart, iend):
  """The dK/dV partials' document inputs: (lo [B, T] each token's document start; nplain, nlive
  [B, K, W]: per work item, its entries whose document starts at or before the block's first key
  (no bound needed), and those whose document starts before the block's end (the rest see no key
  of the block)). Documents are contiguous runs, so both are prefixes of an item's ascending
  entries: a token's document starts after position p iff the token is at or past the first run
  start after p (run_lasts[p] + 1)."""
  from pallas_kernels.compress_attention import run_lasts, run_starts  # (it imports this module)
  b, t = seg.shape
  last = run_lasts(seg)
  start = iblk * BLOCK                                          # [B, K, W], each < T

  def start_after(p):  # [B, K, W]: the first run start after position p (T if none)
    return jnp.take_along_axis(last[:, None, :], p.reshape(b, 1, -1), axis=-1).reshape(p.shape) + 1
  nplain = _count_below(tokens, istart, iend, start_after(start))
  nlive = _count_below(tokens, istart, iend, start_after(jnp.minimum(start + BLOCK - 1, t - 1)))
  return run_starts(seg).astype(jnp.int32), nplain, nlive


def dkv_partials(q, k, v, block_idx, do, lse, delta, *, chunk_entries, scale, interpret=False,
                 seg=None):
  """float32 dK/dV partials [B,K,W,64,D] of the inverse-list work items (C.inverse_lists) and the
  (first, nitems) per block that select_attention_bwd.reduce_partials sums them with. block_idx
  must not name blocks that start after their token (select_attention drops those): with
  FAST_MASK only a work item's first 64 / tq steps get the causal mask. seg: [B, T] int32
  document ids, contiguous runs (DKV_SEGMENT_IDS; dkv_doc_counts)."""
  b, t, h, dk = q.shape
  kh, dv, n = k.shape[2], v.shape[3], block_idx.shape[3]
  g, dtype = h // kh, q.dtype
  ok, why = dkv_supports(g, dk, dv)
  if not ok:
    raise ValueError(f"select_attention[mosaic] dK/dV: {why}")
  tq = ROWS // g
  nb = C.cdiv(t, BLOCK)
  tokens, iblk, istart, iend, first, nitems = C.inverse_lists(block_idx, nb, chunk_entries)
  nw = iblk.shape[-1]
  docs = () if seg is None else dkv_doc_counts(seg, tokens, iblk, istart, iend)
  rows_major = functools.partial(_rows_major, kh=kh, tp=t)
  tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(SWIZZLE))
  slots = dkv_slots(dk, dv)

  def entry(*refs):
    *doc_refs, iblk_ref, istart_ref, iend_ref, tokens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, \
        delta_ref, dk_ref, dv_ref = refs
    pl.run_scoped(
        lambda *s: _dkv_kernel(iblk_ref, istart_ref, iend_ref, tokens_ref, q_ref, k_ref, v_ref,
                               do_ref, lse_ref, delta_ref, dk_ref, dv_ref, s, g=g, tq=tq,
                               n_entries=t * n, dk=dk, dv=dv, scale=scale, dtype=dtype,
                               interpret=interpret, slots=slots,
                               doc_refs=tuple(doc_refs) or None),
        (plgpu.SMEM((BLOCK, dk), dtype, transforms=tr),
         plgpu.SMEM((BLOCK, dv), dtype, transforms=tr),
         _shared((plgpu.SMEM((slots, ROWS, dk), dtype, transforms=tr),
                  plgpu.SMEM((slots, ROWS, dv), dtype, transforms=tr),
                  plgpu.SMEM((slots, ROWS), jnp.float32), plgpu.SMEM((slots, ROWS), jnp.float32)),
                 (plgpu.SMEM((BLOCK, dk), jnp.float32), plgpu.SMEM((BLOCK, dv), jnp.float32))),
         plgpu.SMEM((BLOCK, ROWS), dtype, transforms=tr) if _staging(interpret) else None),
        (plgpu.Barrier(num_barriers=2),
         plgpu.Barrier(num_arrivals=4 * tq, num_barriers=slots)))

  dkx, dvx = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, kh, nw, BLOCK, dk), jnp.float32),
                jax.ShapeDtypeStruct((b, kh, nw, BLOCK, dv), jnp.float32)),
      grid=(nw, kh, b), grid_names=("item", "group", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*docs, iblk, istart, iend, tokens, rows_major(q), _blocks_major(k), _blocks_major(v),
    rows_major(do.astype(dtype)),
    rows_major(lse.astype(jnp.float32)), rows_major(delta.astype(jnp.float32)))
  return dkx, dvx, first, nitems
