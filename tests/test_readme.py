"""The README's "Use it in your own model" code block runs as written (a user copies it first)."""

import os
import re

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(heading: str) -> str:
  text = open(os.path.join(ROOT, "README.md")).read()
  section = text.split(heading, 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_use_it_in_your_own_model_block_runs_as_written():
  env = {}
  exec(compile(readme_block("## Use it in your own model"), "README.md", "exec"), env)  # noqa: S102
  cfg, t = env["cfg"], env["T"]
  assert env["y"].shape == env["x"].shape
  assert env["aux"]["block_idx"].shape == (1, t, cfg.num_kv_heads, cfg.num_selected)
  assert env["o"].shape == (1, t, cfg.num_heads, cfg.dim_v)
  assert env["logits"].shape == env["tokens"].shape + (env["lm"].cfg.vocab_size,)
  for name in ("y", "o", "logits"):
    assert np.all(np.isfinite(np.asarray(env[name], np.float32))), name
