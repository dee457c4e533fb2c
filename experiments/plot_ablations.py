"""One bar chart of several ablation sweeps: each run's validation loss minus the reference run's.

  python -m experiments.plot_ablations docs/results/branches_gpu/results.jsonl \
      docs/results/design_gpu/results.jsonl docs/results/blocks_gpu/results.jsonl \
      --extra=docs/results/nsa_vs_dense_gpu.jsonl:dense --out=docs/figures/ablations_gpu.png

Inputs are `experiments.ablate` results files. Each run is its latest record in its sweep (a
rerun with other settings replaces the earlier record instead of adding a bar), and a run recorded
in several sweeps (the shared `nsa` reference) is drawn once: those records are keyed by config
hash, the last one read wins. `--extra` adds single runs (FILE:RUN) from other sweeps, e.g. the
dense baseline. Prints the Markdown table the chart shows.
"""

from __future__ import annotations

import argparse
import os


def _latest_per_run(path: str) -> dict[tuple, dict]:
  """{(sweep, run): the last record of that run} in one results file."""
  from experiments.ablate import read_records
  return {(rec.get("sweep"), rec["run"]): rec for rec in read_records(path)}


def load_records(paths: list[str], extra: list[str] = ()) -> list[dict]:
  """Records from results.jsonl files (all runs) and FILE:RUN entries (that run only): each run's
  latest record, then one per config hash (the last one read wins)."""
  picks = []
  for item in extra:
    path, sep, run = item.rpartition(":")
    if not sep or not path or not run:
      raise ValueError(f"--extra {item!r}: expected FILE:RUN")
    picks.append((path, run))
  for path in [*paths, *(p for p, _ in picks)]:
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: no such results file (an experiments.ablate results.jsonl)")
  by_hash = {}
  for path in paths:
    by_hash.update({r["config_hash"]: r for r in _latest_per_run(path).values()})
  for path, run in picks:
    chosen = [r for (_, name), r in _latest_per_run(path).items() if name == run]
    if not chosen:
      raise ValueError(f"{path} has no run named {run!r}")
    by_hash.update({r["config_hash"]: r for r in chosen})
  return list(by_hash.values())


def deltas(records: list[dict], reference: str = "nsa") -> tuple[dict, list[tuple[str, float, dict]]]:
  """(reference record, [(run, val_loss - reference val_loss, record)] sorted by delta)."""
  refs = [r for r in records if r["run"] == reference]
  if not refs:
    names = sorted({r["run"] for r in records})
    raise ValueError(f"no run named {reference!r} among {names}: pass --reference=NAME")
  ref = refs[-1]
  rows = [(r["run"], r["val_loss"] - ref["val_loss"], r) for r in records if r is not ref]
  return ref, sorted(rows, key=lambda x: x[1])


def markdown(ref: dict, rows) -> str:
  out = [f"Reference `{ref['run']}`: val loss {ref['val_loss']:.4f}\n",
         "| run | val loss | vs reference | params |", "|---|---|---|---|"]
  for name, d, r in rows:
    out.append(f"| {name} | {r['val_loss']:.4f} | {d:+.4f} | {r['params']:,} |")
  return "\n".join(out) + "\n"


def plot(ref: dict, rows, out: str, title: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [n for n, _, _ in rows]
  vals = [d for _, d, _ in rows]
  fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(rows) + 1.4))
  colors = ["tab:green" if v < 0 else "tab:red" for v in vals]
  ax.barh(range(len(rows)), vals, color=colors)
  ax.set_yticks(range(len(rows)), names)
  ax.invert_yaxis()
  ax.axvline(0, color="black", lw=0.8)
  span = max(abs(v) for v in vals) if vals else 1.0
  for i, v in enumerate(vals):
    ax.text(v + (0.01 if v >= 0 else -0.01) * span, i, f"{v:+.3f}", va="center",
            ha="left" if v >= 0 else "right", fontsize=8)
  ax.set_xlim(min(0, min(vals, default=0)) - 0.25 * span, max(0, max(vals, default=0)) + 0.25 * span)
  ax.set_xlabel(f"validation loss minus {ref['run']}'s ({ref['val_loss']:.4f}); lower is better")
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("results", nargs="+", help="experiments.ablate results.jsonl files")
  p.add_argument("--extra", action="append", default=[], help="FILE:RUN, one more run (repeatable)")
  p.add_argument("--reference", default="nsa", help="the run the deltas are taken against")
  p.add_argument("--out", default="ablations.png", help="PNG to write")
  p.add_argument("--title", default="Ablations: validation loss against the reference run")
  a = p.parse_args(argv)
  ref, rows = deltas(load_records(a.results, a.extra), a.reference)
  plot(ref, rows, a.out, a.title)
  table = markdown(ref, rows)
  print(table + f"\nchart: {a.out}")
  return table


if __name__ == "__main__":
  from experiments.cli import run_main
  run_main(main)
