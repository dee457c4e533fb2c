"""Overlay the loss curves of several training work directories in one PNG.

  python -m experiments.plot_runs runs/small_nsa runs/small_dense --out=runs/nsa_vs_dense.png
Labels default to "<dir name> (<attention>, <layers>L d<width>)"; --labels=a,b overrides them.
"""

import argparse

from nsa_jax.training.plotting import plot_runs, read_metrics


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", help="training work directories (with metrics.jsonl)")
  parser.add_argument("--out", default="loss_curves.png", help="PNG to write")
  parser.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")
  parser.add_argument("--smoothing", type=float, default=0.9, help="train loss smoothing: a centered window over (1 - this) of the points")
  args = parser.parse_args(argv)
  labels = args.labels.split(",") if args.labels else None
  if labels and len(labels) != len(args.workdirs):
    parser.error(f"{len(labels)} labels for {len(args.workdirs)} work directories")
  empty = [wd for wd in args.workdirs
           if not any("train/loss" in r or "val/loss" in r for r in read_metrics(wd))]
  if empty:  # they would be a blank plot, or silently missing from the legend
    raise ValueError(f"no loss records yet in {empty} (a run that has not logged a step). Fix: "
                     "plot it once it has trained, or leave it out")
  print(plot_runs(args.workdirs, args.out, labels=labels, smoothing=args.smoothing))


if __name__ == "__main__":
  from experiments.cli import run_main
  run_main(main)
