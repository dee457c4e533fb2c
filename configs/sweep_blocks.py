"""Sweep: block sizes and n (l, d, l', n) around the scaled-down paper setting.

The base is (l, d, l', n) = (16, 8, 32, 4) at 512 tokens, the paper's (32, 16, 64, 16) at 8k
shrunk in length. Variants halve or double one knob; the selected-token budget n * l' is noted.

  l8_d4_s16_n8     finer blocks, same 128 selected tokens
  l32_d16_s64_n4   the paper's block lengths (coarser at our context), 256 selected tokens
  n8               twice the selected blocks (256 tokens)
  n3               only the 3 forced blocks (1 initial + 2 local): selection chooses nothing
  no_overlap       l = d = l' = 16 (no overlap, p_slc = p_cmp), n = 8: 128 selected tokens

Run: python -m experiments.ablate --config=configs/sweep_blocks.py [--run=NAME]
"""

from configs.sweep_base import sweep_base_config

REFERENCE = "nsa"


def _blocks(l, d, lp, n):
  return {"model.nsa.cmp_block": l, "model.nsa.cmp_stride": d, "model.nsa.sel_block": lp,
          "model.nsa.num_selected": n}


def get_config():
  return sweep_base_config()


def get_runs():
  return {
      "nsa": {},
      "l8_d4_s16_n8": _blocks(8, 4, 16, 8),
      "l32_d16_s64_n4": _blocks(32, 16, 64, 4),
      "n8": {"model.nsa.num_selected": 8},
      "n3": {"model.nsa.num_selected": 3},
      "no_overlap": _blocks(16, 16, 16, 8),
  }
