#!/usr/bin/env bash
# Kernel measurements on one H200, one phase per device call (each fits in a few minutes).
#
#   bash scripts/h200_kernels.sh PHASE [PHASE ...]     (repository root; writes under $OUT)
#
# union4   selection kernel, G=16, 64k: 4-token "union" tiles (64 rows, wgmma-eligible) with 1 and
#          2 blocks a step, "clustered" then "random" (issue 4's clustered 15x target); ~3 min.
# auto     selection kernel check (compiled vs reference) and 64k table, G=16 and 4, both patterns,
#          without a tiling (G=16 picks its tile from the block lists); ~3 min.
# profile  device kernels of the whole NSA op's forward and forward+backward at 64k, 192/128
#          (jax.profiler; where the top-n and compression time goes, issue 5); ~2 min.
# cmpsplit  compression kernels at 64k, 192/128: 1, 4, 8 or 16 dK/dV programs a key tile, mask skip; ~2 min.
# nsa      the whole op and its branches vs cuDNN, 8k-64k, both head dims (issue 5's table); ~4 min.
# train8k  the whole op, its branches and a kernel profile at one layer of the 8k training model
#          (configs/small_gpu_nsa.py: 16 query heads, 1 KV group, 64/64, batch 8 x 8192; issue 7's
#          8k throughput gap); 34 s measured.
# sel8k    selection tilings at that layer shape (bench_kernels --plan train8k), both patterns;
#          69 s measured.
# mosaic   the Mosaic GPU selection kernels (select_attention(backend="mosaic")):
#          compiled check against the reference, then 64k, G=16 and G=4, both patterns, against the
#          Triton tiles (with mosaiccmp: 257 s measured, 2026-11-30).
# mosaic8k  the same at the 8k training layer shape (16/1 heads, 64/64, batch 8); with mosaicnsa
#          180 s measured.
# mosaicslots  the Mosaic kernels' pipeline depth (2 = default, 3, 4 K/V blocks / query steps in
#          flight) at the 8k training layer, A/B with the default repeated; compiled check first
# mosaicovl  the Mosaic selection forward with FA3's intra-warpgroup overlap (OVERLAP: S(j+1)
#          issued with P(j)V(j), its softmax while P(j)V(j) runs) on / off twice at the 8k training
#          layer, G = 16 and 4; compiled check (OVERLAP on) first, ptxas' register / spill report
#          of every Mosaic kernel compiled in it (MOSAIC_GPU_DUMP_PTXAS) in mosaicovl_ptxas.log
# mosaiclean  the Mosaic selection kernels' shared memory: buffers with disjoint lifetimes
#          sharing memory and unused staging dropped (LEAN_SMEM, the default) vs separate buffers,
#          twice each, at the 8k training layer (G = 16 and 4); compiled check first; ptxas'
#          register report in mosaiclean_ptxas.log
# mosaicring  the Mosaic selection forward's K and V in one ring of 3 shared-memory buffers
#          (KV_RING: 64 KB instead of 80 KB at d = 128, so 3 CTAs an SM instead of 2) on / off
#          twice: 64k 128/128 G = 16 and 4 clustered (issue 4's shape; compiled check with the
#          ring first; ptxas' report in mosaicring_ptxas.log), then the 8k training layer
# mosaicb1  the Mosaic GPU selection forward with SELECTION_SPEED_PLAN's B1 step changes (the
#          token's pick as a row bias, the causal mask on the last union entry only, P from
#          registers) on, off, and on again (a repeat), at the 8k training layer shape, G = 16
#          and 4, both patterns, Triton's union tile as control; compiled check first; 398 s with
#          the trimmed plan plus context8 on x2 (2026-11-30).
# mosaiccmp  the Mosaic GPU compression forward vs the Triton one, 64k, 192/128
#          (bench_nsa --sweep_parts mosaic); ~1 min.
# mosaicnsa  the whole op with implementation="pallas-mosaic" vs cuDNN: 64k and 8k at 192/128,
#          and the 8k training layer shape with a profile (compare with nsa / train8k); ~3 min.
# auto8k   the whole op at the 8k training layer shape (16/1 heads, 64/64, batch 8) with
#          implementation "pallas" (selection backend picked per shape: Mosaic GPU there) against
#          "pallas-triton", with a compiled check of each; ~2 min measured.
# registry  the selection kernel through backend="auto" (what implementation="pallas" runs: Mosaic
#          GPU or Triton per shape, G=4's lax.cond on 16-token unions), compiled check, 64k, G=16
#          and 4, both patterns, then the 8k layer shape (295 s measured, 2026-11-30).
# mosaicab16  G = 16 at 64k, 128/128 (issue 4's target shape): the registry (backend="auto", now
#          with Mosaic's union tile as the lax.cond's union branch; compiled check first), then
#          Mosaic's union tile vs Triton's, twice, clustered
# mosaicws  the two-warpgroup Mosaic GPU selection forward (128-row tiles: a TMA producer warpgroup,
#          two consumers with a ping-pong barrier; select_attention_mgpu.ws_forward) against the
#          64-row Mosaic one and Triton: compiled check, 64k G=16 both patterns, then the 8k
#          layer shape, each with and without the ping-pong barrier (~4 min; measured 2026-11-30:
#          correct, slower than the 64-row kernel at every shape, see docs/STATUS.md).
# cmpfold  the compression branch as one cuDNN call on folded queries
#          (pallas_kernels.compress_fold): compiled checks, now including the gradients of the
#          fold (fold_grad_relerr: the cuDNN backward, default at d_k == d_v) and of the fold
#          forward + Triton backward against plain JAX; the 8k training layer shape with "pallas"
#          and "pallas-triton"; then 64k and 16k at both head dims with the branch breakdown at
#          64k. 200 s measured (2026-11-30, before the gradient fields).
# foldnsa  the whole op at 64k and 16k, both head dims, with the compression fold's backward in
#          cuDNN (the default at d_k == d_v) and in Triton (--fold_backward triton), each with its
#          compiled check (fold gradients included); 195 s measured (2026-11-30, cold).
# foldsweep  the compression branch alone three ways (Triton; cuDNN fold fwd+bwd; cuDNN fold fwd
#          + Triton bwd) at 16k-64k, paper heads, both head dims, and at the 8k/16k training layer
#          shape (16/1 heads, 64/64, batch 8): where ops.FOLD_MIN_BLOCKS comes from; ~3 min.
# decode   the decode step vs cuDNN at 8k-128k, batch 8 and 1 (issue 6's table); ~5 min.
# walk     the decode kernel tests compiled (scripts/gpu_tests.sh test_decode.py, ~65 s), then the
#          fused decode step with the block scores in the compressed walk (scores_in_walk) against
#          the committed three-kernel scoring, 64k and 128k, batch 8 and 1, with a profile; needs
#          carry [".whl"] only where the machine lacks pytest; ~3.5 min measured (2026-11-30:
#          correct, slower than the three-kernel path at every shape).
# decodehf  the decode scores' head sum first (scores_head_first, the default since 2026-12-03)
#          against the band matmuls (pallas_all_bandmm) and the top-n rounds in a loop
#          (topn_loop), each default / bandmm timed twice in the run; their compiled tests first;
#          64k and 128k, batch 8 and 1, with a profile; carry [".whl"] where the machine lacks
#          pytest. 2026-12-03 (before the default changed): 459 s with 140 compiled top-n tests
#          after it (decode_headfirst_h200.md).
# fastmerge  the top-n tests compiled (they run the merge variants both ways), then the top-n
#          kernel's merge variants (select_topn.CARRY_BOUNDS, FIRST_FILL) in all four combinations
#          via NSA_TOPN_CARRY_BOUNDS / NSA_TOPN_FIRST_FILL at the 8k training layer and at 64k
#          128/128 (the topn rows); 199 s for the A/B measured (2026-11-30).
# topnvar  the top-n tests compiled (every optional code path on, then off; 179 s with the first
#          version of the sweep, 2026-12-01), then topnsweep.
# topnsweep  the top-n kernel's optional code paths (bench_nsa --sweep_parts topnvar:
#          TOPN_FLAG_SETS, each checked against the default's indices) at the 8k training layer
#          and at 16k, 32k, 64k for both head dims.
# topnlayers  the same at the 16k and 32k training layers (16/1 heads, 64/64, batch 4 and 2, as
#          h200_runs.sh context16/context32), where the new default turns both paths on.
# topnptx  a diagnostic: compile the top-n kernel at 64k (128/128) with XLA's dumps on
#          (--xla_dump_to + --xla_gpu_dump_llvmir), list what was written and which files name the
#          kernel, and run ptxas -v (registers, spills) on any PTX that does. On 2026-12-01
#          --xla_dump_to alone wrote no PTX for the Pallas kernels; this is the next attempt.
# topn2pass  select_topn.TWO_PASS (scores to a bounded buffer, then a pick kernel) against the
#          merges: its compiled tests, the whole op at 64k and 16k with NSA_TOPN_TWO_PASS=1 and
#          =0 (issue 5's forward and its 16k crossover), then the topnvar sweep (two_pass rows
#          beside the merges, indices checked against the default's) at the 8k training layer
#          and at 16k for both head dims. Needs carry [".whl"] where the machine lacks pytest.
# fla      FLA's NSA kernels (experiments/bench_fla.py, PyTorch) and ours on the same GPU in one
#          call, each against its own framework's cuDNN dense attention: FLA's selection on our
#          bench_kernels index lists and its compression + top-n + selection at 8k-64k (128/128),
#          then our whole op (bench_nsa, 128/128, 8k-64k; FLA_LIMIT / FLA_OURS_LIMIT seconds)
#          and, with FLA_REGISTRY=1, our selection registry at 64k on the same lists; compare
#          with experiments.compare_fla. ~9 min. Needs carry
#          [".whl"] holding fla_core-0.6.0 and flash_linear_attention-0.6.0 (pure Python wheels).
# ncuprof  Nsight Compute hardware counters (--set full, clocks left alone) of one launch of each
#          kernel that bounds the 64k targets (benchmarks/ncu_kernels.py: the compression forward,
#          top-n scores + pick, the selection forward on random and clustered lists, the random
#          backward); writes the report and its raw / details pages as CSV (NCU_CASES to choose;
#          summarise here with benchmarks/ncu_report.py). 2026-12-03: the three Triton cases
#          (NCU_CASES=topn,topn_head_first,random_fwd) took 110 s; "--target-processes all"
#          crashed Python after the first kernel; the Mosaic and backward cases are untried.
# cmdsched  does XLA's command-buffer (CUDA graph) scheduling let independent kernels of the
#          whole op overlap? The window branch depends on nothing else, and the L2-bound selection
#          would gain from running beside compute-bound work (docs/STATUS.md issue 5, FLOP
#          floors). The 64k 128/128 whole op (forward and backward, no breakdown) under
#          --xla_gpu_command_buffer_scheduling_mode = SERIALIZE, CONCURRENT, LHS and the default,
#          the default repeated last, each a fresh process. The values parse in jaxlib 0.11.2
#          (checked on CPU); whether Pallas calls land in the graphs and overlap is what it
#          measures. 2026-12-03 (139 s): no mode moved the forward (40.25-41.30 ms) or the
#          backward (67.7-69.1 ms) by more than ~1% against the default's two readings (timing only).
# streams  branches on separate GPU streams (ops.BRANCH_STREAMS through jax's compute_on, with
#          --xla_gpu_experimental_stream_annotation=true): benchmarks/stream_overlap_trial.py
#          times the whole op forward and forward + backward per stream layout in one process
#          (one-stream first and last), checks every layout's output and gradients against the
#          one-stream layout's, cuDNN dense in the same run; at 64k 128/128, without and with
#          XLA's command buffers ("group": one XLA scheduling group, ops.STREAM_GROUP).
# window   the sliding-window branch by backend (experiments/bench_window.py: cuDNN's sliding
#          window, its forward + the Pallas Triton backward, the Pallas kernels both ways) with a
#          compiled check of each, at 64k both head dims, 32k, 16k and the 8k training layer;
#          then packed documents (the Pallas kernels against the plain-JAX path that a GPU ran
#          before them) at the 8k training layer and 64k 192/128.
# winsweep  the Pallas window kernels' tiles (bench_window --tilings: dq added atomically by the
#          dK/dV kernel (bwd_fused_dq) alone and with 64 rows / 4 warps, forward rows, keys a step,
#          backward rows, keys a dK/dV program, dK/dV warps) at 64k both head dims and the 8k
#          training layer.
# winfused  the lean first look at CmpTiling.bwd_fused_dq (dq added atomically by the dK/dV
#          kernel, no dq kernel): the window kernels with it (8 and 4 dK/dV warps) against their
#          default and cuDNN at 64k both head dims and the 8k training layer, one process a shape
#          (~6 min, not measured); then the compression kernels with it (cmp_tiling_trial, 8k
#          training layer and 64k 192/128).
# winnsa   the whole op at 64k, both head dims, with the window branch on each backend
#          (NSA_WINDOW_BACKEND unset, triton, cudnn-fwd, unset again), each its own process.
# warps2nsa  the whole op at 64k (both head dims, 128/128 branch breakdown) with G = 16's 2-warp
#          per-token selection tile, then 128/128 alternating with that tile patched back to 4
#          warps (before / after twice; issue 5's 128/128 backward); ~5 min.
# dqsteps  benchmarks/select_bwd_trial.py at 64k 128/128: the dq kernel walking 2 selected blocks
#          a step (SelectTiling.dq_blocks_per_step), on the op's top-n lists and random ones; ~4 min.
# densedoc  dense attention as our window kernels with w = T (what dense layers with document ids
#          run) against cuDNN's causal call: the 8k training layer without and with packed
#          documents, the dK/dV walk with 8 splits too (bench_window), then
#          benchmarks/dense_doc_trial.py (ids: our kernels vs cuDNN's explicit mask) at 8k and 32k,
#          and our kernels at 8k with long documents (mean 16384 tokens); ~2 min (the phase without
#          the last run took ~100 s on an H100, 2026-12-06).
# cmpdoc   document ids at the 8k training layer, current defaults: the compression kernels
#          (benchmarks/cmp_tiling_trial.py --docs, with the id shortcuts switched off in turn) at
#          mean document lengths 4096 and 16384, then the window kernels at w = T
#          (benchmarks/doc_mask_trial.py: 8 warps with 2 stages, the dK/dV launch without ids); ~4 min
#          (206 s on an H100, 2026-12-06).
# seldoc   the selection branch with packed documents at the 8k training layer
#          (benchmarks/select_doc_trial.py) on the op's own top-n lists, documents of mean 16384
#          (the corpus's case) then 4096 tokens: auto (with ids on Hopper: the Mosaic union tile
#          alone with the ids as document bounds, select_attention_mgpu.SEGMENT_IDS, on since
#          2026-12-07, and the dK/dV partials with the ids too, DKV_SEGMENT_IDS, on since the
#          same day), auto_triton_dkv_ids (DKV_SEGMENT_IDS off: the Triton dK/dV with the ids),
#          auto_triton_ids (SEGMENT_IDS off: the Triton union tile alone,
#          STATIC_UNION_IDS), auto_no_ids (Mosaic without ids, what unmasked training runs),
#          triton (the lax.cond), triton_no_ids; 116 s on an H100 (2026-12-07, with mosaic_ids
#          in place of auto_triton_ids: benchmarks/results/seldoc_h100_s44/).
# cudnnpacked  cuDNN's packed-sequence layout (per-row document offsets, jax's private cuDNN call)
#          against our Triton kernels with ids and cuDNN without ids, at the 8k training layer:
#          w = T (dense layers) and w = 512 (NSA's window branch), mean document lengths 4096 and
#          512, the segment cap at the inputs' maximum and at 64 (benchmarks/cudnn_packed_trial.py,
#          output and gradients compared with ours; M = 64 needs a ~33 GiB backward workspace at
#          this shape); ~6-8 min, cut at 560 s (parts ran on an H100 in three calls, 2026-12-07:
#          benchmarks/results/cudnn_packed_h100_s42/; the whole phase has not run).
# windoc   NSA's window branch (w = 512) with document ids at the 8k training layer, per dK/dV
#          launch and masked-path switch (benchmarks/doc_mask_trial.py --window 512: no ids, mean
#          4096 and 16384 tokens; baseline cuDNN's sliding window without ids). The masked 8k NSA
#          step's window kernels took 35.1 ms against cuDNN's 26.6 (profdoc_nsa_h100_s44); the
#          small-head launch with ids (8 warps, 3 stages) was chosen at w = T only. First run
#          (four of these variants, then default / no_seg_split; one H100, 2026-12-07,
#          benchmarks/results/windoc_h100_s45/): the defaults fastest; the ids cost the forward
#          and dq kernels, not dK/dV; ~2-3 min.
# windq    the window's dq kernel with and without document ids (benchmarks/doc_mask_trial.py
#          --window 512, no ids and mean 16384 tokens): the default (4 warps at w < T and small
#          heads since 2026-12-07) against the 8 warps of before (dq_w8), seg_bounds, 3 stages,
#          32 / 128 keys a step, 64-row tiles; ~2-3 min. First run (one H100, 2026-12-07,
#          benchmarks/results/windq_h100_s46/, the variants of then): with ids 8 warps took the
#          dq kernel from 122 to 170 registers (ncu) and 0.86 against 0.57 ms; 4 warps 0.63.
#
# Every phase appends to $OUT/log.txt and writes its JSON / Markdown under $OUT/<phase>/. The device
# copy's git metadata lags: correct code_commit in the records by hand when committing them.
set -uo pipefail
OUT=${OUT:-/tmp/h200_kernels_out}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p "$OUT"

union4() {
  timeout 200 python3 -m experiments.bench_kernels --plan union4 --patterns clustered,random \
    --T 65536 --iters 5 --out "$OUT/union4" --tag union4
}
auto() {
  timeout 240 python3 -m experiments.bench_kernels --check --T 65536 --groups 16,4 --iters 5 \
    --out "$OUT/auto" --tag h200_auto
}
profile() {
  timeout 150 python3 -m experiments.bench_nsa --profile_T 65536 --dims 192/128 --T '' \
    --out "$OUT/profile"
}
cmpsplit() {
  timeout 150 python3 -m experiments.bench_nsa --sweep_T 65536 --sweep_parts cmp --T '' \
    --out "$OUT/cmpsplit"
}
nsa() {
  timeout 330 python3 -m experiments.bench_nsa --check --T 65536,8192,16384,32768 \
    --dims 192/128,128/128 --breakdown_T 65536 --iters 5 --budget_s 240 --out "$OUT/nsa"
}
train8k() {
  timeout 200 python3 -m experiments.bench_nsa --heads 16/1 --dims 64/64 --batch 8 --T 8192 \
    --breakdown_T 8192 --profile_T 8192 --iters 10 --out "$OUT/train8k"
}
sel8k() {
  timeout 280 python3 -m experiments.bench_kernels --plan train8k --T 8192 --heads 16 --groups 16 \
    --d 64 --batch 8 --patterns clustered,random --iters 10 --out "$OUT/sel8k" --tag h200_train8k
}
mosaic() {
  timeout 420 python3 -m experiments.bench_kernels --check --plan mosaic --T 65536 \
    --patterns clustered,random --iters 5 --out "$OUT/mosaic" --tag h200_mosaic
}
mosaic8k() {
  timeout 240 python3 -m experiments.bench_kernels --plan mosaic --T 8192 --heads 16 --d 64 \
    --batch 8 --patterns clustered,random --iters 10 --out "$OUT/mosaic8k" --tag h200_mosaic8k
}
mosaicslots() {  # the Mosaic kernels' pipeline depth (FWD_SLOTS / DKV_SLOTS 2, 3, 4) at the 8k
  # training layer shape, compiled check at 4 slots first
  timeout 400 python3 -m experiments.bench_kernels --check --plan mosaicslots --T 8192 --heads 16 \
    --d 64 --batch 8 --patterns clustered,random --iters 10 --out "$OUT/mosaicslots" \
    --tag h200_mosaicslots
}

mosaicovl() {  # the forward's intra-warpgroup overlap on / off at the 8k training layer
  mkdir -p "$OUT/mosaicovl"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 400 python3 -m experiments.bench_kernels --check --plan mosaicovl \
    --T 8192 --groups 16,4 --heads 16 --d 64 --batch 8 --patterns clustered,random --iters 10 \
    --out "$OUT/mosaicovl" --tag h200_mosaicovl > "$OUT/mosaicovl/mosaicovl_ptxas.log" 2>&1
  local rc=$?
  grep -vE "^ptxas" "$OUT/mosaicovl/mosaicovl_ptxas.log" | tail -40
  return $rc
}
mosaiclean() {  # shared vs separate shared-memory buffers at the 8k training layer
  mkdir -p "$OUT/mosaiclean"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 400 python3 -m experiments.bench_kernels --check \
    --plan mosaiclean --T 8192 --groups 16,4 --heads 16 --d 64 --batch 8 \
    --patterns clustered,random --iters 10 --out "$OUT/mosaiclean" --tag h200_mosaiclean \
    > "$OUT/mosaiclean/mosaiclean_ptxas.log" 2>&1
  local rc=$?
  grep -vE "^ptxas" "$OUT/mosaiclean/mosaiclean_ptxas.log" | tail -40
  return $rc
}
mosaicring() {  # the forward's K/V ring on / off: 64k 128/128, then the 8k training layer
  mkdir -p "$OUT/mosaicring"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 330 python3 -m experiments.bench_kernels --check \
    --plan mosaicring --T 65536 --groups 16,4 --patterns clustered --iters 5 \
    --out "$OUT/mosaicring" --tag h200_mosaicring > "$OUT/mosaicring/mosaicring_ptxas.log" 2>&1
  local rc=$?
  grep -vE "^ptxas" "$OUT/mosaicring/mosaicring_ptxas.log" | tail -30
  timeout 200 python3 -m experiments.bench_kernels --plan mosaicring --T 8192 --groups 16 \
    --heads 16 --d 64 --batch 8 --patterns clustered,random --iters 10 \
    --out "$OUT/mosaicring8k" --tag h200_mosaicring8k || rc=$?
  return $rc
}
mosaicb1() {  # the Mosaic forward step (FAST_MASK, REG_P) on / off at the 8k training layer shape
  timeout 330 python3 -m experiments.bench_kernels --check --plan mosaicb1 --T 8192 --heads 16 \
    --d 64 --batch 8 --patterns clustered,random --iters 10 --out "$OUT/mosaicb1" --tag h200_mosaicb1
}
mosaiccmp() {
  timeout 200 python3 -m experiments.bench_nsa --sweep_T 65536 --sweep_parts mosaic --T '' \
    --out "$OUT/mosaiccmp"
}
mosaicnsa() {
  timeout 200 python3 -m experiments.bench_nsa --impl pallas-mosaic --check --T 65536,8192 \
    --dims 192/128 --breakdown_T '' --iters 5 --out "$OUT/mosaicnsa"
  timeout 150 python3 -m experiments.bench_nsa --impl pallas-mosaic --heads 16/1 --dims 64/64 \
    --batch 8 --T 8192 --breakdown_T '' --profile_T 8192 --iters 10 --out "$OUT/mosaicnsa8k"
}
auto8k() {
  for impl in pallas pallas-triton; do
    timeout 150 python3 -m experiments.bench_nsa --impl $impl --check --heads 16/1 --dims 64/64 \
      --batch 8 --T 8192 --breakdown_T '' --iters 10 --out "$OUT/auto8k_$impl"
  done
}
mosaicws() {
  timeout 300 python3 -m experiments.bench_kernels --check --plan mosaicws --T 65536 --groups 16 \
    --patterns clustered,random --iters 5 --out "$OUT/mosaicws" --tag h200_mosaicws
  timeout 150 python3 -m experiments.bench_kernels --plan mosaicws --T 8192 --heads 16 --d 64 \
    --groups 16 --batch 8 --patterns clustered,random --iters 10 --out "$OUT/mosaicws8k" \
    --tag h200_mosaicws8k
}
mosaicab16() {  # G = 16, 64k, 128/128: the registry with Mosaic's union tile as the union branch
  # (compiled check of backend="auto" first), then that tile vs Triton's, twice, clustered
  timeout 330 python3 -m experiments.bench_kernels --check --plan registry --T 65536 --groups 16 \
    --patterns clustered,random --iters 5 --out "$OUT/registry16" --tag h200_registry16
  timeout 200 python3 -m experiments.bench_kernels --plan mosaicab16 --T 65536 --groups 16 \
    --patterns clustered --iters 5 --out "$OUT/mosaicab16" --tag h200_mosaicab16
}
registry() {
  timeout 300 python3 -m experiments.bench_kernels --check --plan registry --T 65536 \
    --patterns clustered,random --iters 5 --out "$OUT/registry" --tag h200_registry
  timeout 150 python3 -m experiments.bench_kernels --plan registry --T 8192 --heads 16 --d 64 \
    --batch 8 --patterns clustered,random --iters 10 --out "$OUT/registry8k" --tag h200_registry8k
}
cmpfold() {
  for impl in pallas pallas-triton; do
    timeout 150 python3 -m experiments.bench_nsa --impl $impl --check --heads 16/1 --dims 64/64 \
      --batch 8 --T 8192 --breakdown_T="$([ $impl = pallas ] && echo 8192)" --iters 10 \
      --out "$OUT/cmpfold8k_$impl"
  done
  timeout 300 python3 -m experiments.bench_nsa --check --T 65536,16384 --dims 192/128,128/128 \
    --breakdown_T 65536 --iters 5 --budget_s 220 --out "$OUT/cmpfold"
}
foldnsa() {
  for bwd in cudnn triton; do
    timeout 270 python3 -m experiments.bench_nsa --check --T 65536,16384 --dims 128/128,192/128 \
      --breakdown_T '' --iters 5 --budget_s 200 --fold_backward $bwd --out "$OUT/foldnsa_$bwd"
  done
}
foldsweep() {
  timeout 240 python3 -m experiments.bench_nsa --fold_sweep_T 16384,32768,65536 \
    --dims 192/128,128/128 --T '' --iters 5 --out "$OUT/foldsweep"
  timeout 150 python3 -m experiments.bench_nsa --fold_sweep_T 8192,16384 --heads 16/1 \
    --dims 64/64 --batch 8 --T '' --iters 10 --out "$OUT/foldsweep8"
}
decode() {
  timeout 360 python3 -m experiments.bench_decode --out "$OUT/decode" \
    --max_seconds 330 --lengths 65536,8192,16384,32768,131072
}
walk() {
  GPU_TEST_FILES=tests/test_decode.py OUT="$OUT/walk" timeout 200 bash scripts/gpu_tests.sh
  timeout 300 python3 -m experiments.bench_decode --out "$OUT/walk" --name decode_walk \
    --lengths 65536,131072 --batches 8,1 --impls pallas_all,pallas_all_walkscores --profile \
    --selection_only_T '' --breakdown_T '' --max_seconds 200
}
decodehf() {
  GPU_TEST_FILES=tests/test_decode.py OUT="$OUT/decodehf" timeout 200 bash scripts/gpu_tests.sh \
    -k "fused_compression_topn or lower_for_cuda or pallas_kernels_interpret"
  timeout 300 python3 -m experiments.bench_decode --out "$OUT/decodehf" --name decode_headfirst \
    --lengths 65536,131072 --batches 8,1 --impls \
    pallas_all,pallas_all_bandmm,pallas_all_topn_loop,pallas_all_again,pallas_all_bandmm_again \
    --profile --selection_only_T '' --breakdown_T '' --max_seconds 220
}
fastmerge() {
  GPU_TEST_FILES=tests/test_compress_kernels.py OUT="$OUT/fastmerge" timeout 200 \
    bash scripts/gpu_tests.sh -k "topn or lower"
  local cb ff
  for cb in 0 1; do
    for ff in 0 1; do
      NSA_TOPN_CARRY_BOUNDS=$cb NSA_TOPN_FIRST_FILL=$ff timeout 100 python3 -m experiments.bench_nsa \
        --heads 16/1 --dims 64/64 --batch 8 --T 8192 --breakdown_T 8192 --iters 10 \
        --out "$OUT/fastmerge/ab8_$cb$ff"
      NSA_TOPN_CARRY_BOUNDS=$cb NSA_TOPN_FIRST_FILL=$ff timeout 100 python3 -m experiments.bench_nsa \
        --T 65536 --dims 128/128 --breakdown_T 65536 --iters 5 --out "$OUT/fastmerge/ab64_$cb$ff"
    done
  done
}
topnvar() {
  GPU_TEST_FILES=tests/test_compress_kernels.py OUT="$OUT/topnvar" timeout 240 \
    bash scripts/gpu_tests.sh -k "topn or lower"
  topnsweep
}
topnsweep() {
  local dims t
  timeout 100 python3 -m experiments.bench_nsa --T '' --sweep_T 8192 --sweep_parts topnvar \
    --sweep_dims 64/64 --heads 16/1 --batch 8 --iters 10 --out "$OUT/topnsweep/sweep8k"
  for t in 16384 32768 65536; do
    for dims in 192/128 128/128; do
      timeout 120 python3 -m experiments.bench_nsa --T '' --sweep_T $t --sweep_parts topnvar \
        --sweep_dims $dims --out "$OUT/topnsweep/sweep${t}_${dims/\//_}"
    done
  done
}
topnlayers() {
  local t b
  for t in 16384 32768; do
    b=$(( 65536 / t ))
    timeout 100 python3 -m experiments.bench_nsa --T '' --sweep_T $t --sweep_parts topnvar \
      --sweep_dims 64/64 --heads 16/1 --batch $b --iters 10 --out "$OUT/topnlayers/sweep$t"
  done
}
topn2pass() {  # most important first: the device budget may cut the call
  local dims tp
  GPU_TEST_FILES=tests/test_compress_kernels.py OUT="$OUT/topn2pass" timeout 150 \
    bash scripts/gpu_tests.sh -k "two_pass"
  for tp in 1 0; do
    NSA_TOPN_TWO_PASS=$tp timeout 150 python3 -m experiments.bench_nsa --T 65536,16384 \
      --dims 128/128,192/128 --breakdown_T 65536 --iters 5 --out "$OUT/topn2pass/nsa_tp$tp"
  done
  timeout 100 python3 -m experiments.bench_nsa --T '' --sweep_T 8192 --sweep_parts topnvar \
    --sweep_dims 64/64 --heads 16/1 --batch 8 --iters 10 --out "$OUT/topn2pass/sweep8k"
  for dims in 192/128 128/128; do  # 64k: the whole op's breakdown above has the top-n rows
    timeout 120 python3 -m experiments.bench_nsa --T '' --sweep_T 16384 --sweep_parts topnvar \
      --sweep_dims $dims --out "$OUT/topn2pass/sweep16384_${dims/\//_}"
  done
}
topnptx() {
  local d=/tmp/topn_dump f ptxas
  rm -rf "$d"
  mkdir -p "$OUT/topnptx"
  XLA_FLAGS="--xla_dump_to=$d --xla_gpu_dump_llvmir" timeout 200 python3 -c '
import jax, jax.numpy as jnp
from pallas_kernels import select_topn as st
t, h, kh, dk = 65536, 64, 4, 128
nc = (t - 32) // 16 + 1
q = jnp.zeros((1, t, h, dk), jnp.bfloat16)
kc = jnp.zeros((1, nc, kh, dk), jnp.bfloat16)
lse = jnp.zeros((1, t, h), jnp.float32)
f = lambda q, kc, lse: st.select_topn(q, kc, lse, block=32, stride=16, sel_block=64, num_selected=16)
jax.jit(f).lower(q, kc, lse).compile()
print("top-n kernel compiled")'
  ls -la "$d" > "$OUT/topnptx/dump_files.txt" 2>&1
  grep -l "nsa_select_topn" "$d"/* 2>/dev/null | tee "$OUT/topnptx/files_naming_the_kernel.txt"
  ptxas=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -1)
  for f in $(grep -l "nsa_select_topn" "$d"/*.ptx 2>/dev/null); do
    cp "$f" "$OUT/topnptx/"
    [ -n "$ptxas" ] && "$ptxas" -v -arch=sm_90a "$f" -o /tmp/topn.cubin 2>&1 | tail -8
  done
}

fla() {
  local site=/tmp/fla_site
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl || { echo "fla wheels missing in .whl/"; return 2; }
  # FLA's Triton autotuning took most of 200 s at the first length (twenty-first session), so
  # its 64k row needs ~300 s; ours then at 128/128 only (FLA's kernels need d_k = d_v).
  PYTHONPATH=$PWD:$site timeout "${FLA_LIMIT:-320}" python3 -m experiments.bench_fla \
    --T 8192,16384,32768,65536 --iters 10 --out "$OUT/fla" --tag gpu
  timeout "${FLA_OURS_LIMIT:-200}" python3 -m experiments.bench_nsa --T 65536,8192,16384,32768 \
    --dims 128/128 --breakdown_T 65536 --iters 5 --budget_s 180 --out "$OUT/fla"
  [ -z "${FLA_REGISTRY:-}" ] || timeout 150 python3 -m experiments.bench_kernels --plan registry \
    --T 65536 --groups 16 --patterns clustered,random --iters 5 --out "$OUT/fla" --tag gpu_registry
}

cmdsched() {
  local mode flags
  for mode in default SERIALIZE CONCURRENT LHS default2; do
    flags=""
    [[ $mode == default* ]] || flags="--xla_gpu_command_buffer_scheduling_mode=$mode"
    XLA_FLAGS="$flags" timeout 110 python3 -m experiments.bench_nsa --T 65536 --dims 128/128 --breakdown_T '' \
      --iters 5 --out "$OUT/cmdsched/$mode"
  done
}

streams() {
  local f=--xla_gpu_experimental_stream_annotation=true
  # 2026-12-03, first try: win:1 ran (no gain), win:1+cmp:2 failed to compile (XLA: "No
  # ExecutionStreamId found for call-start" on the fold's nested pad), which ended that process.
  XLA_FLAGS="$f --xla_gpu_enable_command_buffer=" timeout 200 python3 \
    benchmarks/stream_overlap_trial.py "$OUT/streams/64k_nocmdbuf" --layouts ",win:1,win:1+group,slc:1,"
  XLA_FLAGS=$f timeout 200 python3 benchmarks/stream_overlap_trial.py "$OUT/streams/64k" \
    --layouts ",win:1+group,slc:1,win:1+slc:2+group,"
}

window() {
  timeout 330 python3 -m experiments.bench_window --check --iters 10 --out "$OUT/window"
  timeout 200 python3 -m experiments.bench_window --segments --iters 5 --out "$OUT/window" \
    --shapes 8192:8:16/1:64/64,65536:1:64/4:192/128
}
winsweep() {
  timeout 400 python3 -m experiments.bench_window --backends triton,cudnn --iters 5 --name window_sweep \
    --shapes 65536:1:64/4:128/128,65536:1:64/4:192/128,8192:8:16/1:64/64 --out "$OUT/winsweep" \
    --tilings "fused:bwd_fused_dq=true,fusedr64:bwd_fused_dq=true;dkv_rows=64,fusedw4:bwd_fused_dq=true;dkv_num_warps=4,f128:rows=128,fbk32:block_k=32,b64:bwd_rows=64,bk128:bwd_block_k=128,dkvw4:dkv_num_warps=4"
}
winfused() {
  local s
  for s in 65536:1:64/4:128/128 65536:1:64/4:192/128 8192:8:16/1:64/64; do
    timeout 120 python3 -m experiments.bench_window --backends triton,cudnn --iters 5 \
      --name "window_fused_$(echo "$s" | cut -d: -f1,4 | tr :/ __)" --shapes "$s" \
      --out "$OUT/winfused" --tilings "fused:bwd_fused_dq=true,fusedw4:bwd_fused_dq=true;dkv_num_warps=4"
  done
  timeout 150 python3 benchmarks/cmp_tiling_trial.py --out="$OUT/winfused" --shapes=8k,64k-paper \
    --iters=10 --variants default --extra '{"fused dq": {"bwd_fused_dq": true}}'
}
winnsa() {
  local be
  for be in rule triton cudnn-fwd rule2; do
    NSA_WINDOW_BACKEND=$(case $be in rule*) ;; *) echo $be ;; esac) timeout 200 python3 -m \
      experiments.bench_nsa --T 65536 --dims 128/128,192/128 --breakdown_T '' --iters 5 \
      --out "$OUT/winnsa/$be"
  done
}

warps2nsa() {
  # timeouts sum to 540 s, inside the device's 600 s a command (the four A/B runs took 132 s on
  # an H100)
  timeout 180 python3 -m experiments.bench_nsa --T 65536 --dims 128/128,192/128 \
    --breakdown_T 65536 --iters 10 --out "$OUT/warps2nsa/now"
  local v
  for v in before after before after; do  # before: default_tiling patched back to 4 warps
    timeout 90 python3 -c "
import dataclasses, sys
import pallas_kernels._common as C
if sys.argv[1] == 'before':
  orig = C.default_tiling
  C.default_tiling = lambda g, b: dataclasses.replace(orig(g, b), num_warps=4)
from experiments import bench_nsa
bench_nsa.main(['--T', '65536', '--dims', '128/128', '--breakdown_T', '', '--iters', '10',
                '--out', sys.argv[2]])
" "$v" "$OUT/warps2nsa/$v" | grep '^| nsa' | sed "s/^/$v /"
  done
}

dqsteps() {
  timeout 230 python3 benchmarks/select_bwd_trial.py --out "$OUT/dqsteps" --shapes 64k-128 \
    --lists nsa-topn,random --iters 10 --budget_s 200 \
    --variants "dq 2 blocks a step,dq 2 blocks a step warps 4,dq+fwd warps 4 (G = 16 before 2026-12-06)"
}

densedoc() {
  # the 8k layer without and with packed documents (the plain-JAX path runs beside the latter),
  # then dense_attention with ids per implementation (our kernels, cuDNN's explicit mask) against
  # cuDNN's causal call at 8k and 32k, and at 8k with long documents; timeouts sum to 570 s
  timeout 120 python3 -m experiments.bench_window --window 8192 --shapes 8192:8:16/1:64/64 \
    --backends triton,cudnn --tilings splits8:bwd_splits=8 --iters 10 --out "$OUT/densedoc" \
    --name dense_8192
  timeout 120 python3 -m experiments.bench_window --window 8192 --shapes 8192:8:16/1:64/64 \
    --segments --tilings splits8:bwd_splits=8 --iters 10 --out "$OUT/densedoc" \
    --name dense_8192_segments
  timeout 240 python3 benchmarks/dense_doc_trial.py --out "$OUT/densedoc" \
    --shapes 8192:8:16/1:64/64,32768:2:16/1:64/64 --impls pallas,cudnn
  # long documents, as in the embedded corpus (token-weighted mean file ~52 kB): at 8k most rows
  # hold one or two documents, so the masked path's own cost shows (2026-12-06 masked training:
  # dense 196k vs 314k tokens/s unmasked)
  timeout 90 python3 benchmarks/dense_doc_trial.py --out "$OUT/densedoc/long" \
    --shapes 8192:8:16/1:64/64 --impls pallas --mean_doc_len 16384
}

cmpdoc() {  # timeouts sum to 560 s
  local n
  for n in 4096 16384; do
    timeout 130 python3 benchmarks/cmp_tiling_trial.py --out="$OUT/cmpdoc/cmp_$n" --shapes=8k \
      --docs=$n --variants="no seg split,dkv masked ids" --iters=20
  done
  timeout 300 python3 benchmarks/doc_mask_trial.py --out "$OUT/cmpdoc/dmt" --docs 4096,16384 \
    --variants default,dkv_w8_s2,dkv_w4,dkv_masked_ids
}

seldoc() {
  timeout 560 python3 benchmarks/select_doc_trial.py --out "$OUT/seldoc" --docs 16384,4096 \
    --variants auto,auto_triton_dkv_ids,auto_triton_ids,auto_no_ids,triton,triton_no_ids
}

windoc() {
  timeout 400 python3 benchmarks/doc_mask_trial.py --out "$OUT/windoc" --window 512 \
    --docs none,16384,4096 --name windoc \
    --variants default,dkv_w4,dkv_w8_s2,dkv_masked_ids,dkv_masked_ids_w4_s2,no_seg_split
}

windq() {
  timeout 300 python3 benchmarks/doc_mask_trial.py --out "$OUT/windq" --window 512 \
    --docs none,16384 --name windq \
    --variants default,dq_w8,seg_bounds,dq_s3,dq_bk32,dq_bk128,dq_rows64
}

cudnnpacked() {
  timeout 560 python3 benchmarks/cudnn_packed_trial.py --out "$OUT/cudnnpacked"
}

ncuprof() {
  local bin d="$OUT/ncuprof"
  bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$bin" ] || { echo "ncu not found"; return 2; }
  "$bin" --version | tail -1
  # No preallocation (ncu's replay needs device memory), no command buffers (one launch a kernel).
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
    timeout "${NCU_TIMEOUT:-420}" "$bin" --clock-control none --set full --target-processes application-only \
    -k regex:'nsa_|mosaic' -f -o "$d/prof" python3 benchmarks/ncu_kernels.py \
    --cases "${NCU_CASES:-topn,random_fwd,clustered_fwd,random_bwd}"
  "$bin" -i "$d/prof.ncu-rep" --page raw --csv > "$d/raw.csv"
  "$bin" -i "$d/prof.ncu-rep" --page details --csv > "$d/details.csv"
  gzip -f "$d/raw.csv" "$d/details.csv"
  ls -la "$d"
}

nvidia-smi -L >> "$OUT/log.txt" 2>&1
for phase in "$@"; do
  declare -F "$phase" > /dev/null || { echo "unknown phase '$phase' (see the header)"; exit 2; }
done
for phase in "$@"; do
  mkdir -p "$OUT/$phase"
  echo "=== $phase $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
  "$phase" >> "$OUT/log.txt" 2>&1
  echo "=== $phase done (rc $?) $(date -u +%H:%M:%S)" >> "$OUT/log.txt"
  # The device tool brings back only the files at the top of $OUT: every folder under it as one
  # archive, repacked after each phase (tar xzf results.tgz here).
  tar czf "/tmp/results.$$.tgz" --exclude=./results.tgz -C "$OUT" . && mv "/tmp/results.$$.tgz" "$OUT/results.tgz"
done
tail -n 40 "$OUT/log.txt"
