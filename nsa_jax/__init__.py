"""nsa_jax: Native Sparse Attention (Yuan et al., ACL 2025) in JAX and Flax NNX."""

from nsa_jax.config import ModelConfig, NSAConfig

__all__ = ["ModelConfig", "NSAConfig"]
__version__ = "0.1.0"
