"""Per-stage cost of one speculative round, timed in isolation.

The measured generate run is never instrumented: each stage (draft, select,
verify = target forward + accept + commit) runs as its own jitted function
on a real post-prefill state of the benchmark's first batch, compiled once,
then timed over several repetitions (median).
"""

from __future__ import annotations

import statistics
import time

import jax

from taps_jax.engine.stages import Stages


def _median_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile + warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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
