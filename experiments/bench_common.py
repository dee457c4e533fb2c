"""Shared benchmark plumbing: a device-synchronised timer, measured machine peaks, FLOP/byte floors,
and the JSON + Markdown record writer used by every benchmarks/results/*.json file.

A record is one measurement: op, impl, pass ("fwd" | "bwd" | "decode"), T, batch, q_heads, kv_heads,
d_k, d_v, ms, cudnn_ms, speedup (= cudnn_ms / ms), hardware, date, command, plus optional extras
(pattern, tflops, floor_ms, ...). Ops add rows by calling `record(...)` from their own bench function.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

BASE_FIELDS = ("op", "impl", "pass", "T", "batch", "q_heads", "kv_heads", "d_k", "d_v", "ms",
               "cudnn_ms", "speedup", "hardware", "date", "command")


def time_ms(fn, *args, warmup=2, iters=10, min_total_s=0.0, sync=jax.block_until_ready):
  """Median wall time (ms) of fn(*args), device synchronised around every call.

  fn should be jitted; its first call (compile) is excluded by the warm-up. `sync(result)` waits
  for the device (another framework's wait, e.g. torch's, in experiments/bench_fla.py).
  """
  for _ in range(warmup):
    sync(fn(*args))
  times, start = [], time.perf_counter()
  while len(times) < iters or time.perf_counter() - start < min_total_s:
    t0 = time.perf_counter()
    sync(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


CPU_MAX_T = 4096  # off a GPU the kernels run in the Pallas interpreter: code paths only


def require_gpu(parser, lengths, *, cpu_ok=True, how=""):
  """Benchmarks time GPU kernels. Off a GPU: refuse outright (cpu_ok=False), or allow only lengths
  up to CPU_MAX_T, a dry run of the code paths whose numbers mean nothing (said on stderr).
  parser.error exits with status 2 and the reason."""
  if jax.default_backend() == "gpu":
    return
  backend = jax.default_backend()
  if not cpu_ok:
    parser.error(f"this benchmark needs a GPU (this backend: {backend}); its kernels have no CPU "
                 "mode. Fix: run it on a GPU machine (scripts/h200_kernels.sh)")
  big = [t for t in lengths if t > CPU_MAX_T]
  if big:
    parser.error(f"lengths {big} on {backend}: off a GPU the kernels run in the Pallas "
                 f"interpreter, where T > {CPU_MAX_T} takes hours or runs out of memory and the "
                 f"timings mean nothing. Fix: run on a GPU, or pass small lengths for a dry run of "
                 f"the code paths{how}")
  print(f"note: {backend} backend: a dry run of the code paths; the timings mean nothing",
        file=sys.stderr)


def hardware():
  d = jax.devices()[0]
  return f"{d.device_kind} ({d.platform})"


def device_tag():
  """Short name of the machine for default result file names: "h200", "h100", "a100", "b200" (or
  the device kind's last word, lower case) on a GPU; the backend ("cpu") elsewhere."""
  if jax.default_backend() != "gpu":
    return jax.default_backend()
  kind = jax.devices()[0].device_kind
  return next((g.lower() for g in ("GH200", "GB200", "H200", "H100", "A100", "B200") if g in kind),
              kind.split()[-1].lower())


def measure_peaks(n=8192, copy_mib=2048):
  """Measured bf16 matmul rate (FLOP/s, n^3 matmul) and HBM copy rate (bytes/s, read + write)."""
  key = jax.random.key(0)
  a = jax.random.normal(key, (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda x, y: x @ y)
  flops = 2 * n ** 3 / (time_ms(mm, a, b, iters=10) / 1e3)
  x = jax.random.normal(key, (copy_mib * 2 ** 19,), jnp.bfloat16)  # copy_mib MiB
  cp = jax.jit(lambda x: x * 2)  # one read + one write per element, not fusable away
  bw = 2 * x.size * 2 / (time_ms(cp, x, iters=10) / 1e3)
  return flops, bw


def floor_ms(flops, nbytes, peaks):
  """The larger of FLOPs / matmul rate and bytes / copy rate, in ms."""
  return max(flops / peaks[0], nbytes / peaks[1]) * 1e3


def nsa_pairs(t, block, stride, sel_block, num_selected, window):
  """Query-key pairs per head over a causal sequence of t tokens: {compress, select, window,
  dense}. compress: query p sees compressed block i when i * stride + block - 1 <= p; select:
  min(n, current block + 1) distinct blocks of sel_block keys, the current one causal (every
  slot filled, as the top-n fills them); window: the last min(p + 1, window) keys; dense: causal."""
  pos = np.arange(t, dtype=np.int64)
  cmp = np.where(pos >= block - 1, (pos - block + 1) // stride + 1, 0)
  blocks = np.minimum(num_selected, pos // sel_block + 1)
  sel = (blocks - 1) * sel_block + pos % sel_block + 1
  return dict(compress=int(cmp.sum()), select=int(sel.sum()),
              window=int(np.minimum(pos + 1, window).sum()), dense=t * (t + 1) // 2)


def attn_flops(pairs, heads, dk, dv, pass_):
  """Matmul FLOPs of attention over `pairs` query-key pairs a head: forward QK^T + PV; backward
  S recomputed, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q (3 d_k-sized + 2 d_v-sized)."""
  per = {"fwd": dk + dv, "bwd": 3 * dk + 2 * dv}[pass_]
  return 2 * heads * pairs * per


def nsa_flops(t, batch, heads, dk, dv, *, block, stride, sel_block, num_selected, window):
  """{(op, pass): matmul FLOPs} of the NSA op and its branches at the paper's counting, and of
  dense causal attention at d = max(d_k, d_v) (what cuDNN is timed at). "topn" counts its QK^T
  recompute only (the scores' softmax, head sum and band are not matmuls). "nsa" is compress +
  select + window, the op's own work; "nsa_built" adds the top-n's recompute, which every
  implementation that does not store the [heads, T, T/d] probabilities pays."""
  p = nsa_pairs(t, block, stride, sel_block, num_selected, window)
  dd = max(dk, dv)
  out = {}
  for pass_ in ("fwd", "bwd"):
    for op in ("compress", "select", "window"):
      out[(op, pass_)] = batch * attn_flops(p[op], heads, dk, dv, pass_)
    out[("nsa", pass_)] = sum(out[(op, pass_)] for op in ("compress", "select", "window"))
    out[("dense", pass_)] = batch * attn_flops(p["dense"], heads, dd, dd, pass_)
  out[("topn", "fwd")] = batch * 2 * heads * p["compress"] * dk
  out[("nsa_built", "fwd")] = out[("nsa", "fwd")] + out[("topn", "fwd")]
  out[("nsa_built", "bwd")] = out[("nsa", "bwd")]
  return out


def command_line():
  """The command as typed from the repository root: `<python> -m experiments.X ...` for the
  experiments' modules, `<python> benchmarks/X.py ...` for a script of the repository run by its
  path (an absolute path outside it), sys.argv as given otherwise (`-c`, an interactive shell)."""
  arg0 = sys.argv[0] if sys.argv else ""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if arg0.endswith(".py") and os.path.exists(arg0):
    rel = os.path.relpath(os.path.abspath(arg0), root)
    if rel.startswith("experiments" + os.sep) and os.sep not in rel[len("experiments") + 1:]:
      head = ["-m", "experiments." + os.path.splitext(os.path.basename(arg0))[0]]
    else:
      head = [os.path.abspath(arg0) if rel.startswith("..") else rel]
  else:
    head = [arg0] if arg0 else []
  return " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *head, *sys.argv[1:]])


def code_commit():
  """Short git commit of the working tree, "-dirty" when files differ from it (a copied tree whose
  git metadata lags, as on the device machine, shows up that way), or None where there is no git."""
  try:
    run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, timeout=10,
                                    check=True).stdout.strip()
    head = run("rev-parse", "--short=7", "HEAD")
    return (head + "-dirty" if run("status", "--porcelain", "--untracked-files=no") else head) or None
  except (OSError, subprocess.SubprocessError):
    return None


def utc_now():
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def provenance():
  """hardware, date, command and code_commit: what every saved result carries."""
  return dict(hardware=hardware(), date=utc_now(), command=command_line(),
              code_commit=code_commit())


def record(*, op, impl, pass_, t, batch, q_heads, kv_heads, d_k, d_v, ms, cudnn_ms, **extra):
  """One result row with the base fields filled in (hardware, date, command, speedup)."""
  rec = dict(op=op, impl=impl, T=t, batch=batch, q_heads=q_heads, kv_heads=kv_heads, d_k=d_k,
             d_v=d_v, ms=round(ms, 4), cudnn_ms=None if cudnn_ms is None else round(cudnn_ms, 4),
             speedup=None if not cudnn_ms or ms <= 0 else round(cudnn_ms / ms, 3),
             hardware=hardware(), date=utc_now(), command=command_line())
  rec["pass"] = pass_
  rec = {f: rec[f] for f in BASE_FIELDS}
  rec["code_commit"] = code_commit()
  if ms <= 0:  # e.g. a backward read as (fwd + bwd) - fwd, below the two timings' noise
    rec["note"] = "non-positive time: a difference of two timings within their noise; no speed-up"
  rec.update(extra)
  return rec


def markdown_table(records, extra_cols=("pattern", "tflops", "floor_ms", "floor_ratio")):
  cols = ["op", "impl", "pass", "pattern", "T", "q_heads", "kv_heads", "d_k", "d_v", "ms",
          "cudnn_ms", "speedup", "tflops", "floor_ms", "floor_ratio"]
  cols = [c for c in cols if c in BASE_FIELDS or c in extra_cols]
  cols += [c for c in extra_cols if c not in cols]  # a caller's own fields, after the standard ones
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in records:
    cell = lambda c: "" if r.get(c) is None else str(r.get(c)).replace("|", "\\|")
    lines.append("| " + " | ".join(cell(c) for c in cols) + " |")
  return "\n".join(lines)


def write_results(records, out_dir, name, preamble="", extra_cols=None):
  """Write out_dir/name.json (list of records) and out_dir/name.md (preamble + table; extra_cols
  as markdown_table's, its default when None)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, name + ".json"), "w") as f:
    json.dump(records, f, indent=1)
  with open(os.path.join(out_dir, name + ".md"), "w") as f:
    table = markdown_table(records) if extra_cols is None else markdown_table(records, extra_cols)
    f.write(preamble + "\n\n" + table + "\n")


def kernel_profile(fn, args, trace_dir, top=25):
  """Device kernels of one call of fn(*args) (after a warm-up), from a jax.profiler trace:
  [(kernel name, launches, total microseconds)], longest first. Written for a GPU; on a backend
  whose trace has no device plane the list is empty."""
  jax.block_until_ready(fn(*args))
  jax.profiler.start_trace(trace_dir)
  try:
    jax.block_until_ready(fn(*args))
  finally:
    jax.profiler.stop_trace()
  return trace_kernels(trace_dir, top)


def trace_kernel_events(trace_dir):
  """Yields (f"[{stream line}] {kernel name}", microseconds, stats dict) for every device kernel
  of the newest jax.profiler trace under trace_dir (nothing when it has no GPU device plane, e.g.
  on a CPU). The stats carry XLA's op metadata (the JAX name stack, with jax.named_scope names)."""
  import glob
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    return
  data = jax.profiler.ProfileData.from_file(paths[-1])
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if "module" in line.name.lower() or "step" in line.name.lower():  # not single kernels
        continue
      for ev in line.events:
        yield f"[{line.name}] {ev.name}", ev.duration_ns / 1e3, dict(ev.stats)


def trace_gaps(trace_dir, steps=1, top=20):
  """Where the GPU sat idle in the newest jax.profiler trace under trace_dir: per GPU, the union
  of its lines' kernel and copy intervals from the first start to the last end; returns, for the
  GPU with the most idle time (device: its plane, devices: how many were traced),
  {span_ms, busy_ms, idle_ms} per step (divided by `steps`) and the `top` longest idle gaps as
  (gap us, what ended before it, what started after it; names with the scope of their op), or
  None without a GPU device plane. Device kernel sums say what the GPU computed; these gaps say
  what the step lost between kernels (launches, host round trips)."""
  import glob
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    return None
  worst, n = None, 0
  for plane in jax.profiler.ProfileData.from_file(paths[-1]).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    iv = []
    for line in plane.lines:
      if "module" in line.name.lower() or "step" in line.name.lower():
        continue
      for ev in line.events:
        st = dict(ev.stats)
        label = ev.name + (f" ({st['tf_op']})" if st.get("tf_op") else "")
        iv.append((ev.start_ns, ev.start_ns + ev.duration_ns, label[:160]))
    if iv:
      n += 1
      got = dict(device=plane.name, **idle_gaps(iv, steps, top))
      if worst is None or got["idle_ms"] > worst["idle_ms"]:
        worst = got
  return None if worst is None else dict(worst, devices=n)


def idle_gaps(iv, steps=1, top=20):
  """trace_gaps' arithmetic on [(start ns, end ns, name)] intervals of any device lines."""
  iv = sorted(iv)
  busy, gaps, end, last = 0.0, [], iv[0][0], iv[0][2]
  for s, e, name in iv:
    if s > end:
      gaps.append(((s - end) / 1e3, last, name))
    if e > end:
      busy += e - max(s, end)
      end, last = e, name
  span = end - iv[0][0]
  gaps.sort(key=lambda g: -g[0])
  return dict(span_ms=round(span / 1e6 / steps, 3), busy_ms=round(busy / 1e6 / steps, 3),
              idle_ms=round((span - busy) / 1e6 / steps, 3), gaps=len(gaps) / steps,
              largest=[(round(g, 1), a, b) for g, a, b in gaps[:top]])


def kernel_totals(events, top=25):
  """[(kernel name, launches, total microseconds)] of trace_kernel_events' events, longest first
  (all of them with top=0)."""
  totals = {}
  for key, us, _ in events:
    n, tot = totals.get(key, (0, 0.0))
    totals[key] = (n + 1, tot + us)
  rows = sorted(((k, n, round(us, 2)) for k, (n, us) in totals.items()), key=lambda r: -r[2])
  return rows[:top] if top else rows


def trace_kernels(trace_dir, top=25):
  """kernel_totals of the newest jax.profiler trace under trace_dir ([] when the trace has no GPU
  device plane, e.g. on a CPU)."""
  return kernel_totals(trace_kernel_events(trace_dir), top)
