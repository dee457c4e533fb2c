"""How far a passkey config's training data asks a model to retrieve, beside the
distances that needle_eval's depths ask for.

  python -m experiments.passkey_distances --config=configs/sweep_needle.py:gpu \
      --rows=2000 --out=docs/results/passkey_distances_gpu

For every scored answer of `rows` training rows: the tokens back to the nearest earlier copy of
its digits (with extra questions, that is usually the previous question, not the fact). Then, for
each evaluation depth at the config's seq_len, the distance that depth asks for and the fraction
of training answers at least that far back. Prints a Markdown table; --out writes it (.md) and
the numbers (.json).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments.cli import one_line_errors, parse_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "passkey config (configs/sweep_needle.py[:gpu])",
                                          lock_config=True)
_ROWS = flags.DEFINE_integer("rows", 2000, "training rows drawn")
_DEPTHS = flags.DEFINE_list("depths", ["0", "0.01", "0.05", "0.25", "0.5", "0.75", "1"],
                            "needle_eval depths to compare with")
_OUT = flags.DEFINE_string("out", None, "path prefix for .md and .json (optional)")


def eval_distance(length: int, depth: float) -> int:
  """The distance needle_eval's example of `length` tokens at `depth` asks for (answer start minus
  key start; the same for every sample, as only the digits vary)."""
  from experiments.needle_eval import FACT_PREFIX, passkey_example
  tokens, key, cut = passkey_example(length, depth, np.random.default_rng(0))
  return (len(tokens) - 5) - (cut + len(FACT_PREFIX))


def summary(distances: np.ndarray, length: int, depths) -> dict:
  qs = [0.5, 0.9, 0.99, 1.0]
  return {
      "answers": int(distances.size),
      "quantiles": {str(q): int(np.quantile(distances, q)) for q in qs},
      "depths": [{"depth": d, "eval_distance": (e := eval_distance(length, d)),
                  "train_fraction_at_least": float((distances >= e).mean()),
                  "train_fraction_at_least_90pct": float((distances >= 0.9 * e).mean())}
                 for d in depths],
  }


def markdown(s: dict, command: str, length: int) -> str:
  q = s["quantiles"]
  lines = [f"Command: `{command}` ({datetime.date.today().isoformat()}, CPU, no model involved)", "",
           f"{s['answers']} scored answers at seq_len {length}: distance back to the nearest earlier "
           f"copy of the key, median {q['0.5']}, 90% {q['0.9']}, 99% {q['0.99']}, max {q['1.0']} tokens.",
           "", "| needle_eval depth | distance it asks for | training answers at least that far | at least 90% of it |",
           "|---|---|---|---|"]
  lines += [f"| {d['depth']:g} | {d['eval_distance']} | {100 * d['train_fraction_at_least']:.2f}% | "
            f"{100 * d['train_fraction_at_least_90pct']:.2f}% |"
            for d in s["depths"]]
  return "\n".join(lines) + "\n"


@one_line_errors
def main(argv):
  del argv
  from nsa_jax.training import data as data_lib
  cfg = _CONFIG.value
  if cfg.data.source != "passkey":
    raise ValueError(f"config.data.source={cfg.data.source!r}: this tool reads passkey data (the "
                     "distances it compares with are needle_eval's passkey examples). Fix: "
                     "--config=configs/sweep_needle.py[:gpu]")
  if _ROWS.value < 1:
    raise ValueError(f"--rows={_ROWS.value}: must be >= 1. Fix: e.g. --rows=2000")
  length = cfg.data.seq_len
  dist = data_lib.retrieval_distances(data_lib.make_sources(cfg.data)["train"], length,
                                      _ROWS.value, cfg.data.seed)
  s = summary(dist, length, [float(d) for d in _DEPTHS.value])
  command = "python -m experiments.passkey_distances " + " ".join(sys.argv[1:])
  text = markdown(s, command, length)
  print(text)
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value + ".md", "w") as f:
      f.write(text)
    with open(_OUT.value + ".json", "w") as f:
      json.dump(dict(s, command=command, seq_len=length, data_config=cfg.data.to_dict()), f, indent=1)
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
