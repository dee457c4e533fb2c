"""Orbax checkpoints of the train state, the data-iterator state and run metadata.

One step directory holds three items: "state" (sharded arrays, StandardSave), "data" (the
iterator state, JSON) and "meta" (the model config, JSON, checked before any array is read, and
a checksum of every state array, checked after the arrays are read: orbax keeps none, so damage
that still decodes to finite numbers would otherwise load silently).
Restores go straight into the sharded layout described by an abstract target. Failures are
raised as CheckpointError naming the step directory; nothing is ever deleted or overwritten here
except by orbax's keep-last-N policy after a newer save has finished.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax

ITEMS = ("state", "data", "meta")


class CheckpointError(RuntimeError):
  """A checkpoint in the work directory cannot be used; the message says which and why."""


@contextlib.contextmanager
def quiet_reads():
  """Silences the asyncio logger while orbax reads: a damaged array file makes TensorStore fail
  every pending read, and asyncio logs each failed task with its full TensorStore spec (tens of
  thousands of lines for one truncated file) before the one CheckpointError that names the
  step and the fix. NSA_TRACEBACK=1 keeps them."""
  log = logging.getLogger("asyncio")
  level = log.level
  if os.environ.get("NSA_TRACEBACK") != "1":
    log.setLevel(logging.CRITICAL + 1)
  try:
    yield
  finally:
    log.setLevel(level)


def config_diff(saved: dict, current: dict, prefix: str = "", ignore=(),
                fmt="{key}: checkpoint has {a!r}, config has {b!r}", defaults=None) -> list[str]:
  """Human-readable differences between two JSON-like dicts (dotted paths in ignore skipped),
  one fmt line (key = dotted path, a = saved, b = current) each.

  defaults: a dict shaped like current holding each field's default. A field the saved dict lacks
  (added to the config after it was written) matches when current holds its default: defaults
  keep the behaviour of the code that wrote it."""
  out = []
  defaults = defaults or {}
  for key in sorted(set(saved) | set(current)):
    if f"{prefix}{key}" in ignore:
      continue
    a, b = saved.get(key, "<missing>"), current.get(key, "<missing>")
    if a == "<missing>" and key in defaults and b == defaults[key]:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      sub = defaults.get(key) if isinstance(defaults.get(key), dict) else None
      out += config_diff(a, b, f"{prefix}{key}.", ignore, fmt, sub)
    elif a != b:
      out.append(fmt.format(key=f"{prefix}{key}", a=a, b=b))
  return out


def _jsonable(x):
  return json.loads(json.dumps(x, default=str))


def _per_leaf(tree, keep, reduce) -> list[tuple[str, object]]:
  """[(leaf path, host value)] of reduce, a module-level jit mapping a list of arrays to one
  stacked array (one entry per array), over the leaves of tree that keep accepts. One jitted pass
  over the global arrays, so it works on sharded arrays from any process."""
  named = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
           if keep(x)]
  if not named:
    return []
  host = np.asarray(reduce([x for _, x in named]).addressable_data(0))  # replicated output
  return [(name, v) for (name, _), v in zip(named, host)]


@jax.jit
def _all_finite(leaves):  # module level, so every call on the same state reuses one compile
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_leaves(tree) -> list[str]:
  """Paths of the floating-point leaves of tree that hold a NaN or an infinity."""
  floating = lambda x: hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
  return [name for name, good in _per_leaf(tree, floating, _all_finite) if not good]


_ODD_MULT, _ODD_ADD = np.uint32(2654435761), np.uint32(0x9E3779B9)


def _bits_u32(x):
  """x's bit patterns as uint32 (8-byte types gain a trailing axis of 2; keys give their data)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size >= 4:
    return lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)


def _checksum_u32(x):
  """sum_i bits_i * w_i mod 2^32 with an odd weight w_i per flat position i: any change of one
  element changes it, as does moving values between positions; integer sums are exact, so the
  value does not depend on the sharding or the reduction order."""
  bits = _bits_u32(x)
  idx = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(bits.ndim)):
    idx = idx + lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * np.uint32(stride % 2**32)
    stride *= bits.shape[axis]
  weight = (idx * _ODD_MULT + _ODD_ADD) | np.uint32(1)
  return jnp.sum(bits * weight, dtype=jnp.uint32)


@jax.jit
def _checksums(leaves):  # module level, so every save of the same state reuses one compile
  return jnp.stack([_checksum_u32(x) for x in leaves])


def state_checksums(tree) -> dict[str, int]:
  """{leaf path: uint32 checksum of its bits} for every array leaf of tree."""
  return {name: int(v) for name, v in _per_leaf(tree, lambda x: hasattr(x, "dtype"), _checksums)}


class Checkpointer:
  """Thin wrapper over ocp.CheckpointManager with the checks training needs."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state, data_state: dict, meta: dict):
    """Starts an (async) save of step; raises if that step already exists (no overwrite). The
    state's checksums go into meta (see state_checksums)."""
    if step in self.manager.all_steps():
      raise CheckpointError(f"checkpoint step {step} already exists in {self.directory}; "
                            "refusing to overwrite it")
    meta = {**meta, "checksums": state_checksums(state)}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(_jsonable(data_state)),
        meta=ocp.args.JsonSave(_jsonable(meta))))

  def require_step(self, step: int):
    """A step that is not saved here is named as missing, not reported as a corrupt checkpoint."""
    steps = self.all_steps()
    if step not in steps:
      raise CheckpointError(f"no checkpoint step {step} in {self.directory}: it holds steps "
                            f"{sorted(steps) or 'none'}. Fix: pass one of those (or no step "
                            "for the newest)")

  def check_finite(self, step: int, params):
    """Training saves only steps whose loss, gradient and parameter norms it checked to be finite,
    so non-finite parameters in a saved step mean the files were damaged after the save."""
    bad = nonfinite_leaves(params)
    if bad:
      raise CheckpointError(
          f"checkpoint {self.step_dir(step)} is corrupt: {len(bad)} parameter arrays hold NaN or "
          f"inf after reading (first: {bad[0]}), and training never saves a non-finite state. It "
          f"was left untouched. Fix: {self.move_away_hint(step)}.")

  def check_checksums(self, step: int, state, saved: dict | None, prefix: str = ""):
    """The restored arrays must be bit for bit the saved ones; checkpoints written before the
    checksums existed (no "checksums" in meta) are read without this check. prefix: check only
    the saved leaves whose path starts with it (state then holds only those, under the same
    paths), e.g. "['params']" for a reader that needs the parameters alone."""
    if saved is None:
      return
    now = state_checksums(state)  # a leaf saved as a Python scalar may come back as an array:
    differ = [name for name in saved  # only saved sums count
              if name.startswith(prefix) and now.get(name) != saved[name]]
    if differ:
      raise CheckpointError(
          f"checkpoint {self.step_dir(step)} is corrupt: {len(differ)} state arrays read back "
          f"differ from what was saved (checksum mismatch; first: {differ[0]}). It was left "
          f"untouched. Fix: {self.move_away_hint(step)}.")

  def read(self, step: int, what: str, **items):
    """The orbax items of step (e.g. state=ocp.args.StandardRestore()), read with the asyncio
    logger quiet; any failure becomes one CheckpointError naming `what`, the step and the fix."""
    try:
      with quiet_reads():
        return self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax raises many kinds; the user needs the path and the cause
      raise CheckpointError(self._broken(step, what, e)) from e

  def read_meta(self, step: int) -> dict:
    self.require_step(step)
    return self.read(step, "its metadata", meta=ocp.args.JsonRestore())["meta"]

  def restore(self, step: int, abstract_state, expected_meta: dict, ignore=(), defaults=None):
    """Checks meta against expected_meta, then restores (state, data_state) at step.

    ignore: dotted model fields that may change on resume (how to compute, not what is learned).
    defaults: the model fields' defaults (config_diff): a field newer than the checkpoint matches
    at its default.
    abstract_state: a tree of jax.ShapeDtypeStruct carrying the target NamedShardings, so every
    array is read directly into its shards.
    """
    meta = self.read_meta(step)
    problems = config_diff(meta.get("model", {}), _jsonable(expected_meta["model"]), ignore=ignore,
                           defaults=_jsonable(defaults) if defaults else None)
    if problems:
      raise CheckpointError(
          f"checkpoint {self.step_dir(step)} was written for a different model:\n  "
          + "\n  ".join(problems)
          + "\nFix: use the config it was trained with, or a fresh --workdir. The checkpoint was "
          "left untouched.")
    out = self.read(step, "its arrays", state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore())
    if isinstance(out["state"], dict) and "params" in out["state"]:
      self.check_finite(step, out["state"]["params"])
    self.check_checksums(step, out["state"], meta.get("checksums"))
    return out["state"], out["data"]

  def move_away_hint(self, step) -> str:
    earlier = [s for s in self.all_steps() if s < step]
    return (f"move that directory away to resume from step {max(earlier)}" if earlier
            else "move that directory away (or use a fresh --workdir) to start over")

  def _broken(self, step, what, err) -> str:
    first = str(err).splitlines()[0] if str(err) else ""
    # TensorStore appends a repr of its spec, in one phrasing or another (" See full TensorStore
    # details", " [tensorstore_spec=..."): the cause is what comes before it.
    for tail in (" See full TensorStore details", " [tensorstore_spec"):
      first = first.split(tail)[0]
    first = first.rstrip(".")
    if len(first) > 400:
      first = first[:400] + " ..."
    return (f"checkpoint {self.step_dir(step)} is corrupt or incompatible: could not read {what} "
            f"({type(err).__name__}: {first}). "
            f"It was left untouched. Fix: {self.move_away_hint(step)}.")

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree, shardings):
  """ShapeDtypeStructs of tree's leaves with the given shardings (a restore target)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
