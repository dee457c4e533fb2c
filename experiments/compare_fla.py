"""Our whole NSA op against the best public NSA kernels (fla-org/flash-linear-attention, fla/ops/nsa)
on the H200, as a Markdown table and a speed-up chart.

  python -m experiments.compare_fla \
      --ours benchmarks/results/nsa_h200_rank8k.json \
      --fla benchmarks/results/fla_nsa_h200_reference.json --out docs/figures/nsa_vs_fla_h200.png

--ours: a bench_nsa JSON (records with op "nsa" / "select", pass, T, d_k, d_v, ms, cudnn_ms).
--fla: reference numbers measured with PyTorch on the same H200 kind, but not in our run (the
device has no PyTorch): see that file's "source". The two runs each time their own dense cuDNN
baseline, so the chart compares speed-ups over each run's own dense attention, and the table also
gives the raw milliseconds. FLA's "whole" has no sliding-window branch; ours includes it.
Prints the table; writes the PNG and, next to it, the table as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments import cli


def load_ours(path: str, dk: int, dv: int) -> dict:
  """{(op, pass, T): (ms, cudnn_ms)} of a bench_nsa JSON at head dims dk/dv."""
  with open(path) as f:
    recs = json.load(f)
  if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
    raise ValueError(f"{path}: expected a bench_nsa JSON (a list of records). Fix: pass a "
                     "benchmarks/results/nsa_h200*.json file")
  out = {(r["op"], r["pass"], r["T"]): (r["ms"], r["cudnn_ms"]) for r in recs
         if r.get("op") in ("nsa", "select") and r.get("d_k") == dk and r.get("d_v") == dv}
  if not any(k[0] == "nsa" for k in out):
    raise ValueError(f"{path} has no whole-op (op 'nsa') records at d_k/d_v = {dk}/{dv}. Fix: "
                     "pass a bench_nsa table that ran those head dims")
  return out


def rows(ours: dict, fla: dict) -> list[dict]:
  """One row per (T, pass, part) present in both: ms and speed-up over each run's own dense."""
  table = []
  for r in sorted(fla["rows"], key=lambda r: r["T"]):
    t = r["T"]
    for part, op in (("whole", "nsa"), ("select", "select")):
      for p in ("fwd", "bwd"):
        if (op, p, t) not in ours:
          continue
        ms, dense = ours[(op, p, t)]
        f_ms, f_dense = r[f"{part}_{p}"], r[f"dense_{p}"]
        table.append(dict(T=t, part=part, pass_=p, ours_ms=ms, ours_speedup=dense / ms,
                          fla_ms=f_ms, fla_speedup=f_dense / f_ms, fla_over_ours_ms=f_ms / ms))
  if not table:
    raise ValueError("no sequence length is in both files. Fix: pass tables with common T")
  return table


def markdown(table: list[dict], ours_path: str, fla: dict, dims: str) -> str:
  lines = [f"# nsa-jax vs FLA's NSA kernels (H200, d_k/d_v = {dims})", "",
           f"Ours: `{ours_path}` (its command, date and code commit are in the file). FLA: "
           f"{fla['source']} Shape: {fla['shape']}.", "",
           "'whole': our op includes the sliding-window branch; FLA's does not. Speed-ups are over "
           "each run's own dense cuDNN attention (forward / backward of that run). 'select': "
           "our selection kernel as timed in the whole op's breakdown (block lists from our top-n "
           "on random inputs) against FLA's selection kernel alone.", "",
           "| T | part | pass | ours ms | ours vs dense | FLA ms | FLA vs dense | FLA ms / ours ms |",
           "|---|---|---|---|---|---|---|---|"]
  for r in table:
    lines.append(f"| {r['T']} | {r['part']} | {r['pass_']} | {r['ours_ms']:.2f} | "
                 f"{r['ours_speedup']:.2f}x | {r['fla_ms']:.2f} | {r['fla_speedup']:.2f}x | "
                 f"**{r['fla_over_ours_ms']:.2f}** |")
  return "\n".join(lines) + "\n"


def plot(table: list[dict], out: str, dims: str):
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
  ax.set_title(f"Whole NSA op vs dense attention, H200, bf16, 64 q / 4 KV heads, {dims}",
               fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ours", required=True, help="a bench_nsa JSON")
  p.add_argument("--fla", default="benchmarks/results/fla_nsa_h200_reference.json")
  p.add_argument("--dims", default="128/128", help="our head dims to compare (FLA ran 128/128)")
  p.add_argument("--out", default="docs/figures/nsa_vs_fla_h200.png")
  a = p.parse_args(argv)
  try:
    dk, dv = (int(x) for x in a.dims.split("/"))
  except ValueError:
    p.error(f"--dims={a.dims!r}: expected d_k/d_v, e.g. 128/128")
  with open(a.fla) as f:
    fla = json.load(f)
  if "rows" not in fla or "source" not in fla:
    raise ValueError(f"{a.fla}: expected the FLA reference file (keys 'source', 'rows')")
  table = rows(load_ours(a.ours, dk, dv), fla)
  text = markdown(table, a.ours, fla, a.dims)
  print(text)
  plot(table, a.out, a.dims)
  with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
    f.write(text)
  return a.out


if __name__ == "__main__":
  cli.run_main(main)
