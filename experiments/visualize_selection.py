"""What NSA selects: for a trained model and a real validation input, the selection blocks each
query chose (per layer and KV group) and the branch gates, as one PNG plus a text listing.

  python -m experiments.visualize_selection --workdir=runs/ablate/nsa_vs_dense:nsa \
      --row=0 --out=docs/figures/selection.png

Map colours: grey = not visible (block starts after the query, or, in a document-masked run,
lies wholly before the query's document), light blue = forced block (1 initial + 2 local, counted
inside n; the initial one is the query's document's first), dark red = chosen by the score (top-n), white = visible
but not chosen. The .txt beside the PNG lists, for a few queries, the text of the blocks chosen by
score, so one can read whether the choice makes sense (matching identifiers, the open bracket...).
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

_WORKDIR = None
_ROW = None
_OUT = None
_QUERIES = None
_STAT_ROWS = None


def define_flags():
  """Command-line flags; defined only when run as a script, so that importing this module
  (tests, other scripts) never defines absl flags twice."""
  global _WORKDIR, _ROW, _OUT, _QUERIES, _STAT_ROWS
  _WORKDIR = flags.DEFINE_string("workdir", None, "NSA run: workdir or SWEEP_OUT_DIR:RUN, optional @STEP for that checkpoint")
  _ROW = flags.DEFINE_integer("row", 0, "which validation sequence (row of batch 0, 1, ...)")
  _OUT = flags.DEFINE_string("out", "docs/figures/selection.png", "PNG path (.txt written beside)")
  _QUERIES = flags.DEFINE_integer("queries", 6, "queries listed in the .txt")
  _STAT_ROWS = flags.DEFINE_integer("stat_rows", 8, "validation rows for the n-gram statistic")

NOT_VISIBLE, VISIBLE, FORCED, CHOSEN = 0, 1, 2, 3


def selection_map(block_idx: np.ndarray, sel_block: int, num_init: int, num_local: int,
                  segment_ids=None):
  """block_idx [T, n] (-1 = empty) -> [T, num_blocks] codes (NOT_VISIBLE/VISIBLE/FORCED/CHOSEN).

  segment_ids [T] (a document-masked run's row; None: one document): as in the model, a query sees
  only the blocks that overlap its own document (a contiguous run of one id), and its forced
  initial blocks are its document's first ones, from floor(doc_start / l')."""
  t_len = block_idx.shape[0]
  nb = -(-t_len // sel_block)
  start = np.zeros(t_len, int)  # each query's document start
  if segment_ids is not None:
    from nsa_jax.reference import document_starts
    start = np.asarray(document_starts(np.asarray(segment_ids).reshape(1, t_len)))[0]
  t = np.arange(t_len)[:, None]
  j = np.arange(nb)[None, :]
  first = start[:, None] // sel_block
  codes = np.where((j * sel_block <= t) & (j >= first), VISIBLE, NOT_VISIBLE)
  for q in range(t_len):
    for b in block_idx[q]:
      if b >= 0:
        codes[q, b] = CHOSEN
  cur = t // sel_block
  forced = ((j >= first) & (j < first + num_init)) | ((j <= cur) & (j > cur - num_local))
  codes = np.where((codes == CHOSEN) & forced, FORCED, codes)
  return codes


def chosen_distances(codes: np.ndarray, sel_block: int) -> np.ndarray:
  """Distance in blocks from each query's block back to each block it chose by score."""
  out = []
  for q, row in enumerate(codes):
    for b in np.flatnonzero(row == CHOSEN):
      out.append(q // sel_block - b)
  return np.asarray(out, dtype=int)


def ngram_overlap(tokens: np.ndarray, codes: np.ndarray, sel_block: int, ngram: int = 4,
                  context: int = 32) -> tuple[float, float, int]:
  """Does selection find related text? For each query t and each block chosen by score: the share
  of the n-grams of the query's last `context` tokens that also occur in the block; compared with
  the same share averaged over every block the query could have chosen instead (visible, not
  forced), i.e. the expectation of a uniformly random choice. Returns (chosen, random, count)."""
  def grams(seq):
    return {bytes(seq[i:i + ngram]) for i in range(len(seq) - ngram + 1)}
  tok = tokens.astype(np.uint8)
  block_grams = [grams(tok[b * sel_block:(b + 1) * sel_block]) for b in range(codes.shape[1])]
  chosen, rand = [], []
  for t, row in enumerate(codes):
    picks = np.flatnonzero(row == CHOSEN)
    pool = np.flatnonzero((row == CHOSEN) | (row == VISIBLE))
    if not len(picks) or not len(pool):
      continue
    q = grams(tok[max(0, t + 1 - context):t + 1])
    if not q:
      continue
    share = {b: len(q & block_grams[b]) / len(q) for b in pool}
    chosen += [share[b] for b in picks]
    rand.append(np.mean([share[b] for b in pool]))
  return float(np.mean(chosen)), float(np.mean(rand)), len(chosen)


def describe_queries(tokens: np.ndarray, codes: np.ndarray, sel_block: int, count: int) -> str:
  """Text of the blocks chosen by score for `count` queries spread over the second half."""
  def text(a, b):
    return bytes(tokens[a:b].astype(np.uint8)).decode("utf-8", "replace").replace("\n", "\\n")
  lines = []
  t_len = len(tokens)
  for q in np.linspace(t_len // 2, t_len - 1, count).astype(int):
    lines.append(f"query t={q}: ...{text(max(0, q - 40), q + 1)!s}")
    for b in np.flatnonzero(codes[q] == CHOSEN):
      lines.append(f"  chose block {b} [{b * sel_block}, {(b + 1) * sel_block}): "
                   f"{text(b * sel_block, (b + 1) * sel_block)}")
  return "\n".join(lines) + "\n"


def plot(codes_by_layer, gates_by_layer, out: str, title: str):
  """codes_by_layer: list over NSA layers of [K, T, nb]; gates: list of [T, H, 3]."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.colors import ListedColormap
  cmap = ListedColormap(["#d9d9d9", "#ffffff", "#9ecae1", "#a50f15"])
  n_layers = len(codes_by_layer)
  n_groups = codes_by_layer[0].shape[0]
  fig, axes = plt.subplots(n_layers, n_groups + 1, figsize=(3.2 * (n_groups + 1) + 1,
                                                             3.6 * n_layers), squeeze=False)
  for li, (codes, gates) in enumerate(zip(codes_by_layer, gates_by_layer)):
    for k in range(n_groups):
      ax = axes[li, k]
      ax.imshow(codes[k], cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
      ax.set(title=f"layer {li}, KV group {k}: blocks per query", xlabel="selection block j",
             ylabel="query position t")
      ax.xaxis.get_major_locator().set_params(integer=True)
    ax = axes[li, n_groups]
    pos = np.arange(gates.shape[0])
    for c, name in enumerate(("compression", "selection", "window")):
      g = gates[:, :, c]
      ax.plot(pos, g.mean(1), color=f"C{c}", lw=1, label=f"{name} (mean {g.mean():.2f})")
      ax.fill_between(pos, g.min(1), g.max(1), color=f"C{c}", alpha=0.15)
    ax.set(title=f"layer {li}: gates (mean, range over heads)", xlabel="query position t",
           ylim=(0, 1))
    ax.legend(fontsize=7)
  from matplotlib.patches import Patch
  fig.legend(handles=[Patch(color=c, label=n) for c, n in zip(
      cmap.colors, ("not visible", "visible, not chosen", "forced (initial/local)", "chosen by score"))],
      loc="lower center", ncol=4, fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)


def overlap_report(model, config, nsa, rows: int) -> str:
  """ngram_overlap over the first `rows` validation rows, per NSA layer (KV group 0)."""
  import jax.numpy as jnp
  from experiments.trained_model import forward_with_aux, val_batches
  per = config.data.global_batch_size
  batches = val_batches(config, -(-rows // per))
  tokens = np.concatenate([b["inputs"] for b in batches])[:rows]
  segs = (np.concatenate([b["segment_ids"] for b in batches])[:rows]
          if "segment_ids" in batches[0] else None)  # a document-masked run's own documents
  stats = {}
  for r in range(rows):
    _, auxes = forward_with_aux(model, jnp.asarray(tokens[r:r + 1]),
                                None if segs is None else jnp.asarray(segs[r:r + 1]))
    for li, aux in enumerate(auxes):
      if aux is None or "block_idx" not in aux:
        continue
      codes = selection_map(np.asarray(aux["block_idx"])[0, :, 0], nsa.sel_block,
                            nsa.num_init_blocks, nsa.num_local_blocks,
                            None if segs is None else segs[r])
      c, rnd, n = ngram_overlap(tokens[r], codes, nsa.sel_block)
      stats.setdefault(li, []).append((c, rnd, n))
  lines = [f"== 4-gram overlap of the query's last 32 tokens with the block chosen by score vs a "
           f"random eligible block, {rows} validation rows:"]
  for li, vals in stats.items():
    c, rnd, n = (np.array(v) for v in zip(*vals))
    lines.append(f"  layer {li}: chosen {np.average(c, weights=n):.3f}, random {rnd.mean():.3f} "
                 f"(ratio {np.average(c, weights=n) / max(rnd.mean(), 1e-9):.2f}, "
                 f"{int(n.sum())} choices)")
  return "\n".join(lines)


def main(argv):
  del argv
  import jax
  from experiments.cli import quiet_libraries
  quiet_libraries()
  from experiments.trained_model import forward_with_aux, load_model, resolve_workdir, val_batches
  if _ROW.value < 0 or _STAT_ROWS.value < 1:
    raise ValueError(f"--row={_ROW.value} / --stat_rows={_STAT_ROWS.value}: need a row >= 0 and "
                     "at least 1 statistic row. Fix: e.g. --row=0 --stat_rows=8")
  workdir, label, step = resolve_workdir(_WORKDIR.value)
  model, config, model_cfg = load_model(workdir, step=step)
  per_batch = config.data.global_batch_size
  batch = val_batches(config, _ROW.value // per_batch + 1)[-1]
  tokens = batch["inputs"][_ROW.value % per_batch][None]
  seg = batch.get("segment_ids")  # a document-masked run sees its documents apart, as in training
  seg = None if seg is None else jax.numpy.asarray(seg[_ROW.value % per_batch][None])
  _, auxes = forward_with_aux(model, jax.numpy.asarray(tokens), seg)  # eager: no compile
  nsa = model_cfg.nsa
  codes_by_layer, gates_by_layer, report = [], [], []
  for li, aux in enumerate(auxes):
    if aux is None or "block_idx" not in aux:
      continue
    idx = np.asarray(aux["block_idx"])[0]  # [T, K, n]
    codes = np.stack([selection_map(idx[:, k], nsa.sel_block, nsa.num_init_blocks,
                                    nsa.num_local_blocks, None if seg is None else seg[0])
                      for k in range(idx.shape[1])])
    gates = np.asarray(aux["gates"])[0]
    codes_by_layer.append(codes)
    gates_by_layer.append(gates)
    dist = chosen_distances(codes[0], nsa.sel_block)
    report.append(f"== layer {li}: mean gates (cmp, slc, win) = "
                  f"{[round(float(g), 3) for g in gates.mean((0, 1))]}; blocks chosen by score: "
                  f"{len(dist)}, distance back in blocks: median {np.median(dist) if len(dist) else 'n/a'}"
                  f", histogram {np.bincount(dist).tolist() if len(dist) else []}")
    report.append(describe_queries(np.asarray(tokens[0]), codes[0], nsa.sel_block, _QUERIES.value))
  report.append(overlap_report(model, config, nsa, _STAT_ROWS.value))
  if not codes_by_layer:
    raise ValueError(f"{workdir} has no NSA layer with a selection branch: nothing to draw")
  title = (f"{label}: validation row {_ROW.value}, T={tokens.shape[1]}, l'={nsa.sel_block}, "
           f"n={nsa.num_selected} ({nsa.num_init_blocks} initial + {nsa.num_local_blocks} local forced)")
  plot(codes_by_layer, gates_by_layer, _OUT.value, title)
  with open(os.path.splitext(_OUT.value)[0] + ".txt", "w") as f:
    f.write(title + "\n" + "\n".join(report))
  print("\n".join(report[:1] + report[2:3] + report[-1:]))
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  from experiments.cli import one_line_errors, parse_flags
  define_flags()
  flags.mark_flags_as_required(["workdir"])  # a missing one: one line, not the usage
  app.run(one_line_errors(main), flags_parser=parse_flags)
