"""Runnable experiments (entry points over the nsa_jax library)."""
