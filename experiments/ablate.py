"""Runs a named ablation sweep: `python -m experiments.ablate --config=configs/sweep_X.py`.

A sweep file (configs/sweep_*.py) has get_config([scale]) (the base run, an ml_collections
ConfigDict; `--config=configs/sweep_X.py:gpu` passes scale="gpu") and get_runs([base]) ->
{run name: {dotted.field: value}} override sets applied on top of the base (get_runs may take the
resolved base config, to define variants relative to it).
Command-line --config.* overrides change the base of every run (e.g. a bigger GPU model), and the
run's own overrides are applied after them. Special override keys:
  MATCH_PARAMS: "other_run" - set model.ffn_dim so this run's parameter count is as close as
                possible to other_run's (how a dense twin matches NSA's extra projections).
Each run trains in runs_root/<hash of its resolved config>, so a run that appears in two sweeps
(e.g. the NSA baseline) trains once and is reused. Results: <out_dir>/results.jsonl (one line per
finished run, the exact command included), results.md (table) and loss_curves.png.

  --run=NAME       one run (default: all runs of the sweep, in order; finished ones are reused)
  --list           print the runs and their commands, train nothing
  --report_only    rewrite results.md and loss_curves.png from results.jsonl
  --reuse_from=F   results.jsonl file(s) of earlier sweeps: a run whose config hash has a record
                   there is not retrained (e.g. the GPU `nsa` baseline in a later device call,
                   from docs/results/nsa_vs_dense_gpu.jsonl; its curve is drawn only if its
                   workdir is still present)
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import sys
import time

from absl import app, flags
from ml_collections import ConfigDict, config_flags

MATCH_PARAMS = "MATCH_PARAMS"
_UI_FIELDS = ("train.progress_bar", "train.tensorboard", "train.plot")  # do not change the run
# How the same math is traced (added after runs were recorded; left out so their hashes hold).
_COMPUTE_FIELDS = ("model.layer_loop", "model.dense_implementation", "data.cudnn_packed_cap")
# Left out of the hash while they hold their unset values (fields added later: keeps the hashes
# of the runs recorded before). selection_from_layer=0 is a setting, so only None is unset there.
_UNSET_FIELDS = {"checkpoint.init_from": ("", None), "data.single_question_fraction": (0, None),
                 "model.selection_from_layer": (None,), "data.document_mask": (False, None),
                 "data.eos_id": (-1, None)}

_CONFIG = None
_RUN = None
_OUT = None
_RUNS_ROOT = None
_LIST = None
_REPORT = None
_REUSE = None


def define_flags():
  """Command-line flags; defined only when run as a script, so that importing this module
  (tests, other scripts) never defines absl flags twice."""
  global _CONFIG, _RUN, _OUT, _RUNS_ROOT, _LIST, _REPORT, _REUSE
  _CONFIG = config_flags.DEFINE_config_file("config", None, "sweep file (configs/sweep_*.py)",
                                            lock_config=True)
  _RUN = flags.DEFINE_string("run", "all", "run name, comma-separated names, or 'all'")
  _OUT = flags.DEFINE_string("out_dir", None, "sweep output dir (default runs/ablate/<sweep name>)")
  _RUNS_ROOT = flags.DEFINE_string("runs_root", "runs/ablate/_runs", "shared run work directories")
  _LIST = flags.DEFINE_bool("list", False, "print the runs and their commands, train nothing")
  _REPORT = flags.DEFINE_bool("report_only", False, "only rewrite results.md / loss_curves.png")
  _REUSE = flags.DEFINE_list("reuse_from", [], "earlier results.jsonl files to take runs from")


# ----------------------------------------------------------------------------- sweep files ------

def load_sweep(path: str):
  """The sweep module at path (a configs/sweep_*.py file, optionally with a ':arg' suffix)."""
  path = path.split(":")[0]
  spec = importlib.util.spec_from_file_location(f"sweep_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for fn in ("get_config", "get_runs"):
    if not hasattr(module, fn):
      raise ValueError(f"{path}: a sweep file needs {fn}(); see experiments/ablate.py")
  return module


def sweep_name(path: str) -> str:
  name = os.path.splitext(os.path.basename(path.split(":")[0]))[0]
  scale = path.split(":")[1] if ":" in path else ""
  name = name[len("sweep_"):] if name.startswith("sweep_") else name
  return f"{name}_{scale}" if scale and scale != "cpu" else name


def set_field(config: ConfigDict, dotted: str, value):
  """config.a.b.c = value, with an error naming the field when it does not exist."""
  *parents, leaf = dotted.split(".")
  node = config
  for p in parents:
    if p not in node:
      raise ValueError(f"override {dotted!r}: no field {p!r}. Fix: check the name in configs/base.py")
    node = node[p]
  if leaf not in node:
    raise ValueError(f"override {dotted!r}: no field {leaf!r}. Fix: check the name in configs/base.py")
  with node.unlocked():
    node[leaf] = tuple(value) if isinstance(value, list) else value


def get_field(config: ConfigDict, dotted: str):
  node = config
  for p in dotted.split("."):
    node = node[p]
  return node


def count_params(config: ConfigDict) -> int:
  """Parameters of config.model, from shapes only (nothing is allocated)."""
  import jax
  import numpy as np
  from flax import nnx
  from nsa_jax.model import TransformerLM
  from nsa_jax.training.train import model_config_from
  model_cfg = model_config_from(config.model)
  abstract = nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def match_ffn_dim(config: ConfigDict, target: int, multiple: int = 8) -> int:
  """The ffn_dim (a multiple of `multiple`) whose parameter count is closest to target.

  Parameters are affine in ffn_dim (SwiGLU: 3 * d_model per hidden unit per layer), so two
  evaluations fix the line; only ffn_dim moves, never the attention or width.
  """
  f0 = config.model.ffn_dim
  probe = copy.deepcopy(config)
  p0 = count_params(probe)
  set_field(probe, "model.ffn_dim", f0 + multiple)
  per_step = count_params(probe) - p0
  steps = round((target - p0) / per_step)
  return max(multiple, f0 + steps * multiple)


def resolve_runs(module, base: ConfigDict) -> dict[str, tuple[dict, ConfigDict]]:
  """{name: (overrides as written, resolved config)} in the sweep's order."""
  import inspect
  raw = module.get_runs(base) if inspect.signature(module.get_runs).parameters else module.get_runs()
  resolved = {}
  for name, overrides in raw.items():
    config = copy.deepcopy(base)
    for key, value in overrides.items():
      if key != MATCH_PARAMS:
        set_field(config, key, value)
    if MATCH_PARAMS in overrides:
      other = overrides[MATCH_PARAMS]
      if other not in resolved:
        raise ValueError(f"run {name!r}: {MATCH_PARAMS} names {other!r}, which must come earlier "
                         "in get_runs()")
      set_field(config, "model.ffn_dim", match_ffn_dim(config, count_params(resolved[other][1])))
    resolved[name] = (dict(overrides), config)
  return resolved


def config_hash(config: ConfigDict) -> str:
  """Identity of a run: its resolved config, minus fields that only change the UI."""
  d = json.loads(config.to_json_best_effort(sort_keys=True))
  for dotted in _UI_FIELDS + _COMPUTE_FIELDS + tuple(_UNSET_FIELDS):
    group, leaf = dotted.split(".")
    if dotted not in _UNSET_FIELDS or d.get(group, {}).get(leaf) in _UNSET_FIELDS[dotted]:
      d.get(group, {}).pop(leaf, None)
  if not d.get("data", {}).get("document_mask"):  # eos_id does nothing without document masking
    d.get("data", {}).pop("eos_id", None)
  return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def _joined_flags(argv: list[str]) -> list[str]:
  """argv[1:] with each `--flag value` pair (the space form absl accepts) as one `--flag=value`."""
  out, args = [], argv[1:]
  i = 0
  while i < len(args):
    a = args[i]
    if (a.startswith("--") and "=" not in a and i + 1 < len(args)
        and not args[i + 1].startswith("--")):
      out.append(f"{a}={args[i + 1]}")
      i += 2
    else:
      out.append(a)
      i += 1
  return out


def command_for(config_path: str, run: str, argv: list[str]) -> str:
  """The command that reruns this row: --config as given (with any ':scale'), the user's
  --config.* overrides kept (with their values, in either flag form), --run set."""
  flags_given = _joined_flags(argv)
  given = [a.split("=", 1)[1] for a in flags_given if a.startswith("--config=")]
  keep = [a for a in flags_given if a.startswith("--config.") or a.startswith("--runs_root")
          or a.startswith("--out_dir")]
  return shlex.join(["python", "-m", "experiments.ablate", f"--config={given[0] if given else config_path}",
                     f"--run={run}", *keep])


# ----------------------------------------------------------------------------- running ----------

def hardware() -> str:
  import jax
  dev = jax.devices()[0]
  kind = dev.device_kind if dev.platform != "cpu" else platform.processor() or platform.machine()
  return f"{jax.device_count()}x {dev.platform}:{kind} ({os.cpu_count()} host cores)"


def _median(xs):
  xs = sorted(xs)
  return xs[len(xs) // 2] if xs else float("nan")


def read_tokens_per_s(workdir: str) -> float:
  """Median logged training tokens/s (the first logged window includes warm-up, so skip it)."""
  from nsa_jax.training.plotting import read_metrics, series
  _, tps = series(read_metrics(workdir), "train/tokens_per_s")
  tps = list(tps[1:] if len(tps) > 2 else tps)
  return float(_median(tps))


def _summary_from_logs(workdir: str, summary: dict) -> dict:
  """summary with the final train / validation metrics of a run that had already finished, read
  from its metrics.jsonl (its validation at the final step)."""
  from nsa_jax.training.plotting import read_metrics
  recs = read_metrics(workdir)
  val = [r for r in recs if "val/loss" in r]
  train = [r for r in recs if "train/loss" in r]
  if not val or val[-1]["step"] != summary["step"] or not train:
    raise ValueError(f"run in {workdir} is at step {summary['step']}, but its metrics.jsonl holds no "
                     "validation at that step. Fix: move the workdir away to retrain this row")
  v = val[-1]
  return {**summary, "train": {"loss": train[-1]["train/loss"]},
          "val": {"loss": v["val/loss"], "perplexity": v["val/perplexity"],
                  "accuracy": v["val/accuracy"]}}


def train_run(config: ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) one run; returns its metrics record (saved in the workdir too)."""
  from nsa_jax.training import train
  done = os.path.join(workdir, "ablate_result.json")
  if os.path.exists(done):
    with open(done) as f:
      return {**json.load(f), "reused": True}
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  summary = train.train_and_evaluate(config, workdir)
  wall = time.time() - t0
  if summary.get("stopped"):
    raise RuntimeError(f"run in {workdir} stopped early ({summary['stopped']}); rerun to resume")
  if not summary["val"]:  # it had finished (its record file lost, e.g. killed right after the
    summary, wall = _summary_from_logs(workdir, summary), float("nan")  # last save): read the logs
  tokens = config.train.num_steps * config.data.global_batch_size * config.data.seq_len
  rec = dict(val_loss=summary["val"]["loss"], val_ppl=summary["val"]["perplexity"],
             val_acc=summary["val"]["accuracy"], train_loss=summary["train"]["loss"],
             steps=summary["step"], tokens=tokens, tokens_per_s=read_tokens_per_s(workdir),
             wall_s=wall, params=count_params(config), hardware=hardware(),
             date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"))
  with open(done, "w") as f:
    json.dump(rec, f, indent=1)
  return {**rec, "reused": False}


def append_result(out_dir: str, record: dict):
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\n")


def read_records(path: str) -> list[dict]:
  """The records of one results.jsonl file, in the order they were appended."""
  with open(path) as f:
    return [json.loads(line) for line in f]


def records_by_hash(paths: list[str]) -> dict[str, dict]:
  """config_hash -> the latest record with that hash in the given results.jsonl files."""
  return {rec["config_hash"]: rec for path in paths for rec in read_records(path)}


def read_results(out_dir: str, hashes: dict[str, str] | None = None) -> dict[str, dict]:
  """Latest record per run name; with hashes ({run: config hash of this command's settings}), the
  latest record made with those settings (a run recorded only with others is left out)."""
  path = os.path.join(out_dir, "results.jsonl")
  records = read_records(path) if os.path.exists(path) else []
  return {rec["run"]: rec for rec in records
          if hashes is None or hashes.get(rec["run"]) == rec.get("config_hash")}


# ----------------------------------------------------------------------------- report -----------

def _fmt_overrides(overrides: dict) -> str:
  if not overrides:
    return "(base)"
  def short(key):
    return key.removeprefix("model.nsa.").removeprefix("model.")
  return ", ".join(f"{short(k)}={v}" if k != MATCH_PARAMS else f"params~{v}"
                   for k, v in overrides.items())


def markdown_table(results: dict[str, dict], order: list[str], reference: str | None) -> str:
  """One row per finished run; deltas are against the reference run when it has finished."""
  ref = results.get(reference) if reference else None
  head = ("| run | changes vs base | params | val loss | d loss vs ref | val ppl | train tok/s | "
          "wall s | command |\n|---|---|---|---|---|---|---|---|---|\n")
  rows = []
  for name in order:
    r = results.get(name)
    if r is None:
      continue
    delta = f"{r['val_loss'] - ref['val_loss']:+.4f}" if ref else "n/a"
    dparams = f" ({r['params'] - ref['params']:+,})" if ref and name != reference else ""
    rows.append(f"| {name} | {_fmt_overrides(r['overrides'])} | {r['params']:,}{dparams} | "
                f"{r['val_loss']:.4f} | {delta} | {r['val_ppl']:.3f} | {r['tokens_per_s']:,.0f} | "
                f"{r['wall_s']:.0f} | `{r['command']}` |")
  return head + "\n".join(rows) + "\n"


def write_report(out_dir: str, order: list[str], reference: str | None, title: str,
                 hashes: dict[str, str] | None = None):
  """results.md and loss_curves.png. hashes ({run: config hash}, as main passes them): rows only
  from records made with these settings, so a row rerun with other overrides (say more steps)
  never sits beside, or is compared with, rows of the earlier settings; the rest are named below
  the table."""
  from nsa_jax.training.plotting import plot_runs
  results = read_results(out_dir, hashes)
  table = markdown_table(results, order, reference)
  if hashes is not None:
    other = sorted(set(read_results(out_dir)) - set(results))
    if other:
      table += (f"\nNot in this table: {', '.join(other)}, recorded only with other settings "
                "than this command's (other --config.* overrides); rerun them with these "
                "settings, or pass the earlier overrides to see those rows.\n")
  # Curves only for runs whose logs are here (a record reused from another machine has none).
  names = [n for n in order if n in results
           and os.path.exists(os.path.join(results[n]["workdir"], "metrics.jsonl"))]
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(f"# {title}\n\nReference run for deltas: {reference}\n\n{table}")
  if names:
    plot_runs([results[n]["workdir"] for n in names], os.path.join(out_dir, "loss_curves.png"),
              labels=names)
  return table


# ----------------------------------------------------------------------------- main -------------

def main(argv):
  import logging
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  given = next((a.split("=", 1)[1] for a in _joined_flags(sys.argv) if a.startswith("--config=")),
               path)
  module = load_sweep(path)
  name = sweep_name(given)  # keeps the ':scale' suffix: gpu results never mix with cpu ones
  out_dir = _OUT.value or os.path.join("runs", "ablate", name)
  reference = getattr(module, "REFERENCE", None)
  runs = resolve_runs(module, _CONFIG.value)
  order = list(runs)
  hashes = {run: config_hash(config) for run, (_, config) in runs.items()}
  if _REPORT.value:
    print(write_report(out_dir, order, reference, f"sweep {name}", hashes))
    return 0
  reuse = records_by_hash(_REUSE.value)
  wanted = order if _RUN.value == "all" else _RUN.value.split(",")
  unknown = [w for w in wanted if w not in runs]
  if unknown:
    print(f"error: unknown run(s) {unknown}; sweep {name} has {order}", file=sys.stderr)
    return 1
  for run in wanted:
    overrides, config = runs[run]
    cmd = command_for(path, run, sys.argv)
    workdir = os.path.join(_RUNS_ROOT.value, config_hash(config))
    if _LIST.value:
      print(f"{run}: {_fmt_overrides(overrides)} -> {workdir}\n  {cmd}")
      continue
    print(f"=== {name}/{run}: {_fmt_overrides(overrides)} (workdir {workdir})", flush=True)
    earlier = reuse.get(config_hash(config))
    if earlier is not None:
      rec = {k: v for k, v in earlier.items() if k not in ("sweep", "run", "overrides")}
      rec.update(reused=True, reused_from=earlier["command"])
    else:
      rec = train_run(config, workdir)
    record = dict(sweep=name, run=run, overrides=overrides, workdir=workdir, command=cmd,
                  config_hash=config_hash(config))
    record.update({k: v for k, v in rec.items() if k not in record or k == "workdir"})
    append_result(out_dir, record)
    print(f"=== {name}/{run}: val loss {rec['val_loss']:.4f}, {rec['tokens_per_s']:,.0f} tok/s, "
          f"{rec['wall_s']:.0f} s{' (reused)' if rec['reused'] else ''}", flush=True)
  if not _LIST.value:
    print(write_report(out_dir, order, reference, f"sweep {name}", hashes))
  return 0


if __name__ == "__main__":
  from experiments.cli import one_line_errors, parse_flags
  define_flags()
  flags.mark_flags_as_required(["config"])
  app.run(one_line_errors(main), flags_parser=parse_flags)
