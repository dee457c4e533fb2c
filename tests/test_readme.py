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


def test_setup_refuses_an_unsuitable_nsa_python_with_the_reason(tmp_path):
  """NSA_PYTHON names the interpreter to use: one below 3.12, or a missing path, is refused with
  the reason (it was skipped silently and another interpreter searched for)."""
  import shutil
  import subprocess
  for name in ("scripts", "requirements.txt", "pyproject.toml"):
    src = os.path.join(ROOT, name)
    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, tmp_path / name)
  fake = tmp_path / "python3.11"  # answers like a Python 3.11
  fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Python 3.11.2'; exit 0; fi\n"
                  "exit 1\n")
  fake.chmod(0o755)
  for value, why in ((str(fake), "(Python 3.11.2)"), (str(tmp_path / "nope"), "(not found)")):
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, NSA_PYTHON=value), timeout=60)
    assert r.returncode == 1 and f"NSA_PYTHON={value} is not a Python >= 3.12 {why}" in r.stderr, (
        r.stdout, r.stderr)
    assert not (tmp_path / ".venv").exists()
