"""Dense-attention twin of small_gpu_nsa.py: identical except model.attention = "dense".

Run (from the repository root, GPU install):
  .venv/bin/python -m experiments.train --config=configs/small_gpu_dense.py --workdir=runs/small_dense
"""

from configs.small_gpu_nsa import get_config as nsa_config


def get_config():
  c = nsa_config()
  c.model.attention = "dense"      # cuDNN causal attention; the NSA block settings are unused
  return c
