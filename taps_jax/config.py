"""Frozen, hashable configuration dataclasses.

They are static at jit boundaries: every field is a plain Python value, so a
config can be a `static_argnums` argument or a closure constant.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

FAMILIES = ("qwen3", "llama", "qwen2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of the Qwen3 / Llama 3 / Qwen2 families."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    family: str = "qwen3"
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"  # parameter and activation dtype; logits are float32

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(
                f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises queries and keys per head."""
        return self.family == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 has biases on the q/k/v projections."""
        return self.family == "qwen2"

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **kwargs) -> "ModelConfig":
        return dataclasses.replace(self, **kwargs)
