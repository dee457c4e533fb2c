# Diagnostic (2026-12-01, twelfth session): how long tracing + lowering takes for L layers of the
# NSA op, forward + backward, with the Pallas kernels lowered for CUDA on an abstract H100 (no GPU
# needed), at the 8k training-layer shape (B=8, 16/1 heads, 64/64). The window branch ran plain
# JAX here when these numbers were taken (cuDNN cannot be traced without a GPU); since
# 2026-12-06 allow_cudnn=False gives it the Pallas window kernels (3 more Triton calls a layer). It splits NSA's start-up (86 s to step 10 at
# 8k on one H200, dense 14 s: benchmarks/results/train_startup_1gpu.json) into the Python side,
# measured here, and XLA's compilation, which is the rest.
#   PYTHONPATH=. python benchmarks/lowering_time_trial.py 12 [T]
# Measured on the 2-core CPU machine (code f6dd4c5): L=1 trace 0.6 s + lower 1.3 s (9 Triton and
# 3 Mosaic GPU custom calls); L=12 trace 3.7 s + lower 12.9 s (108 Triton custom calls: one per
# layer and kernel, identical kernels are not shared between layers). The training step also
# re-runs each layer's forward under remat, so its Python side is larger than this.
import sys, time
import re
import jax, jax.numpy as jnp
from nsa_jax import ops
from nsa_jax.config import NSAConfig
ops.on_gpu = lambda: True
_w = ops.window_attention
ops.window_attention = lambda *a, **k: _w(*a, **{**k, "allow_cudnn": False})
L = int(sys.argv[1]); T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
b, h, kh, d = 8, 16, 1, 64
cfg = NSAConfig(num_heads=h, num_kv_heads=kh, head_dim=d, head_dim_v=d)
nc = cfg.num_cmp_blocks(T)
S = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
args = [S(b, T, h, d), S(b, nc, kh, d), S(b, nc, kh, d), S(b, T, kh, d), S(b, T, kh, d),
        S(b, T, kh, d), S(b, T, kh, d), S(b, T, h, 3, dt=jnp.float32)]
def loss(*a):
  tot = 0.0
  q = a[0]
  for i in range(L):
    o = ops.nsa_attention(q, *a[1:], cfg, implementation="pallas")
    tot = tot + jnp.sum(o.astype(jnp.float32))
    q = (q.astype(jnp.float32) + 1e-3 * o.astype(jnp.float32)).astype(q.dtype)
  return tot
mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
with jax.sharding.use_abstract_mesh(mesh):
  t0 = time.perf_counter()
  tr = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6, 7))).trace(*args)
  t1 = time.perf_counter()
  low = tr.lower(lowering_platforms=("cuda",))
  t2 = time.perf_counter()
txt = low.as_text()
print(f"L={L} T={T}: trace {t1-t0:.1f} s, lower {t2-t1:.1f} s, "
      f"Triton custom calls: {txt.count('@__gpu$xla.gpu.triton')}, "
      f"Mosaic GPU custom calls: {len(re.findall(r'custom_call @mosaic_gpu', txt))}")
