# Report of `bash scripts/h200_runs.sh determinism`: are training runs of the same config and seed
# bitwise equal, with and without XLA's determinism flags, and what do the flags cost in tokens/s?
#   python3 benchmarks/determinism_report.py RESULTS_DIR   (reads det_<name>/metrics.jsonl)
# Writes RESULTS_DIR/determinism.{json,md}.
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import bench_common as bc  # noqa: E402


def main(root):
  runs = {}
  for path in sorted(glob.glob(os.path.join(root, "det_*", "metrics.jsonl"))):
    recs = [json.loads(l) for l in open(path)]
    name = os.path.basename(os.path.dirname(path))[4:]  # <model>_<det|nondet>_<i>
    train = [r for r in recs if "train/loss" in r]
    val = [r["val/loss"] for r in recs if "val/loss" in r]
    runs[name] = dict(steps=[r["step"] for r in train], losses=[r["train/loss"] for r in train],
                      grad_norms=[r["train/grad_norm"] for r in train], val=val,
                      tokens_per_s=[round(r["train/tokens_per_s"]) for r in train
                                    if "train/tokens_per_s" in r])
  rows = []
  groups = sorted({n.rsplit("_", 1)[0] for n in runs})
  for g in groups:
    members = [runs[n] for n in sorted(runs) if n.rsplit("_", 1)[0] == g]
    if len(members) < 2:
      rows.append(dict(group=g, runs=len(members), bitwise_equal=None))
      continue
    a, b = members[:2]
    if not (a["losses"] and b["losses"]):  # a run that logged no step (e.g. failed to compile)
      rows.append(dict(group=g, runs=len(members), bitwise_equal=None,
                       note="a run logged no training step: see its log"))
      continue
    same = a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"] and a["val"] == b["val"]
    at_a, at_b = dict(zip(a["steps"], a["losses"])), dict(zip(b["steps"], b["losses"]))
    diff = max((abs(at_a[k] - at_b[k]) for k in at_a.keys() & at_b.keys()), default=None)
    tps = [t for m in members for t in m["tokens_per_s"][1:]]  # the first window holds warm-up
    rows.append(dict(group=g, runs=len(members), bitwise_equal=same, max_loss_diff=diff,
                     losses=[m["losses"] for m in members], val=[m["val"] for m in members],
                     mean_tokens_per_s=round(sum(tps) / len(tps)) if tps else None))
  prov = bc.provenance()
  prov["command"] = "bash scripts/h200_runs.sh determinism; python3 benchmarks/determinism_report.py"
  with open(os.path.join(root, "determinism.json"), "w") as f:
    json.dump({"provenance": prov, "groups": rows, "runs": runs}, f, indent=1)
  lines = ["# Run-to-run determinism of training (same config, same seed)\n",
           f"Command: `{prov['command']}`  ", f"Hardware: {prov['hardware']}. Date: {prov['date']}.\n",
           "| runs | count | bitwise equal (losses, grad norms, val loss) | largest train-loss difference (same step) | "
           "mean tokens/s (windows after the first) |", "|---|---|---|---|---|"]
  for r in rows:
    eq = r["bitwise_equal"] if r["bitwise_equal"] is not None else r.get("note", "n/a")
    lines.append(f"| {r['group']} | {r['runs']} | {eq} | {r.get('max_loss_diff')} | "
                 f"{r.get('mean_tokens_per_s')} |")
  with open(os.path.join(root, "determinism.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main(sys.argv[1])
