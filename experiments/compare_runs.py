"""Throughput and loss table of several training runs: layouts, scaling efficiency, loss agreement.

  python -m experiments.compare_runs 1gpu=runs/nsa_1 dp2=runs/nsa_dp2 fsdp2=runs/nsa_fsdp2 \
      --baseline=1gpu --out_dir=benchmarks/results --name=multigpu_h200

Each argument is label=workdir (a finished or stopped experiments.train run). Per run: devices and
mesh, steps, median step time and tokens/s over the logged windows (the first window, which holds
compilation, is never logged), tokens/s per device, MFU, peak memory, last train and validation
loss; against the baseline: scaling efficiency = tokens/s / (devices x baseline tokens/s per
device), and the largest |train loss - baseline train loss| over the steps both logged (the same
global batch gives the same curve up to float reordering). Where the run wrote collectives.json
(config.train.hlo_report), the collectives of its compiled step: counts and MB per kind, how many
carry a sequence-length dimension, and how many sit inside an attention op (should be 0).
Writes <name>.json (one record per run) and <name>.md, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys


def read_run(workdir: str) -> dict:
  start, end, train, val = {}, {}, {}, {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if rec.get("event") == "start":
        start = start or rec  # the first start (a resumed run appends more)
      elif rec.get("event") == "end":
        end = rec
      elif "train/loss" in rec:
        train[rec["step"]] = rec
      elif "val/loss" in rec:
        val[rec["step"]] = rec
  if not train:
    raise SystemExit(f"{workdir}: no train records in metrics.jsonl. Fix: point at a workdir of "
                     "experiments.train that logged at least one window")
  return dict(start=start, end=end, train=train, val=val)


def _median(values):
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def _last_val(val: dict, max_step: int):
  steps = [s for s in val if not max_step or s <= max_step]
  return val[max(steps)]["val/loss"] if steps else None


def summarize(label: str, run: dict, workdir: str, max_step: int = 0) -> dict:
  tr = run["train"]
  steps = sorted(s for s in tr if not max_step or s <= max_step)
  if not steps:
    raise SystemExit(f"{workdir}: no train window at or below --max_step={max_step} (first logged "
                     f"step: {min(tr)}). Fix: raise --max_step")
  rec = dict(label=label, workdir=workdir, devices=run["start"].get("devices"),
             mesh=run["start"].get("mesh"), device_kind=run["start"].get("device_kind"),
             params=run["start"].get("params"), attention=sorted(set(run["start"].get("attention", []))),
             last_step=steps[-1], logged_windows=len(steps),
             step_time_s=_median(tr[s].get("train/step_time_s") for s in steps),
             tokens_per_s=_median(tr[s].get("train/tokens_per_s") for s in steps),
             mfu=_median(tr[s].get("train/mfu") for s in steps),
             train_loss=tr[steps[-1]]["train/loss"],
             val_loss=_last_val(run["val"], max_step),
             peak_memory_gb=run["end"].get("peak_memory_gb"),
             losses={s: tr[s]["train/loss"] for s in steps})
  if rec["tokens_per_s"] and rec["devices"]:
    rec["tokens_per_s_per_device"] = rec["tokens_per_s"] / rec["devices"]
  path = os.path.join(workdir, "collectives.json")
  if os.path.exists(path):
    with open(path) as f:
      s = json.load(f)["summary"]
    rec["collectives"] = {k: v["count"] for k, v in s["per_kind"].items()}
    if "note" in s:  # reports before the tuple-aware parser counted one array per combined op
      rec["collective_mb"] = round(sum(v["bytes"] for v in s["per_kind"].values()) / 2 ** 20, 1)
    rec["collectives_with_seq_dim"] = len(s["with_sequence_dim"])
    rec["collectives_in_attention"] = len(s["in_attention_op"])
  return rec


def compare(records: list[dict], baseline: str | None) -> None:
  base = next((r for r in records if r["label"] == baseline), None)
  if baseline and base is None:
    raise SystemExit(f"--baseline={baseline}: no run has that label ({[r['label'] for r in records]})")
  for r in records:
    if base is None:
      continue
    # Scaling and loss agreement mean something only between layouts of one model.
    differ = [k for k in ("params", "attention") if r.get(k) != base.get(k)]
    if differ:
      r["not_compared"] = f"{' and '.join(differ)} differ from {baseline}'s (another model)"
      print(f"note: {r['label']}: {r['not_compared']}: no scaling efficiency or loss difference",
            file=sys.stderr)
      continue
    if r.get("tokens_per_s") and base.get("tokens_per_s_per_device"):
      r["scaling_efficiency"] = r["tokens_per_s"] / (r["devices"] * base["tokens_per_s_per_device"])
    common = sorted(set(r["losses"]) & set(base["losses"]))
    if common:
      r["max_abs_loss_diff_vs_baseline"] = max(abs(r["losses"][s] - base["losses"][s]) for s in common)
      r["compared_steps"] = f"{common[0]}-{common[-1]} ({len(common)} windows)"


def _fmt(v, nd=3):
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:,.{nd}f}" if abs(v) < 1000 else f"{v:,.0f}"
  if isinstance(v, dict):
    return " ".join(f"{k}={x}" for k, x in v.items() if x != 1 or k == "data") if v else ""
  return str(v)


COLS = [("label", "run"), ("devices", "GPUs"), ("mesh", "mesh"), ("last_step", "steps"),
        ("step_time_s", "step s"), ("tokens_per_s", "tokens/s"),
        ("tokens_per_s_per_device", "tokens/s/GPU"), ("mfu", "MFU"),
        ("scaling_efficiency", "scaling eff."), ("max_abs_loss_diff_vs_baseline", "max |dloss|"),
        ("train_loss", "train loss"), ("val_loss", "val loss"), ("peak_memory_gb", "peak GB"),
        ("collectives", "collectives"), ("collectives_with_seq_dim", "with T dim"),
        ("collectives_in_attention", "in attention"), ("not_compared", "not compared")]


def markdown(records: list[dict]) -> str:
  cols = [(k, h) for k, h in COLS if any(r.get(k) is not None for r in records)]
  lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
  for r in records:
    lines.append("| " + " | ".join(_fmt(r.get(k), 4 if k.startswith("max_abs") else 3)
                                   for k, _ in cols) + " |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("runs", nargs="+", help="label=workdir pairs")
  p.add_argument("--baseline", default=None, help="label of the run to compare against")
  p.add_argument("--out_dir", default=None, help="where to write <name>.json and <name>.md")
  p.add_argument("--name", default="runs_comparison")
  p.add_argument("--note", default="", help="a sentence for the Markdown preamble")
  p.add_argument("--max_step", type=int, default=0,
                 help="use only train windows up to this step (e.g. a long baseline cut to the "
                      "length of short layout runs); 0 = all")
  args = p.parse_args(argv)
  records = []
  for item in args.runs:
    label, sep, workdir = item.partition("=")
    if not sep or not label or not workdir:
      p.error(f"{item!r}: expected label=workdir")
    records.append(summarize(label, read_run(workdir), workdir, args.max_step))
  compare(records, args.baseline)
  table = markdown(records)
  print(table)
  if args.out_dir:
    os.makedirs(args.out_dir, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python -m experiments.compare_runs " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(date=date, command=cmd, hardware=records[0].get("device_kind"))
    with open(os.path.join(args.out_dir, args.name + ".json"), "w") as f:
      json.dump([{**meta, **{k: v for k, v in r.items() if k != "losses"}, "losses": r["losses"]}
                 for r in records], f, indent=1)
    with open(os.path.join(args.out_dir, args.name + ".md"), "w") as f:
      f.write(f"# {args.name}\n\n{args.note}\n\nDate: {date}. Hardware: {meta['hardware']}. "
              f"Command: `{cmd}`\n\n{table}\n")


if __name__ == "__main__":
  from experiments.cli import run_main
  run_main(main)
