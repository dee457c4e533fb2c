"""Bad input is refused early: every invalid NSAConfig / ModelConfig raises a ValueError naming the
field and saying how to fix it, and reference.check_nsa_inputs names the mis-shaped tensor."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax import reference
from nsa_jax.config import ModelConfig, NSAConfig


def assert_names_field_and_fix(excinfo, field):
  msg = str(excinfo.value)
  assert re.search(rf"\b{re.escape(field)}\b", msg), f"message does not name {field!r}: {msg}"
  assert "Fix" in msg, f"message gives no fix: {msg}"


NSA_BAD = [
    # (field named in the error, overrides)
    ("cmp_block", dict(cmp_block=24, cmp_stride=16)),  # l not a multiple of d
    ("sel_block", dict(cmp_block=32, cmp_stride=16, sel_block=72)),  # l' not a multiple of d
    ("cmp_block", dict(cmp_block=128, cmp_stride=16, sel_block=64)),  # l > l'
    ("num_selected", dict(num_selected=2)),  # 1 initial + 2 local forced, counted inside n
    ("num_selected", dict(num_selected=4, num_init_blocks=2, num_local_blocks=3)),
    ("num_heads", dict(num_heads=6, num_kv_heads=4)),
    ("window", dict(window=0)),
    ("window", dict(window=-3)),
    ("num_heads", dict(num_heads=0)),
    ("num_kv_heads", dict(num_kv_heads=0)),
    ("head_dim", dict(head_dim=0)),
    ("head_dim_v", dict(head_dim_v=0)),
    ("cmp_stride", dict(cmp_stride=0)),
    ("sel_block", dict(sel_block=0)),
    ("num_selected", dict(num_selected=0)),
    ("query_chunk", dict(query_chunk=0)),
    ("cmp_hidden", dict(cmp_hidden=0)),
    ("cmp_block", dict(cmp_block=2.5)),
    ("num_init_blocks", dict(num_init_blocks=-1)),
    ("num_local_blocks", dict(num_local_blocks=-1)),
    ("score_alignment", dict(score_alignment="spatial")),
    ("compression", dict(compression="conv")),
    ("gating", dict(gating="softmax")),
    ("selector", dict(selector="random")),
    ("implementation", dict(implementation="cuda")),
    ("branches", dict(branches=())),
    ("branches", dict(branches=["cmp", "win"])),  # a list, not a tuple
    ("branches", dict(branches=("cmp", "sparse"))),
    ("branches", dict(branches=("cmp", "cmp"))),
]


@pytest.mark.parametrize("field,overrides", NSA_BAD, ids=[f"{f}:{o}" for f, o in NSA_BAD])
def test_invalid_nsa_config_names_field_and_fix(field, overrides):
  with pytest.raises(ValueError) as excinfo:
    NSAConfig(**overrides)
  assert_names_field_and_fix(excinfo, field)


def test_branches_typed_without_quotes_get_the_command_line_syntax():
  """`--config.model.nsa.branches=(cmp,slc)` reaches the config as one string in a tuple; the
  error shows the quoted form that works."""
  with pytest.raises(ValueError, match=r"'\(cmp,slc\)' is not a branch name.*"
                     r"branches=\"\('cmp','slc'\)\""):
    NSAConfig(branches=("(cmp,slc)",))


MODEL_BAD = [
    ("n_heads", dict(n_heads=6, n_kv_heads=4)),
    ("head_dim", dict(head_dim=31)),  # odd: RoPE rotates pairs
    ("layer_attention", dict(n_layers=4, layer_attention=("nsa", "dense"))),
    ("layer_attention", dict(n_layers=2, layer_attention=("nsa", "sparse"))),
    ("attention", dict(attention="linear")),
    ("dtype", dict(dtype="int8")),
    ("param_dtype", dict(param_dtype="float64")),
    ("vocab_size", dict(vocab_size=0)),
    ("d_model", dict(d_model=-1)),
    ("n_layers", dict(n_layers=0)),
    ("n_kv_heads", dict(n_kv_heads=0)),
    ("ffn_dim", dict(ffn_dim=0)),
    ("max_seq_len", dict(max_seq_len=0)),
    # selection_from_layer: a dense layer, the last NSA layer, no selection branch, the aux gate
    ("selection_from_layer", dict(n_layers=3, layer_attention=("dense", "nsa", "nsa"),
                                  selection_from_layer=0)),
    ("selection_from_layer", dict(n_layers=3, selection_from_layer=2)),
    ("selection_from_layer", dict(n_layers=3, selection_from_layer=-1)),
    ("selection_from_layer", dict(n_layers=3, selection_from_layer=0, nsa=NSAConfig(
        num_heads=8, num_kv_heads=2, head_dim=32, branches=("cmp", "win"), cmp_block=16,
        cmp_stride=8, sel_block=32, num_selected=4, window=64))),
    ("selection_from_layer", dict(n_layers=3, selection_from_layer=0, nsa=NSAConfig(
        num_heads=8, num_kv_heads=2, head_dim=32, selector="aux", cmp_block=16, cmp_stride=8,
        sel_block=32, num_selected=4, window=64))),
]


@pytest.mark.parametrize("field,overrides", MODEL_BAD, ids=[f"{f}:{o}" for f, o in MODEL_BAD])
def test_invalid_model_config_names_field_and_fix(field, overrides):
  with pytest.raises(ValueError) as excinfo:
    ModelConfig(**overrides)
  assert_names_field_and_fix(excinfo, field)


def test_model_config_validates_its_nsa_block():
  """The head layout is copied into the NSA config, which must then still be valid."""
  with pytest.raises(ValueError) as excinfo:
    ModelConfig(nsa=NSAConfig(num_heads=8, num_kv_heads=2, head_dim=32, cmp_block=16,
                              cmp_stride=8, sel_block=32, num_selected=2, window=64))
  assert_names_field_and_fix(excinfo, "num_selected")


def test_valid_configs_and_derived_sizes():
  cfg = NSAConfig()  # the paper's settings
  assert (cfg.group_size, cfg.dim_v, cfg.cmp_hidden_dim) == (16, 128, 384)
  for t in (1, 31, 32, 33, 47, 48, 8192):
    assert cfg.num_cmp_blocks(t) == (0 if t < 32 else (t - 32) // 16 + 1)
    assert cfg.num_sel_blocks(t) == -(-t // 64)
  model = ModelConfig(n_heads=8, n_kv_heads=4, head_dim=16, n_layers=2,
                      layer_attention=("dense", "nsa"))
  assert model.attention_kinds == ("dense", "nsa")
  assert (model.nsa.num_heads, model.nsa.num_kv_heads, model.nsa.head_dim) == (8, 4, 16)
  assert ModelConfig(head_dim_v=24).nsa.dim_v == 24


# ----------------------------------------------------------------------------- input shapes

CFG = NSAConfig(num_heads=4, num_kv_heads=2, head_dim=8, head_dim_v=6, cmp_block=4, cmp_stride=2,
                sel_block=8, num_selected=3, window=4, implementation="reference")
B, T = 2, 20
NC = CFG.num_cmp_blocks(T)
GOOD = dict(q=(B, T, 4, 8), k_cmp=(B, NC, 2, 8), v_cmp=(B, NC, 2, 6), k_slc=(B, T, 2, 8),
            v_slc=(B, T, 2, 6), k_win=(B, T, 2, 8), v_win=(B, T, 2, 6), gates=(B, T, 4, 3))
NAMES = tuple(GOOD)


def nsa_inputs(**shapes):
  return [jnp.zeros(shapes.get(n, GOOD[n]), jnp.float32) for n in NAMES]


def test_good_shapes_pass():
  reference.check_nsa_inputs(*nsa_inputs(), CFG, segment_ids=jnp.zeros((B, T), jnp.int32))
  o = reference.nsa_attention(*nsa_inputs(), CFG)
  assert o.shape == (B, T, 4, 6)


BAD_SHAPES = [
    ("k_cmp", (B, NC + 1, 2, 8)), ("k_cmp", (B, NC, 1, 8)), ("v_cmp", (B, NC, 2, 8)),
    ("k_slc", (B, T - 1, 2, 8)), ("v_slc", (B, T, 2, 5)), ("k_win", (B, T, 4, 8)),
    ("v_win", (1, T, 2, 6)), ("gates", (B, T, 4, 2)), ("gates", (B, T, 2, 3)),
    ("q", (B, T, 3, 8)), ("q", (B, T, 4, 7)), ("q", (B, T, 32)),
]


@pytest.mark.parametrize("name,shape", BAD_SHAPES, ids=[f"{n}{s}" for n, s in BAD_SHAPES])
def test_mismatched_shape_names_the_tensor(name, shape):
  for fn in (reference.check_nsa_inputs, reference.nsa_attention):
    with pytest.raises(ValueError) as excinfo:
      fn(*nsa_inputs(**{name: shape}), CFG)
    msg = str(excinfo.value)
    assert re.match(rf"{name}\b", msg), f"message does not start with {name!r}: {msg}"
    assert "Fix" in msg, f"message gives no fix: {msg}"
    if name != "q":  # the expected shape is the fix
      assert str(GOOD[name]) in msg, f"message does not give the expected shape: {msg}"


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas-triton"])
def test_a_missing_input_that_a_branch_reads_is_named(impl):
  """A None that an enabled branch reads is refused by every path (the plain-JAX path took a missing
  k_cmp for "no compressed blocks": a zero compression branch and forced-only selection; the
  others failed with AttributeError); one that nothing reads stays allowed."""
  import dataclasses
  from nsa_jax import ops
  cfg = dataclasses.replace(CFG, head_dim=16, head_dim_v=16)  # shapes the kernels take
  shapes = dict(GOOD, q=(B, T, 4, 16), k_cmp=(B, NC, 2, 16), v_cmp=(B, NC, 2, 16),
                k_slc=(B, T, 2, 16), v_slc=(B, T, 2, 16), k_win=(B, T, 2, 16), v_win=(B, T, 2, 16))
  args = dict(zip(NAMES, nsa_inputs(**shapes)))
  for branches, selector, missing in (
      (("cmp", "slc", "win"), "nsa", "k_cmp"), (("slc", "win"), "nsa", "v_cmp"),
      (("cmp", "slc"), "nsa", "v_slc"), (("cmp", "win"), "nsa", "k_win"),
      (("cmp", "slc", "win"), "nsa", "gates")):
    c = dataclasses.replace(cfg, branches=branches, selector=selector)
    with pytest.raises(ValueError, match=rf"{missing} is None, but branches=.* read it\. Fix: "):
      ops.nsa_attention(**dict(args, **{missing: None}), cfg=c, implementation=impl)
  c = dataclasses.replace(cfg, branches=("slc", "win"), selector="quest")  # nothing reads k/v_cmp
  o = ops.nsa_attention(**dict(args, k_cmp=None, v_cmp=None), cfg=c, implementation=impl)
  assert o.shape == (B, T, 4, 16)


def test_an_empty_sequence_is_refused_by_every_path():
  """T = 0 failed deep inside each path with an unrelated error."""
  from nsa_jax import ops
  shapes = {n: (B, 0) + GOOD[n][2:] for n in NAMES}
  shapes["k_cmp"], shapes["v_cmp"] = (B, 0, 2, 8), (B, 0, 2, 6)
  for impl in ("reference", "xla"):
    with pytest.raises(ValueError, match=r"batch and time must be at least 1\. Fix: "):
      ops.nsa_attention(*nsa_inputs(**shapes), CFG, implementation=impl)


def test_mismatched_segment_ids_named():
  for bad in ((B, T + 1), (T,), (1, T)):
    with pytest.raises(ValueError, match=r"segment_ids.*expected"):
      reference.check_nsa_inputs(*nsa_inputs(), CFG, segment_ids=np.zeros(bad, np.int32))


def test_reused_segment_id_is_accepted_as_another_document():
  """An id that comes back later in a row starts another document (reference.document_runs;
  tests/test_document_runs.py checks every path): accepted, not refused."""
  seg = np.zeros((B, T), np.int32)
  seg[:, T // 3:] = 1
  seg[:, 2 * T // 3:] = 0  # document 0's id again after document 1
  reference.check_nsa_inputs(*nsa_inputs(), CFG, segment_ids=seg)
  with pytest.raises(TypeError, match=r"segment_ids has dtype float64.*Fix"):
    reference.check_nsa_inputs(*nsa_inputs(), CFG, segment_ids=seg + 0.5)


def test_quest_needs_a_forced_current_block():
  with pytest.raises(ValueError, match=r"num_local_blocks.*Fix"):
    NSAConfig(selector="quest", num_local_blocks=0)
  NSAConfig(selector="quest", num_local_blocks=1)
