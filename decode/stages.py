"""Per-stage cost of one speculative round, timed in isolation.

The measured generate run is never instrumented: here each stage (draft,
select, verify = target forward + accept + commit) is its own jitted
function, run on a real post-prefill state of the benchmark's first batch,
compiled once, then timed over several repetitions (median).
"""

from __future__ import annotations

import functools
import statistics
import time

import jax

from taps_jax.engine import speculative as spec

_STATIC = ("target_graphdef", "drafter_graphdef", "scorer_graphdef", "config")


def _jit(fn):
    return functools.partial(jax.jit, static_argnames=_STATIC)(fn)


@_jit
def _init(models, prompt_BT, prompt_len_B, active_B, key, *, target_graphdef, drafter_graphdef, scorer_graphdef, config):
    target, drafter, _ = spec._merge(target_graphdef, models[0], drafter_graphdef, models[1], scorer_graphdef, models[2], config)
    return spec.init_state(target, drafter, prompt_BT, prompt_len_B, active_B, key, config)


@_jit
def _draft(models, state, *, target_graphdef, drafter_graphdef, scorer_graphdef, config):
    target, drafter, _ = spec._merge(target_graphdef, models[0], drafter_graphdef, models[1], scorer_graphdef, models[2], config)
    return spec.draft_stage(target, drafter, state)


@_jit
def _select(models, draft_BHV, hidden_BHD, bonus_B, *, target_graphdef, drafter_graphdef, scorer_graphdef, config):
    target, _, scorer = spec._merge(target_graphdef, models[0], drafter_graphdef, models[1], scorer_graphdef, models[2], config)
    return spec.select_stage(config.tree, target, scorer, draft_BHV, hidden_BHD, bonus_B)


@_jit
def _verify(models, state, dcache, tree, *, target_graphdef, drafter_graphdef, scorer_graphdef, config):
    target, drafter, _ = spec._merge(target_graphdef, models[0], drafter_graphdef, models[1], scorer_graphdef, models[2], config)
    return spec.verify_stage(target, drafter, state, dcache, tree, config)


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
    _, args, kwargs = decoder.prepare(prompts, max_new_tokens)
    tg, tp, dg, dp, prompt, lens, active, key = args
    static = dict(target_graphdef=tg, drafter_graphdef=dg, scorer_graphdef=kwargs.get("scorer_graphdef"),
                  config=kwargs["config"])
    models = (tp, dp, kwargs.get("scorer_params"))
    state = _init(models, prompt, lens, active, key, **static)
    dcache, draft, hidden = _draft(models, state, **static)
    tree = _select(models, draft, hidden, state.bonus_B, **static)
    return {
        "draft": _median_ms(lambda: _draft(models, state, **static), reps),
        "select": _median_ms(lambda: _select(models, draft, hidden, state.bonus_B, **static), reps),
        "verify": _median_ms(lambda: _verify(models, state, dcache, tree, **static), reps),
    }
