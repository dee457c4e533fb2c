"""model.layer_loop: the layers as one jax.lax.scan per stretch of same-kind layers ("unrolled",
the default, and "scan") or a Python loop ("python").

The scans must be the same model (same parameters, same layout, same outputs and gradients as the
Python loop) and must do what they are for: trace each layer once, not once per layer (NSA's
start-up on the GPU: benchmarks/results/compile_time_*.json), and, rolled, lower each Pallas
kernel once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nsa_jax import ops
from nsa_jax.config import ModelConfig, NSAConfig
from nsa_jax.model import TransformerLM


def _cfg(**kw):
  base = dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=128,
              max_seq_len=128, nsa=NSAConfig(num_heads=4, num_kv_heads=1, head_dim=32,
                                             cmp_block=16, cmp_stride=8, sel_block=32,
                                             num_selected=3, window=32))
  base.update(kw)
  return ModelConfig(**base)


def _pair(mode="unrolled", **kw):
  """(Python-loop model, `mode` model) built from the same seed."""
  cfg = _cfg(**kw)
  return (TransformerLM(dataclasses.replace(cfg, layer_loop="python"), rngs=nnx.Rngs(0)),
          TransformerLM(dataclasses.replace(cfg, layer_loop=mode), rngs=nnx.Rngs(0)))


def _tokens(seed, t=128, b=2):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, 256)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("mode", ["unrolled", "scan"])
@pytest.mark.parametrize("kw", [
    {},                                                     # all NSA
    {"layer_attention": ("dense", "nsa", "nsa", "dense"), "n_layers": 4},  # three stretches
    {"attention": "dense", "remat": True},                  # remat inside the scan
    {"remat": True, "nsa": NSAConfig(num_heads=4, num_kv_heads=1, head_dim=32, cmp_block=16,
                                     cmp_stride=8, sel_block=32, num_selected=3, window=32,
                                     selector="aux")},     # per-layer selector losses
    {"layer_attention": ("nsa", "dense", "nsa"),           # selector losses across stretches,
     "nsa": NSAConfig(num_heads=4, num_kv_heads=1, head_dim=32, cmp_block=16, cmp_stride=8,
                      sel_block=32, num_selected=3, window=32, selector="aux")},  # dense: none
])
def test_scan_equals_the_layer_loop(kw, mode):
  loop, scan = _pair(mode, **kw)
  if loop.uses_aux_selector:
    # At the initial scale both attentions are near uniform and the selector's KL is ~1e-8, all
    # rounding; sharper weights make it a number worth comparing.
    for m in (loop, scan):
      nnx.update(m, jax.tree.map(lambda p: 2.0 * p, nnx.state(m, nnx.Param)))
  # Same parameters, same tree: checkpoints, decoding and sharding rules do not see the flag.
  s_loop, s_scan = nnx.state(loop, nnx.Param), nnx.state(scan, nnx.Param)
  assert jax.tree.structure(s_loop) == jax.tree.structure(s_scan)
  for a, b in zip(jax.tree.leaves(s_loop), jax.tree.leaves(s_scan)):
    np.testing.assert_array_equal(a, b)
  tok = _tokens(1)
  aux = loop.uses_aux_selector
  # Two documents; not with the aux selector, whose loss needs >= 2 complete past blocks in a
  # document to be more than rounding (64-token documents hold one 32-token block before a query).
  seg = None if aux else jnp.asarray(np.repeat([[0, 1]], 64, axis=1).repeat(2, 0), jnp.int32)

  # Positions other than 0..T-1 (RoPE reads them): a layer that dropped them would differ.
  pos = jnp.broadcast_to(jnp.arange(128) * 3 + 5, (2, 128))

  def loss(model):
    if aux:
      logits, sel = model(tok, segment_ids=seg, positions=pos, return_selector_loss=True)
      return jnp.mean(logits ** 2) + jnp.mean(sel), (logits, sel)
    logits = model(tok, segment_ids=seg, positions=pos)
    return jnp.mean(logits ** 2), (logits, None)

  (l1, (o1, sel1)), g1 = nnx.value_and_grad(loss, has_aux=True)(loop)
  (l2, (o2, sel2)), g2 = nnx.value_and_grad(loss, has_aux=True)(scan)
  # float32 throughout; the scan and the loop fuse differently (x2 weights: larger rounding)
  tol = 5e-4 if aux else 1e-5
  assert _rel(o2, o1) < tol
  if aux:
    assert _rel(sel2, sel1) < tol and float(jnp.max(jnp.abs(sel1))) > 1.0
  g1, g2 = nnx.state(g1, nnx.Param), nnx.state(g2, nnx.Param)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(g1),
                               jax.tree_util.tree_leaves_with_path(g2)):
    assert float(jnp.max(jnp.abs(a))) > 0, f"zero gradient at {jax.tree_util.keystr(path)}"
    assert _rel(b, a) < 10 * tol, f"gradient differs at {jax.tree_util.keystr(path)}"


def test_scans_rematerialise_when_asked():
  """remat=True puts each scanned layer under jax.checkpoint (equal outputs cannot show it)."""
  for remat in (False, True):
    _, scan = _pair("unrolled", attention="dense", remat=remat)
    graphdef, state = nnx.split(scan)
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(_tokens(3)))(state))
    assert ("checkpoint" in jaxpr or "remat" in jaxpr) == remat


def test_scans_refuse_layers_they_would_change():
  """Layers with state other than nnx.Param (which a forward could update and the scan would
  drop), or same-kind layers built differently, are refused with the fix, not run wrong."""
  _, scan = _pair()
  for block in scan.blocks:
    block.counter = nnx.Variable(jnp.zeros(()))
  with pytest.raises(ValueError, match="only state is nnx.Param.*layer_loop='python'"):
    scan(_tokens(4))
  _, scan = _pair()
  scan.blocks[2].extra = nnx.Param(jnp.zeros((3,)))
  with pytest.raises(ValueError, match="layers 0 and 2 have different structures.*"
                                       "layer_loop='python'"):
    scan(_tokens(4))


def test_scan_still_reports_each_layers_selection():
  """return_aux (the selection picture) walks the layers one by one in every layer_loop mode."""
  loop, scan = _pair()
  tok = _tokens(2)
  (o1, a1), (o2, a2) = loop(tok, return_aux=True), scan(tok, return_aux=True)
  assert len(a2) == 3 and _rel(o2, o1) < 1e-6
  for x, y in zip(a1, a2):
    np.testing.assert_array_equal(x["block_idx"], y["block_idx"])


def _abstract_gpu_lowering(cfg, mode, monkeypatch):
  """(calls of ops.nsa_attention while tracing, Triton custom calls in the CUDA lowering) of the
  model's gradient, lowered for an abstract H100 (no GPU needed)."""
  monkeypatch.setattr(ops, "on_gpu", lambda: True)
  win = ops.window_attention
  monkeypatch.setattr(ops, "window_attention",
                      lambda *a, **k: win(*a, **{**k, "allow_cudnn": False}))
  calls = []
  op = ops.nsa_attention
  monkeypatch.setattr(ops, "nsa_attention", lambda *a, **k: calls.append(1) or op(*a, **k))
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
  model = TransformerLM(dataclasses.replace(cfg, layer_loop=mode), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def loss(state, tok):
    return jnp.mean(nnx.merge(graphdef, state)(tok) ** 2)

  tok = jax.ShapeDtypeStruct((1, 512), jnp.int32)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(jax.grad(loss)).trace(abstract, tok).lower(
        lowering_platforms=("cuda",)).as_text()
  return len(calls), text.count("__gpu$xla.gpu.triton")


def test_scans_trace_each_layer_once(monkeypatch):
  """With the Pallas implementation: the Python loop traces the NSA op once per layer; both scans
  trace it once per stretch of NSA layers. Rolled, the lowering also holds each Triton kernel
  once; unrolled it holds one copy per layer (as the loop does), the program XLA runs fastest."""
  layers = 3
  nsa = NSAConfig(num_heads=16, num_kv_heads=1, head_dim=64, cmp_block=32, cmp_stride=16,
                  sel_block=64, num_selected=4, window=64, implementation="pallas")
  cfg = _cfg(n_layers=layers, n_heads=16, head_dim=64, max_seq_len=512, nsa=nsa,
             dtype="bfloat16")
  got = {m: _abstract_gpu_lowering(cfg, m, monkeypatch) for m in ("python", "unrolled", "scan")}
  (loop_traces, loop_kernels) = got["python"]
  assert loop_traces == layers and loop_kernels > 0, got
  assert got["unrolled"] == (1, loop_kernels), got
  assert got["scan"] == (1, loop_kernels // layers), got


def test_layer_loop_is_checked():
  with pytest.raises(ValueError, match="layer_loop"):
    _cfg(layer_loop="loop")
