"""The NSA and dense ops under a device mesh: per-device shard_map, same numbers, no data movement.

Runs itself as a subprocess on 8 simulated CPU devices (XLA_FLAGS must be set before jax starts).
For data, fsdp, tensor and mixed meshes it checks that
  - forward and gradients equal the unsharded op (fresh random inputs, float32);
  - the compiled op over inputs laid out as the training loop lays them out (batch over data x
    fsdp, heads over tensor) contains no collective at all: no all-gather of the sequence, batch or
    heads (the attention op moves no data between devices);
  - KV heads the tensor axis does not divide fall back to whole heads with a warning naming the fix.
The Pallas kernels (interpret mode) are checked on one mixed mesh, the plain-JAX path on all.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _inputs(seed, b, t, h, k, dk, dv, cfg):
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  nc = cfg.num_cmp_blocks(t)
  shapes = [(b, t, h, dk), (b, nc, k, dk), (b, nc, k, dv), (b, t, k, dk), (b, t, k, dv),
            (b, t, k, dk), (b, t, k, dv)]
  xs = [jax.random.normal(kk, s, jnp.float32) for kk, s in zip(ks, shapes)]
  gates = jax.nn.sigmoid(jax.random.normal(ks[7], (b, t, h, 3)))
  # two documents per row, the boundary inside a selection block
  seg = (jnp.arange(t)[None, :] >= t // 2 + 5).astype(jnp.int32) * jnp.ones((b, 1), jnp.int32)
  return xs + [gates], seg


def _run(seed: int):
  import logging

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  from nsa_jax import ops
  from nsa_jax.config import NSAConfig

  assert jax.device_count() == 8, jax.devices()
  warnings = []
  handler = logging.Handler()
  infos = []
  handler.emit = lambda r: (warnings if r.levelno >= logging.WARNING else infos).append(r.getMessage())
  logging.getLogger("nsa_jax").addHandler(handler)
  logging.getLogger("nsa_jax").setLevel(logging.INFO)

  b, t, h, k, dk, dv = 4, 160, 8, 4, 32, 16  # T not a multiple of l'; d_k != d_v
  base = dict(num_heads=h, num_kv_heads=k, head_dim=dk, head_dim_v=dv, cmp_block=16, cmp_stride=8,
              sel_block=32, num_selected=3, window=32)
  arrays, seg = _inputs(seed, b, t, h, k, dk, dv, NSAConfig(**base))
  weights = jnp.cos(jnp.arange(b * t * h * dv, dtype=jnp.float32)).reshape(b, t, h, dv)

  def mesh_of(shape):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:n])

  def check(impl, shape, use_seg):
    cfg = NSAConfig(**base, implementation=impl)
    sg = seg if use_seg else None

    def op(*xs):
      return ops.nsa_attention(*xs, cfg, segment_ids=sg)

    def loss(*xs):
      return jnp.sum(op(*xs) * weights)

    grad = jax.value_and_grad(loss, argnums=tuple(range(8)))
    want_l, want_g = jax.jit(grad)(*arrays)
    mesh = mesh_of(shape)
    with jax.set_mesh(mesh):
      got_l, got_g = jax.jit(grad)(*arrays)
      # Lay the inputs out as training does: rows over (data, fsdp), heads over tensor.
      spec = P(("data", "fsdp"), None, "tensor", None)
      placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]
      fwd = jax.jit(op, out_shardings=NamedSharding(mesh, spec))
      hlo = fwd.lower(*placed).compile().as_text()
      np.testing.assert_allclose(np.asarray(fwd(*placed)), np.asarray(op(*arrays)), rtol=2e-5,
                                 atol=2e-5)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=2e-5, atol=1e-3)
    for name, a, w in zip(("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"),
                          got_g, want_g):
      np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-4, atol=2e-4,
                                 err_msg=f"{impl} mesh {shape}: d{name}")
    found = [c for c in COLLECTIVES if c in hlo]
    assert not found, f"{impl} mesh {shape}: the sharded NSA op contains {found}"
    print(f"ok nsa {impl} mesh={shape} seg={use_seg}")

  for shape in [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 2, 4)]:
    check("xla", shape, use_seg=shape == (2, 2, 2))

  # return_aux (selection_from_layer reads a layer's blocks in training) runs sharded too: the
  # same block indices and branch outputs as unsharded, and no collective in the op.
  cfg = NSAConfig(**{**base, "num_selected": 4}, implementation="xla")  # one block scored
  want_o, want_aux = ops.nsa_attention(*arrays, cfg, segment_ids=seg, return_aux=True)
  mesh = mesh_of((2, 1, 2))
  with jax.set_mesh(mesh):
    spec = P(("data", "fsdp"), None, "tensor", None)
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays]
    aux_fn = jax.jit(lambda *x: ops.nsa_attention(*x, cfg, segment_ids=seg, return_aux=True))
    got_o, got_aux = aux_fn(*placed)
    hlo = aux_fn.lower(*placed).compile().as_text()
  np.testing.assert_array_equal(np.asarray(got_aux["block_idx"]), np.asarray(want_aux["block_idx"]))
  np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), rtol=2e-5, atol=2e-5)
  for br in ("cmp", "slc", "win"):
    np.testing.assert_allclose(np.asarray(got_aux["outputs"][br]),
                               np.asarray(want_aux["outputs"][br]), rtol=2e-5, atol=2e-5)
  found = [c for c in COLLECTIVES if c in hlo]
  assert not found, f"return_aux under mesh (2, 1, 2): the op contains {found}"
  check("pallas", (2, 1, 2), use_seg=True)  # the kernels themselves, in Pallas' interpreter
  assert not warnings, warnings

  # The dense baseline goes through the same wrapper.
  q, kd, vd = arrays[0], arrays[3], arrays[5]
  want = ops.dense_attention(q, kd, vd, implementation="xla")
  with jax.set_mesh(mesh_of((2, 1, 4))):
    got = jax.jit(lambda *x: ops.dense_attention(*x, implementation="xla"))(q, kd, vd)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)

  # 4 KV heads over tensor=8: no split possible; whole heads on every device, with a warning.
  cfg = NSAConfig(**base, implementation="xla")
  want = ops.nsa_attention(*arrays, cfg)
  with jax.set_mesh(mesh_of((1, 1, 8))):
    got = jax.jit(lambda *x: ops.nsa_attention(*x, cfg))(*arrays)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  assert any("cannot be split over tensor=8" in w and "Fix:" in w for w in warnings), warnings
  assert any("heads over None (mesh {'data': 1, 'fsdp': 1, 'tensor': 8})" in m for m in infos), infos
  # The collectives report (training's config.train.hlo_report) sees data moved into the op: inputs
  # split over the sequence must be resharded at the op's boundary, and are reported as such.
  from nsa_jax.training import hlo_report
  mesh = mesh_of((2, 1, 2))
  seq_split = [jax.device_put(x, NamedSharding(mesh, P(None, "data", None, None)
                                               if x.shape[1] % 2 == 0 else P()))
               for x in arrays]
  with jax.set_mesh(mesh):
    hlo = jax.jit(lambda *x: ops.nsa_attention(*x, cfg)).lower(*seq_split).compile().as_text()
  moved = hlo_report.summarize(hlo_report.collectives(hlo), t)["in_attention_op"]
  assert moved and all("nsa_attention" in r["op_name"] for r in moved), moved
  print("ALL OK")


def test_sharded_ops_match_and_move_no_data():
  seed = int.from_bytes(os.urandom(4), "little")
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  proc = subprocess.run([sys.executable, __file__, str(seed)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
      f"seed {seed}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")


if __name__ == "__main__":
  _run(int(sys.argv[1]))
