# Diagnostic (2026-12-01, thirteenth session): where NSA's training start-up goes on the GPU.
# NSA's 8k run reached its 10th step 86 s after start against 14 s for the dense twin, and at
# 16k / 32k it was still compiling at 125 s (benchmarks/results/train_startup_1gpu.json). This
# builds the real training step (experiments.train's setup, the small GPU configs) in a fresh
# process per variant and times tracing + lowering and XLA's compilation separately, over the
# number of layers (does the cost grow per layer, i.e. would a scan over layers help?), against
# the plain-JAX NSA path (no Pallas kernels) and the dense twin, and with JAX's persistent
# compilation cache (the second process of a pair reads what the first wrote).
#   python3 benchmarks/compile_time_trial.py OUT.json [variant ...]
# variant = name:seq_len:n_layers:implementation[:flags], e.g. nsa:8192:12:pallas:scan,cache
# (flags: cache = JAX's persistent compilation cache, scan = model.layer_loop "scan", unroll<N>
# = "unrolled" (N is ignored: always the full unroll), neither = "python" (the Python loop, the
# only way before 2026-12-01); notfk = the initialisers without JAX's threefry GPU kernel;
# scansearch = the selection index maps' jnp.searchsorted while loops (the code before 2026-12-01,
# fourteenth session); union = the selection's lax.cond pinned to its union tile (a constant
# predicate, which XLA folds away; since STATIC_UNION_MAX_T, G = 16 at T <= 8192 has no cond, so
# this flag changes nothing there); cond = STATIC_UNION_MAX_T set to 0, i.e. the lax.cond as before
# 2026-12-01 at every length; cbcond = XLA_FLAGS putting conditionals and
# while loops into the command buffers; stablesort = the index maps' integer sorts stable, as
# before 2026-12-01: XLA then sorts (key, index) pairs); slots<N> / dkvslots<N> = the Mosaic
# selection kernels' pipeline depth (select_attention_mgpu.FWD_SLOTS for the forward, dq and the
# compression forward / DKV_SLOTS for dK/dV; 2 = the default); projsplit = one matmul per input
# projection (attention.FUSE_PROJ "none", as before 2026-12-02), kvonly = only the key / value
# projections as one matmul (FUSE_PROJ "kv"; the default "all" adds the query and gate); ovl =
# the Mosaic selection forward with the intra-warpgroup overlap (select_attention_mgpu.OVERLAP);
# fatsmem = the Mosaic kernels' shared-memory buffers each on its own (LEAN_SMEM off, as before
# 2026-12-02).
# TRIAL_STEPS = timed steps (default 10).
# The runs of 2026-12-01 used an earlier spelling of the same switch (model.scan_layers plus an
# environment variable for the unroll); these flags reproduce them. Each variant
# also times TRIAL_STEPS steps after the first (ms/step), so throughput is in the same rows.
import json
import os
import re
import subprocess
import sys
import time

DEFAULT = ["dense:8192:12:-", "nsa:8192:1:pallas", "nsa:8192:4:pallas", "nsa:8192:12:pallas",
           "nsa:8192:12:xla", "nsa:8192:12:pallas:cache", "nsa:8192:12:pallas:cache",
           "nsa:16384:12:pallas"]


FLAGS = ("cache", "cbcond", "notfk", "scansearch", "stablesort", "cond", "union", "scan",
         "projsplit", "kvonly", "ovl", "fatsmem")
NUMBERED_FLAGS = ("unroll", "dkvslots", "slots")  # followed by a number


def parse(variant):
  """(kind, seq, layers, impl, flags) of a variant; unknown flags are refused (a misspelt or
  retired flag would otherwise time the default under its name)."""
  kind, seq, layers, impl, *rest = variant.split(":")
  flags_ = set(rest[0].split(",")) if rest else set()
  bad = sorted(f for f in flags_  # unroll's number is optional, the slots' are not
               if f not in FLAGS and not re.fullmatch(r"unroll\d*|(dkv)?slots\d+", f))
  if bad:
    raise SystemExit(f"variant {variant!r}: unknown flag(s) {bad}. Known: {', '.join(FLAGS)}, "
                     f"and {', '.join(n + '<N>' for n in NUMBERED_FLAGS)} (see the header)")
  return kind, seq, layers, impl, flags_


def one(variant):
  kind, seq, layers, impl, flags_ = parse(variant)
  cache = "cache" in flags_
  if "cbcond" in flags_:  # lax.cond / while inside XLA's command buffers (CUDA graph conditionals)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
                               "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE").strip()
  if "notfk" in flags_:
    os.environ["NSA_JAX_THREEFRY_KERNEL"] = "0"
  if cache:
    import jax
    jax.config.update("jax_compilation_cache_dir", "/tmp/nsa_jax_cc_trial")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  import jax
  from configs import small_gpu_nsa
  from experiments.profile_step import lower_and_compile
  from nsa_jax.training import sharding as shd
  from nsa_jax.training import train
  from pallas_kernels import _common as kc
  if "scansearch" in flags_:  # the index maps' search as before 2026-12-01 (a while loop)
    kc.search_sorted = lambda a, v, side="left": jax.numpy.searchsorted(a, v, side=side)
  if "stablesort" in flags_:  # the index maps' integer sorts stable, as before 2026-12-01
    import types
    real = jax.numpy
    kc.jnp = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if k[:2] != "__"})
    kc.jnp.sort = lambda a, axis=-1, **kw: real.sort(a, axis=axis, stable=True)
  if "cond" in flags_:  # the selection's lax.cond at every length (before STATIC_UNION_MAX_T)
    from pallas_kernels import select_attention as sk
    sk.STATIC_UNION_MAX_T = 0
  if "union" in flags_:  # the selection's lax.cond always takes its union tile (folded away)
    kc.use_union = lambda *a, **k: jax.numpy.array(True)
  from pallas_kernels import select_attention_mgpu as mgpu
  if "projsplit" in flags_ or "kvonly" in flags_:  # the input projections' fusion (FUSE_PROJ)
    from nsa_jax import attention
    attention.FUSE_PROJ = "none" if "projsplit" in flags_ else "kv"
  if "fatsmem" in flags_:  # the Mosaic kernels' buffers each in its own shared memory
    mgpu.LEAN_SMEM = False
  if "ovl" in flags_:  # the selection forward's intra-warpgroup overlap (read when traced)
    mgpu.OVERLAP = True
  for f in flags_:  # the Mosaic kernels' pipeline depth (read when traced)
    if f.startswith("dkvslots"):
      mgpu.DKV_SLOTS = int(f[len("dkvslots"):])
    elif f.startswith("slots"):
      mgpu.FWD_SLOTS = int(f[len("slots"):])
  c = small_gpu_nsa.get_config()
  seq, layers = int(seq), int(layers)
  c.model.attention = kind
  c.model.n_layers = layers
  c.model.max_seq_len = c.data.seq_len = seq
  c.data.global_batch_size = max(1, int(os.environ.get("TRIAL_TOKENS", 65536)) // seq)
  if impl != "-":
    c.model.nsa.implementation = impl
  c.model.layer_loop = ("scan" if "scan" in flags_ else "unrolled"
                        if any(f.startswith("unroll") for f in flags_) else "python")
  mesh = shd.make_mesh(c.mesh)
  t0 = time.perf_counter()
  setup = train.build_setup(c, mesh)
  build_s = time.perf_counter() - t0
  state = train.create_train_state(setup)
  jax.block_until_ready(state)
  checksum = float(sum(jax.numpy.sum(x.astype("float64") if jax.config.jax_enable_x64 else x)
                       for x in jax.tree.leaves(state["params"])))
  step = train.make_train_step(setup, c.optim.grad_accum_steps)
  batches, _ = train._iterators(c, setup.model_cfg)
  train.set_dense_packed_cap(c, setup.model_cfg, batches, mesh)  # as a training run chooses
  batch = train.to_global(next(batches), setup)
  setup_s = time.perf_counter() - t0
  with jax.set_mesh(mesh):
    lowered, compiled, lower_s, compile_s = lower_and_compile(step, state, batch)
    text = lowered.as_text()
    t0 = time.perf_counter()
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    first_s = time.perf_counter() - t0
    n_steps = int(os.environ.get("TRIAL_STEPS", 10))
    t0 = time.perf_counter()
    for _ in range(n_steps):
      state, m = compiled(state, batch)
    jax.block_until_ready(m)
    step_ms = (time.perf_counter() - t0) / n_steps * 1e3
    hlo = compiled.as_text() or ""
  return dict(variant=variant, attention=kind, seq_len=seq, n_layers=layers, implementation=impl,
              cache=cache, layer_loop=c.model.layer_loop, build_setup_s=round(build_s, 2),
              setup_s=round(setup_s, 2), param_checksum=checksum, lower_s=round(lower_s, 2),
              compile_s=round(compile_s, 2), first_step_s=round(first_s, 2),
              step_ms=round(step_ms, 2), tokens_per_s=round(seq * c.data.global_batch_size
                                                            / step_ms * 1e3),
              triton_calls=text.count("__gpu$xla.gpu.triton"),
              mosaic_calls=text.count("mosaic_gpu"), timed_steps=n_steps,
              hlo_conditionals=hlo.count(" conditional("), hlo_while_loops=hlo.count(" while("),
              loss=float(m["loss"]))


def main():
  if sys.argv[1] == "--one":
    print("RESULT " + json.dumps(one(sys.argv[2])), flush=True)
    return
  out, variants = sys.argv[1], sys.argv[2:] or DEFAULT
  for v in variants:  # every variant checked before the first process starts
    parse(v)
  import datetime
  import platform
  rows = []
  for v in variants:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--one", v], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           x for x in (os.getcwd(), os.environ.get("PYTHONPATH")) if x)})
    wall = time.perf_counter() - t0
    got = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    row = json.loads(got[-1][7:]) if got else dict(variant=v, error=p.stderr[-2000:])
    row["process_wall_s"] = round(wall, 1)
    rows.append(row)
    print(json.dumps(row), flush=True)
    doc = dict(command="python3 benchmarks/compile_time_trial.py " + " ".join(sys.argv[1:]),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               host=platform.node(), rows=rows)
    with open(out, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()
