"""Sweep: NSA vs dense attention at equal tokens (paper Fig. 4 / Table 1 at our scale).

Runs (every run sees the same batches: same data seed, steps, batch and length):
  nsa           the base (configs/sweep_base.py), all three branches, gates.
  dense         the same transformer with full causal attention: fewer parameters, because NSA
                adds two extra K/V projection pairs, phi_k/phi_v and the gate per layer.
  dense_pmatch  dense with ffn_dim widened so its parameter count matches nsa's (the difference
                left is under one ffn step of 8 units; the table shows it).
  *_seed1, *_seed2   the same runs with other init and data seeds (the data seed also picks
                the validation windows): the spread between seeds is the noise floor for
                reading every other table.

Run: python -m experiments.ablate --config=configs/sweep_nsa_vs_dense.py [--run=NAME]
"""

from configs.sweep_base import MATCH_PARAMS, sweep_base_config

REFERENCE = "nsa"


def get_config(scale=None):
  return sweep_base_config(scale)


def get_runs():
  return {
      "nsa": {},
      "dense": {"model.attention": "dense"},
      "dense_pmatch": {"model.attention": "dense", MATCH_PARAMS: "nsa"},
      "nsa_seed1": {"train.seed": 1, "data.seed": 1},
      "dense_seed1": {"model.attention": "dense", "train.seed": 1, "data.seed": 1},
      "dense_pmatch_seed1": {"model.attention": "dense", MATCH_PARAMS: "nsa", "train.seed": 1,
                             "data.seed": 1},
      "nsa_seed2": {"train.seed": 2, "data.seed": 2},
      "dense_seed2": {"model.attention": "dense", "train.seed": 2, "data.seed": 2},
      "dense_pmatch_seed2": {"model.attention": "dense", MATCH_PARAMS: "nsa", "train.seed": 2,
                             "data.seed": 2},
  }
