"""Frozen, hashable configuration dataclasses.

They are static at jit boundaries: every field is a plain Python value, so a
config can be a `static_argnums` argument or a closure constant.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax.numpy as jnp

FAMILIES = ("qwen3", "llama", "qwen2")


def _shipped_configs() -> Path:
    # A wheel carries configs/ as taps_jax/configs (pyproject's package-dir mapping); a source tree or an
    # editable install reads the repository's top-level configs/.
    here = Path(__file__).resolve().parent
    return here / "configs" if (here / "configs").is_dir() else here.parent / "configs"


# The shipped settings: train/ (training presets), published/ (published model configs, for decode.rehearse).
CONFIGS_DIR = _shipped_configs()


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class RopeFactors:
    """Per-frequency RoPE factors, as llama.cpp stores them (a GGUF's `rope_freqs.weight` tensor).

    Frequency i runs at theta^(-2i/head_dim) / factors[i], llama.cpp's rule:
    these factors are what runs. `llama3` is a Llama-3 scaling that gives
    the same factors (from the file's keys or an exact fit), kept to write a
    Hugging Face config and to show; None when none does.
    """

    factors: tuple[float, ...]
    llama3: RopeScaling | None = None

    def __post_init__(self):
        # A tuple of Python floats keeps the config hashable (a static jit argument).
        object.__setattr__(self, "factors", tuple(float(x) for x in self.factors))
        if not self.factors:
            raise ValueError("rope factors are empty; give one per frequency (head_dim / 2)")
        bad = [(i, x) for i, x in enumerate(self.factors) if not (math.isfinite(x) and x > 0)]
        if bad:
            raise ValueError(f"rope factor {bad[0][0]} is {bad[0][1]!r}; every factor must be positive and finite")


def llama3_rope(scaling, whose: str, then: str) -> RopeScaling | None:
    """The rope a config.json records for `scaling`: Llama-3 scaling (per-frequency factors as their Llama-3
    equivalent), or None for plain rope. ValueError (`whose` factors ..., `then`) when the factors follow no
    Llama-3 rule: a Hugging Face or DFlash config.json can hold no other per-frequency factors."""
    if not isinstance(scaling, RopeFactors):
        return scaling
    if scaling.llama3 is None:
        raise ValueError(f"{whose} rope factors (a GGUF's rope_freqs.weight) follow no Llama-3 rope scaling, and a "
                         f"config.json can hold no other per-frequency factors; {then}")
    return scaling.llama3


def check_rope(scaling, head_dim: int, what: str) -> None:
    """ValueError when per-frequency rope factors do not number head_dim / 2."""
    if isinstance(scaling, RopeFactors) and len(scaling.factors) != head_dim // 2:
        raise ValueError(f"{what} has {len(scaling.factors)} rope factors, but head_dim {head_dim} has "
                         f"{head_dim // 2} frequencies")


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
    rope_scaling: RopeScaling | RopeFactors | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"  # parameter and activation dtype; logits are float32

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings")
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}; fix the model config")
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
        check_rope(self.rope_scaling, self.head_dim, "the model")

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


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash-style block-diffusion drafter (Qwen3-style layers, no embedding or head).

    It reads the target's tap features (the OUTPUTS of `target_layer_ids`)
    and the target's token embeddings, so its width must equal the target's.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # Kb; the drafter proposes H = block_size - 1 tokens per round
    mask_token_id: int  # a row of the TARGET's embedding table
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose outputs are tapped
    num_target_layers: int
    vocab_size: int
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | RopeFactors | None = None
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"  # parameter and activation dtype
    # K: the drafter's logits cover only K target ids (its `draft_vocab` buffer, saved with the weights);
    # None: the whole vocabulary (published DFlash drafters). Trees and verification stay in the full vocabulary.
    draft_vocab_size: int | None = None

    def __post_init__(self):
        # Tuples keep the config hashable (a list from JSON would not be).
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        sizes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "num_target_layers", "vocab_size")
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"drafter {name} must be a positive integer, got {value!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(
                f"drafter block_size must be an integer >= 2 (one anchor plus at least one drafted "
                f"position), got {self.block_size!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"drafter num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"drafter head_dim must be even for RoPE, got {self.head_dim}")
        check_rope(self.rope_scaling, self.head_dim, "the drafter")
        if not self.target_layer_ids:
            raise ValueError("drafter target_layer_ids is empty; name at least one target layer to tap")
        bad = [i for i in self.target_layer_ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(f"drafter target_layer_ids must be non-negative integers, got {bad}")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"drafter target_layer_ids has duplicates: {list(self.target_layer_ids)}")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise ValueError(f"drafter mask_token_id must be a non-negative integer, got {self.mask_token_id!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        K = self.draft_vocab_size
        if K is not None and (isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= self.vocab_size):
            raise ValueError(f"drafter draft_vocab_size must be an integer in [1, vocab_size={self.vocab_size}] "
                             f"(or None for the whole vocabulary), got {K!r}")

    @property
    def num_drafted(self) -> int:
        """H: positions proposed per round (block slot 0 is the anchor)."""
        return self.block_size - 1

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **kwargs) -> "DrafterConfig":
        return dataclasses.replace(self, **kwargs)

    def check_target(self, target: ModelConfig) -> None:
        """Raise ValueError if this drafter cannot run on `target`."""
        if self.hidden_size != target.hidden_size:
            raise ValueError(
                f"drafter hidden_size={self.hidden_size} differs from the target's hidden_size="
                f"{target.hidden_size}; the drafter consumes the target's embeddings and tap "
                f"features, so use a drafter trained for this target"
            )
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"drafter vocab_size={self.vocab_size} differs from the target's vocab_size="
                f"{target.vocab_size}; use a drafter trained for this target"
            )
        too_deep = [i for i in self.target_layer_ids if i >= target.num_layers]
        if too_deep:
            raise ValueError(
                f"drafter target_layer_ids {too_deep} do not exist in the target, which has "
                f"{target.num_layers} layers (ids 0..{target.num_layers - 1}); use a drafter "
                f"trained for this target"
            )
        if self.num_target_layers != target.num_layers:
            raise ValueError(
                f"drafter was trained for a target with num_target_layers={self.num_target_layers}, "
                f"but this target has {target.num_layers} layers; use a drafter trained for this target"
            )
        if self.mask_token_id >= target.vocab_size:
            raise ValueError(
                f"drafter mask_token_id={self.mask_token_id} is outside the target's embedding table "
                f"(vocab_size={target.vocab_size}); fix dflash_config.mask_token_id"
            )
