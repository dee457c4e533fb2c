"""Sweep: block sizes and n (l, d, l', n) around the base setting.

Variants are relative to the base, so the same sweep works at both scales: at cpu scale the base
is (l, d, l', n) = (16, 8, 32, 4) at 512 tokens; at gpu scale the paper's (32, 16, 64, 16) at 8k.

  finer           l, d, l' halved and n doubled: the same selected-token budget n * l'
  coarser         l, d, l' doubled, same n: twice the selected tokens, coarser scores
  n_x2            twice the selected blocks
  n_forced_only   n = 3: only the forced 1 initial + 2 local blocks, selection chooses nothing
  no_overlap      l = d = l' (the base l'), n doubled: no overlap, p_slc = p_cmp (what most
                  public implementations do)

Run: python -m experiments.ablate --config=configs/sweep_blocks.py[:gpu] [--run=NAME]
"""

from configs.sweep_base import sweep_base_config

REFERENCE = "nsa"


def _blocks(l, d, lp, n):
  return {"model.nsa.cmp_block": l, "model.nsa.cmp_stride": d, "model.nsa.sel_block": lp,
          "model.nsa.num_selected": n}


def get_config(scale=None):
  return sweep_base_config(scale)


def get_runs(base):
  nsa = base.model.nsa
  l, d, lp, n = nsa.cmp_block, nsa.cmp_stride, nsa.sel_block, nsa.num_selected
  forced = nsa.num_init_blocks + nsa.num_local_blocks
  return {
      "nsa": {},
      "finer": _blocks(l // 2, d // 2, lp // 2, 2 * n),
      "coarser": _blocks(2 * l, 2 * d, 2 * lp, n),
      "n_x2": {"model.nsa.num_selected": 2 * n},
      "n_forced_only": {"model.nsa.num_selected": forced},
      "no_overlap": _blocks(lp, lp, lp, 2 * n),
  }
