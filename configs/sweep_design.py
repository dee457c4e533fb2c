"""Sweep: NSA design choices, one change each from the base.

  shared_kv      one K/V projection for all three branches (paper: separate, §3.3.3)
  gate_sum       plain sum of the branches instead of sigmoid gates
  align_literal  Eq. 9's printed index range instead of the spatial overlap (docs/NSA.md §1.2)
  quest          Quest-style selection: query x per-block min/max of keys (paper §6.1)
  aux_selector   a learned gate trained by an auxiliary loss (KL to full attention's block mass),
                 SeerAttention-like (paper §6.1; nsa_jax/aux_selector.py)
  mean_phi       mean pooling instead of the MLP phi (what most other implementations do)

Run: python -m experiments.ablate --config=configs/sweep_design.py [--run=NAME]
"""

from configs.sweep_base import sweep_base_config

REFERENCE = "nsa"


def get_config(scale=None):
  return sweep_base_config(scale)


def get_runs():
  return {
      "nsa": {},
      "shared_kv": {"model.nsa.shared_kv": True},
      "gate_sum": {"model.nsa.gating": "sum"},
      "align_literal": {"model.nsa.score_alignment": "literal"},
      "quest": {"model.nsa.selector": "quest"},
      "aux_selector": {"model.nsa.selector": "aux"},
      "mean_phi": {"model.nsa.compression": "mean"},
  }
