"""Long-context evaluation of trained models: passkey retrieval over context length x needle depth
(a heatmap like the paper's Fig. 5), and validation loss by position bucket.

  python -m experiments.needle_eval --mode=needle \
      --workdirs=runs/ablate/needle:nsa_passkey,runs/ablate/needle:dense_passkey \
      --lengths=128,256,512 --depths=0,0.25,0.5,0.75,1 --samples=16 --out=docs/figures/needle.png
  python -m experiments.needle_eval --mode=position \
      --workdirs=runs/ablate/nsa_vs_dense:nsa,runs/ablate/nsa_vs_dense:dense \
      --bucket=64 --batches=8 --out=docs/figures/position_loss.png
  python -m experiments.needle_eval --mode=blocks --workdirs=runs/ablate/needle:nsa_passkey \
      --lengths=128,256 --samples=16 --out=docs/figures/needle_blocks.json
      (NSA models: per cell, the blocks the key spans and how often each layer selects them all
      at the answer queries; JSON and a printed table, no picture)

A workdir is a path or SWEEP_OUT_DIR:RUN (looked up in that sweep's results.jsonl), either with an
optional @STEP for that saved checkpoint instead of the newest (e.g. runs/pk/nsa@800; the label
then ends in @800), so one run's checkpoints can be compared.
Passkey examples are a pure function of (seed, length, depth index, sample): the same text every
run, no download. Their format is the training "passkey" source's (nsa_jax/training/data.py).
Scoring: the 5 answer digits are correct under teacher forcing; that is exactly greedy decoding,
because each greedy step sees the digits before it, which are then the correct ones.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

_MODE = None
_WORKDIRS = None
_LABELS = None
_LENGTHS = None
_DEPTHS = None
_SAMPLES = None
_SEED = None
_BUCKET = None
_BATCHES = None
_VAL_SEED = None
_OUT = None


def define_flags():
  """Command-line flags; defined only when run as a script, so that importing this module
  (tests, other scripts) never defines absl flags twice."""
  global _MODE, _WORKDIRS, _LABELS, _LENGTHS, _DEPTHS, _SAMPLES, _SEED, _BUCKET, _BATCHES
  global _VAL_SEED, _OUT
  _MODE = flags.DEFINE_enum("mode", "needle", ["needle", "position", "blocks"],
                            "what to evaluate (blocks: per needle cell, how often each NSA layer's "
                            "selection holds every block the key spans at the answer queries)")
  _WORKDIRS = flags.DEFINE_list("workdirs", None, "workdirs or SWEEP_OUT_DIR:RUN, each with an optional @STEP (that checkpoint, not the newest), comma-separated")
  _LABELS = flags.DEFINE_list("labels", [], "labels for the plot (default: run names)")
  _LENGTHS = flags.DEFINE_list("lengths", ["128", "256", "512"], "needle: context lengths")
  _DEPTHS = flags.DEFINE_list("depths", ["0", "0.25", "0.5", "0.75", "1"], "needle: depth fractions")
  _SAMPLES = flags.DEFINE_integer("samples", 16, "needle: examples per (length, depth) cell")
  _SEED = flags.DEFINE_integer("seed", 1234, "needle: example seed (not a training seed)")
  _BUCKET = flags.DEFINE_integer("bucket", 64, "position: bucket width in tokens")
  _BATCHES = flags.DEFINE_integer("batches", 8, "position: validation batches")
  _VAL_SEED = flags.DEFINE_integer("val_seed", -1, "position: data seed of the validation windows "
                                   "(-1: each run's own; set it to compare runs on the same text)")
  _OUT = flags.DEFINE_string("out", None, "PNG path (a .json with the numbers is written beside it)")

ANSWER_DIGITS = 5


# ----------------------------------------------------------------------------- passkey data -----

def _filler_sentences():
  # The training source's filler, so evaluation text looks like training text.
  from nsa_jax.training.data import _FILLER
  return _FILLER


FACT_PREFIX = "The pass key is "  # the fact's text before the key's digits


def passkey_example(length: int, depth: float, rng: np.random.Generator):
  """One passkey sequence of length + 1 tokens with the fact at `depth` of the filler.

  depth 0: the fact opens the text; depth 1: it sits just before the question.
  Returns (tokens int32 [length + 1], the 5-digit key as a string, the fact's start position).
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth={depth}: must be a fraction in [0, 1]")
  key = f"{int(rng.integers(0, 10 ** ANSWER_DIGITS)):0{ANSWER_DIGITS}d}"
  fact = f"{FACT_PREFIX}{key}. Remember it. ".encode()
  question = f" What is the pass key? The pass key is {key}".encode()
  room = length + 1 - len(fact) - len(question)
  if room < 0:
    raise ValueError(f"length={length} is too short for a passkey example: need at least "
                     f"{length - room} tokens")
  sentences = _filler_sentences()
  filler = b"".join(sentences[i] for i in rng.integers(0, len(sentences), room // 10 + 1))[:room]
  cut = int(round(depth * room))
  text = filler[:cut] + fact + filler[cut:] + question
  return np.frombuffer(text, np.uint8).astype(np.int32), key, cut


def passkey_examples(length: int, depth_index: int, depth: float, samples: int, seed: int):
  """The passkey_example tuples of one heatmap cell; deterministic in its arguments."""
  return [passkey_example(length, depth, np.random.Generator(
      np.random.PCG64([seed, length, depth_index, s]))) for s in range(samples)]


def passkey_batch(length: int, depth_index: int, depth: float, samples: int, seed: int):
  """[samples, length + 1] tokens for one heatmap cell; deterministic in its arguments."""
  return np.stack([r[0] for r in passkey_examples(length, depth_index, depth, samples, seed)])


def score_answers(logits: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(all 5 digits right [N] bool, digit accuracy [N]) from logits [N, L, V] of tokens[:, :-1]."""
  pred = np.argmax(logits[:, -ANSWER_DIGITS:], axis=-1)
  want = tokens[:, -ANSWER_DIGITS:]
  hits = pred == want
  return hits.all(axis=1), hits.mean(axis=1)


def needle_grid(logits_fn, lengths, depths, samples, seed) -> dict:
  """{"exact": [len(depths), len(lengths)], "digits": same} accuracies; logits_fn(tokens)->logits."""
  exact = np.zeros((len(depths), len(lengths)))
  digits = np.zeros_like(exact)
  for j, length in enumerate(lengths):
    for i, depth in enumerate(depths):
      tokens = passkey_batch(length, i, depth, samples, seed)
      ok, dig = score_answers(np.asarray(logits_fn(tokens[:, :-1])), tokens)
      exact[i, j], digits[i, j] = ok.mean(), dig.mean()
  return {"lengths": list(lengths), "depths": list(depths), "exact": exact.tolist(),
          "digits": digits.tolist(), "samples": samples, "seed": seed}


def key_blocks(cut: int, sel_block: int) -> list[int]:
  """Selection blocks holding the key's digits when the fact starts at token `cut`."""
  first = cut + len(FACT_PREFIX)
  return sorted({(first + i) // sel_block for i in range(ANSWER_DIGITS)})


def key_coverage(block_idx: np.ndarray, blocks: list[int], queries: list[int]) -> float:
  """Fraction of `queries` whose selected blocks (any KV group) include every one of `blocks`.
  block_idx [T, K, n] of one sequence and layer."""
  hit = [all(np.any(block_idx[q] == b) for b in blocks) for q in queries]
  return float(np.mean(hit))


def block_grid(model, sel_block, lengths, depths, samples, seed) -> dict:
  """Per cell: exact accuracy, share of examples whose key straddles a selection-block boundary,
  and per NSA layer the mean key_coverage over the answer queries."""
  import jax.numpy as jnp
  from experiments.trained_model import forward_with_aux
  cells = []
  for length in lengths:
    for i, depth in enumerate(depths):
      rows = passkey_examples(length, i, depth, samples, seed)
      tokens = np.stack([r[0] for r in rows])
      logits, auxes = forward_with_aux(model, jnp.asarray(tokens[:, :-1]))
      ok, _ = score_answers(np.asarray(logits), tokens)
      spans = [key_blocks(r[2], sel_block) for r in rows]
      answers = list(range(length - ANSWER_DIGITS, length))  # inputs predicting the digits
      cover = [float(np.mean([key_coverage(np.asarray(aux["block_idx"])[s], spans[s], answers)
                              for s in range(samples)]))
               for aux in auxes if aux is not None and "block_idx" in aux]
      cells.append(dict(length=length, depth=depth, exact=float(ok.mean()),
                        straddling=float(np.mean([len(b) > 1 for b in spans])),
                        key_blocks=spans[0], coverage_by_layer=cover))
  return {"cells": cells, "samples": samples, "seed": seed, "sel_block": sel_block}


def plot_needle(grids: list[dict], labels: list[str], out: str, trained_on: list[str | None]):
  """One heatmap per model; trained_on: e.g. "stdlib, 512 tokens" (None: not shown)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 3.8), squeeze=False)
  for n, (ax, grid, label, tl) in enumerate(zip(axes[0], grids, labels, trained_on)):
    acc = np.asarray(grid["exact"])
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.set_xticks(range(len(grid["lengths"])), [str(x) for x in grid["lengths"]])
    ax.set_yticks(range(len(grid["depths"])), [f"{100 * d:.0f}%" for d in grid["depths"]])
    for (i, j), v in np.ndenumerate(acc):
      ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=8)
    title = f"{label}: passkey accuracy"
    if tl:
      title += f"\n(trained on {tl})"
    ax.set_title(title, fontsize=9)  # neighbouring panels' two-line titles overlapped at 12 pt
    ax.set(xlabel="context length (tokens)", ylabel="needle depth" if n == 0 else "")
  fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="exact 5-digit accuracy")
  _save(fig, out)


# ----------------------------------------------------------------------------- position loss ----

def position_nll(logits_fn, batches) -> np.ndarray:
  """Mean token NLL per position [T] over the batches (weights respected)."""
  total, count = None, None
  for b in batches:
    logits = np.asarray(logits_fn(b["inputs"]), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, b["targets"][..., None], -1)[..., 0]
    w = b["weights"]
    total = (nll * w).sum(0) if total is None else total + (nll * w).sum(0)
    count = w.sum(0) if count is None else count + w.sum(0)
  return total / np.maximum(count, 1e-9)


def bucketize(per_position: np.ndarray, width: int) -> list[tuple[int, int, float]]:
  """[(start, end, mean)] over consecutive buckets of `width` positions (last may be shorter)."""
  out = []
  for s in range(0, len(per_position), width):
    chunk = per_position[s:s + width]
    out.append((s, s + len(chunk), float(chunk.mean())))
  return out


def plot_position(curves: list[list[tuple[int, int, float]]], labels: list[str], out: str):
  """Loss per bucket for each run; with several runs a second panel shows each minus the first
  (content difficulty varies along the sampled windows and cancels in the difference)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2 if len(curves) > 1 else 1, figsize=(11 if len(curves) > 1 else 6, 3.8),
                           squeeze=False)
  ax = axes[0, 0]
  mids = [(s + e) / 2 for s, e, _ in curves[0]]
  for i, (buckets, label) in enumerate(zip(curves, labels)):
    ax.plot(mids, [v for _, _, v in buckets], "o-", color=f"C{i}", label=label, ms=4)
  ax.set(title="validation loss by position", xlabel="token position (bucket centre)",
         ylabel="loss (nats/token)")
  if len(curves) > 1:
    diff = axes[0, 1]
    base = np.array([v for _, _, v in curves[0]])
    for i, (buckets, label) in enumerate(zip(curves[1:], labels[1:]), start=1):
      diff.plot(mids, np.array([v for _, _, v in buckets]) - base, "o-", color=f"C{i}",
                label=f"{label} - {labels[0]}", ms=4)
    diff.axhline(0, color="k", lw=0.8)
    diff.set(title=f"difference to {labels[0]} (> 0: {labels[0]} better)",
             xlabel="token position (bucket centre)", ylabel="loss difference (nats/token)")
  for a in axes[0]:
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
  _save(fig, out)


def _save(fig, out):
  import matplotlib.pyplot as plt
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120, bbox_inches="tight")
  plt.close(fig)


# ----------------------------------------------------------------------------- main -------------

def main(argv):
  del argv
  from experiments.cli import quiet_libraries
  quiet_libraries()
  from experiments.trained_model import jit_logits, load_model, resolve_workdir, val_batches
  specs = [resolve_workdir(w) for w in _WORKDIRS.value]
  labels = _LABELS.value or [label for _, label, _ in specs]
  results = {}
  if _MODE.value == "needle":
    lengths = [int(x) for x in _LENGTHS.value]
    depths = [float(x) for x in _DEPTHS.value]
    grids, trained = [], []
    for (workdir, _, step), label in zip(specs, labels):
      model, config, _ = load_model(workdir, max_seq_len=max(lengths), step=step)
      longer = [n for n in lengths if n > config.data.seq_len]
      if longer:
        print(f"note: {label} was trained on {config.data.seq_len}-token sequences; lengths "
              f"{longer} test extrapolation beyond it")
      grid = needle_grid(jit_logits(model), lengths, depths, _SAMPLES.value, _SEED.value)
      grid.update(workdir=workdir, step=step, trained_seq_len=config.data.seq_len)
      grids.append(grid)
      trained.append(f"{config.data.source}, {config.data.seq_len} tokens")
      results[label] = grid
      print(f"{label} ({workdir}): exact accuracy, rows = depths {depths}, cols = lengths {lengths}")
      for d, row in zip(depths, grid["exact"]):
        print(f"  depth {d:4.2f}: " + "  ".join(f"{100 * v:5.1f}" for v in row))
    plot_needle(grids, labels, _OUT.value, trained)
  elif _MODE.value == "blocks":
    lengths = [int(x) for x in _LENGTHS.value]
    depths = [float(x) for x in _DEPTHS.value]
    for (workdir, _, step), label in zip(specs, labels):
      model, _, model_cfg = load_model(workdir, max_seq_len=max(lengths), step=step)
      if "nsa" not in model_cfg.attention_kinds:
        raise ValueError(f"{workdir}: --mode=blocks needs a model with NSA layers (this one: "
                         f"{model_cfg.attention_kinds}). Fix: pass an NSA run's workdir")
      grid = block_grid(model, model_cfg.nsa.sel_block, lengths, depths, _SAMPLES.value,
                        _SEED.value)
      results[label] = dict(grid, workdir=workdir, num_selected=model_cfg.nsa.num_selected)
      print(f"{label}: n={model_cfg.nsa.num_selected}, l'={model_cfg.nsa.sel_block}; per cell: "
            "exact, straddling share, key blocks (first example), coverage by layer")
      for c in grid["cells"]:
        print(f"  {c['length']:5d} {c['depth']:4.2f}: exact {c['exact']:.3f} straddling "
              f"{c['straddling']:.2f} blocks {c['key_blocks']} coverage "
              + " ".join(f"{v:.2f}" for v in c["coverage_by_layer"]))
  else:
    curves = []
    for (workdir, _, step), label in zip(specs, labels):
      model, config, _ = load_model(workdir, step=step)
      if _VAL_SEED.value >= 0:
        config.data.seed = _VAL_SEED.value
      batches = val_batches(config, _BATCHES.value)
      per_pos = position_nll(jit_logits(model), batches)
      buckets = bucketize(per_pos, _BUCKET.value)
      curves.append(buckets)
      tokens = sum(float(b["weights"].sum()) for b in batches)
      mean = float(np.nanmean(per_pos))  # every position holds the same number of windows
      results[label] = {"workdir": workdir, "buckets": buckets, "mean_loss": mean,
                        "tokens": tokens}
      print(f"{label}: mean {mean:.4f} over {tokens:.0f} tokens; "
            + "  ".join(f"[{s},{e}) {v:.3f}" for s, e, v in buckets))
    plot_position(curves, labels, _OUT.value)
  with open(os.path.splitext(_OUT.value)[0] + ".json", "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  from experiments.cli import one_line_errors, parse_flags
  define_flags()
  flags.mark_flags_as_required(["workdirs", "out"])  # a missing one: one line, not the usage
  app.run(one_line_errors(main), flags_parser=parse_flags)
