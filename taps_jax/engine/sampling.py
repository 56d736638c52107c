"""Target-side sampling: temperature, top-k and top-p applied to the target alone."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits_XV, config: SamplingConfig):
    """Logits after temperature, top-k and top-p; removed tokens get -inf."""
    logits_XV = logits_XV.astype(jnp.float32) / config.temperature
    if 0 < config.top_k < logits_XV.shape[-1]:  # top_k >= vocab keeps everything
        kth_X1 = jax.lax.top_k(logits_XV, config.top_k)[0][..., -1:]
        logits_XV = jnp.where(logits_XV < kth_X1, -jnp.inf, logits_XV)
    if config.top_p < 1.0:
        sorted_XV = jnp.sort(logits_XV, axis=-1)[..., ::-1]
        probs_XV = jax.nn.softmax(sorted_XV, axis=-1)
        # Keep a token while the mass before it is < top_p (the top one always stays).
        before_XV = jnp.cumsum(probs_XV, axis=-1) - probs_XV
        keep_XV = before_XV < config.top_p
        cutoff_X1 = jnp.min(jnp.where(keep_XV, sorted_XV, jnp.inf), axis=-1, keepdims=True)
        logits_XV = jnp.where(logits_XV < cutoff_X1, -jnp.inf, logits_XV)
    return logits_XV


def sample(logits_XV, key, config: SamplingConfig):
    """One token per leading index: argmax when greedy, else a filtered sample."""
    if config.greedy:
        return jnp.argmax(logits_XV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits_XV, config), axis=-1).astype(jnp.int32)
