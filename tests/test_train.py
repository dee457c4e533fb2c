"""Training loop on CPU: end-to-end run, SIGTERM + resume, NaN guard, sharded layouts on 8
simulated devices, config errors, and a golden one-step loss for configs/tiny_cpu.py.

The 8-device test re-runs this file as a subprocess (`python tests/test_train.py sharded`) because
XLA_FLAGS must be set before jax starts.
"""

import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.tiny_cpu import get_config as tiny_cpu_config
from nsa_jax.training import data as data_lib
from nsa_jax.training import sharding as shd
from nsa_jax.training import train
from nsa_jax.training.checkpointing import Checkpointer, CheckpointError, config_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = int.from_bytes(os.urandom(3), "little")  # fresh every run; printed in failure messages


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
  # The runs below compile the same step several times (fresh, resumed, ...): share the work.
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def small_config(num_steps=6, seed=SEED):
  """tiny_cpu shrunk to seconds: one NSA layer, 128 tokens."""
  c = tiny_cpu_config()
  c.model.d_model, c.model.n_layers, c.model.head_dim, c.model.ffn_dim = 64, 1, 16, 128
  c.model.max_seq_len = c.data.seq_len = 128
  c.model.nsa.window = 32
  c.model.nsa.num_selected = 3
  c.data.global_batch_size = 4
  c.data.seed = c.train.seed = seed
  c.train.num_steps = num_steps
  c.train.log_every = 1
  c.train.eval_every = 3
  c.train.eval_batches = 1
  c.train.progress_bar = False
  c.checkpoint.every_steps = 4
  return c


def train_losses(workdir):
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      if "train/loss" in rec:
        out[rec["step"]] = rec["train/loss"]
  return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("full"))
  return workdir, train.train_and_evaluate(small_config(), workdir)


def test_end_to_end_run_leaves_checkpoints_logs_and_plot(full_run):
  workdir, summary = full_run
  assert summary["step"] == 6 and summary["stopped"] is None
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "6"]
  assert os.path.getsize(os.path.join(workdir, "loss.png")) > 10_000
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tb")))
  losses = train_losses(workdir)
  assert sorted(losses) == [1, 2, 3, 4, 5, 6]
  # Model-independent sanity: a fresh byte-level LM predicts close to uniform over 256 bytes
  # (catches, e.g., a sum where the mean belongs: 512 times larger here). The bound is
  # one-sided-loose because the first batch's loss depends on how the random head scores the few
  # bytes that make most targets: over 24 random seeds it sat 0.45 +- 0.21 nats above ln 256
  # (at most 0.79), but seed 11526534 gave 7.27 (+1.72): its log-normaliser was 5.99 as usual,
  # while the batch's target logits averaged -1.27 instead of about 0 (seed 1: normaliser and
  # loss both 6.02).
  assert -1.0 < losses[1] - math.log(256) < 3.0, f"initial loss {losses[1]} (seed {SEED})"
  assert all(math.isfinite(v) for v in losses.values())
  val = summary["val"]
  assert val["loss"] < losses[1] and math.isclose(val["perplexity"], math.exp(val["loss"]))


def test_plot_runs_overlays_several_workdirs(full_run, tmp_path):
  from experiments import plot_runs
  out = str(tmp_path / "overlay.png")
  plot_runs.main([full_run[0], full_run[0], f"--out={out}", "--labels=nsa,again"])
  assert os.path.getsize(out) > 10_000
  started = tmp_path / "started"  # only the start event: a blank plot before, exit status 0
  started.mkdir()
  (started / "metrics.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
  with pytest.raises(ValueError, match=r"no loss records yet in \[.*started"):
    plot_runs.main([full_run[0], str(started), f"--out={tmp_path / 'x.png'}"])


def test_sigterm_then_resume_reproduces_the_uninterrupted_losses(full_run, tmp_path):
  reference = train_losses(full_run[0])
  workdir = str(tmp_path)

  def preempt(step, metrics):
    if step == 1:
      os.kill(os.getpid(), signal.SIGTERM)  # the real signal path, delivered mid-run

  first = train.train_and_evaluate(small_config(), workdir, step_hooks=[preempt])
  # The signal arrives while step 2 runs; the loop saves step 2 and stops cleanly.
  assert first["stopped"] == "SIGTERM" and first["last_saved"] == 2 and first["step"] == 2
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
  second = train.train_and_evaluate(small_config(), workdir)
  assert second["step"] == 6 and second["stopped"] is None
  resumed = train_losses(workdir)
  assert resumed == reference, f"seed {SEED}: resumed {resumed} vs uninterrupted {reference}"


def test_stop_after_and_time_limit_end_cleanly_and_resume_exactly(full_run, tmp_path):
  reference = train_losses(full_run[0])
  workdir = str(tmp_path)
  c = small_config()
  c.train.stop_after = 3
  first = train.train_and_evaluate(c, workdir)
  assert first["stopped"] == "stop_after" and first["last_saved"] == 3 and first["step"] == 3
  c = small_config()
  c.train.time_limit_minutes = 1e-9  # ends after its first step, validated and saved
  second = train.train_and_evaluate(c, workdir)
  assert second["stopped"] == "time limit" and second["last_saved"] == 4 and second["val"]
  third = train.train_and_evaluate(small_config(), workdir)
  assert third["step"] == 6 and third["stopped"] is None
  assert train_losses(workdir) == reference, f"seed {SEED}"


def test_nan_guard_names_the_step_and_keeps_the_last_good_checkpoint(full_run, tmp_path):
  workdir = str(tmp_path / "run")
  subprocess.run(["cp", "-r", full_run[0], workdir], check=True)
  c = small_config(num_steps=8)
  c.optim.learning_rate = 1e38  # the first update after the resume overflows every weight
  with pytest.raises(train.NonFiniteError,
                     match=r"at step 7, the first step after resuming from .*checkpoints/6"):
    train.train_and_evaluate(c, workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "6"]


def test_resume_with_changed_settings_warns_and_keeps_the_earlier_config(full_run, tmp_path,
                                                                         caplog):
  workdir = str(tmp_path / "run")
  subprocess.run(["cp", "-r", full_run[0], workdir], check=True)
  with open(os.path.join(workdir, "config.json")) as f:
    before = f.read()
  c = small_config(num_steps=7)
  c.optim.learning_rate = 1e-4
  with caplog.at_level("WARNING", logger="nsa_jax"):
    train.train_and_evaluate(c, workdir)
  msg = "\n".join(r.getMessage() for r in caplog.records)
  assert "resuming at step 6 with settings that differ" in msg, msg
  assert "optim.learning_rate: 0.003 -> 0.0001" in msg and "train.num_steps: 6 -> 7" in msg, msg
  with open(os.path.join(workdir, "config.before_step_6.json")) as f:
    assert f.read() == before
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["optim"]["learning_rate"] == 1e-4


def test_every_earlier_config_is_kept_and_routine_changes_do_not_warn(tmp_path, caplog):
  """Two resumes from the same step with different settings keep both earlier configs (a
  review: the second overwrote the first, losing what the first steps ran with); changing only
  how an invocation runs (stop_after, time limit, progress bar) is routine and keeps nothing."""
  wd = str(tmp_path)
  a, b, c = small_config(), small_config(), small_config()
  b.optim.learning_rate, c.optim.learning_rate = 1e-4, 5e-5
  train._record_config(a, wd, 0)
  train._record_config(b, wd, 6)
  train._record_config(c, wd, 6)
  lr = lambda name: json.load(open(os.path.join(wd, name)))["optim"]["learning_rate"]
  assert lr("config.before_step_6.json") == a.optim.learning_rate
  assert lr("config.before_step_6.2.json") == 1e-4 and lr("config.json") == 5e-5
  d = small_config()
  d.optim.learning_rate = 5e-5
  d.train.stop_after, d.train.progress_bar = 9, True
  caplog.clear()  # the two resumes above warned
  with caplog.at_level("WARNING", logger="nsa_jax"):
    train._record_config(d, wd, 8)
  assert not caplog.records and not os.path.exists(os.path.join(wd, "config.before_step_8.json"))
  assert json.load(open(os.path.join(wd, "config.json")))["train"]["stop_after"] == 9


def test_a_bug_inside_a_config_file_is_not_blamed_on_the_command_line(tmp_path):
  bad = tmp_path / "buggy_config.py"
  bad.write_text("import os\n\ndef get_config():\n  return os.path.joinn('a')\n")
  r = run_cli(f"--config={bad}", f"--workdir={tmp_path / 'w'}")
  assert r.returncode != 0 and "joinn" in r.stderr and "Traceback" in r.stderr, r.stderr[-2000:]
  assert "no such config field" not in r.stderr


@pytest.mark.parametrize("path,value", [
    ("train.eval_every", 0), ("train.log_every", 0), ("checkpoint.every_steps", 0),
    ("train.eval_batches", 0), ("data.global_batch_size", 0), ("train.num_steps", -3),
    ("optim.grad_accum_steps", 0), ("optim.warmup_steps", -1), ("optim.learning_rate", -1.0),
    ("optim.learning_rate", float("nan")), ("train.log_every", 2.5),
    ("checkpoint.max_to_keep", 0),
    # values that trained silently wrong or ended oddly (review of 2026-12-05): a clip of 0 zeroed
    # every update and a negative one trained uphill; a negative min_lr_ratio made the late rate
    # negative; mqar without queries scored nothing and reported a loss of 0
    ("train.stop_after", -1), ("train.time_limit_minutes", -5.0), ("optim.clip_norm", 0.0),
    ("optim.clip_norm", -1.0), ("optim.min_lr_ratio", -1.0), ("optim.min_lr_ratio", 1.5),
    ("optim.b1", 1.0), ("optim.b2", -0.1), ("optim.eps", 0.0), ("optim.weight_decay", -0.1),
    ("optim.clip_norm", float("inf")), ("data.val_percent", 0.0), ("data.val_percent", 100.0),
    ("data.max_bytes", -1), ("data.num_needles", 0), ("data.num_queries", 0),
    ("data.num_questions", 0), ("data.context_loss_weight", -0.1),
    ("data.single_question_fraction", 1.5), ("optim.b1", True),
    ("data.cudnn_packed_cap", "many"), ("data.cudnn_packed_cap", "-2"),
    ("data.cudnn_packed_cap", 1.5)])
def test_loop_settings_that_would_crash_or_do_nothing_are_refused(path, value):
  c = small_config()
  block, key = path.split(".")
  with c.ignore_type(), c.unlocked():
    c[block][key] = value
  with pytest.raises(ValueError, match=rf"config\.{path}=.*Fix: "):
    train.check_run_config(c)
  train.check_run_config(small_config())  # the defaults pass
  keep_all = small_config()
  with keep_all.ignore_type():
    keep_all.checkpoint.max_to_keep = None  # orbax: keep every checkpoint
  train.check_run_config(keep_all)


def test_a_refused_config_writes_nothing_and_a_file_is_no_workdir(tmp_path):
  """The checks run before the work directory is touched (stop_after was checked after config.json,
  metrics.jsonl and tb/ were written), and a workdir that is a file is named as such."""
  c = small_config()
  c.train.stop_after = -1
  with pytest.raises(ValueError, match=r"config\.train\.stop_after=-1"):
    train.train_and_evaluate(c, str(tmp_path / "w"))
  assert not os.listdir(tmp_path)
  afile = tmp_path / "afile"
  afile.write_text("")
  with pytest.raises(ValueError, match="exists and is not a directory. Fix: "):
    train.train_and_evaluate(small_config(), str(afile))


def test_misspelled_fields_in_a_config_file_are_refused_with_the_near_name():
  """The command line refuses unknown fields (ml_collections); fields set in a config file were
  ignored while the default ran. The optional passkey fields stay allowed."""
  for block, typo, near in (("train", "num_step", "num_steps"), ("data", "sequence_len", None),
                            ("optim", "learning_rat", "learning_rate"), ("checkpoint", "evry_steps",
                                                                           "every_steps")):
    c = small_config()
    with c[block].unlocked():
      c[block][typo] = 3
    with pytest.raises(ValueError, match=rf"config\.{block}: unknown field\(s\) \['{typo}'\]") as e:
      train.check_run_config(c)
    assert "Fix: " in str(e.value) and (near is None or f"-> '{near}'?" in str(e.value)), str(e.value)
  c = small_config()
  with c.data.unlocked():
    c.data.num_questions, c.data.context_loss_weight, c.data.single_question_fraction = 3, 0.1, 0.5
  train.check_run_config(c)


def test_a_short_validation_split_names_itself_and_the_field():
  from nsa_jax.training import data as data_lib
  src = data_lib.WindowSource(np.zeros(5, np.int32), {}, "validation")
  with pytest.raises(ValueError, match=r"the validation split has 5 tokens.*val_percent"):
    src.row(np.random.default_rng(0), 10)
  with pytest.raises(ValueError, match=r"the training split has 5 tokens") as e:
    data_lib.WindowSource(np.zeros(5, np.int32), {}, "training").row(np.random.default_rng(0), 10)
  assert "val_percent" not in str(e.value)


def test_mismatched_checkpoint_is_refused_without_touching_it(full_run, tmp_path):
  workdir = str(tmp_path / "run")
  subprocess.run(["cp", "-r", full_run[0], workdir], check=True)
  c = small_config(num_steps=8)
  c.model.ffn_dim = 192
  with pytest.raises(CheckpointError, match=r"ffn_dim: checkpoint has 128, config has 192"):
    train.train_and_evaluate(c, workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "6"]


def test_a_model_field_newer_than_the_checkpoint_matches_at_its_default(full_run, tmp_path):
  """Checkpoints written before a ModelConfig field existed (selection_from_layer, 2026-12-05) lack
  it in their metadata; needle_eval and visualize_selection then refused the project's own runs.
  The field matches while the config leaves it at its default, and is refused when set."""
  from experiments import trained_model
  workdir = str(tmp_path / "run")
  subprocess.run(["cp", "-r", full_run[0], workdir], check=True)
  for step in ("4", "6"):
    path = os.path.join(workdir, "checkpoints", step, "meta", "metadata")
    with open(path) as f:
      meta = json.load(f)
    del meta["model"]["selection_from_layer"]
    with open(path, "w") as f:
      json.dump(meta, f)
  trained_model.load_model(workdir)  # the evaluation tools' loader
  assert train.train_and_evaluate(small_config(num_steps=8), workdir)["step"] == 8  # resumed at 6
  saved = {"n_layers": 2, "nsa": {"window": 32}}
  current = {"n_layers": 2, "selection_from_layer": None, "nsa": {"window": 32, "new": False}}
  defaults = {"n_layers": 4, "selection_from_layer": None, "nsa": {"window": 64, "new": False}}
  assert config_diff(saved, current, defaults=defaults) == []
  assert len(config_diff(saved, current)) == 2  # without defaults both new fields differ
  current["selection_from_layer"], current["nsa"]["new"] = 0, True  # not the default: refused
  assert config_diff(saved, current, defaults=defaults) == [
      "nsa.new: checkpoint has '<missing>', config has True",
      "selection_from_layer: checkpoint has '<missing>', config has 0"]


def test_warm_start_takes_the_parameters_only_and_trains_at_another_length(full_run, tmp_path):
  src = full_run[0]
  c = small_config(num_steps=2)
  c.data.seq_len = 64  # context change between the runs: the parameters do not depend on it
  c.model.nsa.num_selected = 4  # nor on n and w (a resume would refuse these two)
  c.model.nsa.window = 16
  c.checkpoint.init_from = src
  setup = train.build_setup(c, shd.make_mesh(c.mesh))
  meta = {"model": dataclasses.asdict(setup.model_cfg)}
  state = train.warm_start(setup, meta, src)
  ckpt = Checkpointer(os.path.join(src, "checkpoints"), async_save=False)
  with pytest.raises(CheckpointError, match=r"num_selected: checkpoint has 3, config has 4"):
    ckpt.restore(ckpt.latest_step(), setup.abstract_state, meta,  # a resume refuses it
                 ignore=train.RESUMABLE_MODEL_FIELDS)
  saved, _ = ckpt.restore(ckpt.latest_step(), setup.abstract_state, meta,
                          ignore=train.WARM_START_FREE_FIELDS)
  ckpt.close()
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(saved["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(state["step"]) == 0
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state["opt_state"]))  # fresh Adam
  assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(saved["opt_state"]))

  workdir = str(tmp_path / "warm")
  train.train_and_evaluate(c, workdir)
  cold = str(tmp_path / "cold")
  c_cold = small_config(num_steps=2)
  c_cold.data.seq_len = 64
  c_cold.model.nsa.num_selected, c_cold.model.nsa.window = 4, 16
  train.train_and_evaluate(c_cold, cold)
  # Six steps of pretraining show in the very first step's loss (same data, same seed).
  assert train_losses(workdir)[1] < train_losses(cold)[1] - 0.05, (SEED, train_losses(workdir),
                                                                    train_losses(cold))
  # A warm-started run that saved resumes from its own checkpoint, not from init_from again.
  c3 = small_config(num_steps=3)
  c3.data.seq_len = 64
  c3.model.nsa.num_selected, c3.model.nsa.window = 4, 16
  c3.checkpoint.init_from = os.path.join(str(tmp_path), "does_not_matter_any_more")
  assert train.train_and_evaluate(c3, workdir)["step"] == 3


def test_warm_start_errors_name_the_problem(full_run, tmp_path):
  c = small_config(num_steps=2)
  c.checkpoint.init_from = str(tmp_path / "nowhere")
  with pytest.raises(CheckpointError, match=r"init_from=.*no .*checkpoints directory. Fix"):
    train.train_and_evaluate(c, str(tmp_path / "a"))
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  c.checkpoint.init_from = str(tmp_path / "empty")
  with pytest.raises(CheckpointError, match=r"holds no checkpoint. Fix"):
    train.train_and_evaluate(c, str(tmp_path / "b"))
  c.checkpoint.init_from = full_run[0]
  c.model.ffn_dim = 192
  with pytest.raises(CheckpointError, match=r"(?s)init_from=.*ffn_dim: checkpoint has 128, config "
                                            r"has 192.*Fix: give init_from the workdir of a run of "
                                            r"the same model") as err:
    train.train_and_evaluate(c, str(tmp_path / "c"))
  assert "fresh --workdir" not in str(err.value)


def test_flops_count_the_keys_each_attention_reads():
  from nsa_jax.training import metrics
  c = small_config()
  c.model.attention = "dense"
  dense = train.model_config_from(c.model)
  assert metrics.attention_keys_per_query(dense, 128) == [64.5]  # causal: mean of 1..128
  c.model.attention = "nsa"
  c.model.nsa.branches = ("win",)
  c.model.nsa.window = 128
  assert metrics.attention_keys_per_query(train.model_config_from(c.model), 128) == [64.5]
  c.model.nsa.branches = ("cmp", "slc", "win")
  c.model.nsa.window = 32
  nsa = train.model_config_from(c.model)  # l=16, d=8, l'=32, n=3
  t = np.arange(1, 129)
  expected = (np.maximum((t - 16) // 8 + 1, 0) + np.minimum(96, t) + np.minimum(32, t)).mean()
  assert metrics.attention_keys_per_query(nsa, 128) == [pytest.approx(expected)]
  per_key = 2 * 4 * (16 + 16)  # heads x (d_k + d_v), multiply-adds counted twice
  assert metrics.train_flops_per_token(dense, 1000, 128) == pytest.approx(6000 + 3 * per_key * 64.5)


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, "PYTHONPATH": ROOT})


def test_config_typos_and_bad_values_are_clear_errors(tmp_path):
  typo = run_cli("--config=configs/tiny_cpu.py", "--config.model.n_layer=4", f"--workdir={tmp_path}")
  assert typo.returncode == 2 and "Traceback" not in typo.stderr, typo.stderr[-2000:]
  assert 'Did you mean "n_layers" instead of "n_layer"' in typo.stderr, typo.stderr[-2000:]
  bad = run_cli("--config=configs/tiny_cpu.py", "--config.model.n_kv_heads=3", f"--workdir={tmp_path}")
  assert bad.returncode == 1, bad.stderr[-2000:]
  assert "not divisible by n_kv_heads=3" in bad.stderr and "Fix:" in bad.stderr
  assert not os.listdir(tmp_path), "a rejected config writes nothing"
  zero = run_cli("--config=configs/tiny_cpu.py", "--config.train.eval_every=0", f"--workdir={tmp_path}")
  assert zero.returncode == 1 and "Traceback" not in zero.stderr, zero.stderr[-2000:]
  assert "config.train.eval_every=0: expected an integer >= 1" in zero.stderr
  missing = run_cli("--config=configs/no_such_config.py", f"--workdir={tmp_path}")
  assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
  assert "no_such_config.py" in missing.stderr
  c = small_config()
  c.model.unlock()
  c.model.nsa.windw = 64
  with pytest.raises(ValueError, match=r"config.model.nsa: unknown field\(s\) \['windw'\]"):
    train.model_config_from(c.model)


# Golden values for configs/tiny_cpu.py (seed 0) on GOLDEN_TEXT, from one run of
# `PYTHONPATH=. python tests/test_train.py golden` on CPU (2026-11-29, jax 0.11.2, model as of
# commit d081244).
# They pin the model + optimizer numerics as a regression guard: re-derive them with that command
# whenever the model, its initialisation or the optimizer changes on purpose.
GOLDEN_LOSSES = (6.024816, 5.853228)
GOLDEN_TEXT = (b"Native sparse attention compresses keys into blocks, selects the blocks that matter "
               b"and keeps a sliding window, so each query reads a small part of a long context. ")


def golden_losses():
  """Loss of step 1 (initial weights) and step 2 (after one AdamW update) on a fixed batch."""
  c = tiny_cpu_config()
  mesh = shd.make_mesh(c.mesh, jax.devices()[:1])
  setup = train.build_setup(c, mesh)
  state = train.create_train_state(setup)
  step = train.make_train_step(setup)
  text = np.frombuffer(GOLDEN_TEXT * 40, np.uint8).astype(np.int32)
  rows = np.stack([text[37 * r:37 * r + c.data.seq_len + 1] for r in range(c.data.global_batch_size)])
  batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "weights": np.ones(rows[:, 1:].shape, np.float32)}
  batch = train.to_global(batch, setup)
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses


def test_golden_one_step_loss_of_tiny_config():
  first, second = golden_losses()
  assert abs(first - math.log(256)) < 1.5, "initial loss should be near uniform over 256 bytes"
  assert second < first, "one AdamW step on the same batch lowers its loss"
  np.testing.assert_allclose([first, second], GOLDEN_LOSSES, rtol=2e-4)


def _doc2_nll(setup, state, batch, doc2):
  """The summed NLL of the positions in doc2 (a [B, T] mask), through the training loss."""
  b = dict(batch, weights=doc2.astype(np.float32))
  _, (_, _, nll, _) = train._loss_sums(setup.graphdef, state["params"], state["rest"],
                                       train.to_global(b, setup), with_selector=False)
  return float(nll)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_document_mask_keeps_each_document_blind_to_the_others(attention):
  """With data.document_mask the loss of a row's second document does not depend on the first
  document's tokens (NSA: every branch; dense: the mask); without it, it does. The boundary sits
  mid-block (not a multiple of l, d or l') on purpose."""
  c = small_config()
  c.model.attention = attention
  c.model.dtype = "float32"
  c.data.document_mask = True
  mesh = shd.make_mesh(c.mesh, jax.devices()[:1])
  setup = train.build_setup(c, mesh)
  state = train.create_train_state(setup)
  rng = np.random.default_rng(SEED)
  t, cut = c.data.seq_len, 53  # doc 1 = inputs[:53] (ends with byte 0), doc 2 = the rest
  rows = rng.integers(1, 256, (c.data.global_batch_size, t + 1)).astype(np.int32)
  rows[:, cut - 1] = 0
  other = rows.copy()
  other[:, :cut - 1] = rng.integers(1, 256, (rows.shape[0], cut - 1))  # a different doc 1
  eos = train.data_lib.document_end_id(c.data)
  doc2 = np.zeros((rows.shape[0], t), bool)
  doc2[:, cut:] = True
  nll = {}
  for name, r in (("a", rows), ("b", other)):
    batch = {"inputs": r[:, :-1], "targets": r[:, 1:], "weights": None}
    nll[name + "_masked"] = _doc2_nll(setup, state, dict(
        batch, segment_ids=train.data_lib.segment_ids(r[:, :-1], eos)), doc2)
    nll[name + "_plain"] = _doc2_nll(setup, state, batch, doc2)
  np.testing.assert_allclose(nll["a_masked"], nll["b_masked"], rtol=1e-6, err_msg=str(SEED))
  # the test can fail: without the mask the first document moves the sum by well over the masked
  # check's tolerance (10x its rtol; at initialisation the effect on a summed NLL is small and
  # random: 6e-5 relative in a CI run of 2026-12-07, below the 1e-4 this asked for before)
  assert abs(nll["a_plain"] - nll["b_plain"]) > 1e-5 * abs(nll["a_plain"]), (nll, SEED)


def test_document_mask_settings_are_refused_before_anything_is_built(tmp_path):
  """A token file without eos_id, or a synthetic task, with data.document_mask: refused by the
  run-config check, and a resumed run recorded before these fields existed does not warn."""
  for source, msg in (("tokens", "eos_id=<"), ("passkey", "no documents")):
    c = small_config()
    c.data.source, c.data.document_mask = source, True
    with pytest.raises(ValueError, match=msg):
      train.check_run_config(c)
  c = small_config()
  old = json.loads(c.to_json_best_effort())
  del old["data"]["document_mask"], old["data"]["eos_id"]
  del old["model"]["dense_implementation"], old["model"]["selection_from_layer"]
  (tmp_path / "config.json").write_text(json.dumps(old))
  train._record_config(c, str(tmp_path), start=4)
  assert sorted(os.listdir(tmp_path)) == ["config.json"], "an older run's config counted as changed"
  c.data.document_mask = True  # a real change still keeps the earlier file
  train._record_config(c, str(tmp_path), start=4)
  assert "config.before_step_4.json" in os.listdir(tmp_path)


def test_an_end_token_that_never_occurs_is_named_in_a_warning(tmp_path, caplog):
  path = tmp_path / "tokens.bin"
  np.tile(np.arange(1, 5000, dtype=np.uint16), 4).tofile(path)  # ids 1..4999: no 0
  c = small_config()
  c.model.vocab_size = 5000
  c.data.source, c.data.path, c.data.document_mask = "tokens", str(path), True
  for eos, warned in ((0, True), (7, False)):  # 7 occurs
    c.data.eos_id = eos
    caplog.clear()
    with caplog.at_level("WARNING", logger="nsa_jax.training"):
      it, _ = train._iterators(c, train.model_config_from(c.model))
    assert ("end token 0 does not occur" in caplog.text) == warned, caplog.text
    assert "segment_ids" in next(it)
  c.data.eos_id = 6000  # outside the vocabulary: the range error alone, no "does not occur" first
  caplog.clear()
  with caplog.at_level("WARNING", logger="nsa_jax.training"):
    with pytest.raises(ValueError, match="eos_id=6000 is outside the model vocabulary"):
      train._iterators(c, train.model_config_from(c.model))
  assert "does not occur" not in caplog.text
  c.data.document_mask, c.data.eos_id = False, 7  # an end token without masking does nothing
  with caplog.at_level("WARNING", logger="nsa_jax.training"):
    it, _ = train._iterators(c, train.model_config_from(c.model))
  assert "eos_id=7 does nothing without document masking" in caplog.text
  assert "segment_ids" not in next(it)


def test_sequences_shorter_than_a_compression_block_are_named(caplog):
  c = small_config()
  model_cfg = train.model_config_from(c.model)
  mesh = shd.make_mesh(c.mesh, jax.devices()[:1])
  for seq_len, warned in ((model_cfg.nsa.cmp_block - 1, True), (model_cfg.nsa.cmp_block, False)):
    c.data.seq_len = seq_len
    caplog.clear()
    with caplog.at_level("WARNING", logger="nsa_jax.training"):
      train.check_batch_layout(c, mesh, model_cfg)
    assert ("shorter than a compression block" in caplog.text) == warned, caplog.text
  c.data.seq_len = model_cfg.nsa.cmp_block - 1
  for branches, warned in ((("slc", "win"), True), (("win",), False)):  # scores need cmp blocks
    c.model.nsa.branches = branches
    caplog.clear()
    with caplog.at_level("WARNING", logger="nsa_jax.training"):
      train.check_batch_layout(c, mesh, train.model_config_from(c.model))
    assert ("shorter than a compression block" in caplog.text) == warned, (branches, caplog.text)


def test_document_mask_trains_with_gradient_accumulation():
  """The loop's own batches (stdlib, file ends as document ends) through a jitted step with two
  microbatches: segment ids travel with the rows and the loss is finite and falls."""
  c = small_config()
  c.data.document_mask = True
  c.data.seq_len = c.model.max_seq_len = 512  # long enough that rows cross file ends
  c.optim.grad_accum_steps = 2
  mesh = shd.make_mesh(c.mesh, jax.devices()[:1])
  setup = train.build_setup(c, mesh)
  state = train.create_train_state(setup)
  step = train.make_train_step(setup, 2)
  it, val = train._iterators(c, setup.model_cfg)
  assert "segment_ids" in val[0]
  first = next(it)
  np.testing.assert_array_equal(first["segment_ids"],
                                train.data_lib.segment_ids(first["inputs"], 0))  # byte 0 ends a file
  # Few 512-byte windows of the corpus hold a file end (its files average ~18 kB): plant one in
  # every row, a different place in each, so that the ids split every row.
  for r in range(first["inputs"].shape[0]):
    first["inputs"][r, 100 + 37 * r] = 0
  first["segment_ids"] = train.data_lib.segment_ids(first["inputs"], 0)
  assert (first["segment_ids"][:, -1] >= 1).all()
  batch = train.to_global(first, setup)
  losses = []
  with jax.set_mesh(mesh):
    for _ in range(3):
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
  assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


# ------------------------------------------------------------------ 8 simulated devices -------

LAYOUTS = {  # name: (data, fsdp, tensor, grad_accum_steps)
    "single": (1, 1, 1, 1), "data8": (8, 1, 1, 1),
    "fsdp8": (1, 8, 1, 1), "tensor8": (1, 1, 8, 1), "mixed_accum2": (2, 2, 2, 2)}


def sharded_losses(seed: int) -> dict:
  """Two train steps per layout from the same init and batches; runs with 8 CPU devices."""
  assert jax.device_count() == 8, jax.devices()
  c = small_config(seed=seed)
  c.model.d_model, c.model.ffn_dim = 32, 64
  c.model.max_seq_len = c.data.seq_len = 64
  c.model.nsa.cmp_block, c.model.nsa.cmp_stride, c.model.nsa.sel_block = 8, 4, 16
  c.model.nsa.window = 16
  c.data.global_batch_size = 8
  out = {}
  for name, (d, f, t, accum) in LAYOUTS.items():
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = d, f, t
    c.optim.grad_accum_steps = accum
    mesh = shd.make_mesh(c.mesh, jax.devices()[:d * f * t])
    setup = train.build_setup(c, mesh)
    state = train.create_train_state(setup)
    embed = state["params"]["embed"]["embedding"]
    out[f"{name}_embed_shard"] = list(embed.addressable_shards[0].data.shape)
    step = train.make_train_step(setup, accum)
    it, _ = train._iterators(c, setup.model_cfg)
    losses = []
    with jax.set_mesh(mesh):  # as the loop does: shard_map attention and pinned activations run
      for _ in range(2):
        state, metrics = step(state, train.to_global(next(it), setup))
        losses.append(float(metrics["loss"]))
    out[name] = losses
  return out


def test_sharded_layouts_match_one_device():
  env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, __file__, "sharded", str(SEED)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  ref = out["single"]
  for name in LAYOUTS:
    np.testing.assert_allclose(out[name], ref, rtol=2e-5, err_msg=f"{name} (seed {SEED})")
  # The layouts really differ: fsdp splits the embedding's d_model, tensor its vocab rows.
  assert out["single_embed_shard"] == [256, 32]
  assert out["fsdp8_embed_shard"] == [256, 4] and out["tensor8_embed_shard"] == [32, 32]
  assert out["data8_embed_shard"] == [256, 32]


if __name__ == "__main__":
  if sys.argv[1] == "sharded":
    print(json.dumps(sharded_losses(int(sys.argv[2]))))
  elif sys.argv[1] == "golden":
    print(golden_losses())


def test_dense_packed_cap_is_chosen_from_the_data(monkeypatch, caplog):
  """data.cudnn_packed_cap on a (pretended) Hopper GPU with document masking: "auto" sets the
  dense cap from the most documents in a row of the first 16 batches, with one device's q shape
  (its rows of a microbatch, its heads) for the memory guard; "off", NSA_CUDNN_PACKED=0, a
  dense_implementation other than "auto" and a refusing cuDNN leave our kernels; a number is used
  as given; off a GPU, without masking or without dense layers nothing is set; a training run
  leaves the caller's cap as it found it."""
  import types
  from nsa_jax import cudnn_packed as cp
  monkeypatch.setattr(cp, "_dense_cap", 0)
  monkeypatch.delenv(cp.ENV, raising=False)
  c = small_config()
  c.model.attention = "dense"
  c.model.n_heads, c.model.n_kv_heads = 8, 2
  c.data.document_mask = True
  c.data.seq_len = c.model.max_seq_len = 1024
  c.data.global_batch_size, c.optim.grad_accum_steps = 8, 2
  mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 1, "tensor": 2})
  model_cfg = train.model_config_from(c.model)
  it, _ = train._iterators(c, model_cfg)
  assert train.set_dense_packed_cap(c, model_cfg, it, mesh) == 0  # no GPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (True, ""))
  seen = []
  real = cp.auto_cap
  monkeypatch.setattr(cp, "auto_cap", lambda *a: seen.append(a) or real(*a))
  counts = [int(cp.documents_per_row(jnp.asarray(b["segment_ids"])).max())
            for b in (it.batch(s) for s in range(16))]
  most = max(counts)
  assert most > 1, "the corpus rows should hold several documents at 1024 tokens"
  with caplog.at_level(logging.INFO, logger="nsa_jax"):
    cap = train.set_dense_packed_cap(c, model_cfg, it, mesh)
  assert cap == -(-most // 4) * 4 and cp.packed_cap(dense=True) == cap
  assert seen[-1][:3] == (most, 16, (2, 1024, 4, model_cfg.head_dim))  # 8 / 2 data / 2 accum
  assert f"at most {most} documents a row in 16 batches" in caplog.text
  assert it.step == 0  # the run's iterator is untouched
  monkeypatch.setattr(train, "device_memory_bytes", lambda: 1 << 20)
  assert train.set_dense_packed_cap(c, model_cfg, it, mesh) == 0  # the workspace would not fit
  c.data.cudnn_packed_cap = "off"
  assert train.set_dense_packed_cap(c, model_cfg, it, mesh) == 0 == cp.packed_cap(dense=True)
  c.data.cudnn_packed_cap = "1"
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="nsa_jax"):
    assert train.set_dense_packed_cap(c, model_cfg, it, mesh) == 1 == cp.packed_cap(dense=True)
  assert "raise data.cudnn_packed_cap to" in caplog.text
  monkeypatch.setenv(cp.ENV, "0")
  assert train.set_dense_packed_cap(c, model_cfg, it, mesh) == 0 == cp.packed_cap(dense=True)
  monkeypatch.delenv(cp.ENV)
  xla_cfg = train.model_config_from({**c.model.to_dict(), "dense_implementation": "xla"})
  assert train.set_dense_packed_cap(c, xla_cfg, it, mesh) == 0
  monkeypatch.setattr(cp, "applies", lambda q, k, v: (False, "compute capability 8.0"))
  assert train.set_dense_packed_cap(c, model_cfg, it, mesh) == 0
  c.data.cudnn_packed_cap = "auto"
  c.model.attention = "nsa"
  nsa_cfg = train.model_config_from(c.model)
  assert train.set_dense_packed_cap(c, nsa_cfg, it, mesh) == 0 == cp.packed_cap(dense=True)
  c.model.attention = "dense"
  c.data.document_mask = False
  assert train.set_dense_packed_cap(c, model_cfg, it, mesh) == 0


def test_a_training_run_restores_the_dense_cap(tmp_path, monkeypatch):
  from nsa_jax import cudnn_packed as cp
  monkeypatch.setattr(cp, "_dense_cap", 0)
  cp.set_dense_cap(7)
  c = small_config(num_steps=1)
  train.train_and_evaluate(c, str(tmp_path / "w"))
  assert cp.dense_cap() == 7
