# Trial (2026-11-30, rejected): the window branch as two dense causal cuDNN calls on 512-token
# chunks (the chunk itself, and the previous chunk seen through a flip) against cuDNN's sliding
# window, forward and forward+backward (ms). Results: benchmarks/results/window_chunks_trial.md.
#   python3 benchmarks/window_chunks_trial.py      (on a GPU; public jax.nn.dot_product_attention)
# Timing only: outputs are not the window branch's (no lse merge), which is why it is a trial.
import time, jax, jax.numpy as jnp
def timeit(f, *a, iters=10):
  r = f(*a); jax.block_until_ready(r)
  t0 = time.perf_counter()
  for _ in range(iters): r = f(*a)
  jax.block_until_ready(r)
  return (time.perf_counter() - t0) / iters * 1e3
def dpa(q, k, v, **kw):
  return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
for (b, t, h, kh, d) in [(8, 8192, 16, 1, 64), (1, 65536, 64, 4, 128), (1, 65536, 64, 4, 192)]:
  key = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(key[0], (b, t, h, d), jnp.bfloat16)
  k = jax.random.normal(key[1], (b, t, kh, d), jnp.bfloat16)
  v = jax.random.normal(key[2], (b, t, kh, d), jnp.bfloat16)
  c = 512
  win = lambda q, k, v: dpa(q, k, v, is_causal=True, local_window_size=(c - 1, 0))
  def chunks(q, k, v):
    r = lambda x: x.reshape(b * t // c, c, *x.shape[2:])
    o1 = dpa(r(q), r(k), r(v), is_causal=True)
    o2 = dpa(r(q)[:, ::-1], r(k)[:, ::-1], r(v)[:, ::-1], is_causal=True)
    return o1 + o2[:, ::-1]
  def chunks_noflip(q, k, v):
    r = lambda x: x.reshape(b * t // c, c, *x.shape[2:])
    return dpa(r(q), r(k), r(v), is_causal=True) + dpa(r(q), jnp.roll(r(k), 1, 0), jnp.roll(r(v), 1, 0), is_causal=True)
  dense = lambda q, k, v: dpa(q, k, v, is_causal=True)
  res = {}
  for name, f in [("window", win), ("chunks", chunks), ("chunks_noflip", chunks_noflip), ("dense", dense)]:
    fw = jax.jit(f)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    res[name] = (timeit(fw, q, k, v), timeit(g, q, k, v))
  print((b, t, h, kh, d), {n: (round(a, 3), round(bb, 3)) for n, (a, bb) in res.items()}, flush=True)
