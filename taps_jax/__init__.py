"""taps-jax: tree-verified speculative decoding for JAX."""

from taps_jax.api import GenerateResult, Target, load_target
from taps_jax.config import ModelConfig, RopeScaling
from taps_jax.engine.sampling import SamplingConfig

__all__ = ["GenerateResult", "ModelConfig", "RopeScaling", "SamplingConfig", "Target", "load_target"]
