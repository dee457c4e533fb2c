"""Shared base of every ablation sweep (configs/sweep_*.py); not a sweep itself.

The CPU scale here is the paper's NSA shrunk ~16x in every length: the paper trains at 8k context
with l=32, d=16, l'=64, n=16, w=512; we train at 512 tokens with l=16, d=8, l'=32, n=4, w=64, so
a query at the end sees ~60 compressed blocks, 4 x 32 selected tokens and a 64-token window
(~1/2 of its 512-token past; the paper's 8k setting sees ~1/4). A sweep's runs are override sets
over this base; any field can be changed from the command line (--config.train.num_steps=...).

Scales (the ':scale' suffix of the sweep file, e.g. --config=configs/sweep_branches.py:gpu):
  cpu (default): the tiny model above.
  gpu: configs/small_gpu_nsa.py (~100M parameters, 8k context, the paper's l, d, l', n, w) with a
       run short enough for one 10-minute device call (GPU commands: docs/RESULTS.md, "not yet run").
"""

from configs.base import get_base_config

# Override key read by experiments/ablate.py: "run X" -> widen ffn_dim to match X's parameter count.
MATCH_PARAMS = "MATCH_PARAMS"


def sweep_base_config(scale: str | None = None):
  if scale == "gpu":
    return gpu_sweep_base_config()
  if scale not in (None, "", "cpu"):
    raise ValueError(f"sweep scale {scale!r}: expected 'cpu' or 'gpu' (--config=configs/sweep_X.py:gpu)")
  c = get_base_config()
  c.model.d_model = 64             # tiny: the shared 2-core CPU trains ~1-3k tokens/s at this size
  c.model.n_layers = 2             # two blocks: enough for an induction (copy) circuit
  c.model.n_heads = 4              # 4 query heads ...
  c.model.n_kv_heads = 1           # ... in one KV group (NSA shares selection per group)
  c.model.head_dim = 16            # d_k = d_v = 16
  c.model.ffn_dim = 192            # 3 x d_model
  c.model.max_seq_len = 512        # = data.seq_len
  c.model.dtype = "float32"        # CPUs have no fast bf16 matmul
  c.model.nsa.cmp_block = 16       # l   (paper 32)
  c.model.nsa.cmp_stride = 8       # d   (paper 16)
  c.model.nsa.sel_block = 32       # l'  (paper 64)
  c.model.nsa.num_selected = 4     # n   (paper 16): 1 initial + 2 local forced + 1 chosen
  c.model.nsa.window = 64          # w   (paper 512)
  c.model.nsa.implementation = "auto"  # xla on CPU, Pallas kernels on a GPU when they apply
  c.data.source = "stdlib"         # the embedded Python-stdlib byte corpus (no download)
  c.data.seq_len = 512
  c.data.global_batch_size = 4     # 2k tokens per step
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 20
  c.train.num_steps = 120          # 0.25M tokens: ~3-5 minutes per run on the shared 2-core CPU
  c.train.log_every = 5
  c.train.eval_every = 60
  c.train.eval_batches = 8         # 32 held-out sequences (16k tokens) per pass, the same each run
  c.train.progress_bar = False     # runs go to log files
  c.train.tensorboard = False
  c.checkpoint.every_steps = 60
  c.checkpoint.max_to_keep = 1
  c.checkpoint.async_save = False
  return c


def gpu_sweep_base_config():
  """small_gpu_nsa (~100M, 8k) cut to a run that fits one 10-minute device call, logs kept small."""
  from configs.small_gpu_nsa import get_config as small_gpu_nsa
  c = small_gpu_nsa()
  c.train.num_steps = 300          # 20M tokens (64k per step); raise with --config.train.num_steps
  c.optim.warmup_steps = 30
  c.train.log_every = 10
  c.train.eval_every = 100
  c.train.eval_batches = 4         # 32 held-out 8k sequences
  c.train.progress_bar = False
  c.train.tensorboard = False
  c.checkpoint.every_steps = 300   # only the final one (1.2 GB): keep runs_root outside $OUT
  c.checkpoint.max_to_keep = 1
  return c
