"""Training: sharded train loop, data, optimizer, orbax checkpoints, metrics and plots.

Entry point: nsa_jax.training.train.train_and_evaluate(config, workdir); the command line is
experiments/train.py. Configs live in configs/ (ml_collections).
"""
