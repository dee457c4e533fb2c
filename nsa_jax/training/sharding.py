"""Device mesh and the logical-axis rules that turn module annotations into NamedShardings.

Modules name each parameter axis logically ("embed", "heads", ...); one rules table in the config
maps those names onto the mesh axes (data, fsdp, tensor). Nothing else in training knows layouts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from nsa_jax.layers import BATCH_MESH_AXES

MESH_AXES = ("data", "fsdp", "tensor")
# Batch rows are split over every axis that holds a different slice of the data; the model pins its
# activations and shards its attention by the same names (nsa_jax.layers).
BATCH_AXES = BATCH_MESH_AXES

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Resolves (data, fsdp, tensor) sizes; at most one may be -1 (= fill with what is left)."""
  shape = [int(sizes[a]) for a in MESH_AXES]
  fills = [i for i, s in enumerate(shape) if s == -1]
  if len(fills) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, shape))}: each must be >= 1, and at most one "
                     "may be -1 (fill). Fix: e.g. --config.mesh.data=-1 --config.mesh.fsdp=1")
  known = math.prod(s for s in shape if s != -1)
  if fills:
    if num_devices % known:
      raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, shape))} cannot fill {num_devices} devices "
                       f"({num_devices} is not a multiple of {known}). Fix: change the fixed sizes.")
    shape[fills[0]] = num_devices // known
  if math.prod(shape) != num_devices:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} uses {math.prod(shape)} devices but "
                     f"{num_devices} are present. Fix: make the product match or set one size to -1.")
  return tuple(shape)


def make_mesh(sizes: Mapping[str, int], devices=None) -> jax.sharding.Mesh:
  """Builds the (data, fsdp, tensor) mesh over all devices (all processes)."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(sizes, len(devices))
  # Auto axes on purpose: the model is written without sharding-in-types, so XLA's propagation
  # places activations; we pin parameters, optimizer state and batches with explicit shardings.
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def rules_dict(rules: Rules) -> dict[str, tuple[str, ...]]:
  """Validates the rules table and normalises each target to a tuple of mesh axes."""
  out = {}
  for entry in rules:
    if len(entry) != 2:
      raise ValueError(f"sharding rule {entry!r} must be a (logical_name, mesh_axis) pair")
    name, target = entry
    targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    for t in targets:
      if t not in MESH_AXES:
        raise ValueError(f"sharding rule {name!r} -> {t!r}: unknown mesh axis. Fix: use one of "
                         f"{MESH_AXES} or None.")
    out[name] = targets
  return out


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], rules: Rules,
                    mesh: jax.sharding.Mesh, where: str = "") -> P:
  """Maps one parameter's logical axis names to a PartitionSpec over the mesh."""
  table = rules_dict(rules)
  if len(names) != len(shape):
    raise ValueError(f"{where}: {len(names)} logical axis names {tuple(names)} for a rank-"
                     f"{len(shape)} array {tuple(shape)}")
  spec, used = [], set()
  for name, dim in zip(names, shape):
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise ValueError(f"{where}: logical axis {name!r} has no sharding rule. Fix: add "
                       f"({name!r}, <mesh axis or None>) to config.mesh.rules.")
    axes = tuple(a for a in table[name] if a not in used)  # a mesh axis may shard one dim only
    size = math.prod(mesh.shape[a] for a in axes)
    if dim % size:
      raise ValueError(f"{where}: dimension {name!r} of size {dim} is not divisible by mesh axes "
                       f"{axes} of total size {size}. Fix: change the mesh sizes or the model width.")
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def _logical_names(var: nnx.Variable, rank: int):
  names = var.get_metadata().get("out_sharding")
  return tuple(names) if names else (None,) * rank


def param_specs(abstract_state: nnx.State, rules: Rules, mesh) -> dict:
  """Pure-dict tree of PartitionSpecs for an (abstract) nnx.State of annotated Variables."""
  def one(path, var):
    where = "/".join(str(getattr(k, "key", k)) for k in path)
    return logical_to_spec(_logical_names(var, len(var.shape)), var.shape, rules, mesh, where)
  specs = jax.tree_util.tree_map_with_path(
      one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(specs)


def named(mesh, spec_tree):
  """PartitionSpec tree -> NamedSharding tree."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                      is_leaf=lambda x: isinstance(x, P))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
  """Rows over (data, fsdp), sequence unsplit."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_divisor(mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
