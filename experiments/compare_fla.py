"""Our whole NSA op against the best public NSA kernels (fla-org/flash-linear-attention, fla/ops/nsa),
as a Markdown table and a speed-up chart.

  # same GPU, same device call (experiments/bench_fla.py times FLA and torch's cuDNN):
  python -m experiments.compare_fla --ours benchmarks/results/nsa_h100.json \
      --ours_select benchmarks/results/select_h100.json \
      --fla benchmarks/results/fla_nsa_h100.json --out docs/figures/nsa_vs_fla_h100.png
  # the owners' H200 reference numbers (not our run):
  python -m experiments.compare_fla --ours benchmarks/results/nsa_h200_rank8k.json \
      --fla benchmarks/results/fla_nsa_h200_reference.json --out docs/figures/nsa_vs_fla_h200.png

--ours: a bench_nsa JSON (records with op "nsa" / "select", pass, T, d_k, d_v, ms, cudnn_ms).
--ours_select (optional): a bench_kernels JSON; its selection rows are then compared with FLA's
selection kernel per index pattern, on the same block lists (bench_fla uses bench_kernels'
generator and key). Without it, 'select' is our selection as timed in the whole op's breakdown.
--fla: either a bench_fla JSON (records: fla_nsa, fla_select per pattern, dense_torch) or the
reference file of the owners' numbers (keys 'source', 'shape', 'rows'). Each side times its own
dense cuDNN baseline (jax's and torch's), so the chart compares speed-ups over each side's own
dense attention; the table also gives the raw milliseconds. FLA's whole op has no sliding-window
branch and mean-pools l = d = 64 blocks; ours includes the window and the paper's l = 32, d = 16.
Prints the table; writes the PNG and, next to it, the table as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments import cli


def _records(path: str, what: str) -> list:
  with open(path) as f:
    recs = json.load(f)
  if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
    raise ValueError(f"{path}: expected a {what} JSON (a list of records). Fix: pass a "
                     f"benchmarks/results file written by {what}")
  return recs


def load_ours(path: str, dk: int, dv: int) -> dict:
  """{(part, pattern, pass, T): (ms, cudnn_ms)} of a bench_nsa JSON at head dims dk/dv (part
  "whole" from op "nsa", "select" from the breakdown's op "select"; pattern None)."""
  out = {}
  for r in _records(path, "bench_nsa"):
    if r.get("op") in ("nsa", "select") and r.get("d_k") == dk and r.get("d_v") == dv:
      part = "whole" if r["op"] == "nsa" else "select"
      out[(part, None, r["pass"], r["T"])] = (r["ms"], r["cudnn_ms"])
  if not any(k[0] == "whole" for k in out):
    raise ValueError(f"{path} has no whole-op (op 'nsa') records at d_k/d_v = {dk}/{dv}. Fix: "
                     "pass a bench_nsa table that ran those head dims")
  return out


def load_ours_select(path: str, dk: int, dv: int, heads=(64, 4)) -> dict:
  """{("select", pattern, pass, T): (ms, cudnn_ms)} of a bench_kernels JSON: the registry's row
  (what implementation="pallas" runs) where the file has one, else the only row of that key."""
  found = {}
  for r in _records(path, "bench_kernels"):
    if (r.get("op") == "select" and r.get("d_k") == dk and r.get("d_v") == dv
        and (r.get("q_heads"), r.get("kv_heads")) == heads and r.get("pattern")):
      found.setdefault(("select", r["pattern"], r["pass"], r["T"]), []).append(r)
  if not found:
    raise ValueError(f"{path} has no selection rows at {heads[0]}/{heads[1]} heads, d_k/d_v = "
                     f"{dk}/{dv}. Fix: pass a bench_kernels table of that shape")
  out = {}
  for key, recs in found.items():
    reg = [r for r in recs if "registry" in r.get("impl", "")]
    if len(reg or recs) > 1:
      raise ValueError(f"{path}: {len(reg or recs)} rows for {key} and none from the registry "
                       "plan. Fix: pass a `bench_kernels --plan registry` table")
    r = (reg or recs)[0]
    out[key] = (r["ms"], r["cudnn_ms"])
  return out


def load_fla(path: str) -> dict:
  """FLA's side as {"source", "shape", "hardware", "entries": {(part, pattern, pass, T): (ms,
  dense_ms)}} from a bench_fla JSON or from the owners' reference file."""
  with open(path) as f:
    data = json.load(f)
  entries = {}
  if isinstance(data, dict):
    if "rows" not in data or "source" not in data:
      raise ValueError(f"{path}: expected the FLA reference file (keys 'source', 'rows') or a "
                       "bench_fla JSON (a list of records)")
    for r in data["rows"]:
      for part in ("whole", "select"):
        for p in ("fwd", "bwd"):
          if f"{part}_{p}" in r and f"dense_{p}" in r:
            entries[(part, None, p, r["T"])] = (r[f"{part}_{p}"], r[f"dense_{p}"])
    return dict(source=data["source"], shape=data.get("shape", ""),
                hardware=data.get("hardware", ""), entries=entries)
  recs = _records(path, "bench_fla")
  for r in recs:
    if r.get("op") in ("fla_nsa", "fla_select"):
      part = "whole" if r["op"] == "fla_nsa" else "select"
      entries[(part, r.get("pattern"), r["pass"], r["T"])] = (r["ms"], r["cudnn_ms"])
  if not entries:
    raise ValueError(f"{path} has no fla_nsa / fla_select records. Fix: pass bench_fla's output")
  r0 = recs[0]
  return dict(source=f"`{path}` (experiments/bench_fla.py, torch {r0.get('torch')}, "
                     f"{r0.get('date')}; dense = torch SDPA cuDNN in the same process).",
              shape=f"bf16, B=1, {r0['q_heads']} query heads, {r0['kv_heads']} KV heads, "
                    f"d_k = d_v = {r0['d_k']}, n = 16, l' = 64",
              hardware=r0.get("hardware", ""), entries=entries)


def rows(ours: dict, fla: dict) -> list[dict]:
  """One row per (T, part, pattern, pass) present on both sides: ms and speed-up over each side's
  own dense. A select row of ours without a pattern (the whole op's breakdown) meets FLA's select
  of any pattern only where FLA's has none either."""
  table = []
  for (part, pat, p, t), (f_ms, f_dense) in sorted(
      fla["entries"].items(), key=lambda kv: (kv[0][3], kv[0][0] != "whole", str(kv[0][1]),
                                              kv[0][2] != "fwd")):
    if (part, pat, p, t) not in ours:
      continue
    ms, dense = ours[(part, pat, p, t)]
    table.append(dict(T=t, part=part, pattern=pat, pass_=p, ours_ms=ms, ours_speedup=dense / ms,
                      fla_ms=f_ms, fla_speedup=f_dense / f_ms, fla_over_ours_ms=f_ms / ms))
  if not table:
    raise ValueError("no sequence length is in both files. Fix: pass tables with common T")
  return table


def markdown(table: list[dict], ours_path: str, fla: dict, dims: str, hardware: str) -> str:
  lines = [f"# nsa-jax vs FLA's NSA kernels ({hardware}, d_k/d_v = {dims})", "",
           f"Ours: `{ours_path}` (its command, date and code commit are in the file). FLA: "
           f"{fla['source']} Shape: {fla['shape']}.", "",
           "'whole': our op includes the sliding-window branch and the paper's compression "
           "(l = 32, d = 16: 4x FLA's compressed blocks); FLA's has no window and mean-pools "
           "l = d = 64. Speed-ups are over each side's own dense cuDNN attention (forward / "
           "backward of that run). 'select' with a pattern: both selection kernels on the same "
           "block lists; without one: our selection as timed in the whole op's breakdown (lists "
           "from our top-n on random inputs) against FLA's selection kernel alone.", "",
           "| T | part | pattern | pass | ours ms | ours vs dense | FLA ms | FLA vs dense | "
           "FLA ms / ours ms |", "|---|---|---|---|---|---|---|---|---|"]
  for r in table:
    lines.append(f"| {r['T']} | {r['part']} | {r['pattern'] or ''} | {r['pass_']} | "
                 f"{r['ours_ms']:.2f} | {r['ours_speedup']:.2f}x | {r['fla_ms']:.2f} | "
                 f"{r['fla_speedup']:.2f}x | **{r['fla_over_ours_ms']:.2f}** |")
  return "\n".join(lines) + "\n"


def plot(table: list[dict], out: str, dims: str, hardware: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for who, key, color in (("nsa-jax (with window)", "ours_speedup", "C0"),
                          ("FLA (no window)", "fla_speedup", "C3")):
    for p, style in (("fwd", "-o"), ("bwd", "--s")):
      pts = sorted((r["T"], r[key]) for r in table if r["part"] == "whole" and r["pass_"] == p)
      if pts:
        ax.plot(*zip(*pts), style, color=color, label=f"{who} {p}")
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("sequence length T")
  ax.set_ylabel("speed-up over the same run's dense cuDNN")
  ax.set_title(f"Whole NSA op vs dense attention, {hardware}, bf16, 64 q / 4 KV heads, {dims}",
               fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ours", required=True, help="a bench_nsa JSON")
  p.add_argument("--ours_select", default="", help="a bench_kernels JSON (same-list selection)")
  p.add_argument("--fla", default="benchmarks/results/fla_nsa_h200_reference.json")
  p.add_argument("--dims", default="128/128", help="our head dims to compare (FLA ran 128/128)")
  p.add_argument("--out", default="docs/figures/nsa_vs_fla_h200.png")
  a = p.parse_args(argv)
  try:
    dk, dv = (int(x) for x in a.dims.split("/"))
  except ValueError:
    p.error(f"--dims={a.dims!r}: expected d_k/d_v, e.g. 128/128")
  fla = load_fla(a.fla)
  ours = load_ours(a.ours, dk, dv)
  if a.ours_select:
    ours = {k: v for k, v in ours.items() if k[0] != "select"}
    ours.update(load_ours_select(a.ours_select, dk, dv))
  with open(a.ours) as f:
    hw = json.load(f)[0].get("hardware", "") or fla["hardware"]
  hardware = hw.replace(" (gpu)", "")
  table = rows(ours, fla)
  text = markdown(table, a.ours, fla, a.dims, hardware)
  print(text)
  plot(table, a.out, a.dims, hardware)
  with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
    f.write(text)
  return a.out


if __name__ == "__main__":
  cli.run_main(main)
