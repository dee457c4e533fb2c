"""Experiments on CPU: the sweep machinery (overrides, parameter matching, run identity, results
table, curves, the CLI), the passkey generator and scorer, the trained-model adapters, the
position-loss evaluation and the selection picture, on a two-layer model trained for 2 steps.
"""

import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
from flax import nnx
import numpy as np
import optax
import pytest

from configs.sweep_base import MATCH_PARAMS, sweep_base_config
from experiments import ablate, bench_common, needle_eval, trained_model, visualize_selection as vis
from nsa_jax.training import data as data_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = int.from_bytes(os.urandom(3), "little")  # fresh every run; printed in failure messages


def tiny_config(seed=SEED):
  """Two layers (dense then NSA, two KV groups), 128 tokens, 2 steps: seconds on a CPU."""
  c = sweep_base_config()
  c.model.d_model, c.model.n_layers, c.model.head_dim, c.model.ffn_dim = 32, 2, 8, 64
  c.model.n_heads, c.model.n_kv_heads = 4, 2
  c.model.layer_attention = ("dense", "nsa")
  c.model.max_seq_len = c.data.seq_len = 128
  c.model.nsa.window = 32
  c.model.nsa.num_selected = 3
  c.data.global_batch_size = 2
  c.data.seed = c.train.seed = seed % 1000
  c.train.num_steps = 2
  c.train.log_every = 1
  c.train.eval_every = 2
  c.train.eval_batches = 1
  c.checkpoint.every_steps = 2
  return c


SWEEP_FILE = textwrap.dedent("""
    from configs.sweep_base import sweep_base_config
    REFERENCE = "nsa"
    def get_config():
      c = sweep_base_config()
      c.model.d_model, c.model.n_layers, c.model.head_dim, c.model.ffn_dim = 32, 2, 8, 64
      c.model.layer_attention = ("dense", "nsa")
      return c
    def get_runs():
      return {"nsa": {}, "dense": {"model.layer_attention": ("dense", "dense")},
              "dense_pm": {"model.layer_attention": ("dense", "dense"), "MATCH_PARAMS": "nsa"}}
""")


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("sweep") / "sweep_tiny.py"
  path.write_text(SWEEP_FILE)
  return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished tiny run (train_run: the path every sweep row takes)."""
  workdir = str(tmp_path_factory.mktemp("run"))
  config = tiny_config()
  rec = ablate.train_run(config, workdir)
  return workdir, config, rec


# ----------------------------------------------------------------------------- sweep machinery --

def test_overrides_param_matching_and_unknown_fields(sweep_file):
  module = ablate.load_sweep(sweep_file)
  runs = ablate.resolve_runs(module, module.get_config())
  assert list(runs) == ["nsa", "dense", "dense_pm"]
  assert runs["dense"][1].model.layer_attention == ("dense", "dense")
  assert runs["nsa"][1].model.layer_attention == ("dense", "nsa")
  p_nsa, p_dense, p_pm = (ablate.count_params(runs[n][1]) for n in ("nsa", "dense", "dense_pm"))
  assert p_dense < p_nsa, "NSA adds K/V projections, phi and gates: it must have more parameters"
  # One ffn step of 8 units costs 3 * d_model * 8 per layer: the match is within half of it.
  c = runs["dense_pm"][1]
  step = 3 * c.model.d_model * 8 * c.model.n_layers
  assert abs(p_pm - p_nsa) <= step / 2, (p_pm, p_nsa, c.model.ffn_dim)
  assert c.model.ffn_dim > runs["dense"][1].model.ffn_dim
  with pytest.raises(ValueError, match="no field 'n_layer'"):
    ablate.set_field(module.get_config(), "model.n_layer", 3)
  with pytest.raises(ValueError, match="must come earlier"):
    bad = type("M", (), {"get_runs": staticmethod(lambda: {"a": {MATCH_PARAMS: "b"}, "b": {}})})
    ablate.resolve_runs(bad, module.get_config())


def test_config_hash_ignores_ui_fields_only():
  a, b = tiny_config(seed=1), tiny_config(seed=1)
  b.train.progress_bar = not a.train.progress_bar
  b.train.tensorboard = True
  assert ablate.config_hash(a) == ablate.config_hash(b)
  b.model.nsa.num_selected = 4
  assert ablate.config_hash(a) != ablate.config_hash(b)
  # checkpoint.init_from (added after runs were recorded) counts only when set
  c = tiny_config(seed=1)
  del c.checkpoint["init_from"]
  assert ablate.config_hash(a) == ablate.config_hash(c)
  c.checkpoint.init_from = "/some/run"
  assert ablate.config_hash(a) != ablate.config_hash(c)
  # data.single_question_fraction (added later) counts only when not 0
  e = tiny_config(seed=1)
  e.data.single_question_fraction = 0.0
  assert ablate.config_hash(a) == ablate.config_hash(e)
  e.data.single_question_fraction = 0.5
  assert ablate.config_hash(a) != ablate.config_hash(e)
  # data.cudnn_packed_cap says how dense layers compute, not what: never in the hash
  h = tiny_config(seed=1)
  del h.data["cudnn_packed_cap"]
  assert ablate.config_hash(a) == ablate.config_hash(h)
  h.data.cudnn_packed_cap = "off"
  assert ablate.config_hash(a) == ablate.config_hash(h)
  # data.document_mask / data.eos_id (added later) count only when set
  g = tiny_config(seed=1)
  del g.data["document_mask"], g.data["eos_id"]
  assert ablate.config_hash(a) == ablate.config_hash(g)
  g.data.document_mask = True
  assert ablate.config_hash(a) != ablate.config_hash(g)
  # model.selection_from_layer (added later) counts only when not None: 0 is a setting
  f = tiny_config(seed=1)
  del f.model["selection_from_layer"]
  assert ablate.config_hash(a) == ablate.config_hash(f)
  hashes = set()
  for layer in (0, 1):
    f.model.selection_from_layer = layer
    hashes.add(ablate.config_hash(f))
  assert len(hashes) == 2 and ablate.config_hash(a) not in hashes
  # model.layer_loop only says how the same math is traced (added after runs were recorded)
  d = tiny_config(seed=1)
  d.model.layer_loop = "python"
  assert ablate.config_hash(a) == ablate.config_hash(d)


def test_config_hash_of_recorded_runs_holds():
  """The GPU sweep's recorded runs (docs/results/nsa_vs_dense_gpu.jsonl) are found again by
  --reuse_from only while config_hash of their configs is unchanged: pin two of them."""
  import importlib
  module = importlib.import_module("configs.sweep_nsa_vs_dense")
  runs = ablate.resolve_runs(module, module.get_config("gpu"))
  recorded = {r["run"]: r["config_hash"] for r in map(json.loads, open(
      os.path.join(os.path.dirname(__file__), "..", "docs", "results",
                   "nsa_vs_dense_gpu.jsonl")))}
  for name in ("nsa", "dense"):
    assert ablate.config_hash(runs[name][1]) == recorded[name], name


def test_command_keeps_overrides_and_names_the_run():
  cmd = ablate.command_for("configs/sweep_x.py", "dense",
                           ["ablate.py", "--config=configs/sweep_x.py:gpu", "--run=all",
                            "--config.model.d_model=512", "--out_dir=/o"])
  assert cmd == ("python -m experiments.ablate --config=configs/sweep_x.py:gpu --run=dense "
                 "--config.model.d_model=512 --out_dir=/o")
  # the space form (absl takes `--flag value`) kept its flags but dropped their values
  spaced = ablate.command_for("configs/sweep_x.py", "dense",
                              ["ablate.py", "--config", "configs/sweep_x.py:gpu", "--run", "all",
                               "--config.model.d_model", "512", "--out_dir", "/o"])
  assert spaced == cmd, spaced
  assert ablate.sweep_name("configs/sweep_x.py:gpu") == "x_gpu"
  assert ablate.sweep_name("configs/sweep_x.py") == "x"


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_every_sweep_run_is_a_valid_model_at_both_scales(scale):
  from nsa_jax.training.train import model_config_from
  files = sorted(f for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.startswith("sweep_") and f != "sweep_base.py")
  assert len(files) >= 5
  for f in files:
    module = ablate.load_sweep(os.path.join(ROOT, "configs", f))
    base = module.get_config(scale)
    for name, (overrides, config) in ablate.resolve_runs(module, base).items():
      if MATCH_PARAMS in overrides:
        continue  # parameter matching builds models: covered by the tiny sweep test
      model = model_config_from(config.model)  # raises on any invalid combination
      assert config.data.seq_len <= model.max_seq_len, (f, name)
  blocks = ablate.load_sweep(os.path.join(ROOT, "configs", "sweep_blocks.py"))
  runs = ablate.resolve_runs(blocks, blocks.get_config(scale))
  base_nsa, finer = runs["nsa"][1].model.nsa, runs["finer"][1].model.nsa
  assert finer.sel_block * finer.num_selected == base_nsa.sel_block * base_nsa.num_selected
  if scale == "gpu":  # the paper's settings at 8k
    assert (base_nsa.cmp_block, base_nsa.cmp_stride, base_nsa.sel_block, base_nsa.num_selected,
            base_nsa.window) == (32, 16, 64, 16, 512)


def test_train_run_records_metrics_and_reuses_a_finished_run(trained, tmp_path):
  workdir, config, rec = trained
  assert not rec["reused"] and rec["steps"] == 2
  assert rec["tokens"] == 2 * 2 * 128
  assert math.isfinite(rec["val_loss"]) and abs(rec["val_ppl"] - math.exp(rec["val_loss"])) < 1e-3
  assert rec["params"] == ablate.count_params(config) and rec["wall_s"] > 0
  again = ablate.train_run(config, workdir)
  assert again["reused"] and again["val_loss"] == rec["val_loss"]
  # A finished run whose record file was lost (killed right after its last save): the record is
  # rebuilt from its logs instead of a KeyError (its wall time is unknown).
  lost = str(tmp_path / "lost")
  shutil.copytree(workdir, lost)
  os.remove(os.path.join(lost, "ablate_result.json"))
  rebuilt = ablate.train_run(config, lost)
  assert not rebuilt["reused"] and math.isnan(rebuilt["wall_s"])
  for k in ("val_loss", "val_ppl", "val_acc", "train_loss", "steps"):
    assert rebuilt[k] == pytest.approx(rec[k], rel=1e-6), k
  # Table and curves from results.jsonl; deltas against the reference.
  out = str(tmp_path)
  for name, loss in (("nsa", rec["val_loss"]), ("dense", rec["val_loss"] + 0.5)):
    ablate.append_result(out, dict(rec, run=name, overrides={} if name == "nsa" else
                                   {"model.attention": "dense"}, workdir=workdir,
                                   command=f"cmd {name}", val_loss=loss))
  table = ablate.write_report(out, ["nsa", "dense", "missing"], "nsa", "t")
  rows = [r for r in table.splitlines() if r.startswith("| nsa") or r.startswith("| dense")]
  assert len(rows) == 2 and "+0.5000" in rows[1] and "`cmd dense`" in rows[1]
  assert os.path.getsize(os.path.join(out, "loss_curves.png")) > 10_000
  # nsa rerun with other settings (another config hash): with this command's hashes the table
  # holds only the records made with them, so dense's row (old settings) is named, not compared.
  ablate.append_result(out, dict(rec, run="nsa", overrides={}, workdir=workdir, command="cmd nsa2",
                                 config_hash="new", val_loss=rec["val_loss"] - 0.25))
  table = ablate.write_report(out, ["nsa", "dense"], "nsa", "t", {"nsa": "new", "dense": "new-d"})
  rows = [r for r in table.splitlines() if r.startswith("| nsa") or r.startswith("| dense")]
  assert len(rows) == 1 and "`cmd nsa2`" in rows[0], table
  assert "Not in this table: dense, recorded only with other settings" in table


def test_cli_lists_runs_with_overrides(sweep_file):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.ablate", f"--config={sweep_file}",
                        "--list", "--config.model.d_model=48"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "--run=dense_pm --config.model.d_model=48" in out.stdout
  bad = subprocess.run([sys.executable, "-m", "experiments.ablate", f"--config={sweep_file}",
                        "--run=nope", "--list"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
  assert bad.returncode == 1 and "unknown run" in bad.stderr
  # a model the sweep's overrides make invalid: one line, not a traceback
  bad = subprocess.run([sys.executable, "-m", "experiments.ablate", f"--config={sweep_file}",
                        "--run=nsa", "--config.model.n_kv_heads=3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
  assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
  assert "not divisible by n_kv_heads=3" in bad.stderr, bad.stderr[-2000:]
  field = subprocess.run([sys.executable, "-m", "experiments.ablate", f"--config={sweep_file}",
                          "--list", "--config.model.bogus=1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
  assert field.returncode == 2 and "no such config field 'bogus'" in field.stderr, field.stderr


def test_evaluation_entry_points_report_bad_workdirs_in_one_line(tmp_path):
  """needle_eval, visualize_selection, plot_runs, compare_runs and generate: a workdir that is not
  a training run gives `error: ...` and exit status 1 (generate's bad flags: argparse's 2)."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  nowhere = str(tmp_path / "nowhere")
  vocab64 = tmp_path / "vocab64.py"  # a model whose tokens are ids, not bytes
  vocab64.write_text("from configs.tiny_cpu import get_config as tiny\n\n"
                     "def get_config():\n  c = tiny()\n  c.model.vocab_size = 64\n  return c\n")
  cases = [
      (["experiments.needle_eval", f"--workdirs={nowhere}", f"--out={tmp_path}/n.png"], 1),
      (["experiments.visualize_selection", f"--workdir={nowhere}", f"--out={tmp_path}/v.png"], 1),
      (["experiments.plot_runs", nowhere, f"--out={tmp_path}/p.png"], 1),
      (["experiments.compare_runs", f"a={nowhere}"], 1),
      (["experiments.generate", f"--workdir={nowhere}"], 1),
      (["experiments.generate", "--config=configs/tiny_cpu.py", "--chunk=0"], 2),
      (["experiments.generate", "--config=configs/tiny_cpu.py", "--num_samples=0"], 2),
      # silently ignored or accepted before (review of 2026-12-05)
      (["experiments.generate", f"--workdir={nowhere}", "--attention=dense"], 2,
       "--attention applies to --config"),
      (["experiments.generate", "--config=configs/tiny_cpu.py", "--step=3"], 2,
       "--step picks a checkpoint of --workdir"),
      (["experiments.generate", "--config=configs/tiny_cpu.py", "--temperature=nan"], 2,
       "--temperature=nan: must be a number >= 0"),
      (["experiments.generate", f"--config={vocab64}", "--max_new_tokens=2"], 2,
       "must be space-separated token ids"),
      (["experiments.generate", f"--config={vocab64}", "--prompt=1 2 999"], 2,
       "token ids outside [0, 63]"),
      (["experiments.generate", "--config=configs/tiny_cpu.py", "--stop_token=-1"], 2,
       "--stop_token=-1: expected a token id >= 0"),
      (["experiments.generate", f"--config={vocab64}", "--prompt=1 2", "--stop_token=64"], 2,
       "--stop_token=64 is outside the vocabulary [0, 63]"),
      (["experiments.needle_eval", f"--out={tmp_path}/n.png"], 2),  # a required flag missing
      # another mode's flags were silently ignored; a .json --out failed after the whole grid
      (["experiments.needle_eval", "--mode=position", f"--workdirs={nowhere}", "--lengths=1024",
        f"--out={tmp_path}/n.png"], 1, "--lengths not used by --mode=position"),
      (["experiments.needle_eval", f"--workdirs={nowhere}", "--bucket=3", "--val_seed=7",
        f"--out={tmp_path}/n.png"], 1, "--bucket, --val_seed not used by --mode=needle"),
      (["experiments.needle_eval", f"--workdirs={nowhere}", f"--out={tmp_path}/n.json"], 1,
       "needs an image name"),
      (["experiments.visualize_selection", f"--workdir={nowhere}", "--row=-1",
        f"--out={tmp_path}/v.png"], 1, "--row=-1"),
      (["experiments.visualize_selection", f"--out={tmp_path}/v.png"], 2),
      # a short --labels list silently dropped the runs past it
      (["experiments.needle_eval", f"--workdirs={nowhere},{nowhere}@2", "--labels=one",
        f"--out={tmp_path}/n.png"], 1, "--labels has 1 entries for 2 --workdirs"),
      # a stray word was dropped and training ran with the defaults
      (["experiments.train", "--config=configs/tiny_cpu.py", f"--workdir={nowhere}", "extra"], 2,
       "unexpected argument(s) ['extra']"),
      # a config file's get_config raising: its message, not its traceback squashed into a line
      (["experiments.train", "--config=configs/sweep_nsa_vs_dense.py:bogus", f"--workdir={nowhere}"],
       2, "the config file raised ValueError: sweep scale 'bogus': expected 'cpu' or 'gpu'"),
  ]
  for args, code, *want in cases:
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == code and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    assert "error" in r.stderr and all(w in r.stderr for w in want), (args, r.stderr[-2000:])
    assert "USAGE" not in r.stderr and len(r.stderr.splitlines()) < 10, (args, r.stderr[-2000:])
  for args in (["experiments.needle_eval", "--help"], ["experiments.generate", "--help"]):
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)  # help is not an error (absl exits 1 by default)
    assert r.returncode == 0 and "--workdir" in r.stdout, (args, r.returncode, r.stderr[-2000:])
  assert "streaming the text out" in r.stdout, "generate's whole description, not its first line"


def test_needle_eval_run_flags_are_checked():
  """One distinct label per run (results are keyed by label: a repeated basename kept one run's
  numbers), and the count flags at least 1 (0 gave `need at least one array to stack` and
  `range() arg 3 must not be zero`)."""
  needle_eval.check_run_flags(2, ["a", "b"], True, samples=1, bucket=1, batches=1)
  with pytest.raises(ValueError, match=r"--labels has 3 entries for 2 --workdirs"):
    needle_eval.check_run_flags(2, ["a", "b", "c"], True)
  with pytest.raises(ValueError, match=r"labels \['tiny'\] name more than one run"):
    needle_eval.check_run_flags(3, ["tiny", "x", "tiny"], False)
  for name in ("samples", "bucket", "batches"):
    with pytest.raises(ValueError, match=rf"--{name}=0: must be at least 1"):
      needle_eval.check_run_flags(1, ["a"], False, **{name: 0})


def test_passkey_distances_cli_writes_its_table(tmp_path):
  """The data-distance tool: a table per eval depth, JSON beside it; non-passkey data refused."""
  out = tmp_path / "pd"
  r = subprocess.run([sys.executable, "-m", "experiments.passkey_distances",
                      "--config=configs/sweep_needle.py", "--rows=40",
                      "--config.data.single_question_fraction=1.0", f"--out={out}"],
                     cwd=ROOT, capture_output=True, text=True, timeout=240)
  assert r.returncode == 0, r.stderr[-2000:]
  rec = json.loads((tmp_path / "pd.json").read_text())
  assert rec["answers"] == 40 and rec["seq_len"] == 256
  depths = {d["depth"]: d for d in rec["depths"]}
  # needle_eval's example: the answer starts 5 tokens before the end, the key after the fact's prefix
  for depth, d in depths.items():
    tokens, key, cut = needle_eval.passkey_example(256, depth, np.random.default_rng(SEED))
    text = bytes(tokens.astype(np.uint8)).decode()
    assert d["eval_distance"] == text.rindex(key) - text.index(key), depth
  assert depths[0.0]["eval_distance"] == 236 and depths[1.0]["eval_distance"] == 59
  assert all(0 <= d["train_fraction_at_least"] <= d["train_fraction_at_least_90pct"] <= 1
             for d in rec["depths"])
  assert depths[1.0]["train_fraction_at_least"] > 0.9  # f = 1: nearly every answer is >= 59 back
  assert "| needle_eval depth |" in (tmp_path / "pd.md").read_text()
  for args, want in [(["--config=configs/tiny_cpu.py", "--rows=2"], "passkey"),
                     (["--config=configs/sweep_needle.py", "--rows=0"], "--rows=0")]:
    bad = subprocess.run([sys.executable, "-m", "experiments.passkey_distances", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert bad.returncode == 1 and want in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_cli_reuses_a_record_from_another_sweep_instead_of_training(sweep_file, tmp_path):
  module = ablate.load_sweep(sweep_file)
  config = ablate.resolve_runs(module, module.get_config())["nsa"][1]
  loss = 1.0 + (SEED % 1000) / 1000
  earlier = dict(sweep="x", run="base", overrides={}, workdir=str(tmp_path / "gone"),
                 command="python -m experiments.ablate --config=x --run=base",
                 config_hash=ablate.config_hash(config), val_loss=loss, val_ppl=math.exp(loss),
                 val_acc=0.5, train_loss=loss, steps=2, tokens=1, tokens_per_s=1.0, wall_s=1.0,
                 params=ablate.count_params(config), hardware="h", date_utc="d")
  (tmp_path / "old.jsonl").write_text(json.dumps(earlier) + "\n")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.ablate", f"--config={sweep_file}",
                        "--run=nsa", f"--reuse_from={tmp_path / 'old.jsonl'}",
                        f"--out_dir={tmp_path / 'out'}", f"--runs_root={tmp_path / 'runs'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert out.returncode == 0, out.stderr[-2000:]
  assert not os.path.exists(tmp_path / "runs"), "reused run was trained anyway"
  rec = ablate.read_results(str(tmp_path / "out"))["nsa"]
  assert rec["reused"] and rec["val_loss"] == loss and rec["reused_from"] == earlier["command"]
  assert f"{loss:.4f}" in (tmp_path / "out" / "results.md").read_text()


# ----------------------------------------------------------------------------- passkey ----------

PASSKEY_RE = re.compile(rb"^(.*)The pass key is (\d{5})\. Remember it\. (.*) What is the pass key\? "
                        rb"The pass key is (\d{5})$", re.S)


@pytest.mark.parametrize("length", [96, 200, 333])
def test_passkey_examples_match_the_training_format_and_depth(length):
  rng = np.random.default_rng(SEED)
  train_row, _ = data_lib.NeedleSource(1, {}).row(rng, length + 1)
  m = PASSKEY_RE.match(bytes(train_row.astype(np.uint8)))
  assert m and m.group(2) == m.group(4), f"training passkey format changed (seed {SEED})"
  for depth in (0.0, float(rng.uniform()), 1.0):
    tokens, key, cut = needle_eval.passkey_example(length, depth, np.random.default_rng(SEED))
    assert tokens.shape == (length + 1,) and tokens.dtype == np.int32
    m = PASSKEY_RE.match(bytes(tokens.astype(np.uint8)))
    assert m and m.group(2) == m.group(4) == key.encode(), f"seed {SEED} depth {depth}"
    filler = len(m.group(1)) + len(m.group(3))
    assert len(m.group(1)) == cut and abs(cut - depth * filler) <= 0.5, f"seed {SEED}"
  a = needle_eval.passkey_batch(length, 2, 0.5, 3, SEED)
  np.testing.assert_array_equal(a, needle_eval.passkey_batch(length, 2, 0.5, 3, SEED))
  assert not np.array_equal(a, needle_eval.passkey_batch(length, 2, 0.5, 3, SEED + 1))
  with pytest.raises(ValueError, match="too short"):
    needle_eval.passkey_example(40, 0.5, rng)


def _oracle_logits(tokens_in):
  """Logits that copy the key from the input text: what a perfect retriever predicts."""
  out = np.zeros(tokens_in.shape + (256,), np.float32)
  for r, row in enumerate(tokens_in):
    key = re.search(rb"The pass key is (\d{5})\.", bytes(row.astype(np.uint8))).group(1)
    for i, ch in enumerate(key):
      out[r, tokens_in.shape[1] - 5 + i, ch] = 1.0
  return out


def test_scorer_and_grid_on_an_oracle_and_a_broken_model():
  lengths, depths = [80, 160], [0.0, 0.5, 1.0]
  grid = needle_eval.needle_grid(_oracle_logits, lengths, depths, 4, SEED)
  assert np.all(np.asarray(grid["exact"]) == 1.0), f"oracle missed (seed {SEED})"

  def off_by_one(tokens_in):  # last digit always wrong: no exact hit, 80% of digits right
    logits = _oracle_logits(tokens_in)
    logits[:, -1] = np.roll(logits[:, -1], 1, axis=-1)
    return logits

  grid = needle_eval.needle_grid(off_by_one, lengths, depths, 4, SEED)
  assert np.all(np.asarray(grid["exact"]) == 0.0)
  np.testing.assert_allclose(grid["digits"], 0.8)


# ----------------------------------------------------------------------------- trained model ----

def test_load_model_reads_runs_saved_before_layer_loop(trained, tmp_path):
  """A run saved before model.layer_loop existed (no such key in its checkpoint's metadata or its
  config.json) still loads for evaluation, with the same weights."""
  import shutil
  workdir, _, _ = trained
  old = str(tmp_path / "old_run")
  shutil.copytree(workdir, old)
  edited = 0
  for root, _, files in os.walk(os.path.join(old, "checkpoints")):
    if os.path.basename(root) == "meta" and "metadata" in files:
      path = os.path.join(root, "metadata")
      meta = json.load(open(path))
      assert meta["model"].pop("layer_loop") == "unrolled"
      json.dump(meta, open(path, "w"))
      edited += 1
  cfg_path = os.path.join(old, "config.json")
  cfg = json.load(open(cfg_path))
  del cfg["model"]["layer_loop"]
  json.dump(cfg, open(cfg_path, "w"))
  assert edited >= 1
  model, _, model_cfg = trained_model.load_model(old)
  new_model, _, _ = trained_model.load_model(workdir)
  assert model_cfg.layer_loop == "unrolled"
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(new_model, nnx.Param))):
    np.testing.assert_array_equal(a, b)


def test_load_model_at_a_step_and_workdir_specs(tmp_path):
  """'@STEP' picks a saved checkpoint (evaluation of one run's checkpoints side by side): step 1
  of a run saved at steps 1 and 2 loads step 1's weights, not the newest; a step that is not
  saved is named as missing, with the steps that are."""
  from nsa_jax.training.checkpointing import CheckpointError
  workdir = str(tmp_path / "run")
  config = tiny_config()
  config.checkpoint.every_steps, config.checkpoint.max_to_keep = 1, 3
  ablate.train_run(config, workdir)
  assert trained_model.resolve_workdir(workdir) == (workdir, os.path.basename(workdir), None)
  assert trained_model.resolve_workdir(workdir + "@2") == (
      workdir, os.path.basename(workdir) + "@2", 2)
  out = tmp_path / "sweep"
  out.mkdir()
  (out / "results.jsonl").write_text(json.dumps({"run": "nsa", "workdir": workdir}) + "\n")
  assert trained_model.resolve_workdir(f"{out}:nsa@2") == (workdir, "nsa@2", 2)
  params = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
  at1, at2, newest = (trained_model.load_model(workdir, step=s)[0] for s in (1, 2, None))
  for a, b in zip(params(at2), params(newest)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(params(at1), params(newest))), (
      "step 1 loaded the newest weights")
  with pytest.raises(CheckpointError, match=r"no checkpoint step 3 .*holds steps \[1, 2\]"):
    trained_model.load_model(workdir, step=3)


def test_generate_loads_a_good_checkpoint_and_refuses_arrays_that_differ(trained, tmp_path):
  """experiments.generate reads only the parameters, but checks them bit for bit against the
  save as training's resume does: a step whose array files were swapped for another run's (they
  decode, finite, and differ) is named corrupt, not sampled from; the untouched run loads with
  the same weights as trained_model.load_model."""
  import shutil
  from experiments import generate
  from nsa_jax.training.checkpointing import CheckpointError
  workdir, config, _ = trained
  model, desc = generate.load_checkpoint(workdir)
  assert desc.endswith(os.path.join("checkpoints", "2"))
  ref, _, _ = trained_model.load_model(workdir)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  run, donor = tmp_path / "run", str(tmp_path / "donor")
  shutil.copytree(workdir, run)
  ablate.train_run(tiny_config(seed=SEED + 1), donor)
  shutil.rmtree(run / "checkpoints" / "2" / "state")
  shutil.copytree(os.path.join(donor, "checkpoints", "2", "state"), run / "checkpoints" / "2" / "state")
  with pytest.raises(CheckpointError, match=r"is corrupt: \d+ state arrays read back differ .*"
                     r"checksum mismatch; first: \['params'\]"):
    generate.load_checkpoint(str(run))


def test_generate_reports_a_truncated_array_file_in_one_error(trained, tmp_path, caplog):
  """generate restores without a target; on a truncated array file TensorStore fails every
  pending read and asyncio logged each failed task with its whole spec (~50,000 lines for the
  README's model) before the error. Now: the CheckpointError alone, and the asyncio logger's
  level as it was."""
  import logging
  import shutil
  from experiments import generate
  from nsa_jax.training.checkpointing import CheckpointError
  workdir, _, _ = trained
  run = tmp_path / "run"
  shutil.copytree(workdir, run)
  files = [os.path.join(d, f) for d, _, fs in os.walk(run / "checkpoints" / "2" / "state")
           for f in fs if os.sep + "d" + os.sep in os.path.join(d, f)]
  biggest = max(files, key=os.path.getsize)
  os.truncate(biggest, os.path.getsize(biggest) // 3)
  before = logging.getLogger("asyncio").level
  with pytest.raises(CheckpointError, match="corrupt or incompatible: could not read its arrays"):
    generate.load_checkpoint(str(run))
  flood = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
  assert not flood, (len(flood), flood[0].getMessage()[:300])
  assert logging.getLogger("asyncio").level == before


def test_load_model_forward_with_aux_and_longer_inputs(trained):
  workdir, config, _ = trained
  model, cfg, model_cfg = trained_model.load_model(workdir, max_seq_len=256)
  assert model_cfg.max_seq_len == 256 and cfg.data.seq_len == 128
  tokens = jax.random.randint(jax.random.key(SEED), (2, 256), 0, 256)
  logits, auxes = trained_model.forward_with_aux(model, tokens)
  np.testing.assert_allclose(logits, trained_model.jit_logits(model)(tokens), atol=2e-4, rtol=2e-4)
  assert set(auxes[0]) == {"q", "k"}  # the dense layer
  idx, gates = auxes[1]["block_idx"], auxes[1]["gates"]
  assert idx.shape == (2, 256, 2, 3) and gates.shape == (2, 256, 4, 3)
  assert float(gates.min()) >= 0 and float(gates.max()) <= 1
  # The trained weights, not a fresh init: the eval loss matches the run's own validation loss.
  batches = trained_model.val_batches(cfg, cfg.train.eval_batches)
  nll = needle_eval.position_nll(trained_model.jit_logits(model), batches)
  w = np.stack([b["weights"] for b in batches]).sum((0, 1))
  rec = json.load(open(os.path.join(workdir, "ablate_result.json")))
  assert abs(float((nll * w).sum() / w.sum()) - rec["val_loss"]) < 1e-3


def test_position_nll_matches_optax_and_buckets_cover_all_positions():
  rng = np.random.default_rng(SEED)
  logits = rng.normal(size=(3, 20, 11)).astype(np.float32)
  batch = {"inputs": np.zeros((3, 20), np.int32), "targets": rng.integers(0, 11, (3, 20)),
           "weights": rng.integers(0, 2, (3, 20)).astype(np.float32)}
  got = needle_eval.position_nll(lambda _: logits, [batch])
  ref = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))
  w = batch["weights"].sum(0)
  want = np.where(w > 0, (ref * batch["weights"]).sum(0) / np.maximum(w, 1e-9), np.nan)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  buckets = needle_eval.bucketize(got, 8)
  assert [(s, e) for s, e, _ in buckets] == [(0, 8), (8, 16), (16, 20)]
  seen = got[16:][~np.isnan(got[16:])]  # a position no row weighted is NaN, left out
  np.testing.assert_allclose(buckets[2][2], seen.mean() if len(seen) else np.nan, rtol=1e-9)


def test_selection_map_is_causal_and_counts_every_selected_block(trained):
  workdir, _, _ = trained
  model, cfg, model_cfg = trained_model.load_model(workdir)
  tokens = trained_model.val_batches(cfg, 1)[0]["inputs"][:1]
  _, auxes = trained_model.forward_with_aux(model, tokens)
  idx = np.asarray(auxes[1]["block_idx"])[0]
  nsa = model_cfg.nsa
  for k in range(idx.shape[1]):
    codes = vis.selection_map(idx[:, k], nsa.sel_block, nsa.num_init_blocks, nsa.num_local_blocks)
    picked = np.isin(codes, (vis.FORCED, vis.CHOSEN)).sum(1)
    np.testing.assert_array_equal(picked, (idx[:, k] >= 0).sum(1))
    t = np.arange(len(codes))
    assert np.all(codes[t, 0] == vis.FORCED) and np.all(codes[t, t // nsa.sel_block] == vis.FORCED)
    assert not np.any((codes == vis.NOT_VISIBLE) & (np.arange(codes.shape[1]) * nsa.sel_block
                                                     <= t[:, None]))
    dist = vis.chosen_distances(codes, nsa.sel_block)
    assert np.all(dist >= nsa.num_local_blocks)  # chosen-by-score blocks lie beyond the local ones
  text = vis.describe_queries(np.asarray(tokens[0]), codes, nsa.sel_block, 2)
  assert text.count("query t=") == 2


def test_selection_map_reads_documents_as_the_model_does():
  """A document-masked row: a query sees only the blocks overlapping its own document, and its
  forced initial block is that document's first (it used to be block 0 for every query, so the
  tool called the document's first block "chosen by score" and drew earlier documents' blocks as
  visible). Documents start at 0, 20 and 45; l' = 8, 1 initial + 2 local forced."""
  idx = np.full((64, 4), -1)
  idx[30, :2] = [2, 3]        # doc 2 (start 20, first block 2), t in block 3: both forced
  idx[44] = [2, 3, 4, 5]      # doc 2, t in block 5: 2 initial, 4-5 local, 3 chosen by score
  idx[50, :2] = [5, 6]        # doc 3 (start 45, first block 5), t in block 6: both forced
  seg = np.repeat([7, 9, 7], [20, 25, 19])  # id 7 comes back: the third run is another document
  codes = vis.selection_map(idx, 8, 1, 2, seg)
  N, V, F, C = vis.NOT_VISIBLE, vis.VISIBLE, vis.FORCED, vis.CHOSEN
  assert codes[30].tolist() == [N, N, F, F, N, N, N, N]
  assert codes[44].tolist() == [N, N, F, C, F, F, N, N]
  assert codes[50].tolist() == [N, N, N, N, N, F, F, N]
  assert codes[10].tolist() == [V, V, N, N, N, N, N, N]  # doc 1: blocks 0-1 visible, none picked
  one_doc = vis.selection_map(idx, 8, 1, 2)  # without ids: block 0 is the forced one
  assert one_doc[44].tolist() == [V, V, C, C, F, F, N, N]


def test_plots_are_written(tmp_path):
  grid = needle_eval.needle_grid(_oracle_logits, [80], [0.0, 1.0], 2, SEED)
  needle_eval.plot_needle([grid, grid], ["a", "b"], str(tmp_path / "n.png"), ["x, 80 tokens", None])
  needle_eval.plot_position([[(0, 8, 2.0), (8, 16, 1.5)]], ["a"], str(tmp_path / "p.png"))
  codes = vis.selection_map(np.array([[0, -1, -1], [0, 1, -1], [0, 1, 2]] * 16), 16, 1, 2)
  vis.plot([codes[None]], [np.full((48, 4, 3), 0.5)], str(tmp_path / "s.png"), "t")
  for name in ("n.png", "p.png", "s.png"):
    assert os.path.getsize(tmp_path / name) > 5_000


def test_compare_runs_table_scaling_and_loss_agreement(tmp_path):
  from experiments import compare_runs

  def fake_run(name, devices, tok_s, losses, colls=None, attention="nsa"):
    d = tmp_path / name
    d.mkdir()
    recs = [{"event": "start", "devices": devices, "mesh": {"data": devices, "fsdp": 1, "tensor": 1},
             "device_kind": "fake", "params": 10, "attention": [attention]}]
    recs += [{"step": s, "train/loss": l, "train/tokens_per_s": tok_s, "train/step_time_s": 0.5}
             for s, l in losses.items()]
    recs += [{"step": max(losses), "val/loss": 2.0}, {"event": "end", "peak_memory_gb": 1.0}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    if colls is not None:
      (d / "collectives.json").write_text(json.dumps({"summary": colls}))
    return f"{name}={d}"

  one = fake_run("one", 1, 100.0, {10: 3.0, 20: 2.5})
  colls = {"per_kind": {"all-reduce": {"count": 3, "bytes": 2 ** 20}}, "with_sequence_dim": [],
           "in_attention_op": [], "total": 3, "note": "per instruction"}
  two = fake_run("two", 2, 180.0, {10: 3.001, 20: 2.49, 30: 2.2}, colls)
  compare_runs.main([one, two, "--baseline=one", f"--out_dir={tmp_path}", "--name=cmp"])
  recs = {r["label"]: r for r in json.loads((tmp_path / "cmp.json").read_text())}
  assert recs["two"]["scaling_efficiency"] == pytest.approx(0.9)
  assert recs["two"]["max_abs_loss_diff_vs_baseline"] == pytest.approx(0.01)
  assert recs["two"]["collectives_in_attention"] == 0 and recs["two"]["collective_mb"] == 1.0
  assert "| two | 2 |" in (tmp_path / "cmp.md").read_text()
  # another model (here dense): shown, but no scaling or loss agreement against the baseline
  dense = fake_run("dense", 2, 180.0, {10: 3.3, 20: 2.9}, attention="dense")
  compare_runs.main([one, dense, "--baseline=one", f"--out_dir={tmp_path}", "--name=cmp2"])
  rec = {r["label"]: r for r in json.loads((tmp_path / "cmp2.json").read_text())}["dense"]
  assert "scaling_efficiency" not in rec and "max_abs_loss_diff_vs_baseline" not in rec
  assert rec["not_compared"] == "attention differ from one's (another model)"
  with pytest.raises(SystemExit, match="no run has that label"):
    compare_runs.main([one, "--baseline=nope"])
  with pytest.raises(SystemExit, match="no train window at or below --max_step=5"):
    compare_runs.main([one, "--max_step=5"])


def _script_phases(name):
  """(header comment, names of the shell functions) of scripts/<name>, after a syntax check."""
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                        name)
  assert subprocess.run(["bash", "-n", script]).returncode == 0
  text = open(script).read()
  return text.split("set -uo pipefail")[0], set(re.findall(r"^([a-z_0-9]+)\(\)\s*\{", text, re.M))


def test_h200_runs_script_parses_and_defines_every_documented_phase():
  header, defined = _script_phases("h200_runs.sh")
  for phase in ("pair", "layouts", "layouts_kv2", "passkey", "passkey2", "branches", "design",
                "blocks", "context8", "context16", "context32", "context16_1gpu", "context32_1gpu",
                "impl8", "selgain", "prof8k", "profdoc", "context8_1gpu", "context8_1gpu_rev",
                "determinism", "projfuse", "packedpair", "segids"):
    assert re.search(rf"^# (.*\b)?{phase}\b", header, re.M), f"{phase} not documented"
    assert phase in defined, f"{phase} documented but not defined"


def test_passkey2_refuses_bad_settings_before_training(tmp_path):
  """passkey2 stops, saying why, before it trains anything: extra 4k-stage overrides without a
  PK_TAG (their results would overwrite the plain recipe's files) and PK_EVAL_STEPS that the 4k
  stage does not save (multiples of 200 below PK_STEPS2)."""
  import shutil
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  work = tmp_path / "repo"
  shutil.copytree(os.path.join(root, "scripts"), work / "scripts")  # no .whl here: no installs
  for env, want in [({"PK_ARGS2": "--config.optim.learning_rate=5e-4"}, "with PK_TAG"),
                    ({"PK_ARGS1": "--config.train.seed=1"}, "with PK_TAG"),
                    ({"PK_EVAL_STEPS": "300"}, "300 is not a saved 4k-stage step"),
                    ({"PK_STEPS2": "800", "PK_EVAL_STEPS": "800"}, "800 is not a saved"),
                    ({"PK_STEPS3": "400"}, "with PK_TAG"),
                    ({"PK_ARGS3": "--config.data.single_question_fraction=0.5", "PK_TAG": "t"},
                     "PK_ARGS3 needs PK_STEPS3"),
                    ({"PK_STEPS3": "x", "PK_TAG": "t"}, "must be a positive number"),
                    ({"PK_FORCE": "L3"}, "must be NSA layer indices")]:
    out = subprocess.run(["bash", "scripts/h200_runs.sh", "passkey2"], cwd=work, text=True,
                         capture_output=True, timeout=60,
                         env={**os.environ, "OUT": str(tmp_path / "out"), "PACK_AT": "60", **env})
    assert want in out.stdout, (env, out.stdout, out.stderr)
    assert "experiments.train" not in out.stdout + out.stderr


def test_compile_time_trial_refuses_unknown_flags(monkeypatch):
  """benchmarks/compile_time_trial.py: every variant written in scripts/h200_runs.sh (and its
  default list) parses; a misspelt or retired flag stops the run before any process starts
  (it would otherwise time the default under the flag's name)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "benchmarks"))
  try:
    import compile_time_trial as ctt
  finally:
    sys.path.pop(0)
  script = open(os.path.join(root, "scripts", "h200_runs.sh")).read()
  written = re.findall(r"\b(?:nsa|dense):\d+:\d+:[a-z-]+(?::[a-z0-9,]+)?", script)
  assert len(written) >= 9
  for v in written + ctt.DEFAULT + ["nsa:8192:12:pallas:unroll12,slots3,dkvslots4"]:
    ctt.parse(v)
  for bad in ("nsa:8192:12:pallas:kvsplit", "nsa:8192:12:pallas:unroll,slotsx"):
    with pytest.raises(SystemExit, match="unknown flag"):
      ctt.parse(bad)
  monkeypatch.setattr(sys, "argv", ["x", "/tmp/never_written.json", "nsa:8192:1:pallas:kvsplit"])
  with pytest.raises(SystemExit, match="kvsplit"):
    ctt.main()


def test_bench_nsa_runs_every_part_on_cpu(tmp_path):
  """The GPU benchmark's code paths (whole op, branches, top-n sweep, profile) run interpreted on a
  tiny shape, so a typo cannot cost a GPU call; the numbers themselves mean nothing here."""
  from experiments import bench_nsa
  try:
    bench_nsa.main(["--T", "128", "--breakdown_T", "128", "--sweep_T", "128", "--sweep_parts",
                    "topn,topnvar", "--sweep_dims", "32/32", "--profile_T", "128", "--heads", "4/1",
                    "--dims", "32/16", "--iters", "1", "--batch", "2", "--out", str(tmp_path)])
    # the inputs really carry the batch (the records' field alone comes from the same global)
    assert bench_nsa.make_inputs(jax.random.key(0), 128, bench_nsa.paper_cfg(4, 1, 32, 16))[0].shape \
        == (2, 128, 4, 32)
  finally:
    bench_nsa.BATCH = 1
  recs = json.load(open(tmp_path / f"nsa_{bench_common.device_tag()}.json"))
  assert {(r["op"], r["pass"]) for r in recs} >= {("nsa", "fwd"), ("nsa", "bwd"), ("topn", "fwd"),
                                                  ("select", "bwd"), ("compress", "bwd")}
  # bwd = (fwd + bwd) - fwd: on a busy CPU at this size the difference can come out negative
  assert all(r["T"] == 128 and r["batch"] == 2 and math.isfinite(r["ms"]) for r in recs)
  assert all(r["ms"] > 0 for r in recs if r["pass"] == "fwd")
  # every whole-op / branch row carries its FLOP count and achieved rate (no matmul rate on a
  # CPU, so no floor)
  assert all(r["tflop"] > 0 and r["tflops"] > 0 and "flop_floor_ms" not in r
             for r in recs if r["pass"] == "fwd" and r["op"] != "layer")
  sweep = json.load(open(tmp_path / "nsa_sweep.json"))
  assert sweep["T"] == 128 and sweep["hardware"] and sweep["command"]
  assert (sweep["d_k"], sweep["d_v"], sweep["batch"]) == (32, 32, 2)
  assert [r["variant"].split()[0] for r in sweep["rows"]] == ["topn"] * (
      len(bench_nsa.TOPN_LAUNCHES) + len(bench_nsa.TOPN_FLAG_SETS))
  assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] is None for r in sweep["rows"])
  # the code-path variants pick the same blocks as the first (no near-ties at this size)
  variants = [r for r in sweep["rows"] if "same_slots" in r]
  assert [r["variant"] for r in variants] == [f"topn {k}" for k in bench_nsa.TOPN_FLAG_SETS]
  assert all(r["same_slots"] == 1.0 for r in variants), variants
  prof = json.load(open(tmp_path / "nsa_profile.json"))
  assert prof["T"] == 128 and isinstance(prof["fwd"], list)  # empty without a GPU trace


def test_bench_window_runs_on_cpu(tmp_path):
  """bench_window's code paths on a tiny shape (interpreted; the numbers mean nothing here): the
  Pallas backend plus an extra tiling, then packed documents against the plain-JAX path; the
  records carry the base fields and each shape's dense time; bad shapes / tilings are refused."""
  from experiments import bench_window
  bench_window.main(["--shapes", "96:2:4/2:32/16", "--window", "24", "--iters", "1",
                     "--tilings", "r16:rows=16;bwd_rows=16", "--out", str(tmp_path)])
  recs = json.load(open(tmp_path / "window_cpu.json"))
  assert [(r["impl"], r["pass"]) for r in recs] == [
      (f"window-{i}", p) for i in ("triton", "triton-r16") for p in ("fwd", "bwd")]
  assert all(r["T"] == 96 and r["batch"] == 2 and (r["d_k"], r["d_v"]) == (32, 16)
             and r["cudnn_ms"] and r["window"] == 24 and r["hardware"] for r in recs)
  md = (tmp_path / "window_cpu.md").read_text()
  assert "| 96 | 2 | 4/2 | 32/16 | fwd |" in md and "dense cuDNN" in md
  bench_window.main(["--shapes", "64:1:4/1:16/16", "--segments", "--iters", "1", "--out",
                     str(tmp_path)])
  seg = json.load(open(tmp_path / "window_cpu_segments.json"))
  assert {r["impl"] for r in seg} == {"window-triton", "window-xla"}
  assert all(r["segments"] and "vs_xla" in r for r in seg)
  for bad in (["--shapes", "64:1:4/3:16/16"], ["--shapes", "64:1:4"],
              ["--tilings", "x:foo=1"], ["--backends", "flash"]):
    with pytest.raises(SystemExit) as e:
      bench_window.main(bad + ["--out", str(tmp_path)])
    assert e.value.code == 2


@pytest.mark.parametrize("t,block,stride,sel_block,n,window", [
    (300, 32, 16, 64, 4, 64), (257, 16, 8, 32, 3, 100), (64, 32, 16, 64, 16, 512)])
def test_nsa_pair_counts_equal_the_reference_masks(t, block, stride, sel_block, n, window):
  """bench_common.nsa_pairs (the FLOP floors of bench_nsa) counts the query-key pairs that the
  reference's own masks allow: compression visibility, the window, dense causal, and selection
  with every slot filled (the current block and the n - 1 before it, as the top-n fills them)."""
  import jax.numpy as jnp
  from experiments import bench_common as bc
  from nsa_jax import reference
  seg = jnp.zeros((1, t), jnp.int32)
  got = bc.nsa_pairs(t, block, stride, sel_block, n, window)
  cur = jnp.arange(t) // sel_block
  idx = cur[:, None] - jnp.arange(n)[None, :]
  idx = jnp.where(idx >= 0, idx, -1)[None, :, None, :]  # [1, T, 1, n], -1 = empty slot
  want = dict(compress=reference.cmp_visible_mask(seg, block, stride).sum(),
              select=reference.selection_mask(idx, sel_block, seg).sum(),
              window=reference.window_mask(seg, window).sum(),
              dense=reference.causal_mask(seg).sum())
  assert got == {k: int(v) for k, v in want.items()}
  fl = bc.nsa_flops(t, 2, 4, 32, 16, block=block, stride=stride, sel_block=sel_block,
                    num_selected=n, window=window)
  assert fl[("select", "fwd")] == 2 * 2 * 4 * got["select"] * (32 + 16)
  assert fl[("compress", "bwd")] == 2 * 2 * 4 * got["compress"] * (3 * 32 + 2 * 16)
  assert fl[("dense", "fwd")] == 2 * 2 * 4 * got["dense"] * 64  # cuDNN's dims: 32/32
  assert fl[("nsa_built", "fwd")] == fl[("nsa", "fwd")] + 2 * 2 * 4 * got["compress"] * 32


def test_bench_nsa_floor_report(tmp_path):
  """--floor adds FLOPs, rates and floors to a results file's rows and says what the 6x target
  needs; it refuses to run without a matmul rate."""
  from experiments import bench_nsa, bench_common as bc
  base = dict(T=65536, batch=1, q_heads=64, kv_heads=4, d_k=128, d_v=128, hardware="H", date="D",
              command="c")
  recs = [dict(base, op="nsa", impl="pallas", **{"pass": "fwd"}, ms=40.0, cudnn_ms=120.0,
               speedup=3.0),
          dict(base, op="layer", impl="x", **{"pass": "fwd"}, ms=1.0, cudnn_ms=1.0, speedup=1.0)]
  path = tmp_path / "r.json"
  path.write_text(json.dumps(recs))
  with pytest.raises(SystemExit):
    bench_nsa.main(["--floor", str(path)])
  out = bench_nsa.floor_report(str(path), 600.0)
  text = open(out).read()
  counts = bc.nsa_flops(65536, 1, 64, 128, 128, block=32, stride=16, sel_block=64,
                        num_selected=16, window=512)
  fl, built = counts[("nsa", "fwd")], counts[("nsa_built", "fwd")]
  assert f"{fl / 600e12 * 1e3:.2f} ms" in text and "6.0x allows 20.00 ms" in text
  assert f"at {fl / 600e12 / 20e-3:.0%} of the matmul rate ({built / 600e12 / 20e-3:.0%} " \
         "counting the recompute)" in text
  assert "| layer |" not in text and text.count("| nsa |") == 1
  # small shapes, non-positive times (a CPU's bwd difference) and the backward: no division by
  # a rounded-away floor, no rates from negative times, no "recompute" in the backward
  cfg = bench_nsa.paper_cfg(64, 4, 128, 128)
  for t in (64, 256):
    f = bench_nsa.flop_fields("topn", "fwd", t, cfg, 0.05, 1.0, batch=1, matmul=600e12)
    assert f["flop_floor_ms"] > 0 and f["ms_over_floor"] > 1
  assert "tflops" not in bench_nsa.flop_fields("nsa", "bwd", 256, cfg, -0.1, 1.0, batch=1,
                                               matmul=600e12)
  b = bench_nsa.flop_fields("nsa", "bwd", 65536, cfg, 60.0, 300.0, batch=1, matmul=600e12)
  assert "flop_floor_built_ms" not in b
  assert "recompute" not in " ".join(bench_nsa.floor_lines(dict(b, ms=60.0, cudnn_ms=300.0), 5.0))


def test_bench_nsa_crossover_verdicts():
  """The 16k target's verdict: met or not only when a T <= 16384 was timed; a 64k-only run says
  "not measured" (it used to say "NOT met")."""
  from experiments.bench_nsa import crossover_line
  assert crossover_line([(65536, 4.8)]).endswith("16k target not measured (no T <= 16384 timed)")
  assert "crossover (above 1 from here on): 65536 or shorter" in crossover_line([(65536, 4.8)])
  assert crossover_line([(8192, 0.9), (16384, 1.05), (65536, 3.0)]) == (
      "speed-up > 1 at T = [16384, 65536]; crossover (above 1 from here on): 16384; 16k target MET")
  assert crossover_line([(16384, 0.9), (32768, 1.2)]).endswith(": 32768; 16k target NOT met")
  assert crossover_line([(8192, 1.1), (16384, 0.99)]).endswith(": never; 16k target NOT met")
  assert crossover_line([(32768, 0.8), (65536, 0.9)]).endswith(": never; 16k target NOT met")
  assert crossover_line([(32768, 0.9), (65536, 1.2)]).endswith(": 65536; 16k target NOT met")


def test_bench_nsa_mosaic_paths_run_on_cpu(tmp_path):
  """--sweep_parts mosaic times the Mosaic GPU compression forward beside the Triton one, --impl
  pallas-mosaic the whole op (here in the interpreters, so only the code paths are checked)."""
  from experiments import bench_nsa
  # into a folder that does not exist yet (the sweep alone once failed to create it)
  bench_nsa.main(["--T", "", "--sweep_T", "128", "--sweep_parts", "mosaic", "--heads", "16/1",
                  "--iters", "1", "--out", str(tmp_path / "sweep")])
  sweep = json.load(open(tmp_path / "sweep" / "nsa_sweep.json"))["rows"]
  assert [r["variant"] for r in sweep] == ["cmp triton", "cmp mosaic-gpu fwd"]
  assert all(r["fwd_ms"] > 0 and math.isfinite(r["fwd_bwd_ms"]) for r in sweep)
  # --impl pallas-mosaic: the whole op and its check against the plain-JAX path, into a folder
  # that does not exist yet (the check writes first)
  out = tmp_path / "new"
  bench_nsa.main(["--T", "128", "--breakdown_T", "", "--check", "--heads", "16/1", "--dims",
                  "64/64", "--iters", "1", "--impl", "pallas-mosaic", "--out", str(out)])
  recs = json.load(open(out / f"nsa_{bench_common.device_tag()}.json"))
  assert {(r["op"], r["impl"]) for r in recs} == {("nsa", "pallas-mosaic")}
  chk = json.load(open(out / "nsa_check.json"))
  assert chk["impl"] == "pallas-mosaic" and chk["nsa_o_relerr"] < 3e-2, chk
  # the compression fold's check (XLA attention in cuDNN's place here): o, lse, gradients
  assert chk["fold_impl"] == "xla" and chk["fold_lse_maxerr"] < 1e-3, chk
  for name in ("fold", "fold_fwd_triton_bwd", "triton"):
    assert max(chk[f"{name}_grad_relerr"].values()) < 3e-2, (name, chk)


def test_bench_nsa_fold_sweep_runs_on_cpu(tmp_path):
  """--fold_sweep_T times the three compression paths; --fold_backward=triton clears the
  default-on flag and every record says which way it was (the flag is reset for the other tests)."""
  from experiments import bench_nsa
  from nsa_jax import ops
  try:
    bench_nsa.main(["--T", "128", "--breakdown_T", "", "--fold_sweep_T", "128", "--dims",
                    "32/32", "--heads", "4/2", "--iters", "1", "--fold_backward", "triton", "--out",
                    str(tmp_path)])
    assert ops.FOLD_CUDNN_BACKWARD is False
  finally:
    ops.FOLD_CUDNN_BACKWARD = True
  rows = json.load(open(tmp_path / "nsa_foldsweep.json"))["rows"]
  assert [r["variant"] for r in rows] == ["triton", "cudnn-fold", "cudnn-fwd+triton-bwd"]
  assert all(r["T"] == 128 and r["fwd_ms"] > 0 and math.isfinite(r["fwd_bwd_ms"]) for r in rows)
  recs = json.load(open(tmp_path / f"nsa_{bench_common.device_tag()}.json"))
  assert recs and all(r["fold_cudnn_backward"] is False for r in recs)


def test_h200_kernels_script_parses_and_defines_every_documented_phase():
  header, defined = _script_phases("h200_kernels.sh")
  documented = set(re.findall(r"^# ([a-z0-9_]+) {2,}", header, re.M))
  assert documented == defined == {"union4", "auto", "profile", "cmpsplit", "nsa", "decode",
                                    "train8k", "sel8k", "mosaic", "mosaic8k", "mosaiccmp",
                                    "mosaicnsa", "auto8k", "registry", "mosaicws", "cmpfold",
                                    "foldsweep", "foldnsa", "mosaicb1", "walk", "fastmerge",
                                    "topnvar", "topnsweep",
                                    "topnlayers", "topnptx", "mosaicslots", "mosaicovl",
                                    "mosaiclean", "mosaicab16", "mosaicring", "topn2pass", "fla",
                                    "ncuprof", "decodehf", "cmdsched", "streams", "window",
                                    "winsweep", "winfused", "winnsa", "warps2nsa", "dqsteps",
                                    "densedoc", "cmpdoc", "seldoc", "cudnnpacked", "windoc",
                                    "windq"}


def test_needle_key_blocks_and_coverage():
  # "The pass key is " is 16 tokens: a fact at 44 puts the digits at 60-64, across blocks 1 and 2.
  assert needle_eval.key_blocks(44, 32) == [1, 2]
  assert needle_eval.key_blocks(88, 32) == [3]
  tokens, key, cut = needle_eval.passkey_example(256, 0.25, np.random.default_rng(SEED))
  first = cut + len("The pass key is ")
  assert bytes(tokens[first:first + 5].astype(np.uint8)).decode() == key
  idx = np.full((8, 2, 3), -1, np.int32)  # [T, K, n]
  idx[5, 0] = [0, 1, 2]      # query 5: both key blocks in group 0
  idx[6, 0, :2] = [0, 1]     # query 6: block 1 in group 0 ...
  idx[6, 1, :2] = [2, 3]     # ... and block 2 in group 1: covered across groups
  idx[7, 0, :2] = [1, 3]     # query 7: block 2 missing
  assert needle_eval.key_coverage(idx, [1, 2], [5, 6, 7]) == pytest.approx(2 / 3)
  assert needle_eval.key_coverage(idx, [1], [5, 6, 7]) == 1.0


def test_force_key_blocks_by_hand():
  """The needle intervention's edit: at the answer queries (t >= from_query) each missing key
  block takes the slot of the lowest-numbered block that is neither forced nor a key block, in
  every KV group, and the list stays ascending; lists that hold it, earlier queries, rows
  without a key (-1) and lists with no free slot are left alone."""
  from types import SimpleNamespace
  nsa = SimpleNamespace(sel_block=4, num_init_blocks=1, num_local_blocks=2)
  t, n = 40, 5  # query 39 is in block 9: blocks 0, 8 and 9 are forced
  idx = np.full((2, t, 2, n), -1, np.int32)
  idx[:, 30:] = [0, 2, 3, 8, 9]       # before the edit, every late query: blocks 2 and 3 free
  idx[0, 38:, 1] = [0, 5, 7, 8, 9]    # row 0, group 1 already holds block 5 (not 6)
  keys = np.array([[5, 6], [4, -1]], np.int32)  # row 0 straddles blocks 5 and 6; row 1: block 4
  out = np.asarray(needle_eval.force_key_blocks(idx, (keys, np.array([38, 38], np.int32)), nsa))
  np.testing.assert_array_equal(out[:, :38], idx[:, :38])  # before from_query: untouched
  for tq in (38, 39):
    np.testing.assert_array_equal(out[0, tq, 0], [0, 5, 6, 8, 9])  # 2 -> 5, then 3 -> 6
    np.testing.assert_array_equal(out[0, tq, 1], [0, 5, 6, 8, 9])  # 5 held; 7 -> 6
    np.testing.assert_array_equal(out[1, tq], [[0, 3, 4, 8, 9]] * 2)  # 2 -> 4, sorted
  # a key block after the query's own is never put in; nor where nothing is free
  late = np.array([[9, -1], [-1, -1]], np.int32)
  same = needle_eval.force_key_blocks(idx, (late, np.array([30, 30], np.int32)), nsa)
  np.testing.assert_array_equal(np.asarray(same)[:, 30:36], idx[:, 30:36])  # blocks 7, 8 < 9
  full = SimpleNamespace(sel_block=4, num_init_blocks=3, num_local_blocks=2)  # 0-2, 8, 9 forced
  forced_only = np.broadcast_to(np.array([0, 1, 2, 8, 9], np.int32), idx.shape).copy()
  np.testing.assert_array_equal(np.asarray(needle_eval.force_key_blocks(
      forced_only, (keys, np.array([38, 38], np.int32)), full)), forced_only)


def test_needle_key_positions_and_force_flag():
  rows = needle_eval.passkey_examples(256, 1, 0.5, 3, SEED)
  tokens = np.stack([r[0] for r in rows])[:, :-1]
  blocks, first = needle_eval.key_positions(tokens, 32)
  for row, (_, _, cut) in enumerate(rows):
    want = needle_eval.key_blocks(cut, 32)
    assert list(blocks[row, :len(want)]) == want and (blocks[row, len(want):] == -1).all()
  assert (first == 256 - 5).all()
  with pytest.raises(ValueError, match="holds no passkey fact"):
    needle_eval.key_positions(np.zeros((1, 64), np.int32), 32)
  assert needle_eval.parse_force_layers(["1", "3"], "blocks") == [1, 3]
  assert needle_eval.parse_force_layers([], "needle") == []
  with pytest.raises(ValueError, match="a --mode=blocks intervention, not for --mode=needle"):
    needle_eval.parse_force_layers(["1"], "needle")
  with pytest.raises(ValueError, match="must be layer indices"):
    needle_eval.parse_force_layers(["L1"], "blocks")
  with pytest.raises(ValueError, match="repeats a layer"):
    needle_eval.parse_force_layers(["1", "1"], "blocks")


def test_needle_blocks_with_the_key_forced_in(trained, tmp_path):
  """--force_key_layers: every answer query's selection then holds the key's blocks (coverage 1,
  no selection-reach digit missed) where a slot is free, the answers are scored with the edited
  selection, and a dense layer index is refused in one line."""
  import functools
  from nsa_jax.model import TransformerLM
  from nsa_jax.training.train import model_config_from
  workdir, _, _ = trained
  out = tmp_path / "forced.json"
  base = [sys.executable, "-m", "experiments.needle_eval", "--mode=blocks", f"--workdirs={workdir}",
          "--labels=m", "--lengths=192", "--depths=0.5", "--samples=2", f"--out={out}"]
  res = subprocess.run(base + ["--force_key_layers=1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "layers [1] hold the key's blocks at the answer queries (forced)" in res.stdout
  grid = json.load(open(out))["m"]
  assert grid["force_key_layers"] == [1]
  # the tiny run's n = 3 slots are all forced (1 initial + 2 local): nothing to displace, so the
  # forced run's answers and selections are the unedited model's
  model, _, model_cfg = trained_model.load_model(workdir, max_seq_len=192)
  tokens = needle_eval.passkey_batch(192, 0, 0.5, 2, 1234)
  logits, auxes = trained_model.jit_logits_and_blocks(model)(tokens[:, :-1])
  assert grid["cells"][0]["digit_acc"] == pytest.approx(
      needle_eval.digit_hits(np.asarray(logits), tokens).mean())
  fn = trained_model.jit_logits_and_blocks(model, [1], functools.partial(
      needle_eval.force_key_blocks, nsa=model_cfg.nsa))
  _, forced_auxes = fn(tokens[:, :-1], needle_eval.key_positions(tokens[:, :-1], 32))
  np.testing.assert_array_equal(np.asarray(forced_auxes[1]["block_idx"]),
                                np.asarray(auxes[1]["block_idx"]))
  res = subprocess.run(base + ["--force_key_layers=0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
  assert res.returncode != 0
  assert "key 0, which is not an NSA layer of this model. Fix: use layer indices among [1]" in (
      res.stderr)
  # with free slots (n = 5 of 16 blocks at 512 tokens), forcing holds the key everywhere
  c = tiny_config()
  c.model.nsa.num_selected, c.model.max_seq_len = 5, 512
  cfg = model_config_from(c.model)
  model = TransformerLM(cfg, rngs=nnx.Rngs(SEED % 1000))
  plain = needle_eval.block_grid(trained_model.jit_logits_and_blocks(model), cfg.nsa, [512],
                                 [0.25, 0.5], 4, SEED)
  forced = trained_model.jit_logits_and_blocks(model, [1], functools.partial(
      needle_eval.force_key_blocks, nsa=cfg.nsa))
  grid = needle_eval.block_grid(
      lambda x: forced(x, needle_eval.key_positions(np.asarray(x), cfg.nsa.sel_block)), cfg.nsa,
      [512], [0.25, 0.5], 4, SEED)
  assert [c["coverage_by_layer"] for c in grid["cells"]] == [[1.0], [1.0]]
  assert grid["held_vs_correct"]["missed_right"] + grid["held_vs_correct"]["missed_wrong"] == 0
  assert any(c["coverage_by_layer"][0] < 1 for c in plain["cells"]), (
      f"the random model held every key anyway (seed {SEED}): the check above proves nothing")


def test_needle_digit_reach_records_and_held_vs_correct():
  from types import SimpleNamespace
  nsa = SimpleNamespace(sel_block=32, window=16, num_init_blocks=1, num_local_blocks=2,
                        num_selected=4, branches=("cmp", "slc", "win"))
  reach = lambda p, q: needle_eval.position_reach(p, q, nsa.sel_block, nsa.window, 1, 2, 4)
  assert reach(116, 130) == "window"      # within (114, 130]
  assert reach(114, 130) == "forced"      # just left the window; block 3 precedes the query's 4
  assert reach(80, 130) == "selection"    # block 2: two blocks back, not local
  assert reach(170, 190) == "forced"      # the query's own block 5, outside the window
  assert reach(16, 500) == "forced"       # the initial block
  assert reach(116, 300) == "selection"   # block 3, query block 9: neither local nor initial
  assert reach(40, 500) == "selection"    # block 1 is not an initial block
  assert reach(40, 127) == "forced"       # 4 visible blocks, n = 4: top-n keeps them all
  assert needle_eval.position_reach(40, 127, 32, 16, 1, 2, 3) == "selection"
  assert needle_eval.position_reach(120, 127, 32, 0, 1, 2, 3) == "forced"  # no window branch
  # example_record on hand-made choices: 2 layers, 1 KV group; the fact at 100 puts the digits at
  # 116-120 (block 3); their queries are 219-223 (block 6), so each digit needs a chosen block
  length = 224
  idx_a = np.full((length, 1, 3), -1, np.int32)
  idx_b = idx_a.copy()
  idx_b[219, 0] = [0, 3, 4]               # layer 1 holds block 3 at the first digit's query
  idx_b[220:222, 0] = [3, -1, -1]         # ... and at the second's and third's
  gate = np.zeros((length, 4))
  gate[219] = [0.1, 0.2, 0.3, 0.4]
  right = np.array([True, True, False, True, False])
  # q and keys: at query 219 head 1 matches digit 0 (116), at 220 head 3 digit 1 (117); at 221
  # head 2 matches digit 1 too, not digit 2 (118), which that query must copy
  q = np.zeros((length, 4, 8))
  k = np.zeros((length, 1, 8))
  q[219, 1, 0] = k[116, 0, 0] = 20.0
  q[221, 2, 1] = q[220, 3, 1] = k[117, 0, 1] = 20.0
  rec = needle_eval.example_record([idx_a, idx_b], 100, length, right, nsa, [gate, gate / 2],
                                   [(q, k), (q, k)])
  d = rec["digits"]
  assert not rec["correct"] and [x["right"] for x in d] == right.tolist()
  assert [x["reach"] for x in d] == ["selection"] * 5
  assert [x["held"] for x in d] == [True, True, True, False, False]
  assert d[0]["held_by_layer"] == [False, True]
  assert d[0]["gate_by_layer"] == [pytest.approx(0.25), pytest.approx(0.125)]
  assert d[1]["gate_by_layer"] == [0.0, 0.0]
  assert d[0]["mass_by_layer"][0] == 0.0  # layer 0 selected nothing
  assert d[0]["mass_by_layer"][1] == pytest.approx(1.0, abs=1e-6)
  assert d[1]["mass_by_layer"][1] == pytest.approx(1.0, abs=1e-6)
  assert d[2]["mass_by_layer"][1] < 0.05  # its head found the neighbouring digit
  assert rec["coverage_by_layer"] == [0.0, pytest.approx(0.6)]
  assert rec["key_blocks"] == [3] and rec["distance"] == 219 - 116
  # a fact whose digits straddle blocks 3 and 4 (first digit at 125): per digit, its own block
  idx_c = idx_a.copy()
  idx_c[219:224, 0] = [0, 3, -1]
  rec_c = needle_eval.example_record([idx_c], 109, length, np.ones(5, bool), nsa)
  assert rec_c["key_blocks"] == [3, 4]
  assert [x["held"] for x in rec_c["digits"]] == [True, True, True, False, False]
  assert rec_c["coverage_by_layer"] == [0.0]  # no query holds both
  # two KV groups, only one holding: "held", but by half of the groups
  idx_m = np.full((length, 2, 3), -1, np.int32)
  idx_m[219, 0] = [0, 3, 4]
  rec_m = needle_eval.example_record([idx_m], 100, length, right, nsa)
  assert rec_m["digits"][0]["held"] and rec_m["digits"][0]["groups_by_layer"] == [0.5]
  assert rec_m["digits"][1]["groups_by_layer"] == [0.0]
  near = needle_eval.example_record([idx_a], 190, length, np.zeros(5, bool), nsa)  # 206-210
  assert {x["reach"] for x in near["digits"]} == {"window"}
  hv = needle_eval.held_vs_correct([rec, near])
  assert hv == {"digits": 5, "held_right": 2, "held_wrong": 1, "missed_right": 1,
                "missed_wrong": 1, "p_right_if_held": 2 / 3, "p_right_if_missed": 0.5,
                "held_right_by_layer": [0, 2], "held_wrong_by_layer": [0, 1],
                # layer 0 held nothing (all 5 digits "missed" there: 3 right); layer 1 held
                # 2 right + 1 wrong and missed 1 right + 1 wrong
                "p_right_if_held_by_layer": [None, 2 / 3],
                "p_right_if_missed_by_layer": [3 / 5, 1 / 2],
                # one KV group: the share of groups holding is "held" as 0 / 1, averaged
                "groups_right_by_layer": [0.0, 0.6667], "groups_wrong_by_layer": [0.0, 0.5],
                # per layer, only the digits whose block that layer held (layer 0: none)
                "slc_gate_held_right": [None, 0.0625], "slc_gate_held_wrong": [None, 0.0],
                "slc_mass_held_right": [None, 1.0], "slc_mass_held_wrong": [None,
                                                                            pytest.approx(0.0, abs=0.05)]}
  assert needle_eval.held_vs_correct([near])["p_right_if_held"] is None


def test_selected_key_mass_equals_a_masked_softmax_over_all_keys():
  rng = np.random.default_rng(SEED)
  t_len, heads, groups, dk, lsel = 40, 4, 2, 8, 8
  q = rng.normal(size=(heads, dk))
  k = rng.normal(size=(t_len, groups, dk))
  t = 37  # block 4, causal inside it
  idx_t = np.array([[0, 2, 4, -1], [4, 1, 1, 3]])  # group 1 names block 1 twice
  targets = [3, 17, 20, 36, 38]  # 38 is after t: never visible
  got = needle_eval.selected_key_mass(q, k, idx_t, t, lsel, targets, 0.3)
  for h in range(heads):
    g = h // 2
    visible = np.isin(np.arange(t_len) // lsel, idx_t[g][idx_t[g] >= 0]) & (np.arange(t_len) <= t)
    logits = np.where(visible, k[:, g] @ q[h] * 0.3, -np.inf)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert got[h] == pytest.approx(p[targets].sum(), rel=1e-12, abs=1e-15), h
  assert needle_eval.selected_key_mass(q, k, idx_t, t, lsel, list(range(t_len)), 0.3) == (
      pytest.approx(np.ones(heads)))


def test_needle_blocks_cli_on_a_trained_model(trained, tmp_path):
  """--mode=blocks end to end: its accuracy equals --mode=needle's on the same cells, every count
  adds up, and the JSON and PNG are written."""
  workdir, _, _ = trained
  dense_cfg = tiny_config()
  dense_cfg.model.layer_attention = ("dense", "dense")
  dense_dir = str(tmp_path / "dense")
  ablate.train_run(dense_cfg, dense_dir)
  out = tmp_path / "blocks.json"
  cmd = [sys.executable, "-m", "experiments.needle_eval", "--mode=blocks",
         f"--workdirs={workdir},{dense_dir}", "--labels=m,d", "--lengths=128,192",
         "--depths=0,0.5,1", "--samples=4", f"--out={out}"]
  res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "digits only a chosen block reaches" in res.stdout and "d (dense)" in res.stdout
  both = json.load(open(out))
  assert both["d"]["attention"] == "dense" and len(both["d"]["cells"]) == 6
  assert both["d"]["digits_right"] + both["d"]["digits_wrong"] == 6 * 4 * 5
  grid = both["m"]
  assert os.path.getsize(tmp_path / "blocks.png") > 5_000
  model, _, model_cfg = trained_model.load_model(workdir, max_seq_len=192)
  want = needle_eval.needle_grid(trained_model.jit_logits(model), [128, 192], [0, 0.5, 1], 4,
                                 1234)
  got = {(c["length"], c["depth"]): c for c in grid["cells"]}
  for j, n in enumerate([128, 192]):
    for i, d in enumerate([0, 0.5, 1]):
      c = got[n, d]
      assert c["exact"] == pytest.approx(want["exact"][i][j])
      assert c["digit_acc"] == pytest.approx(want["digits"][i][j])
      assert sum(c["reach"].values()) == pytest.approx(1.0)
      assert len(c["coverage_by_layer"]) == 1
      hv = c["held_vs_correct"]
      assert hv["digits"] == round(4 * 5 * c["reach"]["selection"])
      assert (c["held"] is None) == (hv["digits"] == 0)
      if hv["digits"]:
        assert c["held"] == pytest.approx((hv["held_right"] + hv["held_wrong"]) / hv["digits"])
      held = hv["held_right"] + hv["held_wrong"]
      assert (c["held_mass"] is None) == (held == 0)
      assert c["held_mass"] is None or 0 <= c["held_mass"] <= 1 + 1e-6
  total = grid["held_vs_correct"]
  assert total["digits"] == sum(c["held_vs_correct"]["digits"] for c in grid["cells"])
  assert total["digits"] == sum(total[k] for k in ("held_right", "held_wrong", "missed_right",
                                                   "missed_wrong"))
  # depth 0 puts the key in the initial block; depth 1 in a local block (l' = 32, w = 32)
  assert got[192, 0]["reach"]["forced"] == 1.0 and got[192, 1]["reach"]["selection"] == 0.0
  # the jitted block indices equal the eager aux path's
  tokens = needle_eval.passkey_batch(192, 1, 0.5, 2, SEED)[:, :-1]
  _, idx = trained_model.jit_logits_and_blocks(model)(tokens)
  _, auxes = trained_model.forward_with_aux(model, tokens)
  assert set(idx[0]) == {"q", "k"}  # the dense layer
  np.testing.assert_array_equal(np.asarray(idx[1]["block_idx"]), np.asarray(auxes[1]["block_idx"]))
  np.testing.assert_allclose(np.asarray(idx[1]["gates"]), np.asarray(auxes[1]["gates"]), atol=1e-5)
  for c in grid["cells"]:
    for ok in ("right", "wrong"):
      m = c["held_vs_correct"][f"slc_mass_held_{ok}"]
      assert m is None or (len(m) == 1 and 0 <= m[0] <= 1 + 1e-6), (ok, m)
  # the gate recorded is the selection branch's channel (BRANCH_ORDER = cmp, slc, win) at the
  # query predicting the first digit: the real model's choices with gates set per channel/position
  real = trained_model.jit_logits_and_blocks(model)

  def fake(tokens):
    logits, auxes = real(tokens)
    g = np.zeros(auxes[1]["gates"].shape, np.float32)
    g[..., 0], g[..., 2] = 0.9, 0.7
    g[:, 192 - 5, :, 1] = 0.3  # the first answer query of a 192-token input
    idx = np.array(auxes[1]["block_idx"])
    idx[:, 192 - 4:] = -1  # the later digits' queries hold nothing: only the first digit counts
    for row, toks in enumerate(np.asarray(tokens)):  # hold the key there in half of the rows
      cut = bytes(toks.astype(np.uint8)).find(needle_eval.FACT_PREFIX.encode())
      if row % 2 == 0:
        blocks = needle_eval.key_blocks(cut, model_cfg.nsa.sel_block)
        idx[row, 192 - 5, :, :len(blocks)] = blocks
      else:  # and miss it in the others: the gates there must not count
        idx[row, 192 - 5] = -1
        g[row, 192 - 5, :, 1] = 0.9
    return logits, [None, dict(auxes[1], block_idx=idx, gates=g)]

  fgrid = needle_eval.block_grid(fake, model_cfg.nsa, [192], [0.25, 0.5], 4, 1234)
  seen = [c["held_vs_correct"][key] for c in fgrid["cells"]
          for key in ("slc_gate_held_right", "slc_gate_held_wrong")]
  assert any(seen) and all(g in (None, [pytest.approx(0.3)]) for g in seen), seen
  # the real q and selection keys give each held digit a mass in [0, 1]; its cell's held_mass too
  masses = [m for c in fgrid["cells"] for key in ("slc_mass_held_right", "slc_mass_held_wrong")
            for m in (c["held_vs_correct"][key] or [])]
  assert masses and all(0 <= m <= 1 + 1e-6 for m in masses), masses
  assert all(c["held_mass"] is not None for c in fgrid["cells"] if c["held"])


def test_dense_grid_reads_the_dense_layers_attention_on_each_digit(trained):
  """dense_grid: digit counts and accuracies equal the needle scorer's, masses in [0, 1], and the
  mass of one digit equals a causal softmax computed here from the layer's q and k."""
  workdir, _, _ = trained
  model, _, _ = trained_model.load_model(workdir, max_seq_len=192)
  fn = trained_model.jit_logits_and_blocks(model)
  grid = needle_eval.dense_grid(fn, [192], [0.5], 4, 1234)
  want = needle_eval.needle_grid(trained_model.jit_logits(model), [192], [0.5], 4, 1234)
  c = grid["cells"][0]
  assert c["exact"] == pytest.approx(want["exact"][0][0])
  assert c["digit_acc"] == pytest.approx(want["digits"][0][0])
  assert grid["digits_right"] + grid["digits_wrong"] == 4 * 5
  for m in (grid["mass_right"], grid["mass_wrong"]):
    assert m is None or (len(m) == 1 and 0 <= m[0] <= 1 + 1e-6)  # one dense layer
  rows = needle_eval.passkey_examples(192, 0, 0.5, 1, 1234)
  _, auxes = fn(np.stack([r[0] for r in rows])[:, :-1])
  q, k = np.asarray(auxes[0]["q"])[0], np.asarray(auxes[0]["k"])[0]
  t, pos = 187, rows[0][2] + len(needle_eval.FACT_PREFIX)
  h = 3
  logits = k[:t + 1, h // 2] @ q[t, h] * q.shape[-1] ** -0.5
  p = np.exp(logits - logits.max())
  got = needle_eval.selected_key_mass(q[t], k, np.zeros((2, 1), int), t, t + 1, [pos],
                                      q.shape[-1] ** -0.5)
  assert got[h] == pytest.approx(p[pos] / p.sum(), rel=1e-5)


def test_bench_kernels_registry_labels(monkeypatch):
  """bench_kernels --plan registry labels each record with the branch backend="auto" takes (the
  timing itself needs a GPU and is replaced here)."""
  from experiments import bench_kernels as bk
  monkeypatch.setattr(bk, "time_fwd_bwd", lambda f, *a, **k: (1.0, 2.0))
  recs = bk.bench_select(512, 16, 1, 64, 64, 8, 64, "clustered", tiling="registry")
  assert [r["pass"] for r in recs] == ["fwd", "bwd"]
  assert "pallas-mosaic-gpu" in recs[0]["impl"] and "registry: mosaic branch" in recs[0]["impl"]
  recs = bk.bench_select(512, 16, 4, 128, 128, 8, 64, "random", tiling="registry")
  assert "registry: mosaic branch" in recs[0]["impl"], recs[0]["impl"]  # 8 blocks: small unions
  recs = bk.bench_select(512, 16, 1, 128, 128, 8, 64, "clustered", tiling="registry")
  assert "registry: mosaic branch" in recs[0]["impl"], recs[0]["impl"]  # G = 16 up to d = 128
  recs = bk.bench_select(512, 16, 1, 192, 128, 8, 64, "clustered", tiling="registry")
  assert "pallas-triton" in recs[0]["impl"] and "registry" not in recs[0]["impl"]
  recs = bk.bench_select(512, 16, 1, 64, 64, 8, 64, "clustered", tiling="mosaic-ws")
  assert "pallas-mosaic-gpu union tq8" in recs[0]["impl"] and "2 consumer warpgroups" in recs[0]["impl"]
  assert [j[3] for j in bk.plan_jobs("mosaicws", [8192], [16, 4], ["random"], 64)] == [
      "mosaic-ws", "mosaic-ws-nopp", "mosaic", None]  # G = 4 has no 128-row tile
  seen = []
  monkeypatch.setattr(bk, "time_fwd_bwd",
                      lambda f, *a, **k: (seen.append(bk.select_attention_mgpu.WS_PINGPONG), (1.0, 2.0))[1])
  recs = bk.bench_select(512, 16, 1, 64, 64, 8, 64, "clustered", tiling="mosaic-ws-nopp")
  assert "no ping-pong" in recs[0]["impl"] and seen == [False]
  assert bk.select_attention_mgpu.WS_PINGPONG
  # the K/V ring A/B: the variant sets KV_RING while timed, then restores it
  assert [j[3] for j in bk.plan_jobs("mosaicring", [65536], [16], ["clustered"], 64)] == [
      "mosaic-noring", "mosaic-ring", "mosaic-noring", "mosaic-ring"]
  rings = []
  mg = bk.select_attention_mgpu
  monkeypatch.setattr(bk, "time_fwd_bwd",
                      lambda f, *a, **k: (rings.append(mg.ring_applies(128, 128) and mg.ring_applies(64, 64)
                                                       if mg.KV_RING else False), (1.0, 2.0))[1])
  recs = bk.bench_select(512, 16, 1, 128, 128, 8, 64, "clustered", tiling="mosaic-ring")
  assert "K/V ring" in recs[0]["impl"] and "pallas-mosaic-gpu" in recs[0]["impl"]
  recs = bk.bench_select(512, 16, 1, 128, 128, 8, 64, "clustered", tiling="mosaic-noring")
  assert "K/V ring" not in recs[0]["impl"]
  recs = bk.bench_select(512, 16, 1, 64, 64, 8, 64, "clustered", tiling="mosaic-ring")
  assert "K/V ring" in recs[0]["impl"]  # the variant forces the ring below RING_MIN_DIM too
  recs = bk.bench_select(512, 16, 1, 64, 64, 8, 64, "clustered", tiling="mosaic")
  assert "K/V ring" not in recs[0]["impl"]  # the default: not below RING_MIN_DIM
  assert rings == [True, False, True, False]
  assert mg.KV_RING and mg.RING_MIN_DIM == 128  # restored


def test_bench_kernels_plot_draws_every_panel(tmp_path):
  """bench_kernels --plot: a PNG next to the JSON (one panel per T, G, pattern); a file without
  selection records is refused with its name."""
  from experiments import bench_kernels as bk
  recs = [dict(op="select", impl=impl, pass_=None, T=8192, q_heads=16, kv_heads=kh, d_k=64, d_v=64,
               batch=8, pattern=pat, ms=ms, cudnn_ms=2.6, hardware="test", date="today")
          for impl, ms in (("pallas-mosaic-gpu union tq4", 1.4), ("pallas-triton union tq4", 1.6))
          for kh in (1, 4) for pat in ("clustered", "random")]
  for r in recs:
    r["pass"] = r.pop("pass_") or "fwd"
  path = tmp_path / "select_test.json"
  path.write_text(json.dumps(recs))
  out = bk.main(["--plot", str(path)])
  assert out.endswith("select_test.png") and (tmp_path / "select_test.png").stat().st_size > 10_000
  (tmp_path / "empty.json").write_text("[]")
  with pytest.raises(SystemExit, match="empty.json"):
    bk.main(["--plot", str(tmp_path / "empty.json")])


def test_bench_kernels_bars_keep_repeats_and_name_variants():
  """A variant timed twice keeps both bar pairs (run order), and the Mosaic step switches and the
  two-warpgroup kernel are named in the short labels (they are otherwise the same tile)."""
  from experiments import bench_kernels as bk
  on = "pallas-mosaic-gpu union tq4 bk64 w4s2; bwd tok4 ch512 w4s2 det"
  off = on + " (fast mask off, P from SMEM)"
  rows = [dict(impl=i, ms=m, **{"pass": p}) for i, p, m in
          [(on, "fwd", 1.3), (on, "bwd", 4.1), (off, "fwd", 1.5), (off, "bwd", 4.3),
           (on, "fwd", 1.4), (on, "bwd", 4.0)]]
  assert bk._bar_jobs(rows) == [(on, {"fwd": 1.3, "bwd": 4.1}), (off, {"fwd": 1.5, "bwd": 4.3}),
                                (on, {"fwd": 1.4, "bwd": 4.0})]
  assert bk._bar_label(on) == "mosaic\nunion tq4"
  assert bk._bar_label(off) == "mosaic\nunion tq4\nB1 off"
  assert bk._bar_label(on + " (fast mask on, P from SMEM)").endswith("mask only")
  assert bk._bar_label(on + " (forward: K/V ring of 3 buffers)") == "mosaic\nunion tq4\nK/V ring"
  assert bk._bar_label("pallas-mosaic-gpu union tq8 bk64 w4s2; x 2 consumer warpgroups, no "
                       "ping-pong").endswith("2 WG\nno ping-pong")
  assert bk._bar_label("pallas-triton union tq4 bk64 w4s2; x (auto: mean union 17.5)") == \
      "triton\nunion tq4\nauto"


def test_plot_throughput_median_ratio_and_errors(tmp_path):
  """plot_throughput: the median of each run's tokens/s windows, NSA / dense per pair, a PNG, and
  errors that name a missing work directory, a run without throughput records, a bad --pair."""
  from experiments import plot_throughput as pt
  def run(name, vals):
    d = tmp_path / name
    d.mkdir()
    recs = [{"event": "start"}] + [{"step": i, "train/tokens_per_s": v} for i, v in enumerate(vals)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return str(d)
  n, d = run("nsa", [100.0, 300.0, 310.0, 1000.0]), run("dense", [200.0, 400.0, 420.0])
  out = tmp_path / "t.png"
  table = pt.main(["--pair", f"8k={n},{d}", "--out", str(out)])
  assert out.stat().st_size > 1000
  assert "| 8k | 305 | 400 | 0.762x | 4, 3 |" in table
  with pytest.raises(FileNotFoundError, match="missing"):
    pt.main(["--pair", f"x={n},{tmp_path / 'missing'}", "--out", str(out)])
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "metrics.jsonl").write_text('{"event": "start"}\n')
  with pytest.raises(ValueError, match="no train/tokens_per_s"):
    pt.main(["--pair", f"x={n},{empty}", "--out", str(out)])
  with pytest.raises(ValueError, match="LABEL=NSA_WORKDIR,DENSE_WORKDIR"):
    pt.main(["--pair", f"{n},{d}", "--out", str(out)])
  # runs that say what they are (config.json): a swapped pair is refused
  for path, kind in ((n, "nsa"), (d, "dense")):
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump({"model": {"attention": kind, "layer_attention": None}}, f)
  assert "0.762x" in pt.main(["--pair", f"8k={n},{d}", "--out", str(out)])
  with pytest.raises(ValueError, match="the first run .* has no NSA layer"):
    pt.main(["--pair", f"8k={d},{n}", "--out", str(out)])
  # metrics files given directly (the packed 8k pairs): same medians; a missing file is named
  table = pt.main(["--pair", f"8k={n}/metrics.jsonl,{d}/metrics.jsonl", "--out", str(out)])
  assert "| 8k | 305 | 400 | 0.762x | 4, 3 |" in table
  with pytest.raises(FileNotFoundError, match="gone.jsonl"):
    pt.main(["--pair", f"x={n},{tmp_path / 'gone.jsonl'}", "--out", str(out)])


def test_plot_ablations_chart_table_and_errors(tmp_path):
  """Deltas against the reference, one bar per config hash (the shared reference drawn once), the
  FILE:RUN extras, and clear errors for a missing reference, file or run."""
  from experiments import plot_ablations
  def rec(run, h, loss):
    return {"run": run, "config_hash": h, "val_loss": loss, "params": 1000}
  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  a.write_text("\n".join(json.dumps(r) for r in [rec("nsa", "h0", 1.5), rec("x", "h1", 1.7)]) + "\n")
  b.write_text("\n".join(json.dumps(r) for r in [rec("nsa", "h0", 1.5), rec("y", "h2", 1.4),
                                                   rec("dense", "h3", 1.9)]) + "\n")
  out = tmp_path / "c.png"
  table = plot_ablations.main([str(a), f"--extra={b}:dense", "--extra", f"{b}:y", "--out", str(out)])
  assert out.stat().st_size > 1000
  lines = [l for l in table.splitlines() if l.startswith("| ") and not l.startswith("| run")]
  assert [l.split(" | ")[0][2:] for l in lines] == ["y", "x", "dense"]  # sorted by delta
  assert "-0.1000" in lines[0] and "+0.2000" in lines[1] and "+0.4000" in lines[2]
  ref, rows = plot_ablations.deltas(plot_ablations.load_records([str(a), str(b)]))
  assert ref["val_loss"] == 1.5 and len(rows) == 3  # nsa once, though it is in both files
  with pytest.raises(ValueError, match="no run named 'base'"):
    plot_ablations.deltas(plot_ablations.load_records([str(a)]), "base")
  with pytest.raises(FileNotFoundError, match="no such results file"):
    plot_ablations.load_records([str(tmp_path / "missing.jsonl")])
  with pytest.raises(ValueError, match="no run named 'zzz'"):
    plot_ablations.load_records([], [f"{b}:zzz"])
  with pytest.raises(ValueError, match="expected FILE:RUN"):
    plot_ablations.load_records([], ["nocolon"])
  # A rerun of x with other settings (another hash) replaces x's bar instead of adding one, and the
  # reference is drawn against its own latest record only.
  with open(a, "a") as f:
    f.write(json.dumps(rec("x", "h9", 1.6)) + "\n" + json.dumps(rec("nsa", "h8", 1.45)) + "\n")
  ref, rows = plot_ablations.deltas(plot_ablations.load_records([str(a)]))
  assert ref["config_hash"] == "h8" and [(n, round(d, 4)) for n, d, _ in rows] == [("x", 0.15)]
  assert plot_ablations.load_records([], [f"{a}:x"])[0]["config_hash"] == "h9"


def test_profile_step_times_both_configs_and_groups_kernels(tmp_path):
  """experiments.profile_step on the tiny CPU config and its dense twin: timings and tables are
  written (a CPU trace has no device plane, so the groups are empty here), and the kernel-name
  grouping sorts real GPU kernel names from the H200 profiles into the right groups."""
  from experiments import profile_step as ps
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-m", "experiments.profile_step",
                      "--config=configs/tiny_cpu.py", "--compare=configs/tiny_cpu.py",
                      "--compare.model.attention=dense", f"--out={tmp_path}", "--warmup=1",
                      "--timed=1", "--steps=1", "--nocommand_buffers"], cwd=root,
                     capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  doc = json.load(open(tmp_path / "step_profile.json"))
  assert [run["tag"] for run in doc["runs"]] == ["config:nsa", "compare:dense"]
  assert doc["command_buffers"] is False and "off (--nocommand_buffers)" in open(
      tmp_path / "step_profile.md").read()
  assert all(run["ms_per_step"] > 0 and run["tokens_per_s"] > 0 for run in doc["runs"])
  assert all(run["lower_s"] > 0 and run["compile_s"] > 0 for run in doc["runs"])  # start-up split
  assert "start-up: XLA compile, s" in open(tmp_path / "step_profile.md").read()
  assert doc["runs"][0]["implementation"] == "auto" and doc["runs"][1]["implementation"] is None
  assert "compare:dense" in open(tmp_path / "step_profile.md").read()
  for tag in ("config", "compare"):  # the compiled step's HLO, to read a fusion named in a table
    with gzip.open(tmp_path / f"{tag}_step.hlo.txt.gz", "rt") as f:
      assert "ENTRY" in f.read()
  names = {"[Stream #14] nsa_select_topn": "NSA top-n (Pallas)",
           "[Stream #14] entry_mosaic_gpu_kernel": "NSA selection (Pallas Triton / Mosaic GPU)",
           "[Stream #14] nsa_select_dkv_reduce": "NSA selection (Pallas Triton / Mosaic GPU)",
           "[Stream #14] nsa_cmp_dkv": "NSA compression (Pallas)",
           "[Stream #14] cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16":
               "cuDNN attention (dense, window, fold)",
           "[Stream #14] sm90_xmma_gemm_bf16bf16_bf16f32": "matmuls (cuBLAS / XLA)",
           "[Stream #14] sort_20_1": "sorts", "[Stream #14] MemcpyD2D": "copies, memsets, transposes",
           "[Stream #14] loop_add_fusion_3": "other XLA fusions", "[Stream #14] weird": "other"}
  for name, group in names.items():
    assert ps.group_of(name) == group, name
  # scope labels from the op metadata stats of GPU kernel events (the JAX name stack)
  stats = {"jit(step)/jit(main)/jvp(nsa_op)/topn/pallas_call": "NSA op forward top-n",
           "jit(step)/transpose(jvp(nsa_op))/combine/mul": None,
           "jit(step)/jvp(nsa_gates)/dot_general": None,
           "jit(step)/transpose(jvp(mlp))/dot_general": None,
           "jit(step)/optimizer/add": None, "jit(loss)/mul": None}
  labels = [ps.scope_of({"tf_op": k, "hlo_op": "fusion.1"}) for k in stats]
  assert labels == ["nsa_op/topn", "nsa_op/combine (bwd)", "nsa_gates", "mlp (bwd)", "optimizer",
                    "(no scope)"], labels


def test_idle_gaps_count_time_no_device_line_covers():
  """bench_common.idle_gaps: overlapping intervals on two lines count once as busy, the holes
  between them are the idle gaps (longest first, named by what ended before and started after)."""
  from experiments import bench_common as bc
  ms = 1_000_000  # ns
  iv = [(0, 10 * ms, "a"), (5 * ms, 12 * ms, "copy"), (20 * ms, 30 * ms, "b"),
        (31 * ms, 40 * ms, "c"), (32 * ms, 33 * ms, "inside c")]
  got = bc.idle_gaps(iv, steps=2, top=5)
  assert (got["span_ms"], got["busy_ms"], got["idle_ms"]) == (20.0, 15.5, 4.5)
  assert got["gaps"] == 1.0 and got["largest"] == [(8000.0, "copy", "b"), (1000.0, "b", "c")]


def test_trace_gaps_reports_the_idlest_gpu(tmp_path, monkeypatch):
  """bench_common.trace_gaps takes each GPU plane on its own (one GPU's kernels must not hide
  another's idle time), skips non-GPU planes and module / step lines, and reports the GPU with
  the most idle time."""
  from types import SimpleNamespace as NS
  from experiments import bench_common as bc
  (tmp_path / "host.xplane.pb").write_bytes(b"")
  ms = 1_000_000
  ev = lambda name, s, e: NS(name=name, start_ns=s * ms, duration_ns=(e - s) * ms,
                             stats=[("tf_op", "jit(step)/mlp")])
  planes = [NS(name="/host:CPU", lines=[NS(name="host", events=[ev("x", 0, 100)])]),
            NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=[ev("a", 0, 10),
                                                                          ev("b", 11, 20)]),
                                            NS(name="XLA Modules", events=[ev("m", 0, 20)])]),
            NS(name="/device:GPU:1", lines=[NS(name="Stream #1", events=[ev("c", 0, 5),
                                                                          ev("d", 15, 20)])])]
  monkeypatch.setattr(jax.profiler.ProfileData, "from_file", lambda path: NS(planes=planes))
  got = bc.trace_gaps(str(tmp_path), steps=1, top=3)
  assert got["device"] == "/device:GPU:1" and got["devices"] == 2
  assert (got["span_ms"], got["idle_ms"]) == (20.0, 10.0)
  assert got["largest"] == [(10000.0, "c (jit(step)/mlp)", "d (jit(step)/mlp)")]


def test_fusion_scopes_name_what_a_fusion_mixed():
  """profile_step.fusion_scopes labels each fusion of a compiled module by the scopes of the ops
  fused into it: one scope, or "mixed: A + B" when ops of two scopes were fused together."""
  import jax.numpy as jnp
  from experiments import profile_step as ps

  def f(x, w):
    with jax.named_scope("mlp"):
      y = jnp.sin(x) * 2.0
    with jax.named_scope("nsa_out"):
      z = jnp.cos(y) + 1.0
    with jax.named_scope("nsa_q"):
      u = jnp.tanh(x @ w)
    return z, u

  text = jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
  labels = ps.fusion_scopes(text)
  assert "mixed: mlp + nsa_out" in labels.values(), labels
  assert set(labels.values()) <= {"mixed: mlp + nsa_out", "mlp", "nsa_out", "nsa_q"}, labels
  assert "nsa_q" in labels.values(), labels
  # header / instruction parsing on a hand-written module with a nested call
  hlo = "\n".join([
      "%inner (p: f32[2]) -> f32[2] {",
      '  ROOT %m = f32[2] multiply(%p, %p), metadata={op_name="jit(s)/transpose(jvp(mlp))/mul"}',
      "}",
      "%outer (p: f32[2]) -> f32[2] {",
      '  %a = f32[2] add(%p, %p), metadata={op_name="jit(s)/nsa_kv/add"}',
      "  ROOT %f = f32[2] fusion(%a), kind=kLoop, calls=%inner",
      "}",
      "ENTRY %main (x: f32[2]) -> f32[2] {",
      "  ROOT %loop_add_fusion.7 = f32[2] fusion(%x), kind=kLoop, calls=%outer",
      "}"])
  assert ps.fusion_scopes(hlo) == {"f": "mlp (bwd)",
                                   "loop_add_fusion.7": "mixed: mlp (bwd) + nsa_kv"}


def test_named_scopes_reach_the_compiled_step():
  """The scopes profile_step groups by are in the HLO op metadata of an NSA LM's gradient step
  (forward and transposed), so a GPU trace can attribute kernels to them."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from experiments import profile_step as ps
  from nsa_jax import ModelConfig, NSAConfig
  from nsa_jax.model import TransformerLM
  nsa = NSAConfig(num_heads=4, num_kv_heads=2, head_dim=8, cmp_block=8, cmp_stride=4,
                  sel_block=16, num_selected=3, window=16)
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, max_seq_len=64, attention="nsa", nsa=nsa)
  model = TransformerLM(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jnp.zeros((1, 64), jnp.int32)

  def loss(p):
    lg = nnx.merge(graphdef, p)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(lg, tokens).mean()

  names = re.findall(r'op_name="([^"]*)"', jax.jit(jax.grad(loss)).lower(params).compile().as_text())
  labels = {ps.scope_of({"tf_op": n}) for n in names}
  for scope in ("embed", "attn_norm", "nsa_q", "nsa_kv_cmp", "nsa_kv", "nsa_gates", "nsa_out",
                "mlp", "lm_head"):
    assert scope in ps.SCOPES and {scope, f"{scope} (bwd)"} <= labels, (scope, sorted(labels))
  # off the GPU the op runs the "xla" path, which has no branch scopes
  assert {"nsa_op/other", "nsa_op/other (bwd)"} <= labels, sorted(labels)


def test_benchmarks_refuse_gpu_sizes_off_a_gpu(monkeypatch, capsys):
  """Off a GPU the benchmarks are code-path dry runs: the default (GPU) lengths are refused with
  the reason and the fix (exit 2) instead of running for minutes into an out-of-memory error,
  and the kernels with no CPU mode refuse at once."""
  from experiments import bench_decode, bench_kernels, bench_nsa
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the same on a GPU machine
  with pytest.raises(SystemExit) as e:
    bench_nsa.main([])
  assert e.value.code == 2 and "T > 4096" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    bench_kernels.main(["--T", "128"])
  assert e.value.code == 2 and "needs a GPU" in capsys.readouterr().err
  monkeypatch.setattr(sys, "argv", ["bench_decode"])
  with pytest.raises(SystemExit) as e:
    bench_decode.main()
  assert e.value.code == 2 and "needs a GPU" in capsys.readouterr().err
  monkeypatch.setattr(sys, "argv", ["bench_decode", "--interpret"])
  with pytest.raises(SystemExit) as e:
    bench_decode.main()
  assert e.value.code == 2 and "--lengths 1024" in capsys.readouterr().err
  # a path named twice would be timed once (results are keyed by name): refused, naming the fix
  monkeypatch.setattr(sys, "argv", ["bench_decode", "--interpret", "--lengths", "1024",
                                    "--impls", "pallas_all,pallas_all"])
  with pytest.raises(SystemExit) as e:
    bench_decode.main()
  assert e.value.code == 2 and "pallas_all_again" in capsys.readouterr().err


def test_compare_fla_table_chart_and_errors(tmp_path):
  """compare_fla: speed-ups over each run's own dense baseline and the ms ratio, from the committed
  H200 table and FLA reference; a table without whole-op rows, or without a common T, is refused."""
  from experiments import compare_fla
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ours = os.path.join(root, "benchmarks/results/nsa_h200_rank8k.json")
  fla = os.path.join(root, "benchmarks/results/fla_nsa_h200_reference.json")
  out = tmp_path / "vs_fla.png"
  assert compare_fla.main(["--ours", ours, "--fla", fla, "--out", str(out)]) == str(out)
  assert out.exists() and (tmp_path / "vs_fla.md").exists()
  assert "NVIDIA H200" in (tmp_path / "vs_fla.md").read_text()
  table = compare_fla.rows(compare_fla.load_ours(ours, 128, 128), compare_fla.load_fla(fla))
  r = next(r for r in table if r["T"] == 65536 and r["part"] == "whole" and r["pass_"] == "fwd")
  rec = next(x for x in json.load(open(ours)) if x["op"] == "nsa" and x["pass"] == "fwd"
             and x["T"] == 65536 and x["d_k"] == 128)
  assert r["ours_ms"] == rec["ms"] and r["ours_speedup"] == pytest.approx(rec["cudnn_ms"] / rec["ms"])
  assert r["fla_speedup"] == pytest.approx(125.0 / 57.2)
  assert r["fla_over_ours_ms"] == pytest.approx(57.2 / rec["ms"])
  assert {(r["T"], r["part"]) for r in table} >= {(8192, "whole"), (65536, "select")}
  with pytest.raises(ValueError, match="no whole-op"):
    compare_fla.load_ours(ours, 64, 64)
  bad = tmp_path / "fla.json"
  bad.write_text(json.dumps({"source": "x", "rows": [{"T": 123}]}))
  with pytest.raises(ValueError, match="no sequence length is in both"):
    compare_fla.rows(compare_fla.load_ours(ours, 128, 128), compare_fla.load_fla(str(bad)))
  bad.write_text(json.dumps({"rows": []}))
  with pytest.raises(ValueError, match="reference file"):
    compare_fla.load_fla(str(bad))


def _fla_records(ts=(8192, 65536)):
  """bench_fla-shaped records: dense 10 / 30 ms, whole 4 / 12 ms, select random 2 / 6, clustered
  1 / 3 (fwd / bwd), times T / 8192."""
  recs = []
  for t in ts:
    s = t / 8192
    for op, pat, (f, b) in (("dense_torch", None, (10, 30)), ("fla_nsa", None, (4, 12)),
                            ("fla_select", "random", (2, 6)), ("fla_select", "clustered", (1, 3))):
      for p, ms in (("fwd", f * s), ("bwd", b * s)):
        rec = {"op": op, "impl": "x", "pass": p, "T": t, "batch": 1, "q_heads": 64, "kv_heads": 4,
               "d_k": 128, "d_v": 128, "ms": ms, "cudnn_ms": (10 if p == "fwd" else 30) * s,
               "hardware": "NVIDIA H100 80GB HBM3", "date": "d", "command": "c", "torch": "2.11"}
        if pat:
          rec["pattern"] = pat
        recs.append(rec)
  return recs


def test_compare_fla_same_run_records_and_same_list_selection(tmp_path):
  """compare_fla with bench_fla's records: whole-op rows against bench_nsa's, selection rows per
  pattern against bench_kernels' registry rows (the same block lists), speed-ups over each side's
  own dense; a selection table with ambiguous rows is refused."""
  from experiments import compare_fla
  fla = tmp_path / "fla.json"
  fla.write_text(json.dumps(_fla_records()))
  base = dict(batch=1, q_heads=64, kv_heads=4, d_k=128, d_v=128, hardware="NVIDIA H100 80GB HBM3 (gpu)")
  ours = tmp_path / "nsa.json"
  ours.write_text(json.dumps([dict(op="nsa", impl="pallas", T=t, ms=ms, cudnn_ms=dense,
                                   **{"pass": p}, **base)
                              for t in (8192, 65536) for p, ms, dense in (("fwd", 5.0, 3.0),
                                                                          ("bwd", 8.0, 9.0))]))
  sel = tmp_path / "select.json"
  sel.write_text(json.dumps(
      [dict(op="select", impl=f"pallas-triton x (registry: triton branch)", T=65536, pattern=pat,
            ms=ms, cudnn_ms=100.0, **{"pass": p}, **base)
       for pat, p, ms in (("random", "fwd", 16.0), ("random", "bwd", 32.0),
                          ("clustered", "fwd", 8.0), ("clustered", "bwd", 20.0))]
      + [dict(op="select", impl="pallas-mosaic-gpu other tiling", T=65536, pattern="random",
              ms=99.0, cudnn_ms=100.0, **{"pass": "fwd"}, **base)]))
  out = tmp_path / "cmp.png"
  assert compare_fla.main(["--ours", str(ours), "--ours_select", str(sel), "--fla", str(fla),
                           "--out", str(out)]) == str(out)
  md = (tmp_path / "cmp.md").read_text()
  assert "NVIDIA H100 80GB HBM3," in md and "| 65536 | select | clustered | fwd | 8.00 |" in md
  ours_d = compare_fla.load_ours(str(ours), 128, 128)
  ours_d.update(compare_fla.load_ours_select(str(sel), 128, 128))
  table = compare_fla.rows(ours_d, compare_fla.load_fla(str(fla)))
  pick = lambda part, pat, p, t: next(r for r in table if (r["part"], r["pattern"], r["pass_"],
                                                             r["T"]) == (part, pat, p, t))
  r = pick("select", "random", "fwd", 65536)  # the registry row, not the other tiling's 99 ms
  assert r["ours_ms"] == 16.0 and r["fla_ms"] == pytest.approx(16.0)
  assert r["ours_speedup"] == pytest.approx(100 / 16) and r["fla_speedup"] == pytest.approx(5.0)
  r = pick("whole", None, "bwd", 8192)
  assert r["fla_over_ours_ms"] == pytest.approx(12 / 8.0) and r["fla_speedup"] == pytest.approx(2.5)
  assert not any(r["part"] == "select" and r["T"] == 8192 for r in table)  # no select of ours
  sel.write_text(json.dumps([dict(op="select", impl="a", T=65536, pattern="random", ms=1.0,
                                  cudnn_ms=2.0, **{"pass": "fwd"}, **base)] * 2))
  with pytest.raises(ValueError, match="registry"):
    compare_fla.load_ours_select(str(sel), 128, 128)
  with pytest.raises(ValueError, match="no selection rows"):
    compare_fla.load_ours_select(str(sel), 64, 64)


def test_bench_fla_refuses_clearly_without_torch_or_gpu(monkeypatch, capsys):
  """bench_fla off a GPU (here: no PyTorch, or no CUDA device) ends with one line that names what
  is missing and the fix; bad flags are refused before anything is imported."""
  from experiments import bench_fla
  with pytest.raises(SystemExit) as e:
    bench_fla.main(["--heads", "64/8"])
  assert e.value.code == 2 and "power-of-two group size of at least 16" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    bench_fla.main(["--patterns", "random,zipf"])
  assert e.value.code == 2 and "zipf" in capsys.readouterr().err
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
  with pytest.raises(SystemExit) as e:
    bench_fla.main(["--T", "1024"])
  assert "PyTorch is missing" in str(e.value) and "Fix" in str(e.value)


def test_a_non_positive_benchmark_time_gets_no_speedup():
  """A backward read as (fwd + bwd) - fwd can come out <= 0 within timing noise (a CPU dry run
  printed -0.34 ms and a speed-up of -7.81): no speed-up then, and a note saying why."""
  from experiments import bench_common as bc
  kw = dict(op="window", impl="x", pass_="bwd", t=256, batch=1, q_heads=4, kv_heads=1, d_k=16,
            d_v=16, cudnn_ms=2.0)
  bad = bc.record(ms=-0.3424, **kw)
  assert bad["speedup"] is None and "non-positive time" in bad["note"]
  good = bc.record(ms=0.5, **kw)
  assert good["speedup"] == 4.0 and "note" not in good


def test_result_files_are_named_after_the_machine(monkeypatch):
  """The benches' default file names say which machine measured (nsa_h100.json on an H100, not
  nsa_h200.json on any GPU): the device kind's model, or the backend off a GPU."""
  from experiments import bench_common as bc
  monkeypatch.setattr(bc.jax, "default_backend", lambda: "cpu")
  assert bc.device_tag() == "cpu"
  monkeypatch.setattr(bc.jax, "default_backend", lambda: "gpu")
  for kind, tag in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                    ("NVIDIA GH200 480GB", "gh200"),
                    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "4090")):
    monkeypatch.setattr(bc.jax, "devices", lambda kind=kind: [type("D", (), {"device_kind": kind})()])
    assert bc.device_tag() == tag, kind


def test_position_nll_hands_a_document_masked_batch_its_segment_ids():
  """A run trained with data.document_mask is evaluated with its documents kept apart."""
  seen = []
  batch = {"inputs": np.zeros((2, 6), np.int32), "targets": np.zeros((2, 6), np.int32),
           "weights": np.ones((2, 6), np.float32),
           "segment_ids": np.array([[0, 0, 1, 1, 1, 2]] * 2, np.int32)}
  fn = lambda tokens, *seg: (seen.append(seg), np.zeros((2, 6, 3), np.float32))[1]  # noqa: E731
  needle_eval.position_nll(fn, [batch, {k: v for k, v in batch.items() if k != "segment_ids"}])
  assert len(seen) == 2 and seen[1] == ()
  np.testing.assert_array_equal(seen[0][0], batch["segment_ids"])
  # Tokens count at their position inside their document: row position j has NLL j + 1
  # (logits [0, log(e^(j+1) - 1)] with target 0); documents [0, 0 | 1, 1, 1 | 2] put row
  # positions 0, 2, 5 at document position 0, 1 and 3 at 1, 4 at 2; nothing reaches 3-5.
  x = np.log(np.expm1(np.arange(1, 7, dtype=np.float64)))
  logits = np.stack([np.zeros(6), x], -1)[None].repeat(2, 0)
  got, count = needle_eval.position_nll(lambda tokens, *seg: logits, [batch], return_count=True)
  np.testing.assert_allclose(got[:3], [10 / 3, 3, 5], rtol=1e-9)
  assert np.isnan(got[3:]).all() and count.tolist() == [6, 4, 2, 0, 0, 0]
  b = needle_eval.bucketize(got, 2)  # NaN positions are left out of a bucket's mean
  assert [(s, e) for s, e, _ in b] == [(0, 2), (2, 4), (4, 6)]
  np.testing.assert_allclose([b[0][2], b[1][2]], [(10 / 3 + 3) / 2, 5.0], rtol=1e-9)
  assert np.isnan(b[2][2])


def test_atomic_sem_trial_patches_one_process_and_runs_the_bench(tmp_path):
  """benchmarks/atomic_sem_trial.py (relaxed Triton atomics for the fused-dq trial) still finds
  jax's private default it patches, and runs bench_window under it (CPU: interpret mode)."""
  env = {**os.environ, "PYTHONPATH": ROOT}
  bad = subprocess.run([sys.executable, "benchmarks/atomic_sem_trial.py", "--sem", "weak"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "usage" in bad.stderr
  proc = subprocess.run(
      [sys.executable, "benchmarks/atomic_sem_trial.py", "--sem", "relaxed", "window",
       "--backends", "triton", "--shapes", "64:1:4/1:16/16", "--iters", "1", "--window", "16",
       "--tilings", "fused:bwd_fused_dq=true", "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "RELAXED" in proc.stdout
  recs = json.load(open(tmp_path / "window_cpu.json"))
  assert {r["impl"] for r in recs} == {"window-triton", "window-triton-fused"}


def test_select_bwd_trial_runs_variants_that_agree(tmp_path):
  """benchmarks/select_bwd_trial.py (selection backward launch parameters on the whole op's own
  top-n lists) times a variant beside the default, its dq and dK/dV parts alone, and the variant's
  gradients agree with the default's (CPU: interpret mode, a tiny shape)."""
  sys.path.insert(0, ROOT)
  from benchmarks import select_bwd_trial
  rows = select_bwd_trial.main(["--shapes", "tiny", "--lists", "nsa-topn", "--iters", "1",
                                "--variants", "dkv tokens 2", "--out", str(tmp_path)])
  assert [r["variant"] for r in rows] == ["default", "dkv tokens 2"]
  for r in rows:
    assert "error" not in r, r
    assert r["dq_ms"] > 0 and r["dkv_ms"] > 0 and r["fwd_ms"] > 0
    assert r["tiling"]["tokens_per_tile"] == 1  # the per-token tile the whole op's cond runs
  assert rows[1]["tiling"]["bwd_tokens"] == 2 and rows[0]["tiling"]["bwd_tokens"] == 4
  assert rows[1]["grad_rel_diff_vs_default"] < 2e-2
  saved = json.load(open(tmp_path / "select_bwd_trial.json"))
  assert saved["rows"] == rows and "select_bwd_trial.py" in saved["provenance"]["command"]
  assert "| tiny | nsa-topn" in open(tmp_path / "select_bwd_trial.md").read()


def test_dense_doc_trial_times_every_implementation_and_they_agree(tmp_path):
  """benchmarks/dense_doc_trial.py (dense attention with document ids per implementation, the
  causal call without ids as the baseline) writes one fwd and one bwd record per implementation
  with the issue's fields, and the implementations' outputs agree (CPU: interpret mode, "cudnn"
  runs XLA with a warning, a tiny shape)."""
  sys.path.insert(0, ROOT)
  from benchmarks import dense_doc_trial
  recs = dense_doc_trial.main(["--out", str(tmp_path), "--shapes", "128:2:4/2:16/16",
                               "--iters", "1", "--mean_doc_len", "24"])
  assert [(r["impl"], r["pass"]) for r in recs] == [
      (i, p) for i in ("pallas", "cudnn", "xla") for p in ("fwd", "bwd")]
  for r in recs:
    assert r["op"] == "dense_doc" and r["T"] == 128 and r["q_heads"] == 4 and r["kv_heads"] == 2
    assert r["out_rel_diff_vs_first"] < 1e-5, r
    assert r["documents_per_row"] >= 3  # several documents: the ids matter
  saved = json.load(open(tmp_path / "dense_doc_trial.json"))
  assert saved == recs
  assert "| dense_doc | pallas | fwd |" in open(tmp_path / "dense_doc_trial.md").read()
  with pytest.raises(SystemExit):
    dense_doc_trial.main(["--out", str(tmp_path), "--impls", "flash"])


def test_cudnn_packed_trial_refuses_to_run_off_a_gpu(tmp_path):
  """benchmarks/cudnn_packed_trial.py needs a Hopper GPU (tests/test_cudnn_packed.py tests what it
  times); off one it stops with an argparse error instead of timing a stand-in."""
  sys.path.insert(0, ROOT)
  from benchmarks import cudnn_packed_trial as cp
  if jax.default_backend() != "gpu":
    with pytest.raises(SystemExit):
      cp.main(["--out", str(tmp_path)])
  assert cp.count_docs(np.array([[0, 0, 1, 1, 0], [2, 2, 2, 2, 2]], np.int32)) == 3
  # the temporaries column: XLA's own figure (a 512 x 512 float32 product held across a sort)
  x = jax.numpy.ones((512, 512))
  assert cp.temp_bytes(jax.jit(lambda x: jax.numpy.sort(x @ x, axis=0) @ x), x) >= 512 * 512 * 4


def test_cmp_tiling_trial_with_document_ids_switches_agree(tmp_path):
  """benchmarks/cmp_tiling_trial.py --docs (the compression kernels with packed-document segment
  ids): the id paths' switches give the default's gradients exactly, the rows and the table name
  the documents, and a negative length is refused."""
  sys.path.insert(0, ROOT)
  from benchmarks import cmp_tiling_trial
  rows = cmp_tiling_trial.main(["--out", str(tmp_path), "--shapes", "tiny", "--iters", "1",
                                "--docs", "96", "--variants", "no seg split,dkv masked ids"])
  assert [r["variant"] for r in rows] == ["default", "no seg split", "dkv masked ids"]
  for r in rows:
    assert "error" not in r, r
    assert r["grad_rel_diff_vs_default"] == 0.0, r  # the switches change which loop runs only
    assert r["docs"] == 96 and r["documents_per_row"] >= 3, r
  md = open(tmp_path / "cmp_tiling_trial.md").read()
  assert "packed documents, mean 96 tokens" in md and "--docs 96" in md
  with pytest.raises(SystemExit):
    cmp_tiling_trial.main(["--out", str(tmp_path), "--docs", "-1"])


def test_select_doc_trial_compares_selection_paths_with_and_without_ids(tmp_path):
  """benchmarks/select_doc_trial.py (the selection branch with packed documents: backends and
  tiles with and without the ids on the op's own top-n lists) writes a fwd and a bwd record per
  variant, the variants with ids agree with each other, and unknown variants, shapes and lengths
  are refused."""
  sys.path.insert(0, ROOT)
  from benchmarks import select_doc_trial
  recs = select_doc_trial.main(["--out", str(tmp_path), "--shapes", "tiny", "--iters", "1",
                                "--docs", "48", "--variants", "auto,triton,auto_no_ids"])
  assert [(r["impl"], r["pass"], r["ids"]) for r in recs] == [
      (v, p, i) for v, i in (("auto", True), ("triton", True), ("auto_no_ids", False))
      for p in ("fwd", "bwd")]
  for r in recs:
    assert r["max_abs_diff_vs_first"] <= 1e-6, r  # same function, other kernels: same values
    assert r["docs"] == "48" and r["documents_per_row"] >= 3, r
  assert json.load(open(tmp_path / "select_doc_trial.json")) == recs
  assert "| select_doc | triton | fwd | 256 |" in open(tmp_path / "select_doc_trial.md").read()
  for bad in (["--variants", "mosaic"], ["--docs", "0"], ["--shapes", "4k"]):
    with pytest.raises(SystemExit):
      select_doc_trial.main(["--out", str(tmp_path), *bad])


def test_select_doc_trial_runs_the_mosaic_kernels_with_ids(tmp_path):
  """The trial's Mosaic variants with ids (forward and dq with document bounds; the dK/dV
  partials too, by default since DKV_SEGMENT_IDS went on, and in mosaic_dkv_ids forced; in Mosaic
  GPU's interpreter here; "auto" runs Triton when interpreted)
  agree with the Triton kernels on the same lists and ids within bf16 rounding, and leave
  select_attention_mgpu's flags as they found them."""
  sys.path.insert(0, ROOT)
  from benchmarks import select_doc_trial
  from pallas_kernels import select_attention_mgpu as mgpu
  before = (mgpu.SEGMENT_IDS, mgpu.DKV_SEGMENT_IDS)
  variants = ("auto", "mosaic_ids", "auto_triton_ids", "mosaic_dkv_ids")
  recs = select_doc_trial.main(["--out", str(tmp_path), "--shapes", "tiny64", "--iters", "1",
                                "--docs", "40", "--variants", ",".join(variants)])
  assert (mgpu.SEGMENT_IDS, mgpu.DKV_SEGMENT_IDS) == before
  assert [(r["impl"], r["pass"]) for r in recs] == [(v, p) for v in variants for p in ("fwd", "bwd")]
  assert all(r["ids"] and r["max_abs_diff_vs_first"] < 0.05 for r in recs), recs


def test_select_doc_trial_lists_respect_documents():
  """The trial's top-n lists with ids hold no block before the query's document's first block
  (so the "_no_ids" variants time the same lists, and the ids mask only inside that block)."""
  sys.path.insert(0, ROOT)
  from benchmarks import select_doc_trial
  from pallas_kernels.select_topn import document_first_block
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (1, 256, 16, 32), jnp.bfloat16)
  seg = select_doc_trial.segments(ks[1], 1, 256, 48)
  idx = np.asarray(select_doc_trial.topn_lists(ks[2], q, 1, seg, True))
  first = np.asarray(document_first_block(seg, 64))[:, :, None, None]
  assert ((idx == -1) | (idx >= first)).all()
  assert (idx[:, :, :, :1] == first).all()  # the forced initial block is the document's first
  assert (first > 0).any()


def test_doc_mask_trial_times_each_switch_and_they_change_no_value(tmp_path, monkeypatch):
  """benchmarks/doc_mask_trial.py (the window kernels at w = T with and without document ids, per
  CmpTiling switch of the masked paths) writes a fwd and a bwd record per (documents, variant),
  the variants' outputs and gradients equal the first's, the table names the document length, and
  the command is the script's own; unknown variants and document lengths are refused."""
  sys.path.insert(0, ROOT)
  from benchmarks import doc_mask_trial
  args = ["--out", str(tmp_path), "--shapes", "96:2:4/1:16/16", "--iters", "1", "--docs",
          "none,24", "--variants", "default,no_seg_split,dkv_masked_ids"]
  # as run from a shell: the recorded command is read from sys.argv
  monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "benchmarks", "doc_mask_trial.py"), *args])
  recs = doc_mask_trial.main(args)
  assert [(r["docs"], r["impl"], r["pass"]) for r in recs] == [
      (d, "pallas " + v, p) for d in ("none", "24")
      for v in ("default", "no_seg_split", "dkv_masked_ids") for p in ("fwd", "bwd")]
  for r in recs:
    assert r["max_abs_diff_vs_first"] == 0.0, r  # the switches change which loop runs, not values
    assert re.match(r"python\S* benchmarks/doc_mask_trial\.py --out ", r["command"]), r["command"]
  assert recs[-1]["documents_per_row"] >= 3
  assert json.load(open(tmp_path / "doc_mask_trial.json")) == recs
  assert "| dense_doc | pallas no_seg_split | fwd | 96 |" in open(tmp_path / "doc_mask_trial.md").read()
  assert "| 24 |" in open(tmp_path / "doc_mask_trial.md").read()
  for bad in (["--variants", "fastest"], ["--docs", "-5"], ["--window", "-1"]):
    with pytest.raises(SystemExit):
      doc_mask_trial.main(["--out", str(tmp_path), *bad])


def test_doc_mask_trial_window_times_the_window_branch(tmp_path, monkeypatch):
  """--window=W < T times NSA's window branch (op "window_doc", the window in each record and
  passed to the kernels); W >= T is dense causal (w = T)."""
  sys.path.insert(0, ROOT)
  from benchmarks import doc_mask_trial
  windows = []
  real = doc_mask_trial.wk.window_attention

  def spy(q, k, v, window, *a, **kw):
    windows.append(window)
    return real(q, k, v, window, *a, **kw)
  monkeypatch.setattr(doc_mask_trial.wk, "window_attention", spy)
  for w, op, want in ((16, "window_doc", 16), (500, "dense_doc", 96)):
    windows.clear()
    recs = doc_mask_trial.main(["--out", str(tmp_path / str(w)), "--shapes", "96:2:4/1:16/16",
                                "--iters", "1", "--docs", "24", "--variants", "default,dkv_w4",
                                "--window", str(w)])
    assert [(r["op"], r["window"], r["impl"]) for r in recs] == [
        (op, want, "pallas " + v) for v in ("default", "dkv_w4") for _ in ("fwd", "bwd")]
    assert windows and set(windows) == {want}, windows
    assert all(r["max_abs_diff_vs_first"] == 0.0 for r in recs)
