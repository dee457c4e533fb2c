"""Decoder-only transformer LM (pre-norm RMSNorm, SwiGLU, RoPE) with NSA or dense attention per
layer, chosen by `ModelConfig.attention` / `layer_attention`."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nsa_jax.attention import DenseAttention, NSAAttention
from nsa_jax.config import ModelConfig
from nsa_jax.reference import host_segment_runs
from nsa_jax.layers import (RMSNorm, SwiGLU, annotated, constrain_rows, dtype_of, linear,
                            sharding_scope)


class Block(nnx.Module):
  """x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs):
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    self.kind = kind
    self.attn_norm = RMSNorm(cfg.d_model, dtype=dt, param_dtype=pdt)
    if kind == "nsa":
      self.attn = NSAAttention(cfg.d_model, cfg.nsa, rope_theta=cfg.rope_theta, dtype=dt,
                               param_dtype=pdt, rngs=rngs)
    else:
      self.attn = DenseAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                 cfg.head_dim_v, rope_theta=cfg.rope_theta, dtype=dt,
                                 param_dtype=pdt, implementation=cfg.dense_implementation,
                                 rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, dtype=dt, param_dtype=pdt)
    self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim, dtype=dt, param_dtype=pdt, rngs=rngs)

  def __call__(self, x, segment_ids=None, positions=None, return_aux=False,
               return_selector_loss=False, select_edit=None, block_idx=None):
    """x -> x; with return_aux also aux (a dict), with return_selector_loss also the selector
    loss [B, T] (training with selector="aux"; None for a dense layer): x, aux, loss in that
    order, each present only when asked. select_edit / block_idx: an NSA layer's intervention
    on its selection / blocks chosen elsewhere (NSAAttention)."""
    with jax.named_scope("attn_norm"):
      h = self.attn_norm(x)
    aux = sel = None
    sel_kw = {n: v for n, v in (("select_edit", select_edit), ("block_idx", block_idx))
              if v is not None}
    if sel_kw and self.kind != "nsa":
      raise ValueError(f"{' and '.join(sel_kw)} {'were' if len(sel_kw) > 1 else 'was'} given for "
                       "a dense layer, which selects no blocks. Fix: give it only for NSA layers.")
    if self.kind == "nsa" and (return_aux or return_selector_loss):
      y, *extra = self.attn(h, segment_ids=segment_ids, positions=positions,
                            return_aux=return_aux, return_selector_loss=return_selector_loss,
                            **sel_kw)
      if return_aux:
        aux = {k: extra[0][k] for k in ("block_idx", "gates", "q", "k_slc") if k in extra[0]}
      if return_selector_loss:
        sel = extra[-1]
    elif return_aux:  # a dense layer: its q and k after RoPE (diagnostics)
      y, aux = self.attn(h, segment_ids=segment_ids, positions=positions, return_aux=True)
    else:
      y = self.attn(h, segment_ids=segment_ids, positions=positions, **sel_kw)
    x = constrain_rows(x + y)
    with jax.named_scope("mlp"):
      x = constrain_rows(x + self.mlp(self.mlp_norm(x)))
    out = (x,) + ((aux,) if return_aux else ()) + ((sel,) if return_selector_loss else ())
    return out if len(out) > 1 else x


def check_token_ids(tokens, vocab_size: int):
  """Token ids must be integers in [0, vocab_size): the one-hot embedding would give a zero row
  for an id outside it, and a float id would be truncated, both silently. The range is checked
  where the ids are concrete (eager calls, decode.prefill / decode_step, experiments.generate's
  prompt); under jit nothing can raise, and the training data pipeline refuses such ids."""
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integer ids, got dtype {tokens.dtype}. Fix: cast them to "
                     "int32 (e.g. tokens.astype(jnp.int32)).")
  if (isinstance(tokens, jax.core.Tracer) or tokens.size == 0
      or not getattr(tokens, "is_fully_addressable", True)):  # another process holds some ids
    return
  host = np.asarray(tokens)  # on the host: a concrete array closed over by a trace stays concrete
  lo, hi = int(host.min()), int(host.max())
  if lo < 0 or hi >= vocab_size:
    raise ValueError(f"token ids span [{lo}, {hi}] but vocab_size={vocab_size} allows "
                     f"[0, {vocab_size - 1}]. Fix: tokenize with the model's vocabulary or raise "
                     "model.vocab_size.")


# Vocabularies up to this size are embedded as one_hot(tokens) @ table instead of a gather. The
# gather's gradient is a scatter-add of B*T rows into `vocab` rows; with the 256-token byte
# vocabulary every row takes ~256 colliding atomic adds. On the H200 that one scatter took 67 ms
# of the 274 ms 8k training step (8 x 8192 tokens; `h200_runs.sh prof8k`, 2026-11-30), where the
# one-hot matmul and its transpose are ~50 GFLOP. The forward values are the same (one nonzero
# term per row). Above the limit the one-hot tensor [B, T, vocab] would cost more than it saves.
ONE_HOT_EMBED_MAX_VOCAB = 1024


def check_select_edits(select_edits, cfg: ModelConfig, return_selector_loss: bool):
  """select_edits: {layer index: NSAAttention select_edit} for NSA layers, evaluation only."""
  if return_selector_loss:
    raise ValueError("select_edits is an evaluation intervention; it does not combine with "
                     "return_selector_loss (training). Fix: drop one of them.")
  kinds = cfg.attention_kinds
  for i in select_edits:
    if not isinstance(i, int) or not 0 <= i < len(kinds) or kinds[i] != "nsa":
      nsa = [j for j, k in enumerate(kinds) if k == "nsa"]
      raise ValueError(f"select_edits has key {i!r}, which is not an NSA layer of this model. "
                       f"Fix: use layer indices among {nsa}.")


class TransformerLM(nnx.Module):
  """tokens [B, T] int -> logits [B, T, vocab] float32.

  With return_aux=True also returns one entry per layer: for NSA layers a dict with the selected
  blocks "block_idx" [B, T, K, n], the gates "gates" [B, T, H, 3], and the queries "q" [B, T, H,
  d_k] and selection keys "k_slc" [B, T, K, d_k] after RoPE; for dense layers a dict with "q" and
  "k" after RoPE (q and keys are for diagnostics; unused outputs cost nothing under jit).
  With return_selector_loss=True also returns the "aux" selector's loss per token [B, T], the
  mean over NSA layers (zeros when no layer uses selector="aux").
  select_edits (evaluation interventions): {NSA layer index: NSAAttention's select_edit, a
  function block_idx -> block_idx}; the layers then run one by one. With
  cfg.selection_from_layer, an edit of the source layer reaches every layer reusing its
  selection (they read the edited blocks), and an edit of a reusing layer edits what it reuses.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if not isinstance(cfg, ModelConfig):
      raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    self.cfg = cfg
    if cfg.selection_from_layer is not None:  # a variant: say so in every run's log
      src = cfg.selection_from_layer
      later = [i for i, k in enumerate(cfg.attention_kinds) if k == "nsa" and i > src]
      logging.getLogger("nsa_jax").info(
          f"selection_from_layer={src}: NSA layers {later} reuse layer {src}'s block selection "
          "(cross-layer sharing, not the paper's per-layer selection)")
    dt, pdt = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
    with sharding_scope():
      self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                             embedding_init=annotated(nnx.initializers.normal(1.0), "vocab",
                                                      "embed"), rngs=rngs)
      self.blocks = nnx.List([Block(cfg, kind, rngs=rngs) for kind in cfg.attention_kinds])
      self.final_norm = RMSNorm(cfg.d_model, dtype=dt, param_dtype=pdt)
      if not cfg.tie_embeddings:
        self.lm_head = linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), dtype=dt,
                              param_dtype=pdt, rngs=rngs)

  def embed_tokens(self, tokens):
    """tokens [B, T] int -> [B, T, d_model]: the embedding rows, as a one-hot matmul for small
    vocabularies (ONE_HOT_EMBED_MAX_VOCAB: its gradient is a matmul, not a colliding scatter).
    Equal to the gather (`self.embed`, which decoding uses) for ids in [0, vocab_size); ids
    outside give zero rows here and NaN / wrapped rows from the gather. The data pipeline
    refuses such ids (nsa_jax/training/data.py)."""
    if self.cfg.vocab_size > ONE_HOT_EMBED_MAX_VOCAB:
      return self.embed(tokens)
    dt = dtype_of(self.cfg.dtype)
    table = self.embed.embedding[...].astype(dt)
    # int32 first: one_hot compares in the tokens' dtype, where uint8 ids would wrap past 255
    one_hot = jax.nn.one_hot(tokens.astype(jnp.int32), self.cfg.vocab_size, dtype=dt)
    return jnp.einsum("btv,vd->btd", one_hot, table, precision=jax.lax.Precision.HIGHEST)

  def _scan_blocks(self, x, segment_ids, positions, return_selector_loss):
    """The blocks as jax.lax.scan over each stretch of consecutive same-kind layers
    (cfg.layer_loop "unrolled" or "scan"): the stretch's parameters are stacked along a new
    leading axis (the stack's transpose hands each layer its own gradient; unrolled, XLA reads
    the slices in place), and one traced layer runs over them. Returns (x, [selector loss per
    NSA layer])."""
    sel_losses, blocks, i = [], list(self.blocks), 0
    while i < len(blocks):
      j = i
      while j < len(blocks) and blocks[j].kind == blocks[i].kind:
        j += 1
      graphdef, states = None, []
      for k in range(i, j):
        g, params, other = nnx.split(blocks[k], nnx.Param, ...)
        if graphdef is not None and g != graphdef:
          raise ValueError(f"layer_loop={self.cfg.layer_loop!r}: layers {i} and {k} "
                           "have different structures and cannot share one scanned layer. Fix: "
                           "build same-kind layers identically or set model.layer_loop='python'.")
        if jax.tree.leaves(other):
          # The scan rebuilds each layer from its parameters; anything else a layer holds (and
          # might update in its forward) would be dropped without a word.
          raise ValueError(f"layer_loop={self.cfg.layer_loop!r} supports layers whose only state "
                           "is nnx.Param; these layers also hold " + ", ".join(sorted(
                               {type(v).__name__ for v in jax.tree.leaves(
                                   other, is_leaf=lambda x: isinstance(x, nnx.Variable))})) +
                           ". Fix: set model.layer_loop='python'.")
        graphdef = g
        states.append(params)
      stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
      nsa = blocks[i].kind == "nsa"

      def body(h, state, graphdef=graphdef, nsa=nsa):
        out = nnx.merge(graphdef, state)(h, segment_ids, positions,
                                         return_selector_loss=return_selector_loss)
        if not return_selector_loss:
          return out, None
        h, sel = out
        return h, (sel if nsa else None)

      if self.cfg.remat:
        body = jax.checkpoint(body)
      x, sels = jax.lax.scan(body, x, stacked,
                             unroll=True if self.cfg.layer_loop == "unrolled" else 1)
      if return_selector_loss and sels is not None:
        sel_losses.extend(sels)  # one [B, T] per layer of the stretch
      i = j
    return x, sel_losses

  @property
  def uses_aux_selector(self) -> bool:
    return self.cfg.uses_aux_selector

  def __call__(self, tokens, segment_ids=None, positions=None, return_aux=False,
               return_selector_loss=False, select_edits=None):
    if select_edits:
      check_select_edits(select_edits, self.cfg, return_selector_loss)
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    check_token_ids(tokens, self.cfg.vocab_size)
    segment_ids = host_segment_runs(segment_ids, tokens.shape)  # checked; host ids as runs
    if tokens.shape[1] > self.cfg.max_seq_len:
      raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len="
                       f"{self.cfg.max_seq_len}. Fix: raise model.max_seq_len or shorten the input.")
    with jax.named_scope("embed"):
      x = constrain_rows(self.embed_tokens(tokens))
    auxes, sel_losses = [], []
    edits = select_edits or {}
    want_aux = return_aux and not return_selector_loss
    source = self.cfg.selection_from_layer  # later NSA layers reuse this layer's selection

    def layer_fn(i):
      """block, x, blocks chosen elsewhere (or None) -> (x, aux or None, this layer's
      selection when later layers reuse it or None, selector loss or None). The edit is bound
      here, not passed: jax.checkpoint (remat) takes array arguments only."""
      with_aux = want_aux or i == source

      def run(blk, y, idx):
        out = blk(y, segment_ids, positions, return_aux=with_aux,
                  return_selector_loss=return_selector_loss, select_edit=edits.get(i),
                  block_idx=idx)
        y, *rest = out if (with_aux or return_selector_loss) else (out,)
        aux = rest.pop(0) if with_aux else None
        return (y, aux if want_aux else None, aux["block_idx"] if i == source else None,
                rest[0] if return_selector_loss else None)
      return run

    # return_aux (visualisation), select_edits (interventions) and selection_from_layer (the
    # selection carried from layer to layer) walk the layers one by one
    scan = (self.cfg.layer_loop != "python" and not want_aux and not edits and source is None)
    if scan:
      x, sel_losses = self._scan_blocks(x, segment_ids, positions, return_selector_loss)
    shared = None
    for i, block in enumerate(() if scan else self.blocks):
      given = shared if block.kind == "nsa" else None  # None until the source layer has run
      run = layer_fn(i)
      x, aux, idx, sel = (nnx.remat(run)(block, x, given) if self.cfg.remat and not want_aux
                          else run(block, x, given))
      if want_aux:
        auxes.append(aux)
      if idx is not None:
        shared = idx
      if sel is not None:
        sel_losses.append(sel)
    with jax.named_scope("lm_head"):
      x = self.final_norm(x)
      if self.cfg.tie_embeddings:
        logits = self.embed.attend(x)
      else:
        logits = self.lm_head(x)
      logits = logits.astype(jnp.float32)
    if return_selector_loss:
      sel = (sum(sel_losses) / len(sel_losses) if sel_losses
             else jnp.zeros(tokens.shape, jnp.float32))
      return logits, sel
    return (logits, auxes) if return_aux else logits
