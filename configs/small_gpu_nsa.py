"""~100M-parameter NSA LM at 8k context on one GPU (the dense twin is small_gpu_dense.py).

Run (from the repository root, GPU install):
  .venv/bin/python -m experiments.train --config=configs/small_gpu_nsa.py --workdir=runs/small_nsa
Compare with the dense twin afterwards:
  .venv/bin/python -m experiments.plot_runs runs/small_nsa runs/small_dense --out=runs/small.png
Only the attention differs between the twins: same widths, data, batch, optimizer and steps.
"""

from configs.base import get_base_config


def get_config():
  c = get_base_config()
  c.model.d_model = 768            # GPT-2-small width
  c.model.n_layers = 12            # GPT-2-small depth
  c.model.n_heads = 16             # 16 query heads ...
  c.model.n_kv_heads = 1           # ... in one KV group: the paper's 16 heads per group
  c.model.head_dim = 64            # d_k (a multiple of 16 for the selection kernel)
  c.model.head_dim_v = 64          # d_v = d_k, so the dense twin can use cuDNN
  c.model.ffn_dim = 3072           # 4 x d_model; brings the total to about 100M parameters
  c.model.max_seq_len = 8192       # = data.seq_len
  c.model.attention = "nsa"        # the twin sets "dense"
  c.model.dtype = "bfloat16"       # tensor-core compute; parameters stay float32
  c.model.remat = False            # activations of 8 x 8k tokens fit in an H200's memory
  c.model.nsa.cmp_block = 32       # l (paper)
  c.model.nsa.cmp_stride = 16      # d (paper)
  c.model.nsa.sel_block = 64       # l' (paper)
  c.model.nsa.num_selected = 16    # n (paper): 1 initial + 2 local + 13 chosen blocks
  c.model.nsa.window = 512         # w (paper)
  c.data.seq_len = 8192            # 8k context
  c.data.global_batch_size = 8     # 64k tokens per step
  c.optim.learning_rate = 1e-3     # peak LR for a 100M model at this batch
  c.optim.warmup_steps = 200       # ~2% of the run
  c.train.num_steps = 10000        # 655M tokens (about 6.5 tokens per parameter)
  c.train.log_every = 10           # tokens/s and MFU every 10 steps
  c.train.eval_every = 500         # validation loss/perplexity
  c.train.eval_batches = 8         # 64 held-out 8k sequences
  c.checkpoint.every_steps = 500   # 1.2 GB each (params + Adam moments)
  return c
