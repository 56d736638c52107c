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

from taps_jax.engine.prefill import PREFILL_CHUNK, RUNNING, prefill, stop_reason
from taps_jax.engine.refill import put_rows, until_finished
from taps_jax.engine.sampling import SamplingConfig, sample
from taps_jax.engine.static import merge
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


def ar_init(model, prompt_BT, prompt_len_B, active_B, key, config: DecodeConfig, resume=None) -> ARState:
    """Prefill and the first token; active_B marks real sequences (padded batch slots start finished).

    resume: (cache, start): the prompts' first `start` tokens are in `cache` already (`ar_extend`).
    """
    B = prompt_BT.shape[0]
    N = config.max_new_tokens
    cache, start = (None, None) if resume is None else resume
    logits_BV, _, cache = prefill(model, prompt_BT, prompt_len_B, config.capacity, chunk=config.prefill_chunk,
                                  cache=cache, start=start)
    key, sub = jax.random.split(key)
    first_B = sample(logits_BV, sub, config.sampling)
    generated_B = jnp.ones((B,), jnp.int32)
    finish_B = stop_reason(first_B, generated_B, cache.lengths_B + 1, config.eos_ids, N, config.capacity)
    finish_B = jnp.where(active_B, finish_B, -1)  # -1: padding slot
    return ARState(
        cache=cache,
        pending_B=first_B,
        out_BN=jnp.zeros((B, N), jnp.int32).at[:, 0].set(first_B),
        generated_B=generated_B,
        finish_B=finish_B,
        key=key,
    )


def ar_step(model, s: ARState, config: DecodeConfig) -> ARState:
    """Feed each running sequence's pending token, sample the next one."""
    B = s.pending_B.shape[0]
    N = config.max_new_tokens
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


def running(s) -> jax.Array:
    """Loop condition shared by every engine state: any sequence still running."""
    return jnp.any(s.finish_B == RUNNING)


def ar_outputs(s: ARState):
    return s.out_BN, s.generated_B, s.finish_B


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def ar_generate(graphdef, params, prompt_BT, prompt_len_B, active_B, key, *, config: DecodeConfig):
    """Returns (tokens [B, N], generated [B], finish reason [B]).

    active_B marks real sequences; padded batch slots start finished.
    """
    model = merge(graphdef, params)
    state = ar_init(model, prompt_BT, prompt_len_B, active_B, key, config)
    state = jax.lax.while_loop(running, lambda s: ar_step(model, s, config), state)
    return ar_outputs(state)


# Streaming: the same init and step, run as a start program and an advance
# program of at most `steps` steps (a host loop prints between them).


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def ar_start(graphdef, params, prompt_BT, prompt_len_B, active_B, key, *, config: DecodeConfig) -> ARState:
    return ar_init(merge(graphdef, params), prompt_BT, prompt_len_B, active_B, key, config)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("state",))
def ar_advance(graphdef, params, state: ARState, steps, *, config: DecodeConfig) -> ARState:
    model = merge(graphdef, params)
    return bounded_loop(lambda s: ar_step(model, s, config), state, steps)


def bounded_loop(step, state, limit):
    """`while running(state)` as in generate, stopped after `limit` steps (a traced scalar)."""

    def body(carry):
        s, i = carry
        return step(s), i + 1

    state, _ = jax.lax.while_loop(lambda c: running(c[0]) & (c[1] < limit), body, (state, jnp.int32(0)))
    return state


# Continuous batching (`taps_jax.engine.refill`): run until `need` rows are stopped, then refill K rows.

AR_ROW_FIELDS = ("pending_B", "out_BN", "generated_B", "finish_B")


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("state",))
def ar_until(graphdef, params, state: ARState, need, limit, *, config: DecodeConfig) -> ARState:
    """`ar_advance` that also stops once `need` rows are stopped (finished or padding)."""
    model = merge(graphdef, params)
    return until_finished(lambda s: ar_step(model, s, config), state, need, limit)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("state",))
def ar_refill(graphdef, params, state: ARState, prompt_KT, prompt_len_K, rows_K, *, config: DecodeConfig) -> ARState:
    """Prefill K new prompts into rows `rows_K` (an index >= B: a padding entry, dropped); other rows untouched.
    prompt_KT may be narrower than the run's prompt buffer (not its cache slots: `calls.Refilled`).

    A refilled row is exactly `ar_init`'s row for its prompt: its own cache, first token and counters.
    """
    B = state.pending_B.shape[0]
    key, sub = jax.random.split(state.key)
    part = ar_init(merge(graphdef, params), prompt_KT, prompt_len_K, rows_K < B, sub, config)
    return put_rows(state, part, rows_K, AR_ROW_FIELDS, ("cache",)).replace(key=key)


# A conversation that goes on (`taps_jax.session`): the next turn's prompt reuses the cache of the last one.


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("state",))
def ar_extend(graphdef, params, state: ARState, prompt_BT, prompt_len_B, start, *, config: DecodeConfig) -> ARState:
    """`ar_start` for prompts whose first `start` tokens (a traced scalar) already sit in `state`'s cache: only the
    rest is prefilled (`prefill`'s resume), then the first token and fresh counters, as `ar_init`; the key goes on
    from `state`'s. Rows with prompt_len 0 are padding."""
    key, sub = jax.random.split(state.key)
    s = ar_init(merge(graphdef, params), prompt_BT, prompt_len_B, prompt_len_B > 0, sub, config, (state.cache, start))
    return s.replace(key=key)
