"""Where a training step's GPU time goes: device kernels of whole jitted train steps, grouped.

  python -m experiments.profile_step --config=configs/small_gpu_nsa.py \
      --compare=configs/small_gpu_dense.py --out=benchmarks/results/step_profile_8k

For each config: builds the model, optimizer and sharded step exactly as experiments.train does
(random init, the config's data), runs --warmup steps, times --timed steps (ms/step, tokens/s),
then traces --steps more with jax.profiler and sums the device kernels per step into groups (NSA
selection / top-n / compression kernels, cuDNN attention, matmuls, sorts, copies, other XLA
fusions). Writes <out>/step_profile.json and .md (command, hardware, date). The question it
answers (issue 7): which kernels make NSA's 8k step slower than the dense twin's. On a CPU the
trace has no device plane: only the timings are filled in (that is what the tests check).
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import os
import re
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

from experiments.cli import config_value, one_line_errors, parse_flags

_CONFIG = _COMPARE = _OUT = _WARMUP = _TIMED = _STEPS = _CMDBUF = None


def define_flags():
  """Flags are defined only when run as a script, so importing this module (tests) never defines
  absl flags twice (experiments.ablate does the same)."""
  global _CONFIG, _COMPARE, _OUT, _WARMUP, _TIMED, _STEPS, _CMDBUF
  _CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config (configs/*.py)",
                                            lock_config=True)
  _COMPARE = config_flags.DEFINE_config_file("compare", None, "a second config profiled the same "
                                             "way, e.g. the dense twin", lock_config=True)
  _OUT = flags.DEFINE_string("out", None, "output folder (step_profile.json / .md)")
  _WARMUP = flags.DEFINE_integer("warmup", 2, "steps before timing (the first compiles)")
  _TIMED = flags.DEFINE_integer("timed", 20, "steps timed without the profiler (5 moved by a few ms between runs)")
  _STEPS = flags.DEFINE_integer("steps", 2, "steps traced with jax.profiler")
  _CMDBUF = flags.DEFINE_bool(
      "command_buffers", True,
      "keep XLA's CUDA-graph command buffers (as training runs). Inside them the trace names "
      "only the command buffer, so the by-scope table is empty; --nocommand_buffers turns them "
      "off for the whole run (XLA_FLAGS=--xla_gpu_enable_command_buffer=) so every kernel "
      "carries its op metadata, at the cost of per-kernel launches in the step times")
  flags.mark_flags_as_required(["config", "out"])


# (group, pattern on the kernel name), first match wins.
GROUPS = (
    ("NSA top-n (Pallas)", r"nsa_select_topn"),
    ("NSA selection (Pallas Triton / Mosaic GPU)", r"nsa_select|mosaic"),
    ("NSA compression (Pallas)", r"nsa_cmp"),
    ("window / dense with documents (Pallas Triton)", r"nsa_win"),
    ("cuDNN attention (dense, window, fold)", r"cudnn|sdpa|fmha|flash"),
    ("matmuls (cuBLAS / XLA)", r"gemm|xmma|cutlass|cublas|dot|matmul|sm90_"),
    ("sorts", r"^sort"),
    ("copies, memsets, transposes", r"memcpy|memset|copy|transpose"),
    ("other XLA fusions", r"fusion"),
)


# jax.named_scope names set in the model (nsa_jax/model.py, attention.py, ops.py, training/train.py)
# and, under nsa_op, the op's branches. A kernel is labelled with the outermost top-level scope in
# its op metadata, plus the branch under nsa_op, plus " (bwd)" for the backward pass.
SCOPES = ("embed", "attn_norm", "nsa_q", "nsa_kv_cmp", "nsa_kv", "nsa_gates", "nsa_op", "nsa_out",
          "dense_qkv", "dense_op", "dense_out", "mlp", "lm_head", "loss", "optimizer")
OP_SCOPES = ("cmp", "topn", "slc", "win", "combine")


def scope_of(stats: dict) -> str:
  """The scope label of one kernel from its trace stats ("name" / "tf_op": XLA's op metadata, the
  JAX name stack). With remat, recomputed forward kernels sit under transpose and count as bwd."""
  return _label(" ".join(str(stats[k]) for k in ("name", "tf_op")
                         if isinstance(stats.get(k), str)))


@functools.lru_cache(maxsize=None)
def _label(text: str) -> str:
  """scope_of for one name stack (cached: a module's op names repeat)."""
  text = re.sub(r"jit\([^()]*\)", "", text)  # jitted functions' names are not scopes
  hits = lambda names: {n: m.start() for n in names
                        if (m := re.search(rf"(?<![\w]){n}(?![\w])", text))}
  top = hits(SCOPES)
  if not top:
    return "(no scope)"
  label = min(top, key=top.get)
  if label == "nsa_op":
    sub = [n for n in OP_SCOPES if n in hits(OP_SCOPES)]
    label += "/" + (sub[0] if sub else "other")
  return label + (" (bwd)" if "transpose(" in text else "")


_HLO_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def fusion_scopes(hlo_text: str) -> dict:
  """{instruction name: scope label} for the instructions of a compiled HLO module (its
  as_text()) that call computations (fusions), from the op names of every instruction inside
  them, nested calls included: "mlp (bwd)" when they agree, else "mixed: A + B" (the two scopes
  with the most instructions, "+k" when more). XLA names a fused kernel's trace event only with
  the name stack its fused ops share, which is often none."""
  comp_ops, comp_calls, calls, current = {}, {}, {}, None
  for line in hlo_text.splitlines():
    head = _HLO_HEADER.match(line)
    if head and "=" not in line.split("(")[0]:
      current = head.group(1)
      comp_ops[current], comp_calls[current] = [], []
      continue
    if line.strip() == "}":
      current = None
      continue
    ins = _HLO_INSTR.match(line)
    if not ins or current is None:
      continue
    op = re.search(r'op_name="([^"]*)"', line)
    if op:
      comp_ops[current].append(op.group(1))
    called = re.search(r"\bcalls=(%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)", line)
    if called:
      names = [c.strip().lstrip("%") for c in called.group(1).split(",")]
      calls[ins.group(1)] = names
      comp_calls[current] += names

  def ops_in(comp, depth=0):
    ops = list(comp_ops.get(comp, []))
    if depth < 8:
      for sub in comp_calls.get(comp, []):
        ops += ops_in(sub, depth + 1)
    return ops

  labels = {}
  for inst, comps in calls.items():
    counts = {}
    for o in (o for c in comps for o in ops_in(c)):
      sc = _label(o)
      if sc != "(no scope)":
        counts[sc] = counts.get(sc, 0) + 1
    if counts:
      ranked = sorted(counts, key=lambda k: (-counts[k], k))
      labels[inst] = ranked[0] if len(ranked) == 1 else (
          "mixed: " + " + ".join(ranked[:2]) + (f" +{len(ranked) - 2}" if len(ranked) > 2 else ""))
  return labels


def group_of(kernel: str) -> str:
  name = kernel.split("] ", 1)[-1].lower()
  for group, pattern in GROUPS:
    if re.search(pattern, name):
      return group
  return "other"


def lower_and_compile(step, *args):
  """(lowered, compiled, lower_s, compile_s): a jitted step's start-up in its two halves, tracing
  + lowering (Python; Pallas kernels to Triton / Mosaic IR) and XLA's compilation (kernels
  included). Call under the step's mesh."""
  t0 = time.perf_counter()
  lowered = step.lower(*args)
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return lowered, compiled, lower_s, time.perf_counter() - t0


def profile_config(config, tag, warmup, timed, steps, hlo_path=None):
  import jax
  from experiments import bench_common as bc
  from nsa_jax.training import sharding as shd
  from nsa_jax.training import train

  mesh = shd.make_mesh(config.mesh)
  setup = train.build_setup(config, mesh)
  train.check_batch_layout(config, mesh, setup.model_cfg)
  batches, _ = train._iterators(config, setup.model_cfg)
  train.set_dense_packed_cap(config, setup.model_cfg, batches, mesh)  # as a training run chooses
  state = train.create_train_state(setup)
  step = train.make_train_step(setup, config.optim.grad_accum_steps)
  batch = train.to_global(next(batches), setup)  # one batch, reused: the data is not measured
  with jax.set_mesh(mesh):
    # Compiled once up front so that its HLO can name the fusions' scopes (same executable).
    # Start-up split into its two halves (lower_and_compile), as a training run's first step.
    _, step, lower_s, compile_s = lower_and_compile(step, state, batch)
    hlo = step.as_text() or ""
    fused = fusion_scopes(hlo)
    if hlo_path:  # the compiled module, to read what a fusion named in the tables computes
      with gzip.open(hlo_path, "wt") as f:
        f.write(hlo)
    for _ in range(warmup):
      state, m = step(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(timed):
      state, m = step(state, batch)
    jax.block_until_ready(m)
    ms = (time.perf_counter() - t0) / max(timed, 1) * 1e3
    trace_dir = tempfile.mkdtemp(prefix="step_trace_")  # traces are large: not under --out
    jax.profiler.start_trace(trace_dir)
    try:
      for _ in range(steps):
        state, m = step(state, batch)
      jax.block_until_ready(m)
    finally:
      jax.profiler.stop_trace()
  events = list(bc.trace_kernel_events(trace_dir))  # kernel events, parsed once for the tables
  gaps = bc.trace_gaps(trace_dir, steps)
  kernels = bc.kernel_totals(events, top=0)
  groups = {}
  for name, n, us in kernels:
    g = group_of(name)
    groups[g] = groups.get(g, 0.0) + us / steps
  # The same kernels by the model's named scopes: which layer part (and pass) the time is in.
  scopes, stat_keys, samples = {}, set(), {}
  for name, us, stats in events:
    stat_keys.update(stats)
    sc = scope_of(stats)
    if sc == "(no scope)":  # a fusion whose ops share no scope: label it by what it fused
      sc = fused.get(str(stats.get("hlo_op", "")), sc)
    scopes[sc] = scopes.get(sc, 0.0) + us / steps
    # one event's op metadata per kernel name (tf_op / hlo_op), to read what the scopes missed
    samples.setdefault(name, {k: str(v)[:300] for k, v in stats.items()
                              if k in ("tf_op", "hlo_op", "name")})
  tokens = config.data.seq_len * config.data.global_batch_size
  return dict(tag=tag, attention=setup.model_cfg.attention_kinds,
              implementation=(config.model.nsa.implementation
                              if "nsa" in setup.model_cfg.attention_kinds else None),
              params=setup.num_params, seq_len=config.data.seq_len,
              batch=config.data.global_batch_size, ms_per_step=round(ms, 3),
              lower_s=round(lower_s, 2), compile_s=round(compile_s, 2),
              tokens_per_s=round(tokens / ms * 1e3, 1),
              kernel_ms_per_step=round(sum(groups.values()) / 1e3, 3), gpu_idle=gaps,
              groups_ms={g: round(v / 1e3, 3) for g, v in sorted(groups.items(),
                                                                  key=lambda kv: -kv[1])},
              scopes_ms={g: round(v / 1e3, 3) for g, v in sorted(scopes.items(),
                                                                  key=lambda kv: -kv[1])},
              trace_stat_keys=sorted(stat_keys),
              kernel_op_metadata={k: samples.get(k, {}) for k, _, _ in kernels[:100]},
              top_kernels=[(k, n / steps, round(us / steps / 1e3, 3)) for k, n, us in kernels[:100]])


def _idle(run, key):
  gaps = run.get("gpu_idle")
  return "-" if not gaps else f"{gaps[key]:.1f}"


def markdown(doc) -> str:
  runs = doc["runs"]
  lines = ["# Train-step profile: where the GPU time goes", "",
           f"Command: `{doc['command']}`", f"Hardware: {doc['hardware']}. Date: {doc['date']}. "
           f"Code: {doc['code_commit']}.", "",
           "XLA command buffers (CUDA graphs): " + (
               "on, as in training (kernels inside them carry no op metadata: few scopes)."
               if doc.get("command_buffers", True) else
               "off (--nocommand_buffers), so each kernel has its scope; step times include "
               "the extra launches."), "",
           "| | " + " | ".join(r["tag"] for r in runs) + " |",
           "|---|" + "---|" * len(runs)]
  rows = [("attention", lambda r: str(r["attention"])),
          ("batch x seq_len", lambda r: f"{r['batch']} x {r['seq_len']}"),
          ("ms / step (untraced)", lambda r: f"{r['ms_per_step']:.1f}"),
          ("start-up: trace + lower, s", lambda r: f"{r.get('lower_s', float('nan')):.1f}"),
          ("start-up: XLA compile, s", lambda r: f"{r.get('compile_s', float('nan')):.1f}"),
          ("tokens / s", lambda r: f"{r['tokens_per_s']:,.0f}"),
          ("device kernels, ms / step", lambda r: f"{r['kernel_ms_per_step']:.1f}"),
          ("traced step span, ms (first kernel to last)", lambda r: _idle(r, "span_ms")),
          ("GPU idle inside it, ms / step", lambda r: _idle(r, "idle_ms")),
          ("idle gaps / step", lambda r: _idle(r, "gaps"))]
  groups = []
  for r in runs:
    groups += [g for g in r["groups_ms"] if g not in groups]
  rows += [(g, (lambda g: lambda r: f"{r['groups_ms'].get(g, 0.0):.2f}")(g)) for g in groups]
  lines += [f"| {name} | " + " | ".join(f(r) for r in runs) + " |" for name, f in rows]
  scopes = []
  for r in runs:
    scopes += [g for g in r.get("scopes_ms", {}) if g not in scopes]
  if scopes:
    lines += ["", "## By named scope (ms per step; nsa_op/<branch>; (bwd) = backward pass)", "",
              "| scope | " + " | ".join(r["tag"] for r in runs) + " |",
              "|---|" + "---|" * len(runs)]
    lines += [f"| {g} | " + " | ".join(f"{r['scopes_ms'].get(g, 0.0):.2f}" for r in runs) + " |"
              for g in scopes]
  for r in runs:
    if (r.get("gpu_idle") or {}).get("largest"):
      lines += ["", f"## {r['tag']}: longest GPU idle gaps (all traced steps)", "",
                "| idle us | ended before | started after |", "|---|---|---|"]
      lines += [f"| {g:.1f} | `{a[:90]}` | `{b[:90]}` |" for g, a, b in r["gpu_idle"]["largest"]]
  for r in runs:
    lines += ["", f"## {r['tag']}: longest kernels (ms per step, launches per step)", "",
              "| kernel | launches | ms |", "|---|---|---|"]
    lines += [f"| `{k[:110]}` | {n:g} | {ms:.3f} |" for k, n, ms in r["top_kernels"]]
  if not any(r["groups_ms"] for r in runs):
    lines += ["", "(No device kernels in the trace: not a GPU run, so only the timings above.)"]
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  import jax
  from experiments import bench_common as bc
  logging.getLogger().setLevel(logging.WARNING)
  logging.getLogger("nsa_jax").setLevel(logging.INFO)
  out = _OUT.value
  os.makedirs(out, exist_ok=True)
  if not _CMDBUF.value:  # read when the GPU backend starts, which is below (first jax use)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_enable_command_buffer=").strip()
  configs = [("config", config_value(_CONFIG))] + (
      [("compare", config_value(_COMPARE))] if _COMPARE.value else [])
  runs = []
  for tag, cfg in configs:
    name = f"{tag}:{cfg.model.attention}"
    runs.append(profile_config(cfg, name, _WARMUP.value, _TIMED.value, _STEPS.value,
                               hlo_path=os.path.join(out, f"{tag}_step.hlo.txt.gz")))
    print(f"{name}: {runs[-1]['ms_per_step']:.1f} ms/step, {runs[-1]['tokens_per_s']:,.0f} "
          f"tokens/s", flush=True)
  doc = dict(**bc.provenance(), jax=jax.__version__, command_buffers=_CMDBUF.value, runs=runs)
  with open(os.path.join(out, "step_profile.json"), "w") as f:
    json.dump(doc, f, indent=1)
  text = markdown(doc)
  with open(os.path.join(out, "step_profile.md"), "w") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(one_line_errors(main), flags_parser=parse_flags)
