"""Summarise an Nsight Compute raw-page CSV (benchmarks/ncu_kernels.py under ncu) as JSON + Markdown.

  python3 benchmarks/ncu_report.py RAW.csv[.gz] --out benchmarks/results/ncu_h200 \
      --note "command, hardware, date"

One row per profiled launch: duration, the speed-of-light percentages (SM, memory, DRAM, L2, L1),
bytes moved at DRAM and L2, hit rates, occupancy and what limits it, the busiest pipes, and the
warp stall reasons with the most cycles per issued instruction. Metrics the CSV lacks are left
empty (names differ between ncu versions); the full CSV stays beside the table.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
import sys

# (label, metric name): reported as they are, in the CSV's units (row 2 of the raw page).
METRICS = [
    ("duration", "gpu__time_duration.sum"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L1 %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("DRAM read", "dram__bytes_read.sum"),
    ("DRAM write", "dram__bytes_write.sum"),
    ("L2 sectors", "lts__t_sectors.sum"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("L1 hit %", "l1tex__t_sector_hit_rate.pct"),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("achieved occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("theoretical occupancy %", "sm__maximum_warps_per_active_cycle_pct"),
    ("registers", "launch__registers_per_thread"),
    ("smem/block", "launch__shared_mem_per_block"),
    ("block limit: registers", "launch__occupancy_limit_registers"),
    ("block limit: smem", "launch__occupancy_limit_shared_mem"),
    ("block limit: warps", "launch__occupancy_limit_warps"),
    ("block size", "launch__block_size"),
    ("grid size", "launch__grid_size"),
]
PIPE = re.compile(r"^sm__(?:inst_executed_)?pipe_(\w+?)(?:_cycles_active)?"
                  r"\.avg\.pct_of_peak_sustained_active$")
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+)_per_issue_active\.ratio$")


def read_rows(path):
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    rows = list(csv.reader(f))
  # Some ncu versions print "==PROF==" lines before the CSV: start at the header.
  start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
  header, units, body = rows[start], rows[start + 1], rows[start + 2:]
  return header, units, [r for r in body if len(r) == len(header)]


def num(x):
  try:
    return float(x.replace(",", ""))
  except (AttributeError, ValueError):
    return None


def summarise(header, units, body):
  col = {name: i for i, name in enumerate(header)}
  out = []
  for r in body:
    rec = {"kernel": r[col["Kernel Name"]] if "Kernel Name" in col else r[4]}
    for label, name in METRICS:
      if name in col:
        rec[label] = num(r[col[name]])
        rec[label + " unit"] = units[col[name]]
    if rec.get("L2 sectors") is not None:  # 32-byte sectors through L2 (reads and writes)
      rec["L2 GB"] = rec["L2 sectors"] * 32 / 1e9
    pipes = {}
    for name, i in col.items():
      mm = PIPE.match(name)
      if mm and num(r[i]) is not None:
        pipes[mm.group(1)] = max(pipes.get(mm.group(1), 0.0), num(r[i]))
    rec["pipes %"] = dict(sorted(pipes.items(), key=lambda kv: -kv[1])[:5])
    stalls = {}
    for name, i in col.items():
      mm = STALL.match(name)
      if (mm and num(r[i]) is not None and not mm.group(1).endswith("_not_issued")
          and mm.group(1) not in ("selected", "not_selected")):  # issuing, not waiting
        stalls[mm.group(1)] = num(r[i])
    rec["stalls (cycles per issue)"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
    out.append(rec)
  return out


def fmt(v):
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def markdown(recs, note):
  labels = ["duration", "SM %", "memory %", "DRAM %", "L2 %", "L1 %", "L2 GB", "L2 hit %",
            "L1 hit %", "issue active %", "achieved occupancy %", "theoretical occupancy %",
            "registers", "smem/block"]
  lines = [f"# Nsight Compute profile of the NSA kernels", "", note, "",
           "| kernel | " + " | ".join(labels) + " |",
           "|---" * (len(labels) + 1) + "|"]
  for r in recs:
    cells = []
    for lab in labels:
      unit = r.get(lab + " unit", "")
      cells.append(fmt(r.get(lab)) + (f" {unit}" if unit and lab in ("duration", "smem/block")
                                      else ""))
    lines.append(f"| {r['kernel'][:48]} | " + " | ".join(cells) + " |")
  lines += ["", "Busiest pipes (% of peak while the SM is active) and the largest warp stall "
            "reasons (average cycles a warp waits per issued instruction):", ""]
  for r in recs:
    pipes = ", ".join(f"{k} {v:.3g}" for k, v in r["pipes %"].items())
    stalls = ", ".join(f"{k} {v:.3g}" for k, v in r["stalls (cycles per issue)"].items())
    lines.append(f"- `{r['kernel'][:60]}`: pipes {pipes or 'n/a'}; stalls {stalls or 'n/a'}")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("csv", help="ncu -i REP --page raw --csv output (optionally .gz)")
  p.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.md")
  p.add_argument("--note", default="", help="command, hardware and date, printed above the table")
  a = p.parse_args(argv)
  try:
    header, units, body = read_rows(a.csv)
  except (OSError, StopIteration) as e:
    sys.exit(f"error: {a.csv} is not an ncu raw-page CSV ({e or 'no ID header row'}). Fix: export "
             "it with ncu -i REPORT.ncu-rep --page raw --csv > RAW.csv")
  recs = summarise(header, units, body)
  if not recs:
    sys.exit(f"error: {a.csv} holds no profiled launches (did ncu's -k filter match nothing?)")
  with open(a.out + ".json", "w") as f:
    json.dump({"note": a.note, "kernels": recs}, f, indent=1)
  md = markdown(recs, a.note)
  with open(a.out + ".md", "w") as f:
    f.write(md)
  print(md)


if __name__ == "__main__":
  main()
