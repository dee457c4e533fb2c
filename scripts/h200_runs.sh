#!/usr/bin/env bash
# The project's GPU training runs, one phase per device call (each phase fits in 10 minutes).
#
#   bash scripts/h200_runs.sh PHASE [PHASE ...]      (repository root, on a machine with 2 H200s)
#
# pair     NSA vs dense at equal tokens (configs/sweep_nsa_vs_dense.py:gpu, ~100M parameters, 8k
#          context, 300 steps of 8 x 8k tokens): `nsa` on GPU 0 while `dense` then `dense_pmatch`
#          run on GPU 1; then validation loss by position and the selection picture.
# layouts  the same NSA config stopped after 40 steps on 2 GPUs as data-parallel, FSDP and tensor-
#          parallel meshes (each writes collectives.json). Compare with
#          `python -m experiments.compare_runs ... --max_step=40` against pair's `nsa` run.
# layouts_kv2  a 2-KV-group variant on 1 and 2 GPUs (tensor parallelism that really splits the
#          attention by KV group).
# passkey  passkey retrieval trained at 4k (configs/sweep_needle.py:gpu), NSA on GPU 0 and dense on
#          GPU 1, then the needle grid at 2k-16k (heatmap PNG + JSON).
# passkey2 the same task with a curriculum: 1500 steps at PK_LEN1 tokens (default 1024), then 400 at
#          4k warm-started from them (config.checkpoint.init_from); needle grid at 2k-8k. ~5 min of
#          runs. At 1024 NSA's window + 16 blocks of 64 cover the whole sequence, so nothing asks
#          its block scores to rank the key's block first (2026-11-30: NSA then failed every middle
#          depth at 4k). PK_N1=8 makes the 1024 stage choose (5 of 13 free blocks); PK_LEN1=2048
#          did not get past the plateau in 1500 steps (PK_STEPS1 raises them; the stage's timeout
#          grows with it). PK_STEPS2: steps of the 4k stage (default 400); PK_RUNS: which models
#          (default "nsa dense"); on a one-GPU machine they run one after another. PK_EVAL_STEPS:
#          4k-stage checkpoints scored beside the last (e.g. 600,800); PK_ARGS2: more overrides for
#          the 4k stage (e.g. --config.optim.learning_rate=5e-4), PK_ARGS1 for the first stage
#          (e.g. seeds), with PK_TAG naming the variant. PK_STEPS3 / PK_ARGS3: a third 4k stage
#          warm-started from the second (e.g. the far-answer rows of single_question_fraction late).
#          Then, for NSA's last stage, needle_eval --mode=blocks at 2k and 4k (PK_BLOCKS=0 skips
#          it; at most 150 s): does the selection hold the key where the answer fails?
#          PK_FORCE (e.g. 3 or 2,3): then the same with the key forced into those layers'
#          selection (needle_eval --force_key_layers; at most 150 s more): does that fix it?
# branches, design, blocks
#          the paper's ablations at GPU scale (configs/sweep_*.py:gpu), two runs per GPU (blocks:
#          finer, coarser | n_x2; n_forced_only ran on its own, docs/RESULTS.md §0b).
# selgain  does selection pay off with more tokens? `nsa` (n = 16) on GPU 0 and `n_forced_only`
#          (n = 3, forced blocks only) on GPU 1, same code, SG_STEPS steps (default 600, ~6.5 min
#          estimated from the 300-step runs' 207-237 s); after 300 steps n_forced_only was 0.041
#          lower (docs/RESULTS.md §0b, older-code nsa reference, one seed; at CPU scale that pair's
#          difference flips sign across init seeds, §4b): SG_SEED=1, 2 for more seeds (SG_STEPS=300
#          without a seed would reuse the recorded older-code nsa run).
# startup  benchmarks/compile_time_trial.py with the committed model.layer_loop: NSA's start-up split
#          (setup / lower / compile) unrolled vs the Python loop at 8k, dense at 8k, and the 32k pair
#          unrolled (step-only tokens/s); the 2026-12-01 rows used the change's first spelling.
# prof8k   where the 8k training step's GPU time goes: experiments.profile_step on the NSA config
#          and its dense twin (sequentially on GPU 0; kernels grouped per step, ms/step, tokens/s),
#          the question behind issue 7's 8k throughput gap; 150-205 s measured (2026-11-30).
#          PROF_NOCMDBUF=1: without XLA's command buffers, so the by-scope table is filled.
# profdoc  the 8k step with document masking: experiments.profile_step on the pair's config at 8k x 8,
#          "config" with data.document_mask=True against "compare" without, dense first, then NSA
#          (PROFDOC_MODELS picks; PROFDOC_LIMIT s each, default 240). Why dense with masking trained at
#          196k tokens/s against 314k without (H100, 2026-12-06) when its kernels explain ~50 ms of
#          the ~125 ms a step.
# impl8    NSA at 8k x 8, implementation=pallas-mosaic (GPU 0) vs pallas (GPU 1), CTX_STEPS steps.
# context8, context16, context32
#          training throughput of NSA vs dense at 8k, 16k or 32k context (same tokens per step),
#          20 steps, NSA on GPU 0 and dense on GPU 1 at the same time (each length ~2.5 min of
#          runs, mostly start-up and compilation). CTX_STEPS=100 CTX_LOG=10 for a longer sample;
#          CTX_EXTRA adds flags to both runs (e.g. CTX_EXTRA=--config.data.document_mask=True).
# context8_1gpu, context16_1gpu, context32_1gpu (context8_1gpu_rev: the 8k pair, dense first)
#          the same pairs one after another on ONE GPU, for sessions where only the one-GPU kind
#          is lent (run this script there with `carry=[".whl"]` too): NSA (280 s limit) then
#          dense (200 s), fresh work directories (CTX_NSA_LIMIT / CTX_DENSE_LIMIT change the
#          limits). Before the layers were traced once (2026-12-01), NSA's start-up at 16k / 32k took more than 125 s
#          on one H200 (2026-12-01: both NSA runs killed at that limit before step 10): one
#          length a call.
# projfuse the input projections as one matmul (nsa_jax.attention.FUSE_PROJ): "all" (the default:
#          query, K/V and gate) vs "kv" (flag kvonly) vs "none" (flag projsplit, one matmul per
#          projection as before 2026-12-02): step-only rates of the 8k NSA LM and its dense twin
#          (benchmarks/compile_time_trial.py, KV_STEPS timed steps, default 30); PF_VARIANTS
#          overrides the variant list (~85 s per NSA variant, ~35 s per dense one).
# packedpair  masked 8k runs with NSA_CUDNN_PACKED=PP_CAP (default 8; cuDNN's packed layout for ids)
#          and =0 (our kernels): dense packed / plain, NSA packed / plain, one GPU, carry `.whl`;
#          351 s on an H100 (2026-12-07).
# segids   masked 8k NSA with select_attention_mgpu.SEGMENT_IDS off (the Triton union tile with
#          the ids) and on (the Mosaic forward and dq with the ids as document bounds), in
#          SI_ORDER (default "off on"; SI_FLAG=DKV_SEGMENT_IDS toggles the dK/dV partials' switch
#          instead; SI_TILING=seg_bounds a CmpTiling field of the compression and window kernels'
#          default tilings), then masked dense (data.cudnn_packed_cap "auto"; SI_DENSE=0
#          skips it), one GPU, SI_LIMIT s each (default 165: at 130 both runs of a cold H100
#          were cut, 2026-12-07), carry `.whl`; 415 s with the compiled segment-id tests before
#          it on an H100 (2026-12-07).
# determinism  is 8k training bitwise reproducible, with and without XLA's determinism flags
#          (one GPU, carry `.whl`; DET_FLAGS picks the flags)
#
# Work directories (1.2 GB checkpoints) stay under /tmp/h200; the small results (metrics.jsonl,
# config.json, loss.png, collectives.json, logs, tables, pictures) are packed into $OUT/<phase>.tgz.
# On the device tool: carry [".whl"] (ml-collections and tensorboardX wheels, see GPU.md).
set -uo pipefail
OUT=${OUT:-/tmp/h200_out}
T=/tmp/h200
R=$T/results
mkdir -p "$R" "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
SWEEP=${SWEEP:-configs/sweep_nsa_vs_dense.py:gpu}  # the CPU scale (no suffix) for a smoke test

wait_runs() {  # wait for this phase's runs, not for the packing watchdog (a bare `wait` would:
  # on 2026-11-30 every phase that waited on its runs lasted the watchdog's full 540 s)
  local p
  for p in $(jobs -p); do
    [ "$p" = "${WATCHDOG:-}" ] || wait "$p"
  done
}

keep() {  # keep <workdir> <name>: copy a run's small files into the results
  local f  # (without it the loop overwrote a caller's $f: bash's locals are dynamically scoped)
  mkdir -p "$R/$2"
  for f in metrics.jsonl config.json loss.png collectives.json; do
    [ -f "$1/$f" ] && cp "$1/$f" "$R/$2/"
  done
}

pair() {
  local a="--runs_root=$T/runs --out_dir=$R/nsa_vs_dense_gpu"
  CUDA_VISIBLE_DEVICES=0 python3 -m experiments.ablate --config=$SWEEP --run=nsa $a \
    > "$R/pair_gpu0.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 -m experiments.ablate --config=$SWEEP --run=dense,dense_pmatch $a \
    > "$R/pair_gpu1.log" 2>&1 &
  wait_runs
  python3 -m experiments.ablate --config=$SWEEP --report_only $a >> "$R/pair_gpu0.log" 2>&1
  local w="$R/nsa_vs_dense_gpu"
  CUDA_VISIBLE_DEVICES=0 python3 -m experiments.needle_eval --mode=position \
    --workdirs=$w:nsa,$w:dense,$w:dense_pmatch --bucket=1024 --batches=4 \
    --out=$R/position_loss_gpu.png > "$R/position.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 -m experiments.visualize_selection --workdir=$w:nsa \
    --out=$R/selection_gpu.png > "$R/selection.log" 2>&1 &
  wait_runs
  for d in "$T"/runs/*/; do keep "$d" "pair_$(basename "$d")"; done
}

layout_run() {  # layout_run <name> <devices> <extra flags...>
  local name=$1 dev=$2
  shift 2
  CUDA_VISIBLE_DEVICES=$dev timeout -k 60 -s TERM 170 python3 -m experiments.train --config=$SWEEP \
    --workdir=$T/layouts/$name --config.train.stop_after=40 --config.train.hlo_report=True "$@" \
    > "$R/layout_$name.log" 2>&1
  echo "layout $name: exit $?"
  keep "$T/layouts/$name" "layout_$name"
}

# Each layout run takes ~2.5 min (start-up, compilation, 40 steps, validation, checkpoint): at
# most three fit one 10-minute call, hence two phases.
layouts() {
  layout_run dp2 0,1 --config.mesh.data=2
  layout_run fsdp2 0,1 --config.mesh.data=1 --config.mesh.fsdp=2
  layout_run tp2 0,1 --config.mesh.data=1 --config.mesh.tensor=2
}
layouts_kv2() {
  layout_run kv2_1gpu 0 --config.model.n_kv_heads=2
  layout_run kv2_tp2 0,1 --config.model.n_kv_heads=2 --config.mesh.data=1 --config.mesh.tensor=2
}

ctx_flags() {  # ctx_flags <seq_len> <batch>: the throughput runs' overrides (CTX_STEPS, CTX_LOG)
  echo "--config.data.seq_len=$1 --config.model.max_seq_len=$1 --config.data.global_batch_size=$2
    --config.train.stop_after=${CTX_STEPS:-20} --config.train.log_every=${CTX_LOG:-5}
    --config.train.eval_every=100000 ${CTX_EXTRA:-}"
}

ctx_run() {  # ctx_run <nsa|dense> <seq_len> <batch> <gpu> <limit_s> <kill_s>: one throughput run
  local x=""
  [ "$1" = dense ] && x="--config.model.attention=dense"
  CUDA_VISIBLE_DEVICES=$4 timeout -k "$6" -s TERM "$5" python3 -m experiments.train \
    --config=$SWEEP --workdir=$T/context/$1_$2 $x $(ctx_flags "$2" "$3") \
    > "$R/context_$1_$2.log" 2>&1
  echo "context $1_$2: exit $? (124: cut at its limit)"
}

context_pair() {  # context_pair <seq_len> <batch>: NSA on GPU 0 and dense on GPU 1 at once
  rm -rf "$T/context/nsa_$1" "$T/context/dense_$1"  # a rerun must not resume a saved run
  ctx_run nsa "$1" "$2" 0 300 60 &
  ctx_run dense "$1" "$2" 1 300 60 &
  wait_runs
  keep "$T/context/nsa_$1" "context_nsa_$1"
  keep "$T/context/dense_$1" "context_dense_$1"
}

context8() { context_pair 8192 8; }
impl8() {  # NSA at 8k x 8 with two kernel implementations side by side (IMPL_A on GPU 0, IMPL_B
  # on GPU 1; default pallas-mosaic vs pallas), CTX_STEPS steps: the training throughput of each
  local a=${IMPL_A:-pallas-mosaic} b=${IMPL_B:-pallas} i=0 impl f
  f=$(ctx_flags 8192 8)
  for impl in $a $b; do
    CUDA_VISIBLE_DEVICES=$i timeout -k 60 -s TERM 300 python3 -m experiments.train --config=$SWEEP \
      --workdir=$T/impl8/$impl --config.model.nsa.implementation=$impl $f \
      > "$R/impl8_$impl.log" 2>&1 &
    i=$((i + 1))
  done
  wait_runs
  for impl in $a $b; do keep "$T/impl8/$impl" "impl8_$impl"; done
}
context16() { context_pair 16384 4; }
context32() { context_pair 32768 2; }

context_1gpu() {  # context_1gpu <seq_len> <batch>: NSA, then dense, on GPU 0
  rm -rf "$T/context/nsa_$1" "$T/context/dense_$1"  # a rerun must not resume a saved run
  ctx_run nsa "$1" "$2" 0 "${CTX_NSA_LIMIT:-280}" 20
  keep "$T/context/nsa_$1" "context_nsa_$1"
  ctx_run dense "$1" "$2" 0 "${CTX_DENSE_LIMIT:-200}" 20
  keep "$T/context/dense_$1" "context_dense_$1"
}
context8_1gpu() { context_1gpu 8192 8; }
determinism() {  # is GPU training bitwise reproducible? The 8k LM (CTX_STEPS steps, one GPU, one
  # after another): NSA (DET_NSA_LAYERS layers) twice and dense twice with XLA_FLAGS=$DET_FLAGS,
  # dense twice without; benchmarks/determinism_report.py says which pairs are bitwise equal.
  # 2026-12-01 (jax 0.11.2): "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0" made
  # XLA's compile fail (IndexError raw_hash_map::at) for NSA and dense alike; which flag was not
  # measured, so the default now tries the first alone.
  local flags m run
  flags="$(ctx_flags 8192 8) --config.train.eval_batches=1"
  for run in nsa_det_1 nsa_det_2 dense_det_1 dense_nondet_1 dense_det_2 dense_nondet_2; do
    m=${run#*_}; m=${m%_*}
    rm -rf "$T/det/$run"  # metrics.jsonl appends: a rerun must start clean
    XLA_FLAGS="$([ "$m" = det ] && echo "${DET_FLAGS:---xla_gpu_deterministic_ops=true}")" \
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 -s TERM 150 python3 -m experiments.train --config=$SWEEP \
      --workdir=$T/det/$run $flags $([ "${run%%_*}" = dense ] && echo --config.model.attention=dense \
        || echo --config.model.n_layers=${DET_NSA_LAYERS:-4}) > "$R/det_$run.log" 2>&1
    echo "det $run: exit $?"
    keep "$T/det/$run" "det_$run"
    rm -rf "$T/det/$run/checkpoints"
  done
  python3 benchmarks/determinism_report.py "$R"
}
packedpair() {  # masked 8k runs on one GPU with and without cuDNN's packed layout (NSA_CUDNN_PACKED,
  # cap PP_CAP, default 8): dense packed, dense plain, NSA packed, NSA plain, PP_LIMIT s each
  # (default 130; a masked 8k run took ~80-100 s on an H100, 2026-12-06)
  local m v
  for m in dense nsa; do
    for v in packed plain; do
      rm -rf "$T/context/${m}_8192"
      # plain: NSA_CUDNN_PACKED=0 (since 2026-12-07 an unset variable leaves dense layers on the
      # packed layout through data.cudnn_packed_cap=auto)
      export NSA_CUDNN_PACKED=$([ $v = packed ] && echo "${PP_CAP:-8}" || echo 0)
      CTX_EXTRA="--config.data.document_mask=True ${CTX_EXTRA:-}" \
        ctx_run "$m" 8192 8 0 "${PP_LIMIT:-130}" 15
      mv "$R/context_${m}_8192.log" "$R/packedpair_${m}_$v.log"
      keep "$T/context/${m}_8192" "packedpair_${m}_$v"
    done
  done
  unset NSA_CUDNN_PACKED
  grep -H "tokens_per_s\|cudnn-packed\|packed layout\|fall back" "$R"/packedpair_*.log | tail -n 40
}
segids() {  # masked 8k NSA with the Mosaic selection kernels' SEGMENT_IDS off / on, then masked dense
  local v f s=${SI_TILING:-${SI_FLAG:-}} n
  n=segids${s:+_$s}  # the runs' names say which switch they toggle
  f=$(ctx_flags 8192 8)
  for v in ${SI_ORDER:-off on}; do
    rm -rf "$T/segids/$v"
    # shellcheck disable=SC2086
    timeout -k 15 -s TERM "${SI_LIMIT:-165}" python3 -c "
import dataclasses, os, sys
on, field = sys.argv.pop(1) == 'on', os.environ.get('SI_TILING')
if field:  # a CmpTiling field, in the compression and window kernels' default tilings
  import pallas_kernels.compress_attention as ca, pallas_kernels.window_attention as wk
  ca.DEFAULT_TILING = dataclasses.replace(ca.DEFAULT_TILING, **{field: on})
  wk.WINDOW_TILING = dataclasses.replace(wk.WINDOW_TILING, **{field: on})
else:
  import pallas_kernels.select_attention_mgpu as m
  setattr(m, os.environ.get('SI_FLAG', 'SEGMENT_IDS'), on)
from absl import app
from experiments import train
app.run(train.main, flags_parser=train.parse_flags)
" "$v" --config=$SWEEP --workdir=$T/segids/$v --config.data.document_mask=True $f \
      > "$R/${n}_nsa_$v.log" 2>&1
    echo "$n nsa $v: exit $?"
    keep "$T/segids/$v" "${n}_nsa_$v"
  done
  if [ "${SI_DENSE:-1}" != 0 ]; then
    rm -rf "$T/context/dense_8192"
    CTX_EXTRA="--config.data.document_mask=True ${CTX_EXTRA:-}" \
      ctx_run dense 8192 8 0 "${SI_LIMIT:-165}" 15
    mv "$R/context_dense_8192.log" "$R/segids_dense.log"
    keep "$T/context/dense_8192" "segids_dense"
  fi
  grep -H "tokens_per_s\|select branch\|packed" "$R"/segids_*.log | tail -n 40
}
context8_1gpu_rev() {  # the 8k pair in the other order (dense first): does running second cost?
  rm -rf "$T/context/nsa_8192" "$T/context/dense_8192"
  ctx_run dense 8192 8 0 "${CTX_DENSE_LIMIT:-200}" 20
  keep "$T/context/dense_8192" "context_dense_8192"
  ctx_run nsa 8192 8 0 "${CTX_NSA_LIMIT:-280}" 20
  keep "$T/context/nsa_8192" "context_nsa_8192"
}
context16_1gpu() { context_1gpu 16384 4; }
context32_1gpu() { context_1gpu 32768 2; }

sweep_pair() {  # sweep_pair <sweep> <runs on GPU 0> <runs on GPU 1> [<name> [ablate flags...]]:
  # two runs each fit one call; results and logs under <name> (default <sweep>)_gpu
  local sweep=$1 gpu0=$2 gpu1=$3 name=${4:-$1}
  shift $(( $# < 4 ? $# : 4 ))
  local a="--runs_root=$T/runs --out_dir=$R/${name}_gpu --reuse_from=docs/results/nsa_vs_dense_gpu.jsonl $*"
  CUDA_VISIBLE_DEVICES=0 python3 -m experiments.ablate --config=configs/sweep_$sweep.py:gpu --run=$gpu0 $a \
    > "$R/${name}_gpu0.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 -m experiments.ablate --config=configs/sweep_$sweep.py:gpu --run=$gpu1 $a \
    > "$R/${name}_gpu1.log" 2>&1 &
  wait_runs
  python3 -m experiments.ablate --config=configs/sweep_$sweep.py:gpu --report_only $a >> "$R/${name}_gpu0.log" 2>&1
}

passkey() {  # configs/sweep_needle.py:gpu (docs/results/passkey_recipe.md), NSA and dense at once
  local t="timeout -k 60 -s TERM 300 python3 -m experiments.train --config=configs/sweep_needle.py:gpu"
  CUDA_VISIBLE_DEVICES=0 $t --workdir=$T/passkey/nsa > "$R/passkey_nsa.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 $t --workdir=$T/passkey/dense --config.model.attention=dense \
    > "$R/passkey_dense.log" 2>&1 &
  wait_runs
  keep "$T/passkey/nsa" passkey_nsa
  keep "$T/passkey/dense" passkey_dense
  CUDA_VISIBLE_DEVICES=0 python3 -m experiments.needle_eval --mode=needle \
    --workdirs=$T/passkey/nsa,$T/passkey/dense --labels=nsa,dense --lengths=2048,4096,8192,16384 \
    --depths=0,0.25,0.5,0.75,1 --samples=16 --out=$R/needle_gpu.png > "$R/needle_gpu.log" 2>&1
}

passkey2() {  # PK_LEN1 (default 1024): the first stage's length; tokens per step stay 32k.
  # PK_N1: NSA's n in the first stage only (the 4k stage keeps the paper's 16): with 8 at 1024
  # tokens the selection must choose 5 of 13 free blocks instead of taking them all.
  # PK_DEPTHS (default 0,0.25,0.5,0.75,1): the needle depths scored.
  # PK_STEPS2 (default 400): steps of the 4k stage. PK_RUNS (default "nsa dense"): which models
  # to train. With at least as many GPUs as runs they run at once, one a GPU; otherwise (the
  # one-GPU kind) one after another on GPU 0. PK_ARGS2 needs PK_TAG, a name for the variant in
  # the run's tag, so that its results do not overwrite those of the plain recipe. PK_ARGS1: the
  # same for stage 1 (e.g. "--config.train.seed=1 --config.data.seed=1" with PK_ARGS2 holding
  # them too: a second seed of the whole recipe). PK_STEPS3 (default none): a third stage of that
  # many steps at 4k, warm-started from the 4k stage's last checkpoint, with PK_ARGS3 as its
  # overrides (PK_ARGS2 is not inherited: repeat seeds or rates there), e.g. the far-answer rows
  # only late: PK_ARGS3="--config.data.single_question_fraction=0.5 ...". Its last checkpoint is
  # scored as <model>_s3 beside the 4k stage's.
  local len1=${PK_LEN1:-1024} steps1=${PK_STEPS1:-1500} steps2=${PK_STEPS2:-400} steps3=${PK_STEPS3:-}
  local runs=${PK_RUNS:-nsa dense} evals=${PK_EVAL_STEPS:-} ngpu r gpu st nruns
  local every2=200  # the 4k stage's checkpoint and eval period (as configs/sweep_needle.py:gpu)
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  nruns=$(wc -w <<< "$runs")
  if (( 32768 % len1 )); then echo "PK_LEN1=$len1 must divide 32768 (tokens per step)"; return 2; fi
  if [ -n "${PK_ARGS1:-}${PK_ARGS2:-}${PK_ARGS3:-}${steps3}" ] && [ -z "${PK_TAG:-}" ]; then
    echo "PK_ARGS1 / PK_ARGS2 / PK_ARGS3 / PK_STEPS3 is set: name the variant with PK_TAG (e.g. PK_TAG=lr5e-4)"
    return 2
  fi
  if [ -n "${PK_ARGS3:-}" ] && [ -z "$steps3" ]; then
    echo "PK_ARGS3 is set but PK_STEPS3 is not: PK_ARGS3 needs PK_STEPS3 (the third stage's steps)"; return 2
  fi
  if [ -n "$steps3" ] && { ! [[ $steps3 =~ ^[0-9]+$ ]] || (( steps3 < 1 )); }; then
    echo "PK_STEPS3=$steps3 must be a positive number of steps"; return 2
  fi
  if [ -n "${PK_FORCE:-}" ] && ! [[ $PK_FORCE =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    echo "PK_FORCE=$PK_FORCE must be NSA layer indices, e.g. 3 or 2,3"; return 2
  fi
  for st in ${evals//,/ }; do
    if (( st % every2 || st >= steps2 )); then
      echo "PK_EVAL_STEPS: $st is not a saved 4k-stage step (multiples of $every2 below $steps2)"
      return 2
    fi
  done
  local t="timeout -k 60 -s TERM $((240 * steps1 / 1500)) python3 -m experiments.train --config=configs/sweep_needle.py:gpu"
  local t2="timeout -k 60 -s TERM $((120 + steps2 * 3 / 10)) python3 -m experiments.train --config=configs/sweep_needle.py:gpu"
  local t3="timeout -k 60 -s TERM $((120 + ${steps3:-0} * 3 / 10)) python3 -m experiments.train --config=configs/sweep_needle.py:gpu"
  local tag=pk2_$len1${PK_N1:+_n$PK_N1}${PK_STEPS1:+_s$PK_STEPS1}${PK_STEPS2:+_t$PK_STEPS2}${steps3:+_u$steps3}${PK_TAG:+_$PK_TAG}
  local d=$T/$tag
  # the same answer : context loss ratio as at 4k (25 : 0.01 x ~4000 = 0.04 x ~1000 = 0.02 x ~2000)
  local s1="--config.data.seq_len=$len1 --config.data.global_batch_size=$((32768 / len1))
    --config.data.context_loss_weight=$(python3 -c "print(0.04 * 1024 / $len1)") --config.train.num_steps=$steps1
    --config.train.eval_every=500 --config.checkpoint.every_steps=500 ${PK_ARGS1:-}"
  # every checkpoint of the 4k stage is kept, so PK_EVAL_STEPS (e.g. 600,800) can score earlier
  # ones beside the last (needle_eval's workdir@STEP)
  local s2="--config.train.num_steps=$steps2 --config.train.eval_every=$every2
    --config.checkpoint.every_steps=$every2 --config.checkpoint.max_to_keep=$((steps2 / every2 + 1))
    ${PK_ARGS2:-}"
  local s3="--config.train.num_steps=${steps3:-0} --config.train.eval_every=$every2
    --config.checkpoint.every_steps=$every2 ${PK_ARGS3:-}"
  _pk_run() {  # _pk_run <model> <gpu>: both stages of one model
    local extra1="" extra=""
    if [ "$1" = nsa ]; then extra1=${PK_N1:+--config.model.nsa.num_selected=$PK_N1}
    else extra="--config.model.attention=dense"; fi
    CUDA_VISIBLE_DEVICES=$2 $t $s1 $extra1 $extra --workdir=$d/${1}_s1 > "$R/${tag}_${1}_s1.log" 2>&1
    grep -h "^done:\|stopped" "$R/${tag}_${1}_s1.log"  # a stage cut by its timeout says so here
    CUDA_VISIBLE_DEVICES=$2 $t2 $s2 $extra --workdir=$d/$1 --config.checkpoint.init_from=$d/${1}_s1 \
      > "$R/${tag}_${1}.log" 2>&1
    grep -h "^done:\|stopped" "$R/${tag}_${1}.log"
    if [ -n "$steps3" ]; then
      CUDA_VISIBLE_DEVICES=$2 $t3 $s3 $extra --workdir=$d/${1}_s3 --config.checkpoint.init_from=$d/$1 \
        > "$R/${tag}_${1}_s3.log" 2>&1
      grep -h "^done:\|stopped" "$R/${tag}_${1}_s3.log"
    fi
  }
  gpu=0
  for r in $runs; do
    if (( ngpu > 1 && nruns <= ngpu )); then _pk_run "$r" $gpu & gpu=$((gpu + 1))
    else _pk_run "$r" 0; fi
  done
  wait_runs
  local wds="" labels=""
  for r in $runs; do
    keep "$d/${r}_s1" "${tag}_${r}_s1"; keep "$d/$r" "${tag}_$r"
    wds+="${wds:+,}$d/$r"; labels+="${labels:+,}$r"
    if [ -n "$steps3" ]; then
      keep "$d/${r}_s3" "${tag}_${r}_s3"
      if [ -d "$d/${r}_s3/checkpoints" ]; then wds+=",$d/${r}_s3"; labels+=",${r}_s3"
      else echo "no third-stage checkpoint in $d/${r}_s3: not scored"; fi
    fi
    for st in ${evals//,/ }; do  # a run cut by its timeout may not have reached the step
      if [ -d "$d/$r/checkpoints/$st" ]; then wds+=",$d/$r@$st"; labels+=",$r@$st"
      else echo "no checkpoint $st in $d/$r: not scored"; fi
    done
  done
  # PK_RUNS=nsa then PK_RUNS=dense in one session: each grid under its own name (needle_gpu_<tag>_nsa)
  local ntag=$tag${PK_RUNS:+_${runs// /_}}
  CUDA_VISIBLE_DEVICES=0 python3 -m experiments.needle_eval --mode=needle \
    --workdirs=$wds --labels=$labels --lengths=2048,4096,8192 \
    --depths=${PK_DEPTHS:-0,0.25,0.5,0.75,1} --samples=16 --out=$R/needle_gpu_$ntag.png > "$R/needle_gpu_$ntag.log" 2>&1
  tail -n 30 "$R/needle_gpu_$ntag.log"
  # NSA's last stage: did its selection hold the key where the answer failed? (capped at 150 s)
  local bwd="" blabel=""
  if [[ " $runs " == *" nsa "* ]]; then
    if [ -n "$steps3" ] && [ -d "$d/nsa_s3/checkpoints" ]; then bwd=$d/nsa_s3 blabel=nsa_s3
    else bwd=$d/nsa blabel=nsa; fi
  fi
  _pk_blocks() {  # _pk_blocks <file tag> <label> <lines to show> [needle_eval flags]: capped at 150 s
    local f=needle_blocks_gpu_$1 label=$2 show=$3; shift 3
    CUDA_VISIBLE_DEVICES=0 timeout -k 10 150 python3 -m experiments.needle_eval --mode=blocks "$@" \
      --workdirs=$bwd --labels=$label --lengths=2048,4096 \
      --depths=${PK_DEPTHS:-0,0.25,0.5,0.75,1} --samples=16 --out=$R/$f.json \
      > "$R/$f.log" 2>&1 || echo "needle_eval --mode=blocks $* failed or timed out (log: $f.log)"
    grep -h "$show" "$R/$f.log" || true
  }
  if [ "${PK_BLOCKS:-1}" != 0 ] && [ -n "$bwd" ]; then
    _pk_blocks "$ntag" "$blabel" "digits only a chosen block"
  fi
  if [ -n "${PK_FORCE:-}" ] && [ -z "$bwd" ]; then
    echo "PK_FORCE=$PK_FORCE not run: it forces blocks into an NSA model, and PK_RUNS has no nsa"
  elif [ -n "${PK_FORCE:-}" ]; then  # the intervention (e.g. PK_FORCE=3 or 2,3)
    _pk_blocks "${ntag}_force${PK_FORCE//,/_}" "${blabel}_force${PK_FORCE//,/_}" \
      "^ *[0-9]* [0-9.]*: exact\|digits only a chosen block" --force_key_layers="$PK_FORCE"
  fi
}

# Paper ablations at GPU scale (each ~8 min on 2 GPUs; nsa itself is reused from pair's record).
branches() { sweep_pair branches no_cmp,no_slc no_win; }
design() { sweep_pair design shared_kv,gate_sum quest,mean_phi; }
blocks() { sweep_pair blocks finer,coarser n_x2; }  # n_forced_only: ran alone (RESULTS §0b)
startup() {  # start-up split (setup / lower / compile) and step-only tokens/s with the committed
  # layer_loop spelling: unrolled vs the Python loop at 8k, and the 32k pair unrolled (~6 min)
  timeout -k 20 560 python3 benchmarks/compile_time_trial.py "$R/compile_time_startup.json" \
    nsa:8192:12:pallas:unroll nsa:8192:12:pallas dense:8192:12:-:unroll \
    nsa:32768:12:pallas:unroll dense:32768:12:-:unroll > "$R/startup.log" 2>&1
}
projfuse() {  # the fused input projections' modes at 8k, step-only (one GPU)
  TRIAL_STEPS=${KV_STEPS:-30} timeout -k 20 560 python3 benchmarks/compile_time_trial.py \
    "$R/projfuse_8k.json" ${PF_VARIANTS:-nsa:8192:12:pallas:unroll nsa:8192:12:pallas:unroll,kvonly \
    dense:8192:12:-:unroll dense:8192:12:-:unroll,kvonly} > "$R/projfuse.log" 2>&1
}
prof8k() {
  CUDA_VISIBLE_DEVICES=0 timeout -k 30 420 python3 -m experiments.profile_step \
    --config=configs/small_gpu_nsa.py --compare=configs/small_gpu_dense.py --out="$R/prof8k" \
    ${PROF_NOCMDBUF:+--nocommand_buffers} > "$R/prof8k.log" 2>&1
}
profdoc() {
  local m f x a b
  for m in ${PROFDOC_MODELS:-dense nsa}; do
    x=""; [ "$m" = dense ] && x=model.attention=dense
    a=""; b=""
    for f in data.seq_len=8192 model.max_seq_len=8192 data.global_batch_size=8 $x; do
      a="$a --config.$f"; b="$b --compare.$f"
    done
    CUDA_VISIBLE_DEVICES=0 timeout -k 30 "${PROFDOC_LIMIT:-240}" python3 -m experiments.profile_step \
      --config=$SWEEP $a --config.data.document_mask=True --compare=$SWEEP $b --timed 10 \
      --out="$R/profdoc_$m" ${PROF_NOCMDBUF:+--nocommand_buffers} > "$R/profdoc_$m.log" 2>&1
    echo "profdoc $m: exit $?"
  done
}
selgain() {
  local s=${SG_STEPS:-600}
  sweep_pair blocks nsa n_forced_only selgain --config.train.num_steps=$s \
    --config.train.eval_every=$((s / 4)) --config.checkpoint.every_steps=$s \
    ${SG_SEED:+--config.train.seed=$SG_SEED}
  for r in "$T"/runs/*/; do [ -f "$r/metrics.jsonl" ] && keep "$r" "selgain_$(basename "$r")"; done
}

nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpus.txt" 2>&1
# A device call is killed at its limit with nothing packed: pack what exists before that.
# Its output goes to /dev/null and its sleep is killed with it at the end: a sleep left holding the
# call's stdout kept the 2026-11-30 context8+context32 call open until 540 s (its phases ended at 300 s).
# `&&`: the killed sleep exits non-zero, so no half-written partial.tgz is left at the end.
( sleep "${PACK_AT:-540}" && tar czf "$OUT/partial.tgz" -C "$R" . ) > /dev/null 2>&1 &
WATCHDOG=$!
for phase in "$@"; do
  echo "=== $phase $(date -u +%H:%M:%S)"
  "$phase"
  echo "=== $phase done $(date -u +%H:%M:%S)"
  tar czf "$OUT/$phase.tgz" -C "$R" . && ls -la "$OUT/$phase.tgz"
done
pkill -P "$WATCHDOG" 2>/dev/null; kill "$WATCHDOG" 2>/dev/null
tail -n 3 "$R"/*.log
