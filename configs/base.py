"""Shared defaults for every experiment config: each field of the run, commented once, here.

Not a runnable config itself: the experiment files (tiny_cpu.py, small_gpu_*.py, paper_nsa.py)
start from get_base_config() and override what they change. Any field can be overridden from the
command line, e.g. --config.model.n_layers=4 --config.optim.learning_rate=1e-3.
"""

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder


def get_base_config() -> ConfigDict:
  c = ConfigDict()

  # --- model: fields of nsa_jax.ModelConfig (validated there; unknown keys are errors) ---------
  c.model = ConfigDict()
  c.model.vocab_size = 256         # byte-level tokens for the embedded corpus and synthetic tasks
  c.model.d_model = 256            # residual width
  c.model.n_layers = 4             # transformer blocks
  c.model.n_heads = 8              # query heads H
  c.model.n_kv_heads = 2           # KV groups K (GQA); H must be a multiple of K
  c.model.head_dim = 32            # query/key head dim d_k (even, for RoPE)
  c.model.head_dim_v = placeholder(int)  # value head dim d_v; None = head_dim
  c.model.ffn_dim = 768            # SwiGLU hidden width
  c.model.max_seq_len = 1024       # longest sequence the model is built for; >= data.seq_len
  c.model.attention = "nsa"        # "nsa" or "dense" in every layer ...
  c.model.layer_attention = placeholder(tuple)  # ... unless one kind per layer is listed here
  c.model.rope_theta = 10000.0     # RoPE base
  c.model.dtype = "bfloat16"       # compute dtype (softmax, LSE and logits stay float32)
  c.model.param_dtype = "float32"  # parameter (and optimizer state) dtype
  c.model.tie_embeddings = False   # share the input embedding with the output projection
  c.model.remat = False            # recompute each block in the backward pass (saves memory)
  c.model.layer_loop = "unrolled"  # trace one layer, unroll it (start-up); "scan" | "python"
  # dense layers' attention: "auto" (GPU: cuDNN; with data.document_mask the Pallas Triton
  # kernels, O(T) memory) | "cudnn" (with document masking: an explicit T x T mask) | "pallas" |
  # "xla" | "reference"
  c.model.dense_implementation = "auto"
  # NOT the paper: later NSA layers reuse this NSA layer's block selection (None = each selects)
  c.model.selection_from_layer = placeholder(int)

  # --- model.nsa: fields of nsa_jax.NSAConfig (head counts come from model.*) ----------------
  c.model.nsa = ConfigDict()
  c.model.nsa.cmp_block = 16       # l: compression block length
  c.model.nsa.cmp_stride = 8       # d: compression stride (d divides l)
  c.model.nsa.sel_block = 32       # l': selection block length (d divides l', l <= l')
  c.model.nsa.num_selected = 4     # n: selected blocks per query, forced ones included
  c.model.nsa.window = 64          # w: sliding-window length
  c.model.nsa.num_init_blocks = 1  # forced initial blocks
  c.model.nsa.num_local_blocks = 2  # forced local blocks
  c.model.nsa.score_alignment = "overlap"  # Eq. 9 mapping of compression scores to selection blocks
  c.model.nsa.compression = "mlp"  # phi: "mlp" (paper) or "mean" (ablation)
  c.model.nsa.cmp_hidden = placeholder(int)  # phi's MLP hidden width; None = 2 * head_dim
  c.model.nsa.shared_kv = False    # one K/V projection for all branches (ablation)
  c.model.nsa.branches = ("cmp", "slc", "win")  # branches summed into the output
  c.model.nsa.gating = "sigmoid"   # per-branch gates ("sigmoid", paper) or plain "sum"
  c.model.nsa.selector = "nsa"     # block scores from compression attention ("nsa") or "quest"
  c.model.nsa.implementation = "auto"  # "auto" | "pallas" | "pallas-triton" | "pallas-mosaic" | "xla" | "reference"
  c.model.nsa.query_chunk = 512    # queries per chunk on the plain-JAX "xla" path (memory bound)

  # --- data (nsa_jax/training/data.py) --------------------------------------------------------
  c.data = ConfigDict()
  c.data.source = "stdlib"         # stdlib | text | tokens | passkey | needle | mqar
  c.data.path = ""                 # text: file/dir/glob; tokens: flat token file
  c.data.val_path = ""             # tokens: optional separate validation token file
  c.data.token_dtype = "uint16"    # tokens: uint16 or uint32
  c.data.val_percent = 2.0         # held-out share: files (stdlib/text) or tail tokens (tokens)
  c.data.max_bytes = 16 << 20      # stdlib/text: read at most this many bytes per split
  c.data.num_needles = 4           # needle: facts hidden in the filler (passkey uses 1)
  c.data.num_kv_pairs = 32         # mqar: key-value pairs at the start
  c.data.num_queries = 16          # mqar: queried keys at the end
  c.data.seq_len = 256             # tokens per training sequence
  c.data.global_batch_size = 16    # sequences per optimizer step, all devices and microbatches
  c.data.seed = 0                  # sampling seed; batch at step s is a function of (seed, s)
  # Attention stays inside each document of a row (segment ids; positions restart per document):
  # stdlib/text end documents at file ends, a token file at data.eos_id (required there).
  c.data.document_mask = False
  c.data.eos_id = -1               # tokens: the id that ends a document; -1 = the source's default
  # dense layers with document masking on a GPU: cuDNN's packed layout with this cap on documents
  # in one row ("auto": from the first 16 batches, our Triton kernels where rows hold more than
  # 16 or the workspace would not fit; "off": our kernels; or a number, as a string here: "8").
  # nsa_jax/cudnn_packed.py
  c.data.cudnn_packed_cap = "auto"

  # --- optim (nsa_jax/training/optim.py) ------------------------------------------------------
  c.optim = ConfigDict()
  c.optim.learning_rate = 3e-3     # peak learning rate
  c.optim.warmup_steps = 50        # linear warmup from 0
  c.optim.min_lr_ratio = 0.1       # cosine decays to this fraction of the peak at train.num_steps
  c.optim.weight_decay = 0.1       # AdamW decoupled decay (matrices only)
  c.optim.b1 = 0.9                 # Adam beta1
  c.optim.b2 = 0.95                # Adam beta2
  c.optim.eps = 1e-8               # Adam epsilon
  c.optim.clip_norm = 1.0          # global gradient-norm clip
  c.optim.grad_accum_steps = 1     # microbatches per step (scan); the batch is split A ways

  # --- mesh (nsa_jax/training/sharding.py) ----------------------------------------------------
  c.mesh = ConfigDict()
  c.mesh.data = -1                 # data-parallel replicas (-1: all devices left over)
  c.mesh.fsdp = 1                  # parameter/optimizer sharding (ZeRO-3 style) devices
  c.mesh.tensor = 1                # tensor-parallel devices (heads, mlp, vocab split)
  # Logical parameter axis -> mesh axis (or None = replicated). Batches are split over data+fsdp.
  c.mesh.rules = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"),
                  ("kv_heads", "tensor"), ("mlp", "tensor"))

  # --- train loop (nsa_jax/training/train.py) -------------------------------------------------
  c.train = ConfigDict()
  c.train.num_steps = 1000         # optimizer steps (the schedule's length)
  c.train.seed = 0                 # parameter initialisation seed
  c.train.log_every = 10           # steps between train metric records (JSONL, TensorBoard, bar)
  c.train.eval_every = 200         # steps between validation passes (and at the end)
  c.train.eval_batches = 4         # fixed validation batches per pass
  c.train.peak_tflops = 0.0        # per-device peak for MFU; 0 = look up the device kind
  c.train.progress_bar = True      # tqdm bar on process 0
  c.train.tensorboard = True       # TensorBoard event files in <workdir>/tb
  c.train.plot = True              # loss.png in the workdir at the end
  c.train.stop_after = 0           # end this invocation after this step (0: num_steps); the LR
                                   # schedule still spans num_steps, a rerun resumes from here
  c.train.time_limit_minutes = 0.0  # stop cleanly (checkpoint + validation) after this much wall
                                   # time in the loop; 0 = no limit. A rerun resumes.
  c.train.hlo_report = False       # write <workdir>/collectives.json: the collectives (kind, shape,
                                   # bytes, JAX op) of the compiled train step

  # --- checkpoints (nsa_jax/training/checkpointing.py) ----------------------------------------
  c.checkpoint = ConfigDict()
  c.checkpoint.every_steps = 200   # save period (also saved at the end and on SIGTERM)
  c.checkpoint.max_to_keep = 3     # newest checkpoints kept
  c.checkpoint.async_save = True   # write in the background while training continues
  c.checkpoint.resume = True       # continue from the newest checkpoint in the workdir
  c.checkpoint.init_from = ""      # warm start (e.g. context extension): a fresh run takes its
                                   # parameters from the newest checkpoint of this other workdir
                                   # (same model; optimizer, step and data start afresh)
  return c
