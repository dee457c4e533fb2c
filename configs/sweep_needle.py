"""Sweep: NSA and dense trained on synthetic passkey retrieval, for experiments/needle_eval.py.

Training data: nsa_jax.training.data's "passkey" source: a 5-digit key hidden at a random place
in filler text ("The pass key is 12345. Remember it."), asked for at the end ("... The pass key
is 12345"). The plain task (one question, loss on its 5 digits only) taught the tiny models
nothing in 1M tokens (docs/results/passkey_recipe.md). What makes it learnable fast, measured:
  - data.num_questions > 1: the key is asked for again at random places after the fact, so a
    sequence carries 5 x num_questions scored digits; the last question stays at the end;
  - data.context_loss_weight: a small language-model loss on every other token (0.1 at 256
    tokens; without it the same run stayed at 0-9% exact after 1000 steps). Plausibly it trains
    the previous-token heads that the copy (induction) circuit needs; not tested further;
  - model.n_kv_heads 4 (CPU scale): each query head its own 16-dim K/V instead of one shared;
    a small gain (0.36 vs 0.27 validation digit accuracy at 300 steps, one seed each).
Both need the other: questions close to their fact (inside NSA's window: w = 64 on the CPU, 512
on the GPU) are where the circuit forms first; those beyond the window (57% at the CPU scale)
make NSA learn to fetch the key by compression + selection.

Run: python -m experiments.ablate --config=configs/sweep_needle.py[:gpu] [--run=NAME]
Then: python -m experiments.needle_eval --workdirs=<sweep out dir>:nsa_passkey,<...>:dense_passkey
"""

from configs.sweep_base import sweep_base_config

REFERENCE = "nsa_passkey"


def get_config(scale=None):
  c = sweep_base_config(scale)
  c.data.source = "passkey"
  c.data.num_questions = 3         # 15 scored digits per sequence (see the module docstring)
  c.data.context_loss_weight = 0.1  # small LM loss on the filler: builds previous-token heads
  # Rows asking only at the end (their answer's distance uniform over the row). 0: the recipe of
  # every committed run before 2026-12-03; see experiments/passkey_distances.py for why > 0.
  c.data.single_question_fraction = 0.0
  if scale == "gpu":
    return _gpu(c)
  c.model.n_kv_heads = 4           # one K/V per query head (NSA selects per KV group)
  c.data.seq_len = 256             # 57% of the answers' previous key copy is > 64 tokens back
  c.data.global_batch_size = 8     # 2k tokens per step
  c.model.max_seq_len = 1024       # RoPE is computed on the fly: room to test 4x the length
  c.train.num_steps = 800          # 1.6M tokens
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.optim.warmup_steps = 30
  c.checkpoint.every_steps = 100
  return c


def _gpu(c):
  """A small model (4 x 512, ~20M parameters) at 4k: trains in a few minutes on one H200."""
  c.model.d_model = 512
  c.model.n_layers = 4
  c.model.n_heads = 16             # 16 query heads in one KV group, head_dim 64 (as small_gpu_nsa)
  c.model.ffn_dim = 2048
  c.data.seq_len = 4096            # 8 windows of w = 512 (the CPU scale: 4 windows of 64)
  # 5 questions: 52% of the answers lie beyond the 512-token window, like the CPU scale's 57%.
  # On the CPU a far share of only 22% (4 questions) let NSA lean on its window and fail keys in
  # the middle (12-38% exact after 1200 steps; docs/results/passkey_recipe.md).
  c.data.num_questions = 5
  # The same answer : context loss-weight ratio as the CPU scale (15 : 0.1 x 240, about 1 : 1.6);
  # 0.1 here would give the 4k tokens of filler 16x the answers' weight, and a filler weight of
  # 12x the answers' drowned them on the CPU (run dq4cw).
  c.data.context_loss_weight = 0.01  # 25 : 0.01 x 4070
  c.data.global_batch_size = 16    # 64k tokens per step
  c.model.max_seq_len = 4 * c.data.seq_len  # evaluate up to 16k
  c.optim.learning_rate = 2e-3
  c.optim.warmup_steps = 50
  c.train.num_steps = 800          # 52M tokens
  c.train.log_every = 10
  c.train.eval_every = 200
  c.train.eval_batches = 2
  c.checkpoint.every_steps = 200   # small checkpoints (~0.25 GB); also saved on SIGTERM
  return c


def get_runs():
  return {
      "nsa_passkey": {},
      "dense_passkey": {"model.attention": "dense"},
  }
