"""Training throughput of NSA against dense attention per context length, as a bar chart.

  python -m experiments.plot_throughput \
      --pair "8k (100 steps, d08c80d)=docs/results/context_gpu/nsa_8192_100steps_d08c80d,docs/results/context_gpu/dense_8192_100steps_d08c80d" \
      --pair "16k (20 steps, bb0c235)=docs/results/context_gpu/nsa_16384,docs/results/context_gpu/dense_16384" \
      --out docs/figures/throughput_gpu.png

Each --pair is LABEL=NSA_WORKDIR,DENSE_WORKDIR: two `experiments.train` work directories (their
metrics.jsonl) run at the same tokens per step, or two metrics files themselves (paths ending in
.jsonl, as `h200_runs.sh` packs the 8k pairs: `<model>_metrics.jsonl`). A run's throughput is the median of its logged
train/tokens_per_s windows (robust to the first window's warm-up and the evaluation step). Prints
the Markdown table the chart shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def metrics_path(run: str) -> str:
  """A run's metrics file: RUN itself when it ends in .jsonl, else RUN/metrics.jsonl."""
  return run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")


def tokens_per_s(workdir: str) -> tuple[float, int]:
  """(median train/tokens_per_s over the logged windows, number of windows) of a work directory
  or a metrics .jsonl file."""
  path = metrics_path(workdir)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no metrics file (pass an experiments.train work directory "
                            "or its metrics .jsonl)")
  with open(path) as f:
    vals = [r["train/tokens_per_s"] for r in map(json.loads, filter(str.strip, f))
            if "train/tokens_per_s" in r]
  if not vals:
    raise ValueError(f"{path} has no train/tokens_per_s records (did the run log a step?)")
  return statistics.median(vals), len(vals)


def attention_kinds(workdir: str) -> set[str] | None:
  """The attention kinds a run's layers used (from its config.json), or None if it has none (a
  bare metrics file has none)."""
  if workdir.endswith(".jsonl"):
    return None
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    model = json.load(f).get("model", {})
  return set(model.get("layer_attention") or [model.get("attention", "nsa")])


def check_pair(label: str, nsa: str, dense: str):
  """The first run of a pair must use NSA and the second must be all dense (runs without a
  config.json are taken as given)."""
  kn, kd = attention_kinds(nsa), attention_kinds(dense)
  if kn is not None and "nsa" not in kn:
    raise ValueError(f"--pair {label!r}: the first run {nsa} has no NSA layer ({sorted(kn)}). "
                     "Fix: LABEL=NSA_WORKDIR,DENSE_WORKDIR")
  if kd is not None and kd != {"dense"}:
    raise ValueError(f"--pair {label!r}: the second run {dense} is not all dense ({sorted(kd)}). "
                     "Fix: LABEL=NSA_WORKDIR,DENSE_WORKDIR")


def parse_pair(text: str) -> tuple[str, str, str]:
  label, sep, dirs = text.partition("=")
  nsa, comma, dense = dirs.partition(",")
  if not sep or not comma or not label or not nsa or not dense:
    raise ValueError(f"--pair {text!r}: expected LABEL=NSA_WORKDIR,DENSE_WORKDIR")
  return label, nsa, dense


def main(argv=None) -> str:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--pair", action="append", required=True,
                 help="LABEL=NSA_WORKDIR,DENSE_WORKDIR (repeat; drawn in the order given)")
  p.add_argument("--out", required=True, help="PNG path")
  p.add_argument("--title", default="Training throughput, NSA vs dense attention (one H200)")
  a = p.parse_args(argv)
  rows = []
  for label, nsa, dense in map(parse_pair, a.pair):
    check_pair(label, nsa, dense)
    (n, nw), (d, dw) = tokens_per_s(nsa), tokens_per_s(dense)
    rows.append((label, n, d, nw, dw))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(1.9 * len(rows) + 2.5, 4.2))
  xs = range(len(rows))
  for i, (name, col) in enumerate((("NSA", "tab:blue"), ("dense", "tab:orange"))):
    vals = [r[1 + i] / 1e3 for r in rows]
    bars = ax.bar([x + 0.38 * i for x in xs], vals, 0.38, label=name, color=col)
    ax.bar_label(bars, fmt="%.0fk", fontsize=7)
  for x, r in zip(xs, rows):
    ax.annotate(f"{r[1] / r[2]:.2f}x", (x + 0.19, max(r[1], r[2]) / 1e3 * 1.08), ha="center",
                fontsize=9, weight="bold")
  ax.set_xticks([x + 0.19 for x in xs])
  ax.set_xticklabels([r[0] for r in rows], fontsize=8)
  ax.set_ylabel("thousand tokens / s (median of logged windows)")
  ax.set_ylim(0, max(max(r[1], r[2]) for r in rows) / 1e3 * 1.25)
  ax.legend(fontsize=8, loc="upper right")
  ax.set_title(a.title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  fig.savefig(a.out, dpi=120)
  table = ["| context (steps, code) | NSA tokens/s | dense tokens/s | NSA / dense | windows (NSA, dense) |",
           "|---|---|---|---|---|"]
  table += [f"| {r[0]} | {r[1]:,.0f} | {r[2]:,.0f} | {r[1] / r[2]:.3f}x | {r[3]}, {r[4]} |"
            for r in rows]
  out = "\n".join(table)
  print(out)
  print(f"wrote {a.out}")
  return out


if __name__ == "__main__":
  from experiments.cli import run_main
  run_main(main)
