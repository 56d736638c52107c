"""taps-jax: tree-verified speculative decoding for JAX."""

from taps_jax.api import GenerateResult, Target, load_target
from taps_jax.checkpoints.scorer import ScorerModel, load_scorer
from taps_jax.config import ModelConfig, RopeScaling
from taps_jax.engine.sampling import SamplingConfig

__all__ = [
    "GenerateResult", "ModelConfig", "RopeScaling", "SamplingConfig", "ScorerModel", "Target", "load_scorer",
    "load_target",
]
