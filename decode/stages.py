"""Per-stage cost of one speculative round, timed in isolation.

The measured generate run is never instrumented: each stage (draft, select,
verify = target forward + accept + commit) runs as its own jitted function
on a real post-prefill state of the benchmark's first batch, compiled once,
then timed over several repetitions (median).
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from taps_jax.engine.stages import Stages
from taps_jax.models.cache import KVCache


def times_ms(fn, reps: int) -> list[float]:
    """Wall ms of `reps` calls of `fn` (each waited for), after one compile + warm call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _median_ms(fn, reps: int) -> float:
    return statistics.median(times_ms(fn, reps))


def stage_times_ms(decoder, prompts, max_new_tokens: int, reps: int = 10) -> dict[str, float]:
    """{'draft', 'select', 'verify'}: median milliseconds per round of each stage."""
    stages = Stages.after_prefill(decoder, prompts, max_new_tokens)
    dcache, draft, hidden = stages.draft()
    tree = stages.select(draft, hidden)
    return {
        "draft": _median_ms(stages.draft, reps),
        "select": _median_ms(lambda: stages.select(draft, hidden), reps),
        "verify": _median_ms(lambda: stages.verify(dcache, tree), reps),
    }


VERIFY_COST_CONTEXT = 128  # committed tokens the cost curve attends over


def verify_cost_ms(target, tree_sizes, context: int = VERIFY_COST_CONTEXT, reps: int = 10) -> dict[int, float]:
    """{T: median ms of one target forward over T tree tokens}, batch 1.

    The forward verification runs (embedding, every layer against `context`
    committed cache slots, logits at every node); T = 1 is exactly one AR
    step's forward. With r = cost(T) / cost(1), a policy that accepts tau
    tokens per round with a T-token tree runs at most about tau / r times
    as fast as AR (less: drafting and selection cost extra).
    """
    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def forward(graphdef, params, cache, tokens_1T):
        T = tokens_1T.shape[1]
        positions_1T = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        causal_1TT = jnp.tril(jnp.ones((T, T), bool))[None]  # any mask costs the same
        return nnx.merge(graphdef, params)(tokens_1T, positions_1T, causal_1TT, cache)[0]

    config = target.config
    cache = KVCache.zeros(config, 1, context + max(tree_sizes))
    cache = cache.replace(lengths_B=jnp.full((1,), context, jnp.int32))
    return {T: _median_ms(lambda T=T: forward(target.graphdef, target.params, cache,
                                              jnp.ones((1, T), jnp.int32)), reps)
            for T in tree_sizes}
