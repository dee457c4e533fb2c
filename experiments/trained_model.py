"""Adapters over the training library for the evaluation scripts: load a trained model from a work
directory, and run it while keeping each NSA layer's auxiliary outputs (chosen blocks, gates).

The training library has no such hooks yet (see the experiments helper's report); these functions
use only its public pieces: config.json, build_setup, Checkpointer and TransformerLM's modules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
from flax import nnx
from ml_collections import ConfigDict


def resolve_workdir(spec: str) -> tuple[str, str, int | None]:
  """A workdir path, or 'SWEEP_OUT_DIR:RUN' looked up in that sweep's results.jsonl, either with an
  optional '@STEP' (that checkpoint instead of the newest) -> (dir, label, step or None). The
  label carries the '@STEP'."""
  m = re.fullmatch(r"(.+)@(\d+)", spec)
  if m and not os.path.isdir(spec):
    workdir, label, _ = resolve_workdir(m.group(1))
    return workdir, f"{label}@{m.group(2)}", int(m.group(2))
  if ":" in spec and not os.path.isdir(spec):
    out_dir, run = spec.rsplit(":", 1)
    path = os.path.join(out_dir, "results.jsonl")
    found = None
    with open(path) as f:
      for line in f:
        rec = json.loads(line)
        if rec["run"] == run:
          found = rec["workdir"]
    if found is None:
      raise ValueError(f"run {run!r} not in {path}. Fix: train it with experiments/ablate.py first")
    return found, run, None
  return spec, os.path.basename(os.path.normpath(spec)), None


def load_config(workdir: str) -> ConfigDict:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: is {workdir!r} a training work directory?")
  with open(path) as f:
    return ConfigDict(json.load(f))


def load_model(workdir: str, max_seq_len: int | None = None, step: int | None = None):
  """(TransformerLM with the newest checkpoint's weights, or step's, run config, ModelConfig).

  max_seq_len: build the model for longer inputs than it was trained on. RoPE is computed on the
  fly, so no parameter depends on it; the weights are restored with the trained config (the
  checkpoint's model check needs it) and merged into a graph built for the longer length.
  """
  from nsa_jax.model import TransformerLM
  from nsa_jax.training import sharding as shd
  from nsa_jax.training.checkpointing import Checkpointer
  from nsa_jax.training.train import MODEL_DEFAULTS, RESUMABLE_MODEL_FIELDS, build_setup

  config = load_config(workdir)
  mesh = shd.make_mesh(config.mesh)
  setup = build_setup(config, mesh)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
  try:
    if step is None:
      step = ckpt.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints: train the run first")
    else:
      ckpt.require_step(step)  # names the saved steps when this one is not among them
    with jax.set_mesh(mesh):
      # How-to-compute fields may differ (e.g. layer_loop, added after older runs were saved)
      state, _ = ckpt.restore(step, setup.abstract_state,
                              {"model": dataclasses.asdict(setup.model_cfg)},
                              ignore=RESUMABLE_MODEL_FIELDS, defaults=MODEL_DEFAULTS)
  finally:
    ckpt.close()
  model_cfg = setup.model_cfg
  if max_seq_len and max_seq_len != model_cfg.max_seq_len:
    model_cfg = dataclasses.replace(model_cfg, max_seq_len=max_seq_len)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0))))
  params = jax.device_get(state["params"])
  rest = jax.device_get(state["rest"])
  return nnx.merge(graphdef, params, rest), config, model_cfg


def forward_with_aux(model, tokens, segment_ids=None):
  """TransformerLM forward that also returns, per layer, NSA's aux dict (None for dense layers)."""
  return model(tokens, segment_ids=segment_ids, return_aux=True)


def jit_logits(model):
  """(tokens [B, T], optional segment_ids [B, T]) -> float32 logits [B, T, V], jitted (one compile
  per shape)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens, segment_ids):
    return nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids)

  return lambda tokens, segment_ids=None: run(state, tokens, segment_ids)


def jit_logits_and_blocks(model, edit_layers=(), edit=None):
  """tokens [B, T] -> (float32 logits [B, T, V], per layer: for an NSA layer {"block_idx": [B, T,
  K, n], "gates": [B, T, H, 3], "q": [B, T, H, d_k], "k_slc": [B, T, K, d_k]}, for a dense layer
  {"q", "k"}; q and keys after RoPE: TransformerLM's aux output, which already leaves the branch
  outputs out), jitted.

  With edit_layers (NSA layer indices) and edit(block_idx, extra) -> block_idx, the function is
  (tokens, extra) -> the same, where those layers' selections are edited (TransformerLM's
  select_edits; extra: arrays the edit reads, e.g. per-row positions) and "block_idx" is the
  edited selection."""
  graphdef, state = nnx.split(model)
  if bool(edit_layers) != (edit is not None):
    raise ValueError("jit_logits_and_blocks: edit_layers and edit go together. Fix: give both "
                     "or neither.")

  @jax.jit
  def run(state, tokens, extra):
    edits = {i: lambda idx: edit(idx, extra) for i in edit_layers} or None
    return nnx.merge(graphdef, state)(tokens, return_aux=True, select_edits=edits)

  if edit_layers:
    return lambda tokens, extra: run(state, tokens, extra)
  return lambda tokens: run(state, tokens, None)


def val_batches(config, num_batches: int) -> list[dict]:
  """The run's own validation batches (same source, seed and length as its training; with its
  segment ids when it trained with data.document_mask)."""
  from nsa_jax.training import data as data_lib
  src = data_lib.make_sources(config.data)["val"]
  it = data_lib.BatchIterator(src, split="val", global_batch=config.data.global_batch_size,
                              seq_len=config.data.seq_len, seed=config.data.seed,
                              vocab_size=config.model.vocab_size,
                              eos_id=data_lib.document_end_id(config.data))
  return [it.batch(i) for i in range(num_batches)]
