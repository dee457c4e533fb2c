"""FLA's NSA kernels (fla-org/flash-linear-attention, `fla.ops.nsa`, Triton + PyTorch) timed on this
GPU with PyTorch's own cuDNN dense attention in the same process, so that our tables can be put
beside the best public NSA kernels measured on the same machine in the same device call.

  python3 -m experiments.bench_fla --T 8192,16384,32768,65536 --out $OUT --tag h100
  python3 -m experiments.compare_fla --ours nsa.json --ours_select select.json \
      --fla fla_nsa_h100.json

Needs PyTorch with CUDA and the wheels `fla-core` and `flash-linear-attention` (pure Python; on the
device machine carry them: `pip download --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0`).
It is a cross-check, not a dependency of nsa-jax: nothing in nsa_jax/ or pallas_kernels/ imports it.

What is timed (bf16, B=1, 64 query / 4 KV heads, d_k = d_v, n = 16, l' = 64, one GPU):
- `fla_select`: FLA's selection kernel alone (`parallel_nsa` given block indices), on exactly the
  index lists of our `bench_kernels` (same generator, same key: "random" and "clustered");
- `fla_nsa`: FLA's compression + top-n + selection (`parallel_nsa` with g_cmp and g_slc, no
  block indices): mean-pooled compression with l = d = l' = 64 (FLA's design; the paper's l = 32,
  d = 16 gives our op 4x the compressed blocks), and no sliding-window branch (FLA runs it through
  the flash-attn package, which the device lacks);
- `dense_torch`: torch SDPA with the cuDNN backend, causal, GQA (the baseline of each row).
"bwd" = (forward + backward) - forward, as in bench_nsa; forward runs under no_grad.
Writes <out>/fla_nsa_<tag>.json (a list of records: op, impl, pass, T, ..., ms, cudnn_ms, speedup,
hardware, date, command) and .md.
"""

from __future__ import annotations

import argparse
import os
import sys

# The indices come from jax on the CPU (bench_kernels' generator): torch owns the GPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments import cli  # noqa: E402

NEEDS = ("PyTorch with CUDA and the fla-core + flash-linear-attention wheels (pip install "
         "fla-core==0.6.0 flash-linear-attention==0.6.0 --no-deps; transformers and einops too)")


def load_torch_fla():
  """(torch, parallel_nsa) or a clear error naming what is missing and how to get it."""
  try:
    import torch
  except ImportError as e:
    raise SystemExit(f"error: bench_fla needs {NEEDS}; PyTorch is missing ({e}). Fix: run it "
                     "where PyTorch is installed (the device machine's python3 has it)")
  if not torch.cuda.is_available():
    raise SystemExit("error: bench_fla times GPU kernels and PyTorch sees no CUDA device. Fix: "
                     "run it on a GPU machine")
  try:
    from fla.ops.nsa import parallel_nsa
  except ImportError as e:
    raise SystemExit(f"error: bench_fla needs {NEEDS}; import fla.ops.nsa failed ({e})")
  return torch, parallel_nsa


def fwd_bwd_ms(torch, f, inputs, do, iters):
  """(fwd ms under no_grad, (fwd + bwd) - fwd ms) of o = f(*inputs), gradients in every input;
  bench_common's timer with torch's device wait."""
  from experiments import bench_common as bc
  sync = lambda _: torch.cuda.synchronize()
  with torch.no_grad():
    fwd = bc.time_ms(f, *inputs, iters=iters, sync=sync)
  both = lambda *x: torch.autograd.grad(f(*x), x, do)
  return fwd, bc.time_ms(both, *inputs, iters=iters, sync=sync) - fwd


def block_indices(torch, t, kh, n, bs, pattern):
  """bench_kernels' index lists ([1, T, K, n], -1 in empty slots) for this pattern, same key."""
  import numpy as np
  import jax
  from experiments.bench_kernels import index_pattern
  idx = np.asarray(index_pattern(jax.random.key(3), 1, t, kh, n, bs, pattern))
  return torch.from_numpy(idx.astype(np.int64)).cuda()


def dense_sdpa(torch):
  """Causal GQA attention through torch SDPA's cuDNN backend: o [B, T, H, D] from [B, T, *, D]."""
  from torch.nn.attention import SDPBackend, sdpa_kernel
  import torch.nn.functional as F

  def f(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
      o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    return o.transpose(1, 2)
  return f


def bench_length(torch, parallel_nsa, t, h, kh, d, n, bs, patterns, iters):
  """Records for one sequence length: dense, FLA's selection per pattern, FLA's whole op."""
  from experiments import bench_common as bc
  g = torch.Generator(device="cuda").manual_seed(t)
  rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
  q, k, v = (rnd(1, t, h, d).requires_grad_(), rnd(1, t, kh, d).requires_grad_(),
             rnd(1, t, kh, d).requires_grad_())
  do = rnd(1, t, h, d)
  gates = [torch.sigmoid(torch.randn(1, t, h, device="cuda", generator=g)).to(torch.bfloat16)
           for _ in range(2)]
  common = dict(batch=1, q_heads=h, kv_heads=kh, d_k=d, d_v=d,
                hardware=torch.cuda.get_device_name(),
                date=bc.utc_now(), command=bc.command_line(), code_commit=bc.code_commit(),
                torch=torch.__version__)
  dense = fwd_bwd_ms(torch, dense_sdpa(torch), (q, k, v), do, iters)
  print(f"T={t} dense cuDNN (torch) fwd {dense[0]:.2f} bwd {dense[1]:.2f} ms", flush=True)
  recs = []

  def add(op, impl, ms_pair, **extra):
    for p, ms, base in zip(("fwd", "bwd"), ms_pair, dense):
      recs.append(dict(op=op, impl=impl, T=t, ms=round(ms, 4), cudnn_ms=round(base, 4),
                       speedup=round(base / ms, 3), **{"pass": p}, **common, **extra))
    print(f"T={t} {op} {extra.get('pattern', '')} fwd {ms_pair[0]:.2f} bwd {ms_pair[1]:.2f} ms",
          flush=True)

  def attempt(what, fn):  # one op failing (a kernel that won't compile) is a finding, not a crash
    try:
      fn()
    except Exception as e:  # noqa: BLE001
      print(f"FAILED T={t} {what}: {type(e).__name__}: {str(e)[:400]}", flush=True)

  add("dense_torch", "torch sdpa cudnn (causal, enable_gqa)", dense)
  for pat in patterns:
    idx = block_indices(torch, t, kh, n, bs, pat)
    f = lambda q, k, v, idx=idx: parallel_nsa(q, k, v, block_indices=idx, block_counts=n,
                                              block_size=bs)
    attempt(f"fla_select {pat}", lambda f=f, pat=pat: add(
        "fla_select", "fla.ops.nsa parallel_nsa (given block indices)",
        fwd_bwd_ms(torch, f, (q, k, v), do, iters), pattern=pat))
    del idx
  f = lambda q, k, v: parallel_nsa(q, k, v, g_cmp=gates[0], g_slc=gates[1], block_counts=n,
                                   block_size=bs)
  attempt("fla_nsa", lambda: add(
      "fla_nsa", "fla.ops.nsa parallel_nsa: mean-pool compression (l=d=64) + top-n + selection, "
      "no window", fwd_bwd_ms(torch, f, (q, k, v), do, iters)))
  return recs


def write(recs, out, tag):
  from experiments import bench_common as bc
  pre = (f"# FLA's NSA kernels vs torch cuDNN dense attention ({recs[0]['hardware']})\n\n"
         f"Command: `{recs[0]['command']}`; torch {recs[0]['torch']}. See "
         "experiments/bench_fla.py for what each op covers.")
  bc.write_results(recs, out, f"fla_nsa_{tag}", pre)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--T", default="8192,16384,32768,65536")
  p.add_argument("--heads", default="64/4", help="query heads / KV heads")
  p.add_argument("--d", type=int, default=128, help="d_k = d_v")
  p.add_argument("--n", type=int, default=16)
  p.add_argument("--block", type=int, default=64)
  p.add_argument("--patterns", default="random,clustered")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--tag", default="gpu")
  a = p.parse_args(argv)
  try:
    lengths = [int(x) for x in a.T.split(",")]
    h, kh = (int(x) for x in a.heads.split("/"))
  except ValueError:
    p.error(f"--T={a.T!r} / --heads={a.heads!r}: expected e.g. --T 8192,65536 --heads 64/4")
  if h % kh or h // kh < 16 or (h // kh) & (h // kh - 1):
    p.error(f"--heads={a.heads}: FLA's NSA needs a power-of-two group size of at least 16")
  patterns = [x for x in a.patterns.split(",") if x]
  bad = [x for x in patterns if x not in ("random", "clustered")]
  if bad:
    p.error(f"--patterns: unknown {bad}; expected random and/or clustered")
  torch, parallel_nsa = load_torch_fla()
  recs = []
  for t in lengths:
    recs += bench_length(torch, parallel_nsa, t, h, kh, a.d, a.n, a.block, patterns, a.iters)
    if recs:
      write(recs, a.out, a.tag)
    torch.cuda.empty_cache()
  from experiments import bench_common as bc
  print(bc.markdown_table(recs, extra_cols=("pattern",)))
  return 0


if __name__ == "__main__":
  cli.run_main(main)
