"""What the user sees: JSONL + TensorBoard metrics, a tqdm progress bar, tokens/s and MFU.

Only process 0 writes files or draws the bar; other processes get no-op writers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import numpy as np

# Dense bf16 peak FLOP/s per chip (vendor datasheets, no sparsity). MFU is "not available" for
# devices not listed unless config.train.peak_tflops is set.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "TPU v4": 275.0,
                "TPU v5 lite": 197.0, "TPU v5p": 459.0, "TPU v6": 918.0}


def peak_flops_per_device(override_tflops: float = 0.0) -> float | None:
  if override_tflops:
    return override_tflops * 1e12
  kind = jax.devices()[0].device_kind
  for name, tflops in _PEAK_TFLOPS.items():
    if name.lower() in kind.lower():
      return tflops * 1e12
  return None


def peak_memory_gb() -> float | None:
  """Peak bytes in use on this process's first device (None where the backend does not say)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 2**30


def _mean_keys(seq_len: int, per_query) -> float:
  t = np.arange(1, seq_len + 1)
  return float(np.mean(per_query(t)))


def attention_keys_per_query(model_cfg, seq_len: int) -> list[float]:
  """Mean keys each query attends to, per layer, for a causal sequence of seq_len tokens.

  NSA counts what it computes: compressed blocks + selected tokens + window, not the dense T/2.
  """
  out = []
  for kind in model_cfg.attention_kinds:
    if kind == "dense":
      out.append(_mean_keys(seq_len, lambda t: t))
      continue
    nsa = model_cfg.nsa
    keys = 0.0
    if "cmp" in nsa.branches:
      keys += _mean_keys(seq_len, lambda t: np.maximum((t - nsa.cmp_block) // nsa.cmp_stride + 1, 0))
    if "slc" in nsa.branches:
      keys += _mean_keys(seq_len, lambda t: np.minimum(nsa.num_selected * nsa.sel_block, t))
    if "win" in nsa.branches:
      keys += _mean_keys(seq_len, lambda t: np.minimum(nsa.window, t))
    out.append(keys)
  return out


def train_flops_per_token(model_cfg, matmul_params: float, seq_len: int) -> float:
  """6 * (matmul parameters) + attention scores and values, forward + backward (x3)."""
  per_key = 2 * model_cfg.n_heads * (model_cfg.head_dim + (model_cfg.head_dim_v or model_cfg.head_dim))
  attention = sum(per_key * k for k in attention_keys_per_query(model_cfg, seq_len))
  return 6.0 * matmul_params + 3.0 * attention


def count_params(params, model_cfg, lookup_table_size: int = 0) -> tuple[int, float]:
  """(all parameters, matmul parameters applied per token).

  Matmul parameters: rank >= 2, minus the input lookup table. NSA's compression MLPs (phi_k,
  phi_v) run once per compressed block and KV head, i.e. n_kv_heads / cmp_stride times per
  token; their intra-block position encoding ("pos") is added, not multiplied.
  """
  total, per_token = 0, -float(lookup_table_size)
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    size = int(np.prod(x.shape))
    total += size
    keys = [str(getattr(k, "key", k)) for k in path]
    if len(x.shape) < 2:
      continue
    if any(k.startswith("phi") for k in keys):
      if keys[-1] != "pos":
        per_token += size * model_cfg.n_kv_heads / model_cfg.nsa.cmp_stride
    else:
      per_token += size
  return total, per_token


class MetricsWriter:
  """Appends {"step": s, **metrics} to <workdir>/metrics.jsonl and to TensorBoard (<workdir>/tb)."""

  def __init__(self, workdir: str, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      self._file = open(self.path, "a", buffering=1)  # line-buffered: tail -f works
      if tensorboard:
        try:
          from tensorboardX import SummaryWriter  # imported lazily: process 0 only
          self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        except ImportError as e:  # say so, keep training: the JSONL file has every number
          logging.getLogger("nsa_jax.training").warning(
              "TensorBoard logging off (%s); pip install tensorboardX to enable it", e)

  def write(self, step: int, metrics: dict, prefix: str = ""):
    if not self.enabled:
      return
    clean = {f"{prefix}{k}": float(v) for k, v in metrics.items()}
    self._file.write(json.dumps({"step": int(step), "time": round(time.time(), 3), **clean}) + "\n")
    if self._tb is not None:
      for k, v in clean.items():
        if math.isfinite(v):
          self._tb.add_scalar(k, v, step)

  def note(self, record: dict):
    """A non-scalar line (run header, final summary)."""
    if self.enabled:
      self._file.write(json.dumps(record, default=str) + "\n")

  def close(self):
    if self.enabled:
      self._file.close()
      if self._tb is not None:
        self._tb.close()


class Throughput:
  """tokens/s and MFU over the steps since the last report (wall clock, host side)."""

  def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops_total: float | None):
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak = peak_flops_total
    self.reset()

  def reset(self):
    self._t0, self._steps = time.perf_counter(), 0

  def tick(self, steps: int = 1):
    self._steps += steps

  def report(self) -> dict:
    dt = max(time.perf_counter() - self._t0, 1e-9)
    tps = self._steps * self.tokens_per_step / dt
    out = {"tokens_per_s": tps, "step_time_s": dt / max(self._steps, 1)}
    if self.peak:
      out["mfu"] = tps * self.flops_per_token / self.peak
    self.reset()
    return out


class Progress:
  """tqdm bar with step, loss, tokens/s and MFU on process 0; without a bar (progress_bar=False,
  e.g. batch jobs) the same numbers are printed as one line per log step."""

  def __init__(self, total: int, initial: int, enabled: bool, echo: bool = True):
    self._bar, self._echo = None, echo
    if enabled and echo:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                       smoothing=0.1)

  def update(self, n: int = 1):
    if self._bar is not None:
      self._bar.update(n)

  def log(self, step: int, **values):
    shown = {k: _fmt(k, v) for k, v in values.items()}
    if self._bar is not None:
      self._bar.set_postfix(shown, refresh=False)
    elif self._echo:
      print(f"step {step}: " + "  ".join(f"{k} {v}" for k, v in shown.items()), flush=True)

  def write(self, msg: str):
    if self._bar is not None:
      self._bar.write(msg)
    elif self._echo:
      print(msg, flush=True)

  def close(self):
    if self._bar is not None:
      self._bar.close()


def _fmt(key, v):
  if key == "mfu":
    return f"{100 * v:.1f}%"
  if key.startswith("tok"):
    return f"{v:,.0f}"
  return f"{v:.4g}" if isinstance(v, float) else v
