"""Typed, validated configuration for NSA attention and the transformer LM.

Every block size, head count and switch is checked once, here, with an error that names the
field and says how to fix it. Modules, reference math and kernels trust these objects.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

ALIGNMENTS = ("overlap", "literal")
COMPRESSIONS = ("mlp", "mean")
BRANCHES = ("cmp", "slc", "win")
GATINGS = ("sigmoid", "sum")
SELECTORS = ("nsa", "quest", "aux")
IMPLEMENTATIONS = ("auto", "pallas", "pallas-triton", "pallas-mosaic", "xla", "reference")
# Dense attention (nsa_jax.ops.dense_attention): "auto" = ops.dense_backend's rule.
DENSE_IMPLEMENTATIONS = ("auto", "cudnn", "pallas", "xla", "reference")
LAYER_LOOPS = ("unrolled", "scan", "python")
ATTENTION_KINDS = ("nsa", "dense")


def _fail(field: str, value, problem: str, fix: str):
  raise ValueError(f"{field}={value!r}: {problem}. Fix: {fix}.")


def _check_choice(field: str, value, choices):
  if value not in choices:
    _fail(field, value, f"unknown choice, expected one of {choices}", f"set {field} to one of {choices}")


def _check_positive(field: str, value):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    _fail(field, value, "must be a positive integer", f"set {field} >= 1")


@dataclasses.dataclass(frozen=True)
class NSAConfig:
  """NSA settings. Defaults are the paper's (Yuan et al. 2025, section 4.1).

  Attributes:
    num_heads: query heads H.
    num_kv_heads: KV groups K; H must be a multiple of K (G = H // K heads share one group).
    head_dim: query/key head dim d_k.
    head_dim_v: value head dim d_v (None: same as head_dim).
    cmp_block: compression block length l.
    cmp_stride: compression stride d (d divides l; d < l gives overlapping blocks).
    sel_block: selection block length l' (d divides l', l <= l').
    num_selected: blocks selected per query n, forced blocks included.
    window: sliding-window length w; query t sees keys (t - w, t].
    num_init_blocks: forced initial blocks (the first block(s) of the query's document).
    num_local_blocks: forced local blocks (the block holding t and the ones before it).
    score_alignment: how compression scores map onto selection blocks (Eq. 9):
      "overlap" sums the compression blocks that spatially overlap selection block j (default);
      "literal" uses the printed index range of Eq. 9 (blocks (l'/d) j - m - n).
    compression: "mlp" (the paper's phi: MLP over the flattened block with a learned intra-block
      position encoding) or "mean" (mean pooling, an ablation).
    cmp_hidden: hidden width of phi's MLP (None: 2 * head_dim).
    shared_kv: share one K/V projection across the three branches (ablation; paper: separate).
    branches: which branches contribute to the output (ablation; paper: all three).
    gating: "sigmoid" per-branch, per-head gates from the layer input, or "sum" (ablation).
    selector: "nsa" (compression-attention scores), "quest" (query x per-block key min/max) or
      "aux" (a learned gate trained by an auxiliary loss, nsa_jax.aux_selector; ablations).
    aux_dim: width of the "aux" selector's query/key projections.
    aux_loss_weight: weight of the "aux" selector's loss (KL to full attention's block mass) in
      the training objective.
    implementation: "auto" (GPU: "pallas", else "xla"), "pallas" (Pallas kernels; the selection
      runs Mosaic GPU where it was measured faster on the H200, Triton elsewhere), "pallas-triton"
      (Triton kernels only), "pallas-mosaic" (Mosaic GPU selection and compression kernels
      wherever they apply), "xla" (memory-sane plain JAX) or "reference" (dense masks).
    query_chunk: queries processed together by the plain-JAX "xla" path (bounds its memory).
  """

  num_heads: int = 64
  num_kv_heads: int = 4
  head_dim: int = 192
  head_dim_v: int | None = 128
  cmp_block: int = 32
  cmp_stride: int = 16
  sel_block: int = 64
  num_selected: int = 16
  window: int = 512
  num_init_blocks: int = 1
  num_local_blocks: int = 2
  score_alignment: Literal["overlap", "literal"] = "overlap"
  compression: Literal["mlp", "mean"] = "mlp"
  cmp_hidden: int | None = None
  shared_kv: bool = False
  branches: tuple[str, ...] = BRANCHES
  gating: Literal["sigmoid", "sum"] = "sigmoid"
  selector: Literal["nsa", "quest", "aux"] = "nsa"
  aux_dim: int = 32
  aux_loss_weight: float = 1.0
  implementation: Literal["auto", "pallas", "pallas-triton", "pallas-mosaic", "xla",
                          "reference"] = "auto"
  query_chunk: int = 512

  def __post_init__(self):
    for f in ("num_heads", "num_kv_heads", "head_dim", "cmp_block", "cmp_stride", "sel_block",
              "num_selected", "window", "query_chunk"):
      _check_positive(f, getattr(self, f))
    if self.head_dim_v is not None:
      _check_positive("head_dim_v", self.head_dim_v)
    if self.cmp_hidden is not None:
      _check_positive("cmp_hidden", self.cmp_hidden)
    for f in ("num_init_blocks", "num_local_blocks"):
      v = getattr(self, f)
      if not isinstance(v, int) or v < 0:
        _fail(f, v, "must be a non-negative integer", f"set {f} >= 0")
    if self.num_heads % self.num_kv_heads:
      _fail("num_heads", self.num_heads,
            f"not divisible by num_kv_heads={self.num_kv_heads} (each KV group needs the same number "
            "of query heads)", "choose num_heads as a multiple of num_kv_heads")
    if self.cmp_block % self.cmp_stride:
      _fail("cmp_block", self.cmp_block, f"not a multiple of cmp_stride={self.cmp_stride}",
            "choose cmp_block (l) as a multiple of cmp_stride (d), e.g. l=32, d=16")
    if self.sel_block % self.cmp_stride:
      _fail("sel_block", self.sel_block, f"not a multiple of cmp_stride={self.cmp_stride}",
            "choose sel_block (l') as a multiple of cmp_stride (d), e.g. l'=64, d=16")
    if self.cmp_block > self.sel_block:
      _fail("cmp_block", self.cmp_block, f"larger than sel_block={self.sel_block}",
            "the paper requires l <= l'; lower cmp_block or raise sel_block")
    forced = self.num_init_blocks + self.num_local_blocks
    if self.num_selected < forced:
      _fail("num_selected", self.num_selected,
            f"smaller than the {forced} forced blocks (num_init_blocks={self.num_init_blocks} + "
            f"num_local_blocks={self.num_local_blocks}), which are counted inside n",
            f"set num_selected >= {forced} or force fewer blocks")
    if self.selector in ("quest", "aux") and self.num_local_blocks < 1:
      _fail("num_local_blocks", self.num_local_blocks,
            f"must be >= 1 with selector='{self.selector}': "
            + ("Quest's per-block key bounds include keys after t in the query's own block, so "
               "that block must be forced rather than scored" if self.selector == "quest" else
               "the aux gate scores only complete past blocks, so the query's own block must be "
               "forced or it could never be selected"),
            "set num_local_blocks >= 1 or use selector='nsa'")
    _check_positive("aux_dim", self.aux_dim)
    if not isinstance(self.aux_loss_weight, (int, float)) or self.aux_loss_weight < 0:
      _fail("aux_loss_weight", self.aux_loss_weight, "must be a number >= 0",
            "set aux_loss_weight >= 0 (0 leaves the aux selector's gate untrained)")
    _check_choice("score_alignment", self.score_alignment, ALIGNMENTS)
    _check_choice("compression", self.compression, COMPRESSIONS)
    _check_choice("gating", self.gating, GATINGS)
    _check_choice("selector", self.selector, SELECTORS)
    _check_choice("implementation", self.implementation, IMPLEMENTATIONS)
    if not isinstance(self.branches, tuple) or not self.branches:
      _fail("branches", self.branches, "must be a non-empty tuple", f"use a subset of {BRANCHES}")
    for b in self.branches:
      if b not in BRANCHES:  # e.g. "(cmp,slc)" from a command line without quotes inside
        _fail("branches", self.branches, f"{b!r} is not a branch name (one of {BRANCHES})",
              f"list names from {BRANCHES}; on a command line quote each one, e.g. "
              "--config.model.nsa.branches=\"('cmp','slc')\"")
    if len(set(self.branches)) != len(self.branches):
      _fail("branches", self.branches, "repeats a branch", "list each branch once")

  @property
  def dim_v(self) -> int:
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def cmp_hidden_dim(self) -> int:
    return 2 * self.head_dim if self.cmp_hidden is None else self.cmp_hidden

  def num_cmp_blocks(self, seq_len: int) -> int:
    """Compressed blocks for a sequence: block i covers [i*d, i*d + l)."""
    return num_cmp_blocks(seq_len, self.cmp_block, self.cmp_stride)

  def num_sel_blocks(self, seq_len: int) -> int:
    return -(-seq_len // self.sel_block)


def num_cmp_blocks(seq_len: int, block: int, stride: int) -> int:
  return 0 if seq_len < block else (seq_len - block) // stride + 1


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer LM (RMSNorm, SwiGLU, RoPE) with NSA or dense attention per layer.

  Attributes:
    vocab_size: token vocabulary (256 for the byte-level default data).
    d_model: residual width.
    n_layers: transformer blocks.
    n_heads / n_kv_heads / head_dim / head_dim_v: attention heads (GQA when n_kv_heads < n_heads).
    ffn_dim: SwiGLU hidden width.
    max_seq_len: longest sequence the model is built for (RoPE tables, caches).
    attention: "nsa" or "dense" for every layer, unless layer_attention lists one kind per layer.
    layer_attention: optional per-layer kinds, e.g. ("dense", "nsa", "nsa").
    nsa: NSA block settings (its head fields are overwritten from this config).
    rope_theta: RoPE base.
    dtype / param_dtype: compute and parameter dtypes ("bfloat16", "float32").
    tie_embeddings: share the input embedding with the output projection.
    remat: rematerialise each block in the backward pass.
    layer_loop: how the layers are traced. "unrolled" (default): each stretch of consecutive
      same-kind layers is one jax.lax.scan over their stacked parameters, fully unrolled, so the
      layer (and every Pallas kernel in it) is traced and lowered once, and XLA still gets the
      straight-line program of a Python loop. "scan": the same scan left rolled (a while loop:
      the smallest program, but its steps measured 20-28% longer on the H200). "python": a Python
      loop over the layers (traces every layer). All three are the same math with the same
      parameter layout (one entry per layer: checkpoints, decoding, sharding rules unchanged).
      Measured on one H200 (benchmarks/results/compile_time_h200.md, docs/TRAINING.md,
      "Start-up"): NSA's 8k step traced + lowered in 4.8 s instead of 28-32 s and compiled in
      30 s instead of 49-60 s, at the same step time.
    selection_from_layer: None (the paper's NSA: every NSA layer selects its own blocks from its
      own compression scores), or the index L of an NSA layer whose block selection every later
      NSA layer reuses instead of selecting its own (cross-layer sharing, NOT in the paper; a
      research option for the needle diagnosis in docs/RESULTS.md §5: there the last layer's own
      selection missed the key while layer 1's held it). The later layers still run their
      compression branch (its output is gated in) but skip their top-n. The layers then run in a
      Python loop (the selection is carried from layer to layer). Not with selector="aux" (each
      layer's gate is trained on its own attention) and not in cached decoding (not written).
    dense_implementation: dense layers' attention (nsa_jax.ops.dense_attention): "auto" (GPU:
      cuDNN's causal flash call; with document masking cuDNN's packed layout where a document cap
      is set (nsa_jax/cudnn_packed.py; the training loop sets it from data.cudnn_packed_cap),
      else the Pallas Triton kernels, which take the segment ids in O(T) memory; elsewhere XLA),
      or "cudnn" (with segment ids: an explicit [B, 1, T, T] mask), "pallas", "xla",
      "reference". How, not what: the same math.
  """

  vocab_size: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 8
  n_kv_heads: int = 2
  head_dim: int = 32
  head_dim_v: int | None = None
  ffn_dim: int = 768
  max_seq_len: int = 1024
  attention: Literal["nsa", "dense"] = "nsa"
  layer_attention: tuple[str, ...] | None = None
  nsa: NSAConfig = dataclasses.field(default_factory=lambda: NSAConfig(
      num_heads=8, num_kv_heads=2, head_dim=32, head_dim_v=None, cmp_block=16, cmp_stride=8,
      sel_block=32, num_selected=4, window=64))
  rope_theta: float = 10000.0
  dtype: str = "float32"
  param_dtype: str = "float32"
  tie_embeddings: bool = False
  remat: bool = False
  layer_loop: Literal["unrolled", "scan", "python"] = "unrolled"
  selection_from_layer: int | None = None
  dense_implementation: Literal["auto", "cudnn", "pallas", "xla", "reference"] = "auto"

  def __post_init__(self):
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
              "max_seq_len"):
      _check_positive(f, getattr(self, f))
    if self.n_heads % self.n_kv_heads:
      _fail("n_heads", self.n_heads, f"not divisible by n_kv_heads={self.n_kv_heads}",
            "choose n_heads as a multiple of n_kv_heads")
    if self.head_dim % 2:
      _fail("head_dim", self.head_dim, "must be even for RoPE", "use an even head_dim")
    _check_choice("attention", self.attention, ATTENTION_KINDS)
    _check_choice("layer_loop", self.layer_loop, LAYER_LOOPS)
    _check_choice("dense_implementation", self.dense_implementation, DENSE_IMPLEMENTATIONS)
    if self.layer_attention is not None:
      if len(self.layer_attention) != self.n_layers:
        _fail("layer_attention", self.layer_attention,
              f"has {len(self.layer_attention)} entries for n_layers={self.n_layers}",
              "give one kind per layer or set layer_attention=None")
      for kind in self.layer_attention:
        _check_choice("layer_attention", kind, ATTENTION_KINDS)
    for f in ("dtype", "param_dtype"):
      _check_choice(f, getattr(self, f), ("float32", "bfloat16", "float16"))
    self._check_selection_from_layer()
    # One source of truth for head layout: the NSA config follows the model's.
    object.__setattr__(self, "nsa", dataclasses.replace(
        self.nsa, num_heads=self.n_heads, num_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
        head_dim_v=self.head_dim_v))

  def _check_selection_from_layer(self):
    src = self.selection_from_layer
    if src is None:
      return
    kinds = self.attention_kinds
    nsa = [i for i, k in enumerate(kinds) if k == "nsa"]
    if isinstance(src, bool) or not isinstance(src, int) or src not in nsa:
      _fail("selection_from_layer", src, f"is not the index of an NSA layer (NSA layers: {nsa})",
            "give an NSA layer's index, or None for the paper's per-layer selection")
    if not any(i > src for i in nsa):
      _fail("selection_from_layer", src, "has no later NSA layer to reuse its selection",
            f"give an earlier NSA layer (among {nsa[:-1]}) or None" if len(nsa) > 1 else
            "set it to None (the model has one NSA layer, so there is nothing to share)")
    if "slc" not in self.nsa.branches:
      _fail("selection_from_layer", src, f"needs the selection branch (nsa.branches="
            f"{self.nsa.branches!r})", "set it to None or add 'slc' to nsa.branches")
    if self.nsa.selector == "aux":
      _fail("selection_from_layer", src, "does not combine with nsa.selector='aux' (each "
            "layer's gate is trained against that layer's own attention)",
            "set it to None or use selector='nsa' / 'quest'")

  @property
  def attention_kinds(self) -> tuple[str, ...]:
    return self.layer_attention or (self.attention,) * self.n_layers

  @property
  def uses_aux_selector(self) -> bool:
    """Some layer is NSA with the auxiliary-loss selector (training adds its loss)."""
    return "nsa" in self.attention_kinds and self.nsa.selector == "aux"
