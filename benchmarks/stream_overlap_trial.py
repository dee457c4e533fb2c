# Trial (2026-12-03, twenty-fourth session): can NSA's branches overlap on separate GPU streams?
# The whole op's forward at 64k runs its kernels one after another (issue 5's FLOP floors add the
# branch floors serially), and XLA's command-buffer scheduling modes changed nothing
# (`h200_kernels.sh cmdsched`). jax's compute_on("gpu_stream:N") asks XLA for another stream
# (ops.BRANCH_STREAMS / NSA_BRANCH_STREAMS; XLA honours it with
# --xla_gpu_experimental_stream_annotation=true). This times the whole op, forward and
# forward + backward, for each stream layout in one process, records the largest difference of
# every layout's output and gradients from the first layout that ran (the one-stream layout when
# the list starts with ""; no threshold: read the column), and times cuDNN's dense causal
# attention in the same run.
#   python3 benchmarks/stream_overlap_trial.py OUT_DIR [--T 65536] [--dims 128/128]
#       [--heads 64/4] [--batch 1] [--layouts ",win:1,win:1+cmp:2,slc:1,"] [--iters 5]
# A layout is a BRANCH_STREAMS spec with "+" between entries ("" = one stream; the entry "group"
# also sets ops.STREAM_GROUP); a layout given twice is timed twice (labelled "again"); a layout
# that fails to compile or run is recorded with its error and the others still run.
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import bench_common as bc  # noqa: E402
from experiments import bench_nsa  # noqa: E402
from nsa_jax import ops  # noqa: E402


def write(out, records, command):
  """streams.json + streams.md, rewritten after every layout (an XLA abort later keeps them)."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "streams.json"), "w") as f:
    json.dump(records, f, indent=1)
  cols = ["layout", "pass", "T", "d_k", "d_v", "ms", "cudnn_ms", "speedup", "annotated_lowered",
          "annotated_ops", "max_abs_diff_vs_base", "base_layout", "error"]
  lines = [f"Command: `{command}`; XLA_FLAGS=`{os.environ.get('XLA_FLAGS', '')}`; "
           f"{bc.hardware()}; {bc.utc_now()}", "", bench_nsa.table(records, cols)]
  with open(os.path.join(out, "streams.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("out")
  p.add_argument("--T", type=int, default=65536)
  p.add_argument("--dims", default="128/128")
  p.add_argument("--heads", default="64/4")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--layouts", default=",win:1,win:1+cmp:2,slc:1,")
  p.add_argument("--iters", type=int, default=5)
  a = p.parse_args(argv)
  layouts = a.layouts.split(",")
  def parse(spec):  # (BRANCH_STREAMS, STREAM_GROUP) of a layout
    parts = spec.split("+")
    return ops._parse_streams(",".join(p for p in parts if p != "group")), "group" in parts

  for spec in layouts:  # refuse a bad layout before anything compiles
    parse(spec)
  h, kh = map(int, a.heads.split("/"))
  dk, dv = map(int, a.dims.split("/"))
  bench_nsa.BATCH = a.batch
  cfg = bench_nsa.paper_cfg(h, kh, dk, dv)
  key = jax.random.key(0)
  args = bench_nsa.make_inputs(key, a.T, cfg)
  ct = jax.random.normal(jax.random.fold_in(key, 7), (a.batch, a.T, h, dv), jnp.bfloat16)
  fn = lambda *x: (ops.nsa_attention(*x, cfg, implementation="pallas"),)  # noqa: E731

  command = "python3 " + " ".join(sys.argv)
  dense = bench_nsa.bench_dense(bench_nsa.Bench(a.out, a.iters, float("inf")),
                                jax.random.fold_in(key, 11), a.T, cfg)
  d_fwd, d_fb = dense["fwd"], dense["fwd_bwd"]
  print(f"cuDNN dense: fwd {d_fwd:.3f} ms, fwd+bwd {d_fb:.3f} ms", flush=True)
  records, base, seen = [], None, set()
  for spec in layouts:
    label = (spec or "one stream") + (" (again)" if spec in seen else "")
    seen.add(spec)
    ops.BRANCH_STREAMS, ops.STREAM_GROUP = parse(spec)
    try:
      flow = jax.jit(lambda *x: fn(*x)).lower(*args)  # a fresh function: a fresh trace
      blow = jax.jit(bench_nsa.with_grad(lambda *x: fn(*x))).lower(args, ct)
      lowered = flow.as_text() + blow.as_text()
      fexe, bexe = flow.compile(), blow.compile()
      hlo = fexe.as_text() + bexe.as_text()
      out, grads = fexe(*args), bexe(args, ct)
    except Exception as e:  # a layout XLA refuses is a result too; the others still run
      err = f"{type(e).__name__}: {str(e)[:300]}".replace("|", "/")  # a Markdown cell
      print(f"{label:>22}: FAILED {err}", flush=True)
      records.append(dict(op="nsa", impl="pallas", layout=label, error=err, T=a.T, batch=a.batch,
                          q_heads=h, kv_heads=kh, d_k=dk, d_v=dv, command=command,
                          xla_flags=os.environ.get("XLA_FLAGS", ""), hardware=bc.hardware(),
                          date=bc.utc_now(), code_commit=bc.code_commit()))
      write(a.out, records, command)
      continue
    if base is None:
      base, base_label = (out, grads), label
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    diff = max(float(jnp.max(jnp.abs(f32(x) - f32(y)))) for x, y in
               zip(jax.tree.leaves((out, grads)), jax.tree.leaves(base)))
    fwd = bc.time_ms(fexe, *args, iters=a.iters)
    fb = bc.time_ms(bexe, args, ct, iters=a.iters)
    extra = dict(layout=label, xla_flags=os.environ.get("XLA_FLAGS", ""),
                 annotated_lowered=lowered.count("_xla_stream_annotation"),
                 annotated_ops=hlo.count("_xla_stream_annotation"),
                 max_abs_diff_vs_base=diff, base_layout=base_label)
    common = dict(op="nsa", impl="pallas", t=a.T, batch=a.batch, q_heads=h, kv_heads=kh, d_k=dk,
                  d_v=dv)
    for rec in (bc.record(pass_="fwd", ms=fwd, cudnn_ms=d_fwd, **common, **extra),
                bc.record(pass_="bwd", ms=fb - fwd, cudnn_ms=d_fb - d_fwd, fwd_bwd_ms=round(fb, 4),
                          cudnn_fwd_bwd_ms=round(d_fb, 4), **common, **extra)):
      rec["command"] = command
      records.append(rec)
    write(a.out, records, command)
    print(f"{label:>22}: fwd {fwd:.3f} ms ({d_fwd / fwd:.2f}x cuDNN), bwd {fb - fwd:.3f} ms "
          f"({(d_fb - d_fwd) / (fb - fwd):.2f}x), annotated ops {extra['annotated_lowered']} lowered / "
          f"{extra['annotated_ops']} compiled, "
          f"max |diff| vs {base_label} {diff:.3g}", flush=True)
  ops.BRANCH_STREAMS, ops.STREAM_GROUP = {}, False
  print("\n".join(write(a.out, records, command)))


if __name__ == "__main__":
  main()
