"""Sweep: NSA and dense trained on synthetic passkey retrieval, for experiments/needle_eval.py.

Training data: nsa_jax.training.data's "passkey" source (one 5-digit key hidden at a uniformly
random place in filler text, asked for at the end; loss only on the 5 answer digits), 256 tokens,
so the key is usually outside NSA's 64-token window and must be found by compression/selection.
needle_eval then tests lengths 128..512 (up to 2x the trained length) and depths 0..100%.

Run: python -m experiments.ablate --config=configs/sweep_needle.py[:gpu] [--run=NAME]
Then: python -m experiments.needle_eval --workdirs=<the two workdirs from results.jsonl>
"""

from configs.sweep_base import sweep_base_config

REFERENCE = "nsa_passkey"


def get_config(scale=None):
  c = sweep_base_config(scale)
  c.data.source = "passkey"
  if scale == "gpu":                # keep the 8k context; allow evaluation up to 16k
    c.model.max_seq_len = 2 * c.data.seq_len
    return c
  c.data.seq_len = 256
  c.data.global_batch_size = 8     # 2k tokens, but only 40 answer digits carry loss per step
  c.model.max_seq_len = 1024       # RoPE is computed on the fly: room to test 4x the length
  c.train.num_steps = 500          # 1M tokens; only 40 answer digits per step carry loss
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.optim.warmup_steps = 30
  c.checkpoint.every_steps = 100
  return c


def get_runs():
  return {
      "nsa_passkey": {},
      "dense_passkey": {"model.attention": "dense"},
  }
