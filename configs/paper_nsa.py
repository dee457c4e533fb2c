"""The paper's NSA attention settings (Yuan et al. 2025, section 4.1) in a dense-MLP backbone.

Attention as in the paper: GQA with 4 groups x 16 query heads (64 heads), d_k = 192, d_v = 128,
l = 32, d = 16, l' = 64, n = 16 (1 initial + 2 local blocks forced), w = 512, 30 layers, width
2560, 8k pretraining context. The paper's backbone is a 27B mixture-of-experts; this repository
has no MoE, so a dense SwiGLU of 4 x 2560 stands in (4.4B parameters in all). Needs several
GPUs: the command below shards parameters and optimizer state over 8 devices (fsdp) and splits
heads/mlp 1-way; adjust --config.mesh.* to your machine.

Run (from the repository root, GPU install, 8 GPUs):
  .venv/bin/python -m experiments.train --config=configs/paper_nsa.py --workdir=runs/paper_nsa \
      --config.mesh.data=1 --config.mesh.fsdp=8
"""

from configs.base import get_base_config


def get_config():
  c = get_base_config()
  c.model.d_model = 2560           # paper's hidden size
  c.model.n_layers = 30            # paper's depth
  c.model.n_heads = 64             # 4 groups x 16 query heads
  c.model.n_kv_heads = 4           # GQA groups
  c.model.head_dim = 192           # d_k
  c.model.head_dim_v = 128         # d_v
  c.model.ffn_dim = 10240          # dense stand-in for the paper's MoE (4 x d_model)
  c.model.max_seq_len = 8192       # pretraining context
  c.model.attention = "nsa"        # every layer NSA
  c.model.dtype = "bfloat16"       # compute
  c.model.param_dtype = "float32"  # master weights
  c.model.remat = True             # 30 layers x 8k tokens: recompute activations
  c.model.nsa.cmp_block = 32       # l
  c.model.nsa.cmp_stride = 16      # d
  c.model.nsa.sel_block = 64       # l'
  c.model.nsa.num_selected = 16    # n
  c.model.nsa.window = 512         # w
  c.model.nsa.num_init_blocks = 1  # forced initial block
  c.model.nsa.num_local_blocks = 2  # forced local blocks
  c.data.seq_len = 8192            # 8k tokens per sequence
  c.data.global_batch_size = 64    # 512k tokens per step
  c.optim.learning_rate = 3e-4     # peak LR for a few-billion-parameter model
  c.optim.warmup_steps = 2000      # long warmup at this scale
  c.optim.grad_accum_steps = 8     # 8 microbatches of 8 sequences: bounds activation memory
  c.mesh.data = -1                 # fill with what fsdp/tensor leave
  c.mesh.fsdp = 8                  # shard parameters and Adam moments 8 ways
  c.train.num_steps = 100000       # ~52B tokens
  c.train.log_every = 10           # throughput and loss
  c.train.eval_every = 1000        # validation
  c.checkpoint.every_steps = 1000  # ~34 GB each
  c.checkpoint.max_to_keep = 2     # disk
  return c
