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
      at the answer queries; then digit by digit, at the query that predicts each digit: does
      the window or a forced block reach it anyway, did the selection hold its block, and for
      the digits only a chosen block reaches, how often the digit is right when held against
      when missed, with the selection gate and the branch's attention mass on the digit for
      right and wrong digits: is a miss the selector's, or after it? A dense run gets the
      attention part alone: its best head's causal mass on each digit, right vs wrong. JSON, a
      printed table and a PNG of the NSA runs beside the JSON)
  python -m experiments.needle_eval --mode=blocks --force_key_layers=1 ...
      (an intervention: in those NSA layers the key's blocks are put into every KV group's
      selection at the answer queries, in place of the lowest-numbered block that is neither
      forced nor the key's; does the answer come right once that layer holds the key?)

A workdir is a path or SWEEP_OUT_DIR:RUN (looked up in that sweep's results.jsonl), either with an
optional @STEP for that saved checkpoint instead of the newest (e.g. runs/pk/nsa@800; the label
then ends in @800), so one run's checkpoints can be compared.
Passkey examples are a pure function of (seed, length, depth index, sample): the same text every
run, no download. Their format is the training "passkey" source's (nsa_jax/training/data.py).
Scoring: the 5 answer digits are correct under teacher forcing; that is exactly greedy decoding,
because each greedy step sees the digits before it, which are then the correct ones.
"""

from __future__ import annotations

import functools
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
_FORCE = None


def define_flags():
  """Command-line flags; defined only when run as a script, so that importing this module
  (tests, other scripts) never defines absl flags twice."""
  global _MODE, _WORKDIRS, _LABELS, _LENGTHS, _DEPTHS, _SAMPLES, _SEED, _BUCKET, _BATCHES
  global _VAL_SEED, _OUT, _FORCE
  _MODE = flags.DEFINE_enum("mode", "needle", ["needle", "position", "blocks"],
                            "what to evaluate (blocks: per needle cell, how often the NSA layers' "
                            "selection holds every block the key spans at the answer queries, and "
                            "the accuracy when it does against when it does not)")
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
  _OUT = flags.DEFINE_string("out", None, "PNG path (a .json with the numbers is written beside "
                             "it; blocks mode: either name, both are written)")
  _FORCE = flags.DEFINE_list("force_key_layers", [], "blocks: NSA layer indices whose selection "
                             "gets the key's blocks at the answer queries (an intervention; "
                             "force_key_blocks)")

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


def digit_hits(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """[N, 5] bool: each answer digit predicted right (teacher-forced argmax), from logits [N, L, V]
  of tokens[:, :-1]."""
  return np.argmax(logits[:, -ANSWER_DIGITS:], axis=-1) == tokens[:, -ANSWER_DIGITS:]


def score_answers(logits: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(all 5 digits right [N] bool, digit accuracy [N]) from logits [N, L, V] of tokens[:, :-1]."""
  hits = digit_hits(logits, tokens)
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


def position_reach(pos: int, query: int, sel_block: int, window: int, num_init: int,
                   num_local: int, num_selected: int | None = None) -> str:
  """How the query at `query` sees the token at `pos` without any choice by score: "window"
  (inside its sliding window, keys (query - window, query]; window 0: no window branch),
  "forced" (in one of its forced blocks: the first num_init blocks and the num_local blocks
  ending at the query's own; or every visible block, when there are no more of them than
  num_selected, so top-n keeps them all), or else "selection" (only through a block chosen by
  its score)."""
  if query - pos < window:
    return "window"
  cur = query // sel_block
  if (pos // sel_block < num_init or cur - num_local < pos // sel_block <= cur
      or (num_selected is not None and cur + 1 <= num_selected)):
    return "forced"
  return "selection"


def selected_key_mass(q_t: np.ndarray, k: np.ndarray, idx_t: np.ndarray, t: int, sel_block: int,
                      targets: list[int], scale: float) -> np.ndarray:
  """Per query head, the selection branch's softmax mass on the key positions `targets` at query t:
  q_t [H, d_k] (after RoPE), k [T, K, d_k] the selection keys, idx_t [K, n] the query's blocks
  (-1 empty); head h reads KV group h // (H / K), keys of its blocks up to t (Eq. 12 with the
  causal mask). float64; [H]."""
  heads, groups = q_t.shape[0], k.shape[1]
  per_group = heads // groups
  out = np.zeros(heads)
  for g in range(groups):
    blocks = np.unique(idx_t[g][idx_t[g] >= 0])
    keys = np.arange(t + 1)[np.isin(np.arange(t + 1) // sel_block, blocks)]
    if not len(keys):  # no block selected: no mass anywhere
      continue
    logits = (q_t[g * per_group:(g + 1) * per_group].astype(np.float64)
              @ k[keys, g].astype(np.float64).T) * scale  # [heads of g, keys]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out[g * per_group:(g + 1) * per_group] = p[:, np.isin(keys, targets)].sum(-1)
  return out


def key_positions(tokens: np.ndarray, sel_block: int) -> tuple[np.ndarray, np.ndarray]:
  """For passkey inputs tokens [B, T] (passkey_example's tokens without the last): per row the
  selection blocks the key's digits span, [B, 2] int32 (-1 pads a single block), found from the
  fact's text, and the first answer query T - 5 [B] int32."""
  prefix = FACT_PREFIX.encode()
  blocks = np.full((tokens.shape[0], 2), -1, np.int32)
  for b, row in enumerate(tokens):
    cut = row.astype(np.uint8).tobytes().find(prefix)
    if cut < 0:
      raise ValueError(f"row {b} holds no passkey fact ({FACT_PREFIX!r}); the key intervention "
                       "needs passkey_example inputs")
    kb = key_blocks(cut, sel_block)
    blocks[b, :len(kb)] = kb
  return blocks, np.full(tokens.shape[0], tokens.shape[1] - ANSWER_DIGITS, np.int32)


def force_key_blocks(block_idx, extra, nsa):
  """block_idx [B, T, K, n] (one layer's selection: ascending, -1 in empty slots) with each row's
  key blocks put into every KV group's list at the queries t >= from_query whose own block is
  at or after the key's and whose list lacks it. extra = (key blocks [B, m] with -1 for none,
  from_query [B]) (key_positions). Each missing key block takes the slot of the lowest-numbered
  block that is neither forced (the first num_init_blocks and the num_local_blocks ending at
  t's own; documents start at 0 here) nor a key block; the list is then sorted again. A list
  with no such slot is left as it is: either it already holds every eligible block, or every
  slot is forced (n <= num_init_blocks + num_local_blocks), and the paper's forced blocks are
  not displaced; the coverage the grid reports then shows where forcing did not take."""
  import jax.numpy as jnp
  want_all, from_query = extra
  b, t, k, n = block_idx.shape
  cur = (jnp.arange(t) // nsa.sel_block)[None, :, None, None]  # [1, T, 1, 1]
  active = (jnp.arange(t)[None, :] >= from_query[:, None])[:, :, None]  # [B, T, 1]
  idx = block_idx
  for j in range(want_all.shape[1]):
    want = want_all[:, j][:, None, None, None]  # [B, 1, 1, 1]
    is_key = jnp.any(idx[..., None] == want_all[:, None, None, None, :], -1) & (idx >= 0)
    forced = (idx < nsa.num_init_blocks) | (idx > cur - nsa.num_local_blocks)
    free = (idx >= 0) & ~forced & ~is_key  # [B, T, K, n]
    put = (active & (want[..., 0] >= 0) & (want[..., 0] <= cur[..., 0])
           & ~jnp.any(idx == want, -1) & jnp.any(free, -1))  # [B, T, K]
    slot = jnp.argmax(free, -1)  # the first free slot: its block is the lowest-numbered
    idx = jnp.where(put[..., None] & (jnp.arange(n) == slot[..., None]), want, idx)
  big = jnp.iinfo(jnp.int32).max
  idx = jnp.sort(jnp.where(idx < 0, big, idx), axis=-1)
  return jnp.where(idx == big, -1, idx).astype(block_idx.dtype)


def example_record(block_idx_by_layer: list[np.ndarray], cut: int, length: int,
                   digits_right: np.ndarray, nsa,
                   slc_gate_by_layer: list[np.ndarray] | None = None,
                   qk_by_layer: list[tuple[np.ndarray, np.ndarray]] | None = None) -> dict:
  """One passkey example of `length` input tokens with the fact at `cut`, scored digit by digit
  (digits_right [5] bool, teacher-forced). block_idx_by_layer: each NSA layer's [T, K, n] choices
  for this sequence; nsa: the layers' NSAConfig. Per answer digit i, at the query that predicts it
  (input length - 5 + i), with the digit's own position in the fact as the target:
    reach   position_reach of that digit;
    held    some layer's selection (any KV group) holds the digit's block (held_by_layer: each);
    groups  per layer, the share of its KV groups whose selection holds it (a head reads only
            its own group's blocks: with several groups, "held" can hide the copying head's miss);
    gate    each layer's selection-branch gate there, head mean (slc_gate_by_layer [T, H]);
    mass    each layer's largest head softmax mass on the digit inside its selected blocks
            (qk_by_layer: (q [T, H, d_k], selection keys [T, K, d_k]) after RoPE).
  Plus, per layer, the share of the answer queries whose selection holds every key block."""
  blocks = key_blocks(cut, nsa.sel_block)
  answers = list(range(length - ANSWER_DIGITS, length))  # inputs predicting the digits
  first = cut + len(FACT_PREFIX)
  digits = []
  for i, t in enumerate(answers):
    pos = first + i
    held = [bool(np.any(idx[t] == pos // nsa.sel_block)) for idx in block_idx_by_layer]
    digits.append(dict(
        right=bool(digits_right[i]), held=any(held), held_by_layer=held,
        groups_by_layer=[float(np.mean(np.any(idx[t] == pos // nsa.sel_block, axis=-1)))
                         for idx in block_idx_by_layer],
        reach=position_reach(pos, t, nsa.sel_block, nsa.window if "win" in nsa.branches else 0,
                             nsa.num_init_blocks, nsa.num_local_blocks, nsa.num_selected),
        gate_by_layer=[float(np.mean(g[t])) for g in (slc_gate_by_layer or [])],
        mass_by_layer=[float(selected_key_mass(q[t], k, idx[t], t, nsa.sel_block, [pos],
                                               q.shape[-1] ** -0.5).max())
                       for (q, k), idx in zip(qk_by_layer or [], block_idx_by_layer)]))
  return dict(correct=bool(np.all(digits_right)), digits=digits, key_blocks=blocks,
              coverage_by_layer=[key_coverage(idx, blocks, answers) for idx in block_idx_by_layer],
              distance=answers[0] - first)


def held_vs_correct(records: list[dict]) -> dict:
  """Over the answer digits that only a chosen block reaches (reach "selection"): how often the
  digit is predicted right when the selection held its block (in some layer) and when it did not,
  and per layer, over the digits whose block that layer held, the mean selection gate and the
  mean largest head mass on the digit, for right against wrong digits (None for a layer that held
  none), and over all of them the mean share of each layer's KV groups holding the digit's block
  (groups_right / groups_wrong_by_layer). Separates a selector that misses the key from attention
  (or what follows it) that fails after finding it."""
  sel = [d for r in records for d in r["digits"] if d["reach"] == "selection"]
  count = lambda held, ok: sum(d["held"] == held and d["right"] == ok for d in sel)
  out = {"digits": len(sel), "held_right": count(True, True), "held_wrong": count(True, False),
         "missed_right": count(False, True), "missed_wrong": count(False, False)}
  share = lambda r, w: r / (r + w) if r + w else None
  for name in ("held", "missed"):
    out[f"p_right_if_{name}"] = share(out[f"{name}_right"], out[f"{name}_wrong"])
  layers = max((len(d["held_by_layer"]) for d in sel), default=0)
  for ok in (True, False):  # how many digits each layer's selection held (the means' counts)
    out[f"held_{'right' if ok else 'wrong'}_by_layer"] = [
        sum(d["right"] == ok and d["held_by_layer"][j] for d in sel) for j in range(layers)]
  # each layer on its own: is a digit right more often when THIS layer's selection held it?
  n_right, n_wrong = sum(d["right"] for d in sel), sum(not d["right"] for d in sel)
  out["p_right_if_held_by_layer"] = [share(r, w) for r, w in zip(out["held_right_by_layer"],
                                                                   out["held_wrong_by_layer"])]
  out["p_right_if_missed_by_layer"] = [share(n_right - r, n_wrong - w) for r, w in
                                       zip(out["held_right_by_layer"], out["held_wrong_by_layer"])]
  for ok in (True, False):  # per layer, the mean share of KV groups holding the digit's block
    v = [d["groups_by_layer"] for d in sel if d["right"] == ok]
    out[f"groups_{'right' if ok else 'wrong'}_by_layer"] = (
        [round(float(x), 4) for x in np.mean(v, axis=0)] if v else None)
  for what in ("gate", "mass"):
    for ok in (True, False):
      layers = max((len(d[f"{what}_by_layer"]) for d in sel), default=0)
      per_layer = [[d[f"{what}_by_layer"][j] for d in sel
                    if d["right"] == ok and d[f"{what}_by_layer"] and d["held_by_layer"][j]]
                   for j in range(layers)]
      out[f"slc_{what}_held_{'right' if ok else 'wrong'}"] = (
          [round(float(np.mean(v)), 4) if v else None for v in per_layer]
          if any(per_layer) else None)
  return out


def _scored_cells(fn, lengths, depths, samples, seed):
  """Per (length, depth) cell: (length, depth, passkey_examples rows, exact [N], per-digit right
  [N, 5], per-layer aux) from fn(tokens) -> (logits, aux per layer)."""
  for length in lengths:
    for i, depth in enumerate(depths):
      rows = passkey_examples(length, i, depth, samples, seed)
      tokens = np.stack([r[0] for r in rows])
      logits, auxes = fn(tokens[:, :-1])
      right = digit_hits(np.asarray(logits), tokens)
      yield length, depth, rows, right.all(axis=1), right, auxes


def block_grid(blocks_fn, nsa, lengths, depths, samples, seed) -> dict:
  """Per cell: exact accuracy, digit accuracy, share of examples whose key straddles a
  selection-block boundary, per NSA layer the mean key_coverage over the answer queries, the
  answer digits' reach shares (window / forced / selection), the share of the selection-reach
  digits whose block the selection held (None without such digits), over those held the mean of
  the largest head mass on the digit among the layers that held it (held_mass), and
  held_vs_correct; plus
  held_vs_correct over every cell. blocks_fn(tokens) -> (logits, per layer None or {"block_idx",
  "gates", "q", "k_slc"}) (trained_model.jit_logits_and_blocks), nsa the model's NSAConfig."""
  from nsa_jax.reference import BRANCH_ORDER
  cells, everything = [], []
  for length, depth, rows, ok, right, auxes in _scored_cells(blocks_fn, lengths, depths, samples,
                                                             seed):
    auxes = [a for a in auxes if a is not None and "block_idx" in a]  # the NSA layers
    idx_layers = [np.asarray(a["block_idx"]) for a in auxes]
    gate_layers = ([np.asarray(a["gates"][..., BRANCH_ORDER.index("slc")], np.float32)
                    for a in auxes] if "slc" in nsa.branches else [])
    qk_layers = ([(np.asarray(a["q"], np.float32), np.asarray(a["k_slc"], np.float32))
                  for a in auxes] if all("q" in a for a in auxes) else [])
    recs = [example_record([x[s] for x in idx_layers], rows[s][2], length, right[s], nsa,
                           [g[s] for g in gate_layers], [(q[s], k[s]) for q, k in qk_layers])
            for s in range(samples)]
    everything += recs
    events = [d for r in recs for d in r["digits"]]
    sel = [d for d in events if d["reach"] == "selection"]
    cells.append(dict(
        length=length, depth=depth, exact=float(ok.mean()), digit_acc=float(right.mean()),
        straddling=float(np.mean([len(r["key_blocks"]) > 1 for r in recs])),
        key_blocks=recs[0]["key_blocks"],
        coverage_by_layer=[float(np.mean([r["coverage_by_layer"][j] for r in recs]))
                           for j in range(len(idx_layers))],
        reach={k: float(np.mean([d["reach"] == k for d in events]))
               for k in ("window", "forced", "selection")},
        held=float(np.mean([d["held"] for d in sel])) if sel else None,
        held_mass=(float(np.mean([max(m for m, h in zip(d["mass_by_layer"], d["held_by_layer"])
                                      if h) for d in sel if d["held"]]))
                   if any(d["held"] and d["mass_by_layer"] for d in sel) else None),
        held_vs_correct=held_vs_correct(recs)))
  return {"cells": cells, "held_vs_correct": held_vs_correct(everything), "samples": samples,
          "seed": seed, "sel_block": nsa.sel_block, "window": nsa.window}


def dense_grid(fn, lengths, depths, samples, seed) -> dict:
  """The dense counterpart of block_grid's attention reading: per cell, exact and digit accuracy,
  and per attention layer (dense layers of the model) the mean over right and over wrong digits
  of the largest head softmax mass on the digit at the query that predicts it, under full causal
  attention. fn: trained_model.jit_logits_and_blocks of the model."""
  cells = []
  total = {True: [], False: []}
  mean = lambda v: np.mean(v, axis=0).round(4).tolist() if v else None
  for length, depth, rows, ok, right, auxes in _scored_cells(fn, lengths, depths, samples, seed):
    qk = [(np.asarray(a["q"], np.float32), np.asarray(a["k"], np.float32))
          for a in auxes if a is not None and "k" in a]
    by = {True: [], False: []}
    for s in range(samples):
      first = rows[s][2] + len(FACT_PREFIX)
      for d in range(ANSWER_DIGITS):
        t = length - ANSWER_DIGITS + d
        by[bool(right[s, d])].append([float(selected_key_mass(
            q[s, t], k[s], np.zeros((k.shape[2], 1), int), t, t + 1, [first + d],
            q.shape[-1] ** -0.5).max()) for q, k in qk])
    for key in by:
      total[key] += by[key]
    cells.append(dict(length=length, depth=depth, exact=float(ok.mean()),
                      digit_acc=float(right.mean()), mass_right=mean(by[True]),
                      mass_wrong=mean(by[False])))
  return {"cells": cells, "mass_right": mean(total[True]), "mass_wrong": mean(total[False]),
          "digits_right": len(total[True]), "digits_wrong": len(total[False]),
          "samples": samples, "seed": seed}


def _pct(p) -> str:
  return "-" if p is None else f"{100 * p:.0f}%"


def _mass_text(hv: dict) -> str:
  """Per layer: the mean largest-head mass on right / wrong digits that layer held, with how many
  digits each mean is over (means of different layers are not comparable with each other)."""
  right, wrong = hv["slc_mass_held_right"] or [], hv["slc_mass_held_wrong"] or []
  n_r, n_w = hv.get("held_right_by_layer") or [], hv.get("held_wrong_by_layer") or []
  f = lambda v, j: "-" if j >= len(v) or v[j] is None else f"{v[j]:.2f}"
  parts = [f"L{j} {f(right, j)}/{f(wrong, j)}"
           + (f" ({n_r[j]}/{n_w[j]})" if j < min(len(n_r), len(n_w)) else "")
           for j in range(max(len(right), len(wrong)))]
  return ", ".join(parts) if parts else "-"


def plot_blocks(grids: list[dict], labels: list[str], out: str):
  """Per model three heatmaps (depth x length): exact accuracy; the share of the answer digits
  reachable only through a chosen block whose block the selection held at the digit's query; and
  over those held, the selection branch's attention mass on the digit (largest head and layer,
  mean) (grey: no such digit). Cells whose digits the window or the forced blocks mostly reach
  are marked w / f."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cmap = matplotlib.colormaps["RdYlGn"].copy()
  cmap.set_bad("lightgray")
  fig, axes = plt.subplots(len(grids), 3, figsize=(14.5, 3.8 * len(grids)), squeeze=False)
  for row, (grid, label) in zip(axes, zip(grids, labels)):
    lengths = sorted({c["length"] for c in grid["cells"]})
    depths = sorted({c["depth"] for c in grid["cells"]})
    cell = {(c["depth"], c["length"]): c for c in grid["cells"]}
    hv = grid["held_vs_correct"]
    titles = (f"{label}: passkey accuracy",
              f"{label}: digit's block selected\n"
              f"right {_pct(hv['p_right_if_held'])} if so, {_pct(hv['p_right_if_missed'])} if "
              f"not (n = {hv['digits']})",
              f"{label}: selection attention on the digit (where selected)\n"
              f"by layer, right/wrong (digits): {_mass_text(hv)}")
    for col, (ax, field, title) in enumerate(zip(row, ("exact", "held", "held_mass"), titles)):
      acc = np.array([[np.nan if cell[d, n][field] is None else cell[d, n][field]
                       for n in lengths] for d in depths])
      im = ax.imshow(np.ma.masked_invalid(acc), vmin=0, vmax=1, cmap=cmap, aspect="auto",
                     origin="upper")
      for (i, j), v in np.ndenumerate(acc):
        reach = cell[depths[i], lengths[j]]["reach"]
        mark = "w" if reach["window"] >= 0.5 else "f" if reach["forced"] >= 0.5 else ""
        ax.text(j, i, ("-" if np.isnan(v) else f"{100 * v:.0f}") + mark, ha="center",
                va="center", fontsize=8)
      ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
      ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
      ax.set_title(title, fontsize=8)
      ax.set(xlabel="context length (tokens)", ylabel="" if col else "needle depth")
  fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8,
               label="share (w / f: digits mostly in window / forced blocks)")
  _save(fig, out)


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

def position_nll(logits_fn, batches, return_count=False):
  """Mean token NLL per position [T] over the batches (weights respected).

  A batch with segment_ids (a document-masked run) goes to the model with them, and its tokens
  count at their position within their document, not within the row: the curve then says how
  far back inside a document the model reads. Positions no token reached are NaN.
  return_count: also the weight summed at each position (for a token-weighted mean)."""
  from nsa_jax.layers import default_positions
  t = batches[0]["inputs"].shape[1]
  total, count = np.zeros(t), np.zeros(t)
  for b in batches:
    seg = (b["segment_ids"],) if "segment_ids" in b else ()
    logits = np.asarray(logits_fn(b["inputs"], *seg), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, b["targets"][..., None], -1)[..., 0]
    w = b["weights"]
    # position inside the document with segment ids (the model's own positions), else in the row
    pos = np.asarray(default_positions(*w.shape, *seg))
    np.add.at(total, pos.ravel(), (nll * w).ravel())
    np.add.at(count, pos.ravel(), np.asarray(w, np.float64).ravel())
  mean = np.where(count > 0, total / np.where(count > 0, count, 1.0), np.nan)
  return (mean, count) if return_count else mean


def bucketize(per_position: np.ndarray, width: int) -> list[tuple[int, int, float]]:
  """[(start, end, mean)] over consecutive buckets of `width` positions (last may be shorter)."""
  out = []
  for s in range(0, len(per_position), width):
    chunk = per_position[s:s + width]
    seen = chunk[~np.isnan(chunk)]  # positions no token reached (document-masked runs) are NaN
    out.append((s, s + len(chunk), float(seen.mean()) if len(seen) else float("nan")))
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

def parse_force_layers(values: list[str], mode: str) -> list[int]:
  """--force_key_layers as layer indices; only --mode=blocks runs the intervention."""
  if values and mode != "blocks":
    raise ValueError(f"--force_key_layers is a --mode=blocks intervention, not for --mode={mode}. "
                     "Fix: add --mode=blocks, or drop --force_key_layers.")
  try:
    layers = [int(v) for v in values]
  except ValueError:
    raise ValueError(f"--force_key_layers={','.join(values)}: must be layer indices (e.g. 1 or "
                     "2,3). Fix: pass integers.") from None
  if len(set(layers)) != len(layers):
    raise ValueError(f"--force_key_layers={','.join(values)} repeats a layer. Fix: name each once.")
  return layers


# Which modes read each mode-specific flag: given for another mode it was silently ignored.
MODE_FLAGS = {"lengths": ("needle", "blocks"), "depths": ("needle", "blocks"),
              "samples": ("needle", "blocks"), "seed": ("needle", "blocks"),
              "bucket": ("position",), "batches": ("position",), "val_seed": ("position",)}
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def check_mode_flags(mode: str, given: set[str], out: str):
  """Refuses flags of another mode (they were ignored while the defaults ran) and, before any
  evaluation, an --out the plot cannot be written to (a .json failed after the whole grid)."""
  stray = sorted(f for f in given if f in MODE_FLAGS and mode not in MODE_FLAGS[f])
  if stray:
    raise ValueError(f"{', '.join('--' + f for f in stray)} not used by --mode={mode} (they belong "
                     f"to {', '.join(sorted({m for f in stray for m in MODE_FLAGS[f]}))}). Fix: "
                     "drop them, or pick the mode they are for.")
  if mode != "blocks" and os.path.splitext(out)[1].lower() not in IMAGE_SUFFIXES:
    raise ValueError(f"--out={out}: the {mode} plot needs an image name ({', '.join(IMAGE_SUFFIXES)};"
                     " the numbers go to a .json beside it). Fix: e.g. --out=needle.png")


def check_run_flags(n_runs: int, labels: list[str], labels_given: bool, **counts):
  """One label per run, no two alike (results and plots are keyed by label: a short or repeated
  list silently dropped runs), and every count flag (samples, bucket, batches) at least 1."""
  if labels_given and len(labels) != n_runs:
    raise ValueError(f"--labels has {len(labels)} entries for {n_runs} --workdirs. Fix: give one "
                     "label per workdir, in the same order (or leave --labels out).")
  repeated = sorted({label for label in labels if labels.count(label) > 1})
  if repeated:
    raise ValueError(f"labels {repeated} name more than one run (each run's results are stored "
                     "under its label). Fix: pass --labels with a distinct name per workdir.")
  for name, value in counts.items():
    if value < 1:
      raise ValueError(f"--{name}={value}: must be at least 1. Fix: pass a positive --{name}.")


def main(argv):
  del argv
  from experiments.cli import quiet_libraries
  quiet_libraries()
  from experiments.trained_model import jit_logits, load_model, resolve_workdir, val_batches
  check_mode_flags(_MODE.value, {name for name in MODE_FLAGS if flags.FLAGS[name].present},
                   _OUT.value)
  specs = [resolve_workdir(w) for w in _WORKDIRS.value]
  labels = _LABELS.value or [label for _, label, _ in specs]
  check_run_flags(len(specs), labels, bool(_LABELS.value),
                  samples=_SAMPLES.value, bucket=_BUCKET.value, batches=_BATCHES.value)
  force = parse_force_layers(_FORCE.value, _MODE.value)
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
    from experiments.trained_model import jit_logits_and_blocks
    lengths = [int(x) for x in _LENGTHS.value]
    depths = [float(x) for x in _DEPTHS.value]
    grids = []
    for (workdir, _, step), label in zip(specs, labels):
      model, _, model_cfg = load_model(workdir, max_seq_len=max(lengths), step=step)
      if "nsa" not in model_cfg.attention_kinds:  # a dense twin: its attention on the digits
        if force:
          raise ValueError(f"{label}: --force_key_layers needs NSA layers; this run is dense. "
                           "Fix: score dense runs in a call without --force_key_layers.")
        grid = dense_grid(jit_logits_and_blocks(model), lengths, depths, _SAMPLES.value,
                          _SEED.value)
        results[label] = dict(grid, workdir=workdir, step=step, attention="dense")
        print(f"{label} (dense): per cell exact, digit accuracy, best head's mass on the digit by "
              "layer for right / wrong digits")
        for c in grid["cells"]:
          print(f"  {c['length']:5d} {c['depth']:4.2f}: exact {c['exact']:.3f} digits "
                f"{c['digit_acc']:.3f} mass right {c['mass_right']} wrong {c['mass_wrong']}")
        print(f"  all digits: {grid['digits_right']} right, mass {grid['mass_right']}; "
              f"{grid['digits_wrong']} wrong, mass {grid['mass_wrong']}")
        continue
      if "slc" not in model_cfg.nsa.branches:
        raise ValueError(f"{workdir}: --mode=blocks needs the selection branch (this model's "
                         f"NSA branches: {model_cfg.nsa.branches}). Fix: pass a run with 'slc'")
      nsa = model_cfg.nsa
      fn = jit_logits_and_blocks(model)
      if force:  # the intervention: those layers hold the key's blocks at the answer queries
        forced = jit_logits_and_blocks(model, force, functools.partial(force_key_blocks, nsa=nsa))
        fn = lambda tokens, forced=forced, nsa=nsa: forced(  # noqa: E731
            tokens, key_positions(np.asarray(tokens), nsa.sel_block))
        print(f"{label}: layers {force} hold the key's blocks at the answer queries (forced)")
      grid = block_grid(fn, nsa, lengths, depths, _SAMPLES.value, _SEED.value)
      results[label] = dict(grid, workdir=workdir, step=step, num_selected=nsa.num_selected,
                            force_key_layers=force)
      grids.append(grid)
      print(f"{label}: n={model_cfg.nsa.num_selected}, l'={model_cfg.nsa.sel_block}, "
            f"w={model_cfg.nsa.window}; per cell: exact, digit accuracy, held (selection-reach "
            "digits whose block was selected), digit reach (w/f/s shares), straddling share, "
            "key blocks (first example), coverage by layer")
      for c in grid["cells"]:
        r = c["reach"]
        held = "  -  " if c["held"] is None else f"{c['held']:.2f}"
        print(f"  {c['length']:5d} {c['depth']:4.2f}: exact {c['exact']:.3f} digits "
              f"{c['digit_acc']:.3f} held {held} reach {r['window']:.2f}/{r['forced']:.2f}/"
              f"{r['selection']:.2f} straddling {c['straddling']:.2f} blocks {c['key_blocks']} "
              "coverage " + " ".join(f"{v:.2f}" for v in c["coverage_by_layer"]))
      hv = grid["held_vs_correct"]
      print(f"  digits only a chosen block reaches: {hv['digits']}; right {hv['held_right']} / "
            f"wrong {hv['held_wrong']} where the selection held the digit's block, right "
            f"{hv['missed_right']} / wrong {hv['missed_wrong']} where it missed it; where held, "
            f"by layer: selection gate right {hv['slc_gate_held_right']} / wrong "
            f"{hv['slc_gate_held_wrong']}, largest head mass on the digit right "
            f"{hv['slc_mass_held_right']} / wrong {hv['slc_mass_held_wrong']}, over right "
            f"{hv['held_right_by_layer']} / wrong {hv['held_wrong_by_layer']} digits; share of "
            f"KV groups holding the block by layer: right {hv['groups_right_by_layer']} / wrong "
            f"{hv['groups_wrong_by_layer']}; share "
            "right by layer where that layer held / missed the block: "
            + ", ".join(f"L{j} {_pct(a)} / {_pct(b)}" for j, (a, b) in enumerate(zip(
                hv["p_right_if_held_by_layer"], hv["p_right_if_missed_by_layer"]))))
    if grids:
      plot_blocks(grids, [l for l in labels if results[l].get("attention") != "dense"],
                  os.path.splitext(_OUT.value)[0] + ".png")
  else:
    curves = []
    for (workdir, _, step), label in zip(specs, labels):
      model, config, _ = load_model(workdir, step=step)
      if _VAL_SEED.value >= 0:
        config.data.seed = _VAL_SEED.value
      batches = val_batches(config, _BATCHES.value)
      per_pos, counts = position_nll(jit_logits(model), batches, return_count=True)
      buckets = bucketize(per_pos, _BUCKET.value)
      curves.append(buckets)
      tokens = sum(float(b["weights"].sum()) for b in batches)
      seen = counts > 0
      mean = float((per_pos[seen] * counts[seen]).sum() / counts[seen].sum())  # token-weighted
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
