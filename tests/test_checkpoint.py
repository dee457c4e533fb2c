"""Checkpointer: sharded round trip, keep-last-N, no overwrite, clear errors for bad checkpoints."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from nsa_jax.training.checkpointing import (Checkpointer, CheckpointError, abstract_like,
                                            state_checksums)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEED = int.from_bytes(os.urandom(3), "little")
META = {"model": {"d_model": 16, "nsa": {"window": 8, "branches": ["cmp", "slc", "win"]}}}


def make_state(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"step": jnp.asarray(3, jnp.int32),
          "params": {"w": jax.random.normal(k1, (8, 16)), "layers": {0: {"b": jax.random.normal(k2, (16,))}}},
          "opt_state": (jnp.zeros((8, 16)), {"count": jnp.asarray(7)})}


def shardings(state):
  mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  return jax.tree.map(lambda x: NamedSharding(mesh, P("fsdp") if x.ndim == 2 else P()), state)


def save(ckpt, step, state, data_step=None):
  ckpt.save(step, state, {"step": data_step or step, "fingerprint": {"n": 1}}, {**META, "step": step})
  ckpt.wait()


def test_round_trip_into_sharded_target_and_keep_last_n(tmp_path):
  state = make_state(SEED)
  ckpt = Checkpointer(str(tmp_path), max_to_keep=2)
  for step in (1, 2, 3):
    save(ckpt, step, state)
  assert ckpt.all_steps() == [2, 3], "keeps only the newest max_to_keep"
  target = abstract_like(state, shardings(state))
  restored, data_state = ckpt.restore(3, target, META)
  ckpt.close()
  assert data_state == {"step": 3, "fingerprint": {"n": 1}}
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b, t in zip(jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(target)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed {SEED}")
    assert a.sharding == t.sharding


def test_refuses_to_overwrite_a_step(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  save(ckpt, 5, make_state(SEED))
  with pytest.raises(CheckpointError, match="already exists"):
    ckpt.save(5, make_state(SEED + 1), {}, META)
  ckpt.close()


def test_mismatched_model_is_named_and_left_alone(tmp_path):
  state = make_state(SEED)
  ckpt = Checkpointer(str(tmp_path))
  save(ckpt, 4, state)
  other = {"model": {"d_model": 32, "nsa": {"window": 8, "branches": ["cmp", "slc", "win"]}}}
  with pytest.raises(CheckpointError, match=r"d_model: checkpoint has 16, config has 32"):
    ckpt.restore(4, abstract_like(state, shardings(state)), other)
  assert ckpt.all_steps() == [4]
  # Fields listed as resumable (how to compute, not what is learned) may differ.
  window = {"model": {"d_model": 16, "nsa": {"window": 9, "branches": ["cmp", "slc", "win"]}}}
  with pytest.raises(CheckpointError, match="nsa.window"):
    ckpt.restore(4, abstract_like(state, shardings(state)), window)
  restored, _ = ckpt.restore(4, abstract_like(state, shardings(state)), window, ignore=("nsa.window",))
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
  ckpt.close()


def test_shape_mismatch_is_a_clear_error(tmp_path):
  state = make_state(SEED)
  ckpt = Checkpointer(str(tmp_path))
  save(ckpt, 2, state)
  bigger = dict(state, params={**state["params"], "w": jnp.zeros((8, 32))})
  with pytest.raises(CheckpointError, match="corrupt or incompatible"):
    ckpt.restore(2, abstract_like(bigger, shardings(bigger)), META)
  ckpt.close()


def test_corrupt_checkpoint_names_the_step_and_keeps_the_good_ones(tmp_path):
  state = make_state(SEED)
  ckpt = Checkpointer(str(tmp_path), max_to_keep=5)
  save(ckpt, 1, state)
  save(ckpt, 2, state)
  ckpt.close()
  # Garble every array file of step 2 (a torn write / disk error).
  broken = 0
  for dirpath, _, files in os.walk(tmp_path / "2" / "state"):
    for f in files:
      with open(os.path.join(dirpath, f), "r+b") as fh:
        size = fh.seek(0, 2)
        fh.seek(0)
        fh.write(os.urandom(max(size, 16)))
      broken += 1
  assert broken
  ckpt = Checkpointer(str(tmp_path), max_to_keep=5)
  assert ckpt.latest_step() == 2
  with pytest.raises(CheckpointError, match="is corrupt or incompatible") as err:
    ckpt.restore(2, abstract_like(state, shardings(state)), META)
  assert str(tmp_path / "2") in str(err.value) and "resume from step 1" in str(err.value)
  assert ckpt.all_steps() == [1, 2], "nothing deleted"
  restored, _ = ckpt.restore(1, abstract_like(state, shardings(state)), META)
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
  ckpt.close()


def test_a_truncated_array_file_is_one_clear_error(tmp_path, caplog):
  """A truncated data file (a copy cut short): one CheckpointError naming the step and the fix,
  without the TensorStore spec's repr, no asyncio error logs, and the asyncio logger's level as
  it was (quiet_reads restores it). The log flood itself came from the target-less restore that
  experiments.generate uses (tested in test_experiments)."""
  import logging
  keys = jax.random.split(jax.random.key(SEED), 12)
  state = {"params": {f"w{i}": jax.random.normal(k, (128, 256)) for i, k in enumerate(keys)}}
  ckpt = Checkpointer(str(tmp_path), max_to_keep=5)
  save(ckpt, 1, state)
  save(ckpt, 2, state)
  ckpt.close()
  files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "2" / "state") for f in fs
           if os.sep + "d" + os.sep in os.path.join(d, f)]
  biggest = max(files, key=os.path.getsize)
  assert os.path.getsize(biggest) > 100_000, "the arrays should live in a data file"
  os.truncate(biggest, os.path.getsize(biggest) // 3)
  ckpt = Checkpointer(str(tmp_path), max_to_keep=5)
  before = logging.getLogger("asyncio").level
  with pytest.raises(CheckpointError, match="is corrupt or incompatible") as err:
    ckpt.restore(2, abstract_like(state, shardings(state)), META)
  assert "resume from step 1" in str(err.value)
  assert "TensorStore(" not in str(err.value), "the spec's repr is not part of the message"
  assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
  assert logging.getLogger("asyncio").level == before, "quiet_reads restores the logger's level"
  ckpt.close()


def test_nonfinite_parameters_are_reported_as_a_corrupt_checkpoint(tmp_path):
  """Training only saves checked-finite parameters, so NaN/inf read back means damaged files (a
  review overwrote bytes inside an array file: the restore succeeded and the NaN surfaced a step
  later as 'lower the learning rate'). Here the state is written with a NaN directly."""
  state = make_state(SEED)
  bad = jax.tree.map(lambda x: x, state)
  bad["params"]["layers"][0]["b"] = state["params"]["layers"][0]["b"].at[3].set(jnp.nan)
  ckpt = Checkpointer(str(tmp_path), max_to_keep=5)
  save(ckpt, 1, state)
  save(ckpt, 2, bad)
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path), max_to_keep=5)
  with pytest.raises(CheckpointError, match=r"is corrupt: 1 parameter arrays hold NaN") as err:
    ckpt.restore(2, abstract_like(state, shardings(state)), META)
  assert "['layers'][0]['b']" in str(err.value) and "resume from step 1" in str(err.value)
  restored, _ = ckpt.restore(1, abstract_like(state, shardings(state)), META)  # the good one
  assert np.isfinite(np.asarray(restored["params"]["layers"][0]["b"])).all()
  ckpt.close()


def test_a_step_that_was_never_saved_is_named_as_missing(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  save(ckpt, 3, make_state(SEED))
  save(ckpt, 6, make_state(SEED))
  with pytest.raises(CheckpointError, match=r"no checkpoint step 5 .* holds steps \[3, 6\]"):
    ckpt.restore(5, abstract_like(make_state(SEED), shardings(make_state(SEED))), META)
  with pytest.raises(CheckpointError, match="no checkpoint step 5"):
    ckpt.read_meta(5)
  ckpt.close()


def test_arrays_that_decode_but_differ_are_reported_as_corrupt(tmp_path):
  """Damage that still reads back as finite numbers (here: step 2's array files replaced by those
  of another save of the same shapes, as a mixed-up copy would) loaded silently before the
  checksums; now it is named, nothing is deleted, and step 1 still restores."""
  state, other = make_state(SEED), make_state(SEED + 1)
  ckpt = Checkpointer(str(tmp_path / "run"), max_to_keep=5)
  save(ckpt, 1, state)
  save(ckpt, 2, state)
  ckpt.close()
  donor = Checkpointer(str(tmp_path / "donor"))
  save(donor, 2, other)
  donor.close()
  shutil.rmtree(tmp_path / "run" / "2" / "state")
  shutil.copytree(tmp_path / "donor" / "2" / "state", tmp_path / "run" / "2" / "state")
  ckpt = Checkpointer(str(tmp_path / "run"), max_to_keep=5)
  with pytest.raises(CheckpointError, match=r"is corrupt: \d+ state arrays read back differ") as err:
    ckpt.restore(2, abstract_like(state, shardings(state)), META)
  assert "checksum mismatch" in str(err.value) and "resume from step 1" in str(err.value)
  assert ckpt.all_steps() == [1, 2], "nothing deleted"
  restored, _ = ckpt.restore(1, abstract_like(state, shardings(state)), META)
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
  ckpt.close()


def test_checkpoints_without_checksums_still_restore(tmp_path):
  """Steps written before the checksums existed (meta without "checksums") are read unchecked."""
  import orbax.checkpoint as ocp
  state = make_state(SEED)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.manager.save(4, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"step": 4}),
      meta=ocp.args.JsonSave(META)))
  ckpt.wait()
  assert "checksums" not in ckpt.read_meta(4)
  restored, _ = ckpt.restore(4, abstract_like(state, shardings(state)), META)
  np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))
  ckpt.close()


def test_checksum_sees_one_ulp_a_swap_and_every_dtype():
  """One element moved by one ulp, two elements swapped, or a changed key changes the checksum;
  equal arrays give equal sums for bf16, float32, int32, bool and typed keys."""
  rng = np.random.default_rng(SEED)
  x = jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)
  base = state_checksums({"x": x})["['x']"]
  assert state_checksums({"x": jnp.array(x)})["['x']"] == base
  i, j = rng.integers(0, 5), rng.integers(0, 7)
  bumped = x.at[i, j].set(jnp.nextafter(x[i, j], jnp.inf))
  swapped = x.at[0, 0].set(x[1, 1]).at[1, 1].set(x[0, 0])
  assert state_checksums({"x": bumped})["['x']"] != base
  assert state_checksums({"x": swapped})["['x']"] != base
  leaves = {"bf16": x.astype(jnp.bfloat16), "i32": jnp.arange(9, dtype=jnp.int32),
            "b": x > 0, "key": jax.random.key(SEED), "scalar": jnp.float32(3.5)}
  sums = state_checksums(leaves)
  assert sums == state_checksums(jax.tree.map(jnp.array, leaves))
  assert sums["['key']"] != state_checksums({"key": jax.random.key(SEED + 1)})["['key']"]
  assert sums["['b']"] != state_checksums({"b": ~(x > 0)})["['b']"]


def _sharded_checksums():
  """Checksums of one array laid out on 4 devices in three ways, on Auto and Explicit meshes, and
  unsharded (run in a subprocess)."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 12)), jnp.bfloat16)
  out = [state_checksums({"x": x})["['x']"]]
  for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(kind,) * 2)
    for spec in (P(), P("a", "b"), P(("a", "b"), None)):
      y = jax.device_put(x, NamedSharding(mesh, spec))
      assert len(y.addressable_shards) == 4
      out.append(state_checksums({"x": y})["['x']"])
  return out


def test_checksum_does_not_depend_on_the_sharding():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  proc = subprocess.run([sys.executable, __file__, "sharded"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  sums = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(sums) == 7 and len(set(sums)) == 1, sums


if __name__ == "__main__":
  if sys.argv[1] == "sharded":
    print(json.dumps(_sharded_checksums()))


def test_corrupt_checkpoint_error_drops_tensorstores_spec(tmp_path):
  """TensorStore appends a repr of its spec (2,000+ characters for a missing manifest); the one-line
  error keeps the cause before it."""
  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  cause = 'NOT_FOUND: Metadata at "params.w/.zarray" in OCDBT database does not exist'
  for tail in (" [tensorstore_spec='{\"context\": " + "x" * 2000 + "}']",
               " See full TensorStore details: {" + "y" * 2000 + "}"):
    msg = ckpt._broken(4, "its arrays", ValueError(cause + tail))
    assert cause in msg and "tensorstore_spec" not in msg and len(msg) < 600, msg
  long = ckpt._broken(4, "its arrays", ValueError("z" * 5000))
  assert len(long) < 700 and long.count("z") == 400, len(long)
