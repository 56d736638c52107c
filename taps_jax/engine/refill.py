"""Continuous batching on device: rows that finish take new prompts (`calls.run_refilled` drives it).

The host returns from the loop when enough rows have finished (`until_finished`),
reads their tokens, and one compiled refill program prefills new prompts into
a static number of rows K of the batch (`put_rows`): a row's cache, context
and counters are replaced whole, every other row is untouched and stays on
device. Rows already share each forward at different lengths (as prompts
of different lengths do), so a refilled row decodes exactly as it would alone.
Shapes never change: one program per (batch, K, prompt buffer, cache slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from taps_jax.engine.prefill import RUNNING


def put(x, part, rows_K, axis: int = 0):
    """x with its rows `rows_K` along `axis` set to `part`'s; a row index past the batch is dropped (padding)."""
    index = (slice(None),) * axis + (rows_K,)
    return x.at[index].set(part.astype(x.dtype), mode="drop")


def put_cache(cache, part, rows_K):
    """A KVCache (or DrafterCache) with rows `rows_K` replaced by `part`'s (K/V: batch is axis 1)."""
    return cache.replace(k_LBKHS=put(cache.k_LBKHS, part.k_LBKHS, rows_K, 1),
                         v_LBKSH=put(cache.v_LBKSH, part.v_LBKSH, rows_K, 1),
                         lengths_B=put(cache.lengths_B, part.lengths_B, rows_K))


def put_rows(state, part, rows_K, fields: tuple[str, ...], caches: tuple[str, ...]):
    """`state` with rows `rows_K` of each named per-sequence field (and cache) taken from `part` (K rows)."""
    new = {f: put(getattr(state, f), getattr(part, f), rows_K) for f in fields}
    new.update({c: put_cache(getattr(state, c), getattr(part, c), rows_K) for c in caches})
    return state.replace(**new)


def stopped(s) -> jax.Array:
    """Rows not running (finished, or padding): what `until_finished` counts."""
    return jnp.sum(s.finish_B != RUNNING)


def until_finished(step, state, need, limit, of=lambda c: c):
    """`while running` as in generate, stopped once `need` rows are stopped or after `limit` steps (traced).

    of: the SpecState / ARState inside a carry (adaptive carries its statistics beside it).
    """

    def cond(carry):
        c, i = carry
        s = of(c)
        return jnp.any(s.finish_B == RUNNING) & (stopped(s) < need) & (i < limit)

    state, _ = jax.lax.while_loop(cond, lambda c: (step(c[0]), c[1] + 1), (state, jnp.int32(0)))
    return state
