"""Sweep: NSA without each branch in turn (compression, selection, window).

"no_cmp" still computes compression attention, because the NSA selector's block scores come from
it (Eq. 8); only its output leaves the gated sum. Top-n has no gradient (by the paper's design), so
in "no_cmp" nothing trains the compression keys or phi: its block choices stay those of the random
initialisation for the whole run. "no_slc" has no selection branch at all.

Run: python -m experiments.ablate --config=configs/sweep_branches.py [--run=NAME]
"""

from configs.sweep_base import sweep_base_config

REFERENCE = "nsa"


def get_config(scale=None):
  return sweep_base_config(scale)


def get_runs():
  return {
      "nsa": {},
      "no_cmp": {"model.nsa.branches": ("slc", "win")},
      "no_slc": {"model.nsa.branches": ("cmp", "win")},
      "no_win": {"model.nsa.branches": ("cmp", "slc")},
  }
