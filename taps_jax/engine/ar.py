"""Autoregressive decoding: the baseline every speedup is measured against.

prefill + ONE `lax.while_loop` feeding one token per step; static shapes,
per-sequence lengths and stop state, no host transfer inside.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from taps_jax.engine.prefill import PREFILL_CHUNK, RUNNING, prefill, stop_reason
from taps_jax.engine.sampling import SamplingConfig, sample
from taps_jax.models.cache import KVCache


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static settings of one generate call (hashable: a jit static argument)."""

    max_new_tokens: int
    capacity: int  # KV-cache slots per sequence (prompt + generated)
    sampling: SamplingConfig = SamplingConfig()
    eos_ids: tuple[int, ...] = ()
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill step


@flax.struct.dataclass
class ARState:
    cache: KVCache
    pending_B: jax.Array  # [B] last sampled token, not yet fed to the target
    out_BN: jax.Array  # [B, max_new_tokens] generated tokens
    generated_B: jax.Array  # [B] tokens emitted so far
    finish_B: jax.Array  # [B] finish reason (RUNNING while going)
    key: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def ar_generate(graphdef, params, prompt_BT, prompt_len_B, active_B, key, *, config: DecodeConfig):
    """Returns (tokens [B, N], generated [B], finish reason [B]).

    active_B marks real sequences; padded batch slots start finished.
    """
    model = nnx.merge(graphdef, params)
    B = prompt_BT.shape[0]
    N = config.max_new_tokens
    logits_BV, _, cache = prefill(model, prompt_BT, prompt_len_B, config.capacity, chunk=config.prefill_chunk)
    key, sub = jax.random.split(key)
    first_B = sample(logits_BV, sub, config.sampling)
    generated_B = jnp.ones((B,), jnp.int32)
    finish_B = stop_reason(first_B, generated_B, cache.lengths_B + 1, config.eos_ids, N, config.capacity)
    finish_B = jnp.where(active_B, finish_B, -1)  # -1: padding slot
    state = ARState(
        cache=cache,
        pending_B=first_B,
        out_BN=jnp.zeros((B, N), jnp.int32).at[:, 0].set(first_B),
        generated_B=generated_B,
        finish_B=finish_B,
        key=key,
    )

    def step(s: ARState) -> ARState:
        running_B = s.finish_B == RUNNING
        positions_B1 = s.cache.lengths_B[:, None]
        logits_B1V, _, cache = model(s.pending_B[:, None], positions_B1, jnp.ones((B, 1, 1), bool), s.cache)
        cache = cache.replace(lengths_B=cache.lengths_B + running_B)
        key, sub = jax.random.split(s.key)
        token_B = sample(logits_B1V[:, 0], sub, config.sampling)
        slot_B = jnp.where(running_B, s.generated_B, N)  # N: dropped, finished rows keep theirs
        out_BN = s.out_BN.at[jnp.arange(B), slot_B].set(token_B, mode="drop")
        generated_B = s.generated_B + running_B
        reason_B = stop_reason(token_B, generated_B, cache.lengths_B + 1, config.eos_ids, N, config.capacity)
        finish_B = jnp.where(running_B, reason_B, s.finish_B)
        return ARState(cache, jnp.where(running_B, token_B, s.pending_B), out_BN, generated_B, finish_B, key)

    state = jax.lax.while_loop(lambda s: jnp.any(s.finish_B == RUNNING), step, state)
    return state.out_BN, state.generated_B, state.finish_B
