"""Optimizer: AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(cfg, total_steps: int) -> optax.Schedule:
  """Linear warmup to cfg.learning_rate, then cosine down to min_lr_ratio * peak."""
  total = max(int(total_steps), 1)
  warmup = min(int(cfg.warmup_steps), total)
  return optax.warmup_cosine_decay_schedule(
      # Start one warmup increment above zero so the very first update already moves the weights.
      init_value=cfg.learning_rate / (warmup + 1), peak_value=cfg.learning_rate, warmup_steps=warmup,
      decay_steps=max(total, warmup + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)


def _decay_mask(params):
  # Weight decay on matrices only: norms, biases and other vectors are scale parameters whose
  # decay toward zero hurts and buys no regularisation.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """cfg: the config's `optim` block (learning_rate, warmup_steps, ...); total_steps: run length."""
  schedule = learning_rate_schedule(cfg, total_steps)
  tx = optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  mask=_decay_mask))
  return tx, schedule
