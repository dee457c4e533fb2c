"""benchmarks/ncu_report.py: the Nsight Compute raw-page CSV summariser, and benchmarks/ncu_kernels.py's
dry run (no GPU needed)."""

import gzip
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import ncu_report  # noqa: E402

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "gpu__time_duration.sum",
          "lts__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sectors.sum",
          "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"]
UNITS = ["", "", "", "", "", "ms", "%", "sector", "%", "ratio", "ratio", "ratio"]


def _write(path, rows):
  quote = lambda r: ",".join(f'"{c}"' for c in r)
  text = "==PROF== Disconnected from process 1\n" + "\n".join(quote(r) for r in rows) + "\n"
  with gzip.open(path, "wt") as f:
    f.write(text)


def test_summary_reads_units_derives_l2_bytes_and_keeps_only_real_stalls(tmp_path):
  csv_path = str(tmp_path / "raw.csv.gz")
  _write(csv_path, [HEADER, UNITS,
                    ["0", "1", "python3", "h", "nsa_select_fwd_union1", "15.78", "82.37",
                     "4,315,528,631", "16.7", "3.5", "9.0", "0.25"],
                    ["1", "1", "python3", "h", "nsa_select_topn_pick", "1.11", "6.5", "14200161",
                     "50.2", "0.2", "1.0", "0.1"]])
  out = str(tmp_path / "rep")
  ncu_report.main([csv_path, "--out", out, "--note", "cmd, H200, date"])
  recs = json.load(open(out + ".json"))["kernels"]
  assert [r["kernel"] for r in recs] == ["nsa_select_fwd_union1", "nsa_select_topn_pick"]
  first = recs[0]
  assert first["duration"] == 15.78 and first["duration unit"] == "ms"
  assert first["L2 GB"] == pytest.approx(4315528631 * 32 / 1e9)  # thousands separators parsed
  assert first["pipes %"] == {"alu": 16.7}
  # "selected" is issuing, not waiting: left out; the rest sorted by cycles
  assert list(first["stalls (cycles per issue)"]) == ["long_scoreboard", "barrier"]
  md = open(out + ".md").read()
  assert "cmd, H200, date" in md and "| nsa_select_topn_pick | 1.11 ms |" in md


def test_refuses_a_file_that_is_not_a_raw_page(tmp_path):
  bad = tmp_path / "details.csv"
  bad.write_text('"Kernel Name","Section Name"\n"k","SOL"\n')
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ncu_report.py"), str(bad),
                      "--out", str(tmp_path / "x")], capture_output=True, text=True)
  assert r.returncode != 0 and "not an ncu raw-page CSV" in r.stderr and "--page raw" in r.stderr


def test_ncu_kernels_dry_run_runs_the_window_cases(capsys):
  """benchmarks/ncu_kernels.py off a GPU (interpret mode, small shapes): the window cases run
  without and with document ids, and an unknown case is refused."""
  import pytest
  sys.path.insert(0, ROOT)
  from benchmarks import ncu_kernels
  ncu_kernels.main(["--T", "256", "--heads", "4/1", "--dims", "16/16", "--cases",
                    "window_bwd,window_bwd_ids"])
  out = capsys.readouterr().out
  assert "ncu_kernels: window_bwd T=" in out and "ncu_kernels: window_bwd_ids T=" in out
  with pytest.raises(SystemExit):
    ncu_kernels.main(["--T", "256", "--cases", "window_fwd"])
