"""Loss curves from metrics.jsonl: one run or several overlaid (e.g. NSA vs dense) in one PNG."""

from __future__ import annotations

import json
import os

import numpy as np


def read_metrics(workdir: str) -> list[dict]:
  """Scalar records of <workdir>/metrics.jsonl (a resumed run's repeated steps: the later wins)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {workdir!r} a training work directory?")
  by_key = {}
  with open(path) as f:
    for line in f:
      rec = json.loads(line)
      if "event" in rec or "step" not in rec:
        continue
      by_key[(rec["step"], tuple(sorted(rec)))] = rec
  return [by_key[k] for k in sorted(by_key, key=lambda k: k[0])]


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  pts = [(r["step"], r[key]) for r in records if key in r]
  if not pts:
    return np.zeros(0), np.zeros(0)
  steps, vals = map(np.asarray, zip(*pts))
  return steps, vals


def _smooth(x: np.ndarray, smoothing: float) -> np.ndarray:
  """Centered moving average over a (1 - smoothing) share of the points: no lag, unlike an EMA."""
  half = int(len(x) * (1.0 - smoothing) / 2)
  if half < 1:
    return np.asarray(x, float)
  kernel = np.ones(2 * half + 1)
  # Divide by the number of points actually under the window, so the ends are not pulled to 0.
  return np.convolve(x, kernel, "same") / np.convolve(np.ones(len(x)), kernel, "same")


def _label(workdir: str) -> str:
  name = os.path.basename(os.path.normpath(workdir))
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      model = json.load(f)["model"]
    return f"{name} ({model.get('attention')}, {model.get('n_layers')}L d{model.get('d_model')})"
  except (OSError, KeyError, ValueError):
    return name


def plot_runs(workdirs: list[str], out: str, labels: list[str] | None = None,
              smoothing: float = 0.9) -> str:
  """Train (smoothed) and validation loss vs step for each work directory; returns out."""
  import matplotlib
  matplotlib.use("Agg")  # files only: works headless and on any backend
  import matplotlib.pyplot as plt

  fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for i, wd in enumerate(workdirs):
    recs = read_metrics(wd)
    label = labels[i] if labels else _label(wd)
    color = f"C{i}"
    steps, loss = series(recs, "train/loss")
    if len(steps):
      ax_train.plot(steps, loss, color=color, alpha=0.25, lw=0.8)
      ax_train.plot(steps, _smooth(loss, smoothing), color=color, lw=1.6, label=label)
    steps, loss = series(recs, "val/loss")
    if len(steps):
      ax_val.plot(steps, loss, "o-", color=color, ms=3, label=label)
  ax_train.set(title="train loss (smoothed)", xlabel="step", ylabel="loss (nats/token)")
  ax_val.set(title="validation loss", xlabel="step")
  if not ax_val.lines:  # e.g. runs stopped before their first validation
    ax_val.text(0.5, 0.5, "no validation records yet", ha="center", va="center",
                transform=ax_val.transAxes, color="gray")
  for ax in (ax_train, ax_val):
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out
