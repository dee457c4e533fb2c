"""Training library: typed configs, sharded state, jitted train/eval steps and the training loop.

The loop in `train_and_evaluate` is the only stateful part; everything it calls is a function of
its arguments. Train state is a plain dict {"step", "params", "opt_state", "rest"} of global
jax.Arrays laid out by the mesh rules (see sharding.py), created sharded and never gathered.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax._src import config as jax_config  # threefry_gpu_kernel_lowering: no public context manager

from nsa_jax import cudnn_packed, ops
from nsa_jax.config import ModelConfig, NSAConfig
from nsa_jax.training import data as data_lib
from nsa_jax.training import metrics as metrics_lib
from nsa_jax.training import sharding as shd
from nsa_jax.training.checkpointing import (Checkpointer, CheckpointError, abstract_like,
                                            config_diff)
from nsa_jax.training.optim import make_optimizer

log = logging.getLogger("nsa_jax.training")


# Model fields that say how to compute, not what is learned: a run may resume with them changed
# (e.g. turn on remat after an OOM, or switch the NSA implementation). Array shapes are still
# checked by the restore itself.
RESUMABLE_MODEL_FIELDS = ("remat", "layer_loop", "dtype", "max_seq_len", "nsa.implementation", "nsa.query_chunk",
                          "dense_implementation")
# A warm start (config.checkpoint.init_from) may also change what NSA attends to with the same
# parameters: n and w (e.g. a curriculum whose short first stage selects fewer blocks).
WARM_START_FREE_FIELDS = RESUMABLE_MODEL_FIELDS + ("nsa.num_selected", "nsa.window")
# A model field added after a checkpoint was written (e.g. selection_from_layer) is absent from its
# metadata; it matches while the config leaves it at this default, which keeps the old behaviour.
MODEL_DEFAULTS = dataclasses.asdict(ModelConfig())


class NonFiniteError(FloatingPointError):
  """Loss or gradient norm became NaN/Inf; the message names the step and the last good checkpoint."""


# ----------------------------------------------------------------------------- configs ---------

def _typed(cls, fields: dict, where: str):
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {unknown}. Valid fields: {sorted(known)}")
  # ml_collections turns tuples from the command line into lists; the dataclasses want tuples.
  return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def model_config_from(cfg_model) -> ModelConfig:
  """config.model (ConfigDict) -> validated ModelConfig; unknown keys are errors, not ignored."""
  fields = dict(cfg_model.to_dict() if hasattr(cfg_model, "to_dict") else cfg_model)
  nsa = _typed(NSAConfig, dict(fields.pop("nsa", {})), "config.model.nsa")
  return _typed(ModelConfig, {**fields, "nsa": nsa}, "config.model")


def initialize_distributed(mode: str = "auto", **kwargs) -> None:
  """jax.distributed.initialize() when launched multi-process (mode: auto | yes | no).

  auto: only when a launcher says there are several processes (SLURM, Open MPI, or an explicit
  coordinator address), so a plain single-process run never waits for a coordinator.
  """
  env = os.environ
  launched = (int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
              or "JAX_COORDINATOR_ADDRESS" in env or kwargs.get("coordinator_address"))
  if mode == "yes" or (mode == "auto" and launched):
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if v is not None})


# ----------------------------------------------------------------------------- state -----------

@dataclasses.dataclass
class Setup:
  """Everything static about a run: mesh, model graph, optimizer and the state's layout."""
  mesh: jax.sharding.Mesh
  model_cfg: ModelConfig
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  state_shardings: dict
  abstract_state: dict
  batch_shardings: dict
  init_fn: Callable[[], dict]
  num_params: int
  matmul_params: float  # applied per token (see metrics.count_params)


def default_model_factory(model_cfg, rngs):
  from nsa_jax.model import TransformerLM  # imported late: training is testable without it
  return TransformerLM(model_cfg, rngs=rngs)


def build_setup(config, mesh, model_factory=None) -> Setup:
  """Abstract model -> logical shardings -> jitted, sharded initialiser (nothing allocated yet)."""
  model_cfg = model_config_from(config.model)
  factory = model_factory or default_model_factory
  seed = int(config.train.seed)

  def make_model():
    # Eager sharding off: layouts come from our rules table via jit out_shardings, in one place.
    with nnx.use_eager_sharding(False):
      return factory(model_cfg, nnx.Rngs(params=seed))

  abstract_model = nnx.eval_shape(make_model)
  graphdef, abs_params, abs_rest = nnx.split(abstract_model, nnx.Param, ...)
  specs = shd.param_specs(abs_params, config.mesh.rules, mesh)
  tx, schedule = make_optimizer(config.optim, config.train.num_steps)

  def init_fn():
    _, params, rest = nnx.split(make_model(), nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
            "rest": nnx.to_pure_dict(rest)}

  abstract = jax.eval_shape(init_fn)
  replicated = shd.replicated(mesh)
  params_sh = shd.named(mesh, specs)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract["opt_state"], params_sh,
                                 transform_non_params=lambda _: replicated)
  state_sh = {"step": replicated, "params": params_sh, "opt_state": opt_sh,
              "rest": jax.tree.map(lambda _: replicated, abstract["rest"])}
  lookup = 0 if model_cfg.tie_embeddings else sum(
      int(np.prod(v.shape)) for v in jax.tree.leaves(abs_params, is_leaf=_is_var)
      if (v.get_metadata().get("out_sharding") or (None,))[0] == "vocab")
  total, mats = metrics_lib.count_params(abstract["params"], model_cfg, lookup)
  bs = shd.batch_sharding(mesh)
  return Setup(mesh=mesh, model_cfg=model_cfg, graphdef=graphdef, tx=tx, schedule=schedule,
               state_shardings=state_sh, abstract_state=abstract_like(abstract, state_sh),
               batch_shardings={"inputs": bs, "targets": bs, "weights": bs, "segment_ids": bs},
               init_fn=init_fn, num_params=total, matmul_params=mats)


def _is_var(x):
  return isinstance(x, nnx.Variable)


def create_train_state(setup: Setup) -> dict:
  """Initialises parameters and optimizer state directly in their shards.

  On a GPU the random initialisers' threefry hashes are lowered to JAX's threefry kernel
  (jax_threefry_gpu_kernel_lowering: the same bits) instead of XLA's unrolled rounds, a large
  fusion per parameter that XLA then compiles one by one; see docs/TRAINING.md, "Start-up"."""
  init = jax.jit(setup.init_fn, out_shardings=setup.state_shardings)
  if jax.default_backend() != "gpu" or os.environ.get("NSA_JAX_THREEFRY_KERNEL", "1") == "0":
    return init()
  with jax_config.threefry_gpu_kernel_lowering(True):
    return init()


# ----------------------------------------------------------------------------- steps -----------

def _loss_sums(graphdef, params, rest, batch, with_selector=True):
  """(objective sum, (sum of weights, weighted count of correct argmax, sum of weighted token NLL,
  weighted selector-loss sum)). The objective is the NLL sum plus, for a model with the "aux"
  block selector, aux_loss_weight x its selector loss (nsa_jax.aux_selector); otherwise (and with
  with_selector=False, as evaluation uses: the selector's full-attention target is skipped) the
  two are equal and the selector sum is 0."""
  model = nnx.merge(graphdef, params, rest)
  w = batch["weights"]
  seg = batch.get("segment_ids")  # document masking (config.data.document_mask)
  if with_selector and getattr(model, "uses_aux_selector", False):
    logits, sel = model(batch["inputs"], segment_ids=seg, return_selector_loss=True)
    sel_sum = jnp.sum(sel * w)
    extra = model.cfg.nsa.aux_loss_weight * sel_sum
  else:
    logits, sel_sum, extra = model(batch["inputs"], segment_ids=seg), jnp.zeros(()), 0.0
  with jax.named_scope("loss"):
    logits = logits.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    nll_sum = jnp.sum(nll * w)
  return nll_sum + extra, (jnp.sum(w), jnp.sum(correct * w), nll_sum, sel_sum)


def _rows(setup: Setup):
  """The batch's sharding as a pytree prefix: every batch array ([B, T] rows: inputs, targets,
  weights and, with document masking, segment_ids) is split the same way over (data, fsdp)."""
  return setup.batch_shardings["inputs"]


def make_train_step(setup: Setup, grad_accum_steps: int = 1):
  """Jitted (state, batch) -> (state, metrics); the state buffers are donated."""
  grad_fn = jax.value_and_grad(_loss_sums, argnums=1, has_aux=True)
  params_sh = setup.state_shardings["params"]

  def grads_of(params, rest, batch):
    if grad_accum_steps == 1:
      return grad_fn(setup.graphdef, params, rest, batch)
    # Row b goes to microbatch b % A, so each device's contiguous shard of rows splits evenly.
    micro = jax.tree.map(lambda x: jnp.swapaxes(
        x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:]), 0, 1), batch)

    def body(carry, mb):
      (loss, aux), g = grad_fn(setup.graphdef, params, rest, mb)
      acc = jax.tree.map(jnp.add, carry, ((loss, aux), g))
      return jax.lax.with_sharding_constraint(acc, (None, params_sh)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = ((jnp.zeros(()), (jnp.zeros(()),) * 4), zeros)
    acc, _ = jax.lax.scan(body, jax.lax.with_sharding_constraint(init, (None, params_sh)), micro)
    return acc

  def step(state, batch):
    (_, (wsum, correct, nll_sum, sel_sum)), grads = grads_of(state["params"], state["rest"], batch)
    denom = jnp.maximum(wsum, 1.0)  # sums -> means over weighted tokens, as one big batch would
    with jax.named_scope("optimizer"):
      grads = jax.tree.map(lambda g: g / denom, grads)
      updates, opt_state = setup.tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
    new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rest": state["rest"]}
    # param_norm lets the NaN guard catch an update that broke the weights while the loss and
    # gradients it was computed from were still finite.
    # "loss" is the language-model NLL alone, comparable across selectors and with dense models.
    metrics = {"loss": nll_sum / denom, "accuracy": correct / denom,
               "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(params),
               "lr": setup.schedule(state["step"])}
    if setup.model_cfg.uses_aux_selector:
      metrics["selector_loss"] = sel_sum / denom
    return new, metrics

  return jax.jit(step, in_shardings=(setup.state_shardings, _rows(setup)),
                 out_shardings=(setup.state_shardings, shd.replicated(setup.mesh)),
                 donate_argnums=(0,))


def make_eval_step(setup: Setup):
  """Jitted (state, batch) -> sums {nll, weight, correct} (summed over batches by the caller)."""
  def step(state, batch):
    _, (w, correct, nll, _) = _loss_sums(setup.graphdef, state["params"], state["rest"], batch,
                                         with_selector=False)
    return {"nll": nll, "weight": w, "correct": correct}
  return jax.jit(step, in_shardings=(setup.state_shardings, _rows(setup)),
                 out_shardings=shd.replicated(setup.mesh))


def to_global(batch: dict, setup: Setup) -> dict:
  """This process's numpy rows -> global jax.Arrays sharded over (data, fsdp)."""
  return {k: jax.make_array_from_process_local_data(setup.batch_shardings[k], v)
          for k, v in batch.items()}


def to_host(tree):
  """Replicated global arrays -> numpy, on any process (device_get needs fully addressable arrays,
  which replicated arrays are not once several processes share the mesh)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def evaluate(eval_step, state, batches, setup) -> dict:
  sums = None
  for b in batches:
    out = eval_step(state, to_global(b, setup))
    sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
  sums = to_host(sums)
  loss = float(sums["nll"] / max(sums["weight"], 1.0))
  return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)),
          "accuracy": float(sums["correct"] / max(sums["weight"], 1.0))}


# ----------------------------------------------------------------------------- loop ------------

class _StopFlag:
  """Set by SIGTERM (preemption); processes agree on it so all of them save the same step."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    try:
      self._old = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread: no handler, the run simply cannot be preempted
      self._old = None
    return self

  def _handle(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)

  def agreed(self, timed_out: bool = False) -> tuple[bool, bool]:
    """(stop, time limit reached) as every process sees them. Both flags are voted on together:
    clocks differ between processes, and a process that stopped for the time limit runs a
    validation pass (a collective) that the others must join."""
    code = int(self.requested) | int(timed_out) << 1
    if jax.process_count() > 1:
      code = int(multihost_utils.process_allgather(np.int32(code)).max())
    return code != 0, bool(code & 2)


def _compile_and_report(train_step, state, batch, workdir, seq_len, is_main):
  """Compiles the step ahead of time and writes the collectives it contains (collectives.json)."""
  from nsa_jax.training import hlo_report
  compiled = train_step.lower(state, batch).compile()
  records = hlo_report.collectives(compiled.as_text())
  summary = hlo_report.summarize(records, seq_len)
  if is_main:
    with open(os.path.join(workdir, "collectives.json"), "w") as f:
      json.dump({"summary": summary, "collectives": records}, f, indent=1)
  log.info("compiled train step: %d collectives %s; %d with a sequence dimension; %d inside "
           "attention", summary["total"], {k: v["count"] for k, v in summary["per_kind"].items()},
           len(summary["with_sequence_dim"]), len(summary["in_attention_op"]))
  return compiled


# (field, lowest allowed value, what it means): integer settings a zero or negative value would
# turn into a ZeroDivisionError mid-run, an empty validation set, a run that silently does nothing
# or data with nothing to score (a loss of 0 reported as perfect).
_INT_MINIMUMS = (("train.num_steps", 1, "optimizer steps"),
                 ("train.log_every", 1, "steps between train metric records"),
                 ("train.eval_every", 1, "steps between validation passes"),
                 ("train.eval_batches", 1, "validation batches per pass"),
                 ("checkpoint.every_steps", 1, "steps between checkpoints"),
                 ("checkpoint.max_to_keep", 1, "checkpoints kept"),
                 ("data.global_batch_size", 1, "sequences per optimizer step"),
                 ("data.seq_len", 1, "tokens per sequence"),
                 ("optim.grad_accum_steps", 1, "microbatches per step"),
                 ("optim.warmup_steps", 0, "warmup steps"),
                 ("train.stop_after", 0, "the step this run ends at, 0 = num_steps"),
                 ("data.max_bytes", 0, "bytes read per split, 0 = all"),
                 ("data.num_needles", 1, "facts hidden per needle sequence"),
                 ("data.num_queries", 1, "queried pairs per mqar sequence"),
                 ("data.num_questions", 1, "questions per passkey / needle sequence"))


# (field, lowest, highest, which ends are open, what it means): numbers whose values outside the
# range train silently wrong (clip_norm <= 0 zeroes or flips every update, min_lr_ratio < 0 makes
# the late rate negative) or fail late with an error that names neither the field nor the fix.
_RANGES = (("train.time_limit_minutes", 0, None, "", "0 = no limit"),
           ("optim.clip_norm", 0, None, "low", "the global gradient-norm clip"),
           ("optim.min_lr_ratio", 0, 1, "", "the cosine's end as a fraction of the peak rate"),
           ("optim.b1", 0, 1, "high", "Adam's first-moment decay"),
           ("optim.b2", 0, 1, "high", "Adam's second-moment decay"),
           ("optim.eps", 0, None, "low", "Adam's epsilon"),
           ("optim.weight_decay", 0, None, "", "AdamW's decoupled decay"),
           ("data.val_percent", 0, 100, "low high", "the held-out share of the data, in percent"),
           ("data.context_loss_weight", 0, None, "", "loss weight of the filler tokens"),
           ("data.single_question_fraction", 0, 1, "", "share of one-question sequences"))
# Data fields that configs may add to the base config's data block (make_sources reads them with
# defaults, so older configs lack them).
OPTIONAL_DATA_FIELDS = ("num_questions", "context_loss_weight", "single_question_fraction")


def _check_known_fields(config):
  """A misspelled field in a config file (the command line already refuses those) would otherwise
  be ignored while its default runs: each block's fields must be the base config's."""
  try:
    from configs.base import get_base_config
  except ImportError:  # the package used outside this repository: no base config to compare with
    log.debug("configs.base not importable: config field names not checked")
    return
  base = get_base_config()
  for block in ("data", "optim", "mesh", "train", "checkpoint"):
    if block not in config:
      continue
    known = set(base[block].keys()) | (set(OPTIONAL_DATA_FIELDS) if block == "data" else set())
    unknown = sorted(set(config[block].keys()) - known)
    if unknown:
      near = {u: difflib.get_close_matches(u, known, 1) for u in unknown}
      hint = "; ".join(f"{u!r} -> {m[0]!r}?" for u, m in near.items() if m)
      raise ValueError(f"config.{block}: unknown field(s) {unknown}{' (' + hint + ')' if hint else ''}"
                       f". Fix: spell them as in configs/base.py; valid fields: {sorted(known)}")


def _check_bound(config, path, low, high=None, open_ends="", what="", integer=False):
  """One clear error unless config.<path> is a number (an integer with integer=True) within the
  bounds; absent optional fields (OPTIONAL_DATA_FIELDS) pass."""
  block, key = path.split(".")
  if key not in config.get(block, {}):
    return
  value = config[block][key]
  kinds = (int,) if integer else (int, float)
  bad = isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value)
  if not bad:
    bad = value <= low if "low" in open_ends else value < low
    if high is not None:
      bad = bad or (value >= high if "high" in open_ends else value > high)
  if bad:
    kind = "an integer" if integer else "a number"
    lo = f"{'>' if 'low' in open_ends else '>='} {low}"
    hi = f" and {'<' if 'high' in open_ends else '<='} {high}" if high is not None else ""
    raise ValueError(f"config.{path}={value!r}: expected {kind} {lo}{hi} ({what}). "
                     f"Fix: --config.{path}=<{kind} {lo}{hi}>")


def check_run_config(config):
  """The loop, data and optimizer settings that model_config_from does not cover: one clear error
  naming the field and the fix, before anything is built or written."""
  _check_known_fields(config)
  for path, low, what in _INT_MINIMUMS:
    if path == "checkpoint.max_to_keep" and config.checkpoint.max_to_keep is None:
      continue  # orbax: keep every checkpoint
    _check_bound(config, path, low, what=what, integer=True)
  lr = config.optim.learning_rate
  if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
    raise ValueError(f"config.optim.learning_rate={lr!r}: expected a finite number > 0. "
                     "Fix: e.g. --config.optim.learning_rate=3e-4")
  for args in _RANGES:
    _check_bound(config, *args)
  data_lib.document_end_id(config.data)  # document masking's settings, refused here if wrong
  parse_packed_cap(config.data.cudnn_packed_cap)


def check_batch_layout(config, mesh, model_cfg):
  b, a = config.data.global_batch_size, config.optim.grad_accum_steps
  per_step = shd.batch_divisor(mesh) * a
  if b % per_step or b % jax.process_count():
    raise ValueError(f"config.data.global_batch_size={b} must be a multiple of data*fsdp devices x "
                     f"grad_accum_steps = {per_step} and of {jax.process_count()} processes. Fix: "
                     f"use a batch of {per_step * max(1, round(b / per_step))}")
  if config.data.seq_len > model_cfg.max_seq_len:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} exceeds config.model.max_seq_len="
                     f"{model_cfg.max_seq_len}. Fix: raise max_seq_len or lower seq_len")
  nsa = model_cfg.nsa
  scores = "cmp" in nsa.branches or ("slc" in nsa.branches and nsa.selector == "nsa")
  if "nsa" in model_cfg.attention_kinds and scores and config.data.seq_len < nsa.cmp_block:
    log.warning("config.data.seq_len=%d is shorter than a compression block (cmp_block=%d): no "
                "compressed block is ever complete, so the compression branch sees nothing and "
                "selection has only its forced blocks. Fix: train on longer sequences, or shrink "
                "model.nsa.cmp_block / cmp_stride / sel_block", config.data.seq_len, nsa.cmp_block)


def _iterators(config, model_cfg, start_step=0):
  sources = data_lib.make_sources(config.data)
  kw = dict(global_batch=config.data.global_batch_size, seq_len=config.data.seq_len,
            seed=config.data.seed, vocab_size=model_cfg.vocab_size,
            process_index=jax.process_index(), process_count=jax.process_count())
  kw["eos_id"] = eos = data_lib.document_end_id(config.data)
  if eos is None and config.data.get("eos_id", -1) != -1:
    log.warning("config.data.eos_id=%s does nothing without document masking. Fix: add "
                "--config.data.document_mask=True, or drop eos_id", config.data.eos_id)
  train = data_lib.BatchIterator(sources["train"], split="train", step=start_step, **kw)
  # (that refused an eos_id outside the vocabulary) at most 16M tokens, and only with masking on:
  # a memmap stays cheap, other runs read nothing
  head = np.asarray(sources["train"].tokens[:1 << 24]) if eos is not None else None
  if eos is not None and not (head == eos).any():
    log.warning("document masking: end token %d does not occur in the first %d training tokens, "
                "so nothing is masked there. Fix: check config.data.eos_id against your "
                "tokenizer's end-of-text id", eos, len(head))
  val = data_lib.BatchIterator(sources["val"], split="val", **kw)
  return train, [val.batch(i) for i in range(config.train.eval_batches)]


def parse_packed_cap(value) -> str | int:
  """config.data.cudnn_packed_cap: "auto", "off" (-> 0) or a positive cap (-> int)."""
  text = str(value).strip().lower()
  if text in ("auto", "off", "0"):
    return 0 if text in ("off", "0") else "auto"
  try:
    cap = int(text)
  except ValueError:
    cap = -1
  if cap < 1 or isinstance(value, (bool, float)):
    raise ValueError(f"config.data.cudnn_packed_cap={value!r}: expected \"auto\", \"off\" or the "
                     "largest number of documents in one row (a positive integer, e.g. 8). Fix: "
                     "--config.data.cudnn_packed_cap=auto (or =off, or =8; in a config file a "
                     "string: c.data.cudnn_packed_cap = \"8\")")
  return cap


def device_memory_bytes() -> int:
  """This process's first device's memory limit in bytes (0 where it reports none, e.g. a CPU)."""
  return int((jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 0))


def set_dense_packed_cap(config, model_cfg, train, mesh, n_batches=16) -> int:
  """Dense layers with document masking on a GPU: the document cap of cuDNN's packed layout
  (nsa_jax/cudnn_packed.py) from config.data.cudnn_packed_cap, "auto" reading the first
  `n_batches` training batches (each process its rows; the processes agree on the largest count
  and the smallest memory, so all build one program); set with cudnn_packed.set_dense_cap and
  logged (0: our Triton kernels). NSA_CUDNN_PACKED, where set, overrides it; its fit is logged
  instead. Returns the cap."""
  setting = parse_packed_cap(config.data.cudnn_packed_cap)
  cudnn_packed.set_dense_cap(0)
  if data_lib.document_end_id(config.data) is None or jax.default_backend() != "gpu":
    return 0
  segs = lambda: [train.batch(train.step + i)["segment_ids"] for i in range(n_batches)]
  env = cudnn_packed.env_cap()
  if env is not None:  # the variable decides, for dense layers and NSA's window branch alike
    if env:
      log.log(*cudnn_packed.cap_report(segs(), env))
    return env
  if "dense" not in model_cfg.attention_kinds or model_cfg.dense_implementation != "auto":
    return 0
  if setting == 0:
    log.info("dense layers with document masking: our Triton kernels (data.cudnn_packed_cap=off)")
    return 0
  # one device's q: its rows of a microbatch, its heads (as nsa_jax.ops.mesh_layout splits them)
  tp = mesh.shape.get("tensor", 1)
  heads = model_cfg.n_heads // (tp if ops.splits_heads(model_cfg.n_kv_heads, tp) else 1)
  per_device = (max(1, config.data.global_batch_size // shd.batch_divisor(mesh)
                    // config.optim.grad_accum_steps), config.data.seq_len, heads,
                model_cfg.head_dim)
  dtype = jnp.dtype(model_cfg.dtype)
  ok, no = cudnn_packed.applies(
      jax.ShapeDtypeStruct(per_device, dtype), jax.ShapeDtypeStruct(per_device, dtype),
      jax.ShapeDtypeStruct(per_device[:3] + (model_cfg.head_dim_v or model_cfg.head_dim,), dtype))
  if not ok:
    log.info("dense layers with document masking: our Triton kernels (cuDNN's packed layout does "
             "not apply: %s)", no)
    return 0
  if setting == "auto":
    most = max(int(np.asarray(cudnn_packed.documents_per_row(s)).max()) for s in segs())
    memory = device_memory_bytes()
    if jax.process_count() > 1:  # one program on every host: the largest count, the least memory
      most = int(np.max(multihost_utils.process_allgather(np.int64(most))))
      memory = int(np.min(multihost_utils.process_allgather(np.int64(memory))))
    cap, why = cudnn_packed.auto_cap(most, n_batches, per_device, memory or None)
    log.info("dense layers with document masking (data.cudnn_packed_cap=auto): %s", why)
  else:
    cap = setting
    log.log(*cudnn_packed.cap_report(segs(), cap, "data.cudnn_packed_cap"))
  cudnn_packed.set_dense_cap(cap)
  return cap


def warm_start(setup, meta, init_from: str) -> dict:
  """A fresh train state whose parameters (and other model state) come from the newest checkpoint
  of the run in `init_from`; the optimizer state and the step start afresh."""
  directory = os.path.join(init_from, "checkpoints")
  if not os.path.isdir(directory):
    raise CheckpointError(f"config.checkpoint.init_from={init_from!r}: no {directory} directory. "
                          "Fix: give the --workdir of a finished run")
  src = Checkpointer(directory, async_save=False)
  try:
    latest = src.latest_step()
    if latest is None:
      raise CheckpointError(f"config.checkpoint.init_from={init_from!r} holds no checkpoint. Fix: "
                            "give the --workdir of a run that saved one")
    try:
      loaded, _ = src.restore(latest, setup.abstract_state, meta, ignore=WARM_START_FREE_FIELDS,
                              defaults=MODEL_DEFAULTS)
    except CheckpointError as e:  # the resume message's fixes do not apply to a warm start
      reason = str(e).split("\nFix:")[0].split(" Fix:")[0]
      raise CheckpointError(f"config.checkpoint.init_from={init_from!r} cannot start this run: "
                            f"{reason}\nFix: give init_from the workdir of a run of the same "
                            "model (data settings may differ)") from e
  finally:
    src.close()
  opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings["opt_state"])(
      loaded["params"])
  log.info("warm start: parameters from %s (step %d); optimizer and step start afresh",
           src.step_dir(latest), latest)
  return {"step": jnp.zeros((), jnp.int32), "params": loaded["params"], "opt_state": opt_state,
          "rest": loaded["rest"]}


def _restore_or_init(setup, ckpt, meta, train_iter, resume: bool, init_from: str = ""):
  latest = ckpt.latest_step()
  if latest is not None and not resume:
    raise CheckpointError(f"{ckpt.directory} already holds checkpoints (newest: step {latest}) and "
                          "config.checkpoint.resume is False. Fix: use a fresh --workdir, or resume")
  if latest is None:  # a fresh run (a warm-started run that saved once resumes from its own)
    return (warm_start(setup, meta, init_from) if init_from else create_train_state(setup)), 0
  state, data_state = ckpt.restore(latest, setup.abstract_state, meta, ignore=RESUMABLE_MODEL_FIELDS,
                                   defaults=MODEL_DEFAULTS)
  train_iter.restore(data_state)
  step = int(to_host(state["step"]))
  if step != latest or train_iter.step != latest:
    raise CheckpointError(f"checkpoint {ckpt.step_dir(latest)} is inconsistent: directory step "
                          f"{latest}, state step {step}, data step {train_iter.step}. It was "
                          f"left untouched. Fix: {ckpt.move_away_hint(latest)}")
  return state, step


# How an invocation runs, not what it trains: changing these on a resume is routine (the
# preemption workflow), so they neither warn nor keep a copy of the earlier config.
_RUN_CONTROL_FIELDS = frozenset({"data.cudnn_packed_cap", "train.stop_after", "train.time_limit_minutes",
                                 "train.progress_bar", "train.tensorboard", "train.plot",
                                 "train.hlo_report", "checkpoint.async_save"})


# Run fields added to the base config after runs were recorded, at their defaults: an earlier
# config.json that lacks them ran exactly so (no "settings differ" warning on resume).
_ADDED_RUN_FIELDS = {"data": {"document_mask": False, "eos_id": -1},
                     "model": {"dense_implementation": "auto", "selection_from_layer": None}}


def _record_config(config, workdir, start):
  """Writes config.json. On a resume whose settings differ from the recorded ones (data, optimizer,
  loop: the model itself is checked against the checkpoint), warns with the differences and keeps
  the earlier file as config.before_step_<start>.json, so the work directory still says what its
  first steps ran with."""
  path = os.path.join(workdir, "config.json")
  text = config.to_json_best_effort(indent=2)
  if start > 0 and os.path.exists(path):
    with open(path) as f:
      old_text = f.read()
    try:
      old = json.loads(old_text)
    except ValueError:
      old = {"(unreadable config.json)": 0}
    diffs = config_diff(old, json.loads(text), ignore=_RUN_CONTROL_FIELDS,
                        fmt="{key}: {a!r} -> {b!r}", defaults=_ADDED_RUN_FIELDS)
    if diffs:
      keep = os.path.join(workdir, f"config.before_step_{start}.json")
      n = 1
      while os.path.exists(keep):  # a second resume from the same step keeps both earlier files
        n += 1
        keep = os.path.join(workdir, f"config.before_step_{start}.{n}.json")
      with open(keep, "w") as f:
        f.write(old_text)
      log.warning("resuming at step %d with settings that differ from the recorded run (the "
                  "earlier config is kept as %s):\n  %s", start, keep, "\n  ".join(diffs))
  with open(path, "w") as f:
    f.write(text)


def train_and_evaluate(config, workdir: str, model_factory=None, step_hooks=()) -> dict:
  """Trains config in workdir, resuming from its newest checkpoint; returns a summary dict.

  step_hooks: callables (step, metrics) run on the host after each step's metrics arrive.
  The dense layers' packed-layout cap this run chooses (data.cudnn_packed_cap) is undone at the
  end, so a later run or model in the same process starts from the caller's setting.
  """
  before = cudnn_packed.dense_cap()
  try:
    return _train_and_evaluate(config, workdir, model_factory, step_hooks)
  finally:
    cudnn_packed.set_dense_cap(before)


def _train_and_evaluate(config, workdir, model_factory, step_hooks) -> dict:
  is_main = jax.process_index() == 0
  check_run_config(config)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"workdir {workdir!r} exists and is not a directory. Fix: give a directory "
                     "(a new one starts a run, an earlier run's resumes it)")
  mesh = shd.make_mesh(config.mesh)
  setup = build_setup(config, mesh, model_factory)
  check_batch_layout(config, mesh, setup.model_cfg)
  train_iter, val_batches = _iterators(config, setup.model_cfg)
  packed_cap = set_dense_packed_cap(config, setup.model_cfg, train_iter, mesh)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), max_to_keep=config.checkpoint.max_to_keep,
                      async_save=config.checkpoint.async_save)
  meta = {"model": dataclasses.asdict(setup.model_cfg)}
  init_from = config.checkpoint.get("init_from", "")
  state, start = _restore_or_init(setup, ckpt, meta, train_iter, config.checkpoint.resume,
                                 init_from)

  seq, batch = config.data.seq_len, config.data.global_batch_size
  flops_tok = metrics_lib.train_flops_per_token(setup.model_cfg, setup.matmul_params, seq)
  peak = metrics_lib.peak_flops_per_device(config.train.peak_tflops)
  speed = metrics_lib.Throughput(seq * batch, flops_tok, peak and peak * jax.device_count())
  writer = metrics_lib.MetricsWriter(workdir, enabled=is_main, tensorboard=config.train.tensorboard)
  if is_main:
    _record_config(config, workdir, start)
  header = dict(event="start", time=round(time.time(), 3), step=start, params=setup.num_params,
                mesh=dict(mesh.shape), devices=jax.device_count(),
                device_kind=jax.devices()[0].device_kind, flops_per_token=flops_tok,
                attention=setup.model_cfg.attention_kinds)
  if packed_cap:  # dense layers (or with NSA_CUDNN_PACKED, NSA's window branch) on cuDNN's packed layout
    header["cudnn_packed_cap"] = packed_cap
  if start == 0 and init_from:
    header["init_from"] = init_from
  writer.note(header)
  log.info("run: %s", json.dumps(header))

  train_step = make_train_step(setup, config.optim.grad_accum_steps)
  eval_step = make_eval_step(setup)
  total = config.train.num_steps
  # This invocation ends at `end` (stop_after) or at the time limit; the schedule spans `total`.
  stop_after = int(config.train.stop_after)  # >= 0: check_run_config
  end = min(total, stop_after) if stop_after else total
  time_limit = float(config.train.time_limit_minutes) * 60.0
  bar = metrics_lib.Progress(total, start, enabled=config.train.progress_bar, echo=is_main)
  last_saved = start if ckpt.latest_step() == start and start > 0 else None
  pending, last, val, stopped = None, {}, {}, None
  log_now = False  # a stop logs its last step even off the log_every grid

  def fetch():
    """Host-side handling of the previous step's metrics: NaN guard, logs, hooks."""
    nonlocal pending, last
    if pending is None:
      return
    s, m = pending
    pending = None
    last = {k: float(v) for k, v in to_host(m).items()}
    if not all(math.isfinite(last[k]) for k in ("loss", "grad_norm", "param_norm")):
      good = ckpt.latest_step()
      if s == start + 1 and start > 0:  # the first step after a restore: suspect the restore
        raise NonFiniteError(
            f"non-finite training metrics at step {s}, the first step after resuming from "
            f"{ckpt.step_dir(start)}: loss={last['loss']}, grad_norm={last['grad_norm']}, "
            f"param_norm={last['param_norm']}. Stopped without saving. The restored parameters "
            "were finite. If settings changed at this resume, the earlier ones are in the "
            "work directory's config.before_step_* file (the log above lists the changes); "
            "otherwise that checkpoint's optimizer state may be damaged. Fix: restore the "
            "earlier settings or lower config.optim.learning_rate, or move "
            f"{ckpt.step_dir(start)} away to resume from the step before it.")
      raise NonFiniteError(
          f"non-finite training metrics at step {s}: loss={last['loss']}, grad_norm="
          f"{last['grad_norm']}, param_norm={last['param_norm']}. Stopped without saving; the "
          "last good checkpoint is "
          f"{ckpt.step_dir(good) if good is not None else '(none)'}. Fix: lower "
          "config.optim.learning_rate or raise warmup_steps, then rerun to resume from it.")
    speed.tick()
    if s == start + 1:
      speed.reset()  # the first step includes compilation
      bar.write(f"step {s} done {time.time() - loop_start:.0f} s after the loop started "
                "(compilation included)")
    if s % config.train.log_every == 0 or s == end or log_now:
      rates = speed.report() if s > start + 1 else {}
      writer.write(s, {**last, **rates}, prefix="train/")
      bar.log(s, loss=last["loss"], **{k: v for k, v in rates.items() if k != "step_time_s"})
    for hook in step_hooks:
      hook(s, last)

  loop_start = time.time()
  if start >= end and start < total:
    bar.write(f"nothing to do: resumed at step {start}, and config.train.stop_after={stop_after} "
              "stops there. Fix: raise or unset stop_after to continue")
  if start < end:  # the first call compiles the step: minutes at long context on a GPU
    bar.write(f"compiling the training step (seq_len {seq}; the first step waits for it) ...")
  with _StopFlag() as stop, jax.set_mesh(mesh):
    try:
      for s in range(start + 1, end + 1):
        batch = to_global(next(train_iter), setup)
        if s == start + 1 and config.train.hlo_report:
          train_step = _compile_and_report(train_step, state, batch, workdir, seq, is_main)
        with jax.transfer_guard("disallow"):  # the step itself must not copy to or from the host
          state, m = train_step(state, batch)
        fetch()
        pending = (s, m)
        bar.update(1)
        timed_out = bool(time_limit) and time.time() - loop_start > time_limit
        # Across processes the vote is a collective that waits for the device: hold it only at
        # log steps, which sync the host anyway. One process checks its flags every step.
        stop_now, timed_out = stop.agreed(timed_out) if (
            jax.process_count() == 1 or s % config.train.log_every == 0 or s == end) else (
                False, False)
        if s % config.checkpoint.every_steps == 0 or s == end or stop_now:
          log_now = stop_now
          fetch()  # never save a step whose metrics were not checked
          ckpt.save(s, state, train_iter.state(), {**meta, "step": s})
          last_saved = s
          speed.reset()  # nor is saving time (the save's device-to-host copy blocks)
        # A planned stop (time limit) is validated like the end; a SIGTERM exits at once.
        if s % config.train.eval_every == 0 or s == end or (stop_now and timed_out):
          fetch()
          val = evaluate(eval_step, state, val_batches, setup)
          writer.write(s, val, prefix="val/")
          speed.reset()  # evaluation time is not training throughput
          bar.write(f"step {s}: val loss {val['loss']:.4f}  ppl {val['perplexity']:.2f}"
                    f"  acc {val['accuracy']:.3f}")
        if stop_now:
          stopped = "time limit" if timed_out else "SIGTERM"
          bar.write(f"{stopped}: saved step {s} to {ckpt.step_dir(s)}; exiting (rerun to resume)")
          break
      else:
        if start < end < total:
          stopped = "stop_after"
      fetch()
    finally:
      bar.close()
      ckpt.close()  # waits for async saves: a finished run's last checkpoint is on disk
      writer.close()

  final_step = int(to_host(state["step"]))
  summary = dict(event="end", step=final_step, stopped=stopped, last_saved=last_saved,
                 train=last, val=val, peak_memory_gb=metrics_lib.peak_memory_gb())
  if is_main:
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
      f.write(json.dumps(summary) + "\n")
    if config.train.plot:
      from nsa_jax.training.plotting import plot_runs
      plot_runs([workdir], os.path.join(workdir, "loss.png"))
  return summary
