"""Tiny NSA LM on the embedded stdlib corpus: the README's main job, a few minutes on 2 CPU cores.

Run (from the repository root):
  .venv/bin/python -m experiments.train --config=configs/tiny_cpu.py --workdir=runs/tiny
Leaves runs/tiny/{checkpoints/, metrics.jsonl, tb/, config.json, loss.png}; rerunning the same
command resumes (or, when finished, only redraws the plot).
"""

from configs.base import get_base_config


def get_config():
  c = get_base_config()
  c.model.d_model = 128            # small enough for 2 CPU cores
  c.model.n_layers = 2             # two NSA blocks
  c.model.n_heads = 4              # 4 query heads ...
  c.model.n_kv_heads = 1           # ... sharing one KV group (GQA group of 4, as NSA expects)
  c.model.head_dim = 32            # d_k = d_v = 32
  c.model.ffn_dim = 384            # 3 x d_model
  c.model.max_seq_len = 256        # = data.seq_len
  c.model.dtype = "float32"        # CPUs have no fast bf16 matmul
  c.model.nsa.cmp_block = 16       # l
  c.model.nsa.cmp_stride = 8       # d
  c.model.nsa.sel_block = 32       # l'
  c.model.nsa.num_selected = 4     # n (1 initial + 2 local forced + 1 chosen)
  c.model.nsa.window = 64          # w: a quarter of the context, so selection has work to do
  c.data.seq_len = 256             # tokens per sequence
  c.data.global_batch_size = 8     # 2k tokens per step (~0.7 CPU-seconds per step)
  c.optim.learning_rate = 3e-3     # peak LR: fine for a model this small
  c.optim.warmup_steps = 20        # short warmup for a short run
  c.train.num_steps = 200          # 400k tokens: a few minutes on 2 cores
  c.train.log_every = 5            # dense enough for a smooth curve
  c.train.eval_every = 50          # four validation passes
  c.train.eval_batches = 4         # 32 held-out sequences per pass
  c.checkpoint.every_steps = 50    # a checkpoint every ~30 s: an interrupted run loses little
  return c
