"""Prefill and the stop rules shared by the AR and speculative loops."""

from __future__ import annotations

import jax.numpy as jnp

from taps_jax.models.cache import KVCache
from taps_jax.models.transformer import Transformer, causal_mask

# Per-sequence finish reasons (int32 codes carried in the loop state).
RUNNING, EOS, LENGTH, CAPACITY = 0, 1, 2, 3
FINISH_NAMES = {RUNNING: "running", EOS: "eos", LENGTH: "length", CAPACITY: "capacity"}


def prefill(model: Transformer, prompt_BT, prompt_len_B, capacity: int, taps: tuple[int, ...] = ()):
    """Run right-padded prompts through a fresh cache.

    Returns (logits [B, V] at each prompt's last token, tap features of the
    prompt [B, T, n*D] or None, cache with lengths = prompt_len).
    """
    B, T = prompt_BT.shape
    cache = KVCache.zeros(model.config, B, capacity)
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    last_B1 = (prompt_len_B - 1)[:, None]
    logits_B1V, taps_BTF, cache = model(
        prompt_BT, positions_BT, causal_mask(prompt_len_B, T), cache, taps, logits_index_BI=last_B1
    )
    return logits_B1V[:, 0], taps_BTF, cache.replace(lengths_B=prompt_len_B.astype(jnp.int32))


def stop_reason(token_B, generated_B, length_after_B, eos_ids: tuple[int, ...], max_new_tokens: int, capacity: int):
    """Finish reason after emitting `token_B` (RUNNING if the sequence goes on).

    length_after_B is the cache length needed to process one more token.
    """
    is_eos = jnp.isin(token_B, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros_like(token_B, bool)
    return jnp.where(
        is_eos, EOS,
        jnp.where(generated_B >= max_new_tokens, LENGTH,
                  jnp.where(length_after_B > capacity, CAPACITY, RUNNING)),
    ).astype(jnp.int32)
