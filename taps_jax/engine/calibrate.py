"""Cost of one round of each adaptive branch, measured once per device kind and shape, cached on disk.

A branch's round is timed as the generate loop runs it (draft, select,
verify, commit fused in one program; an AR step with its share of the
drafter's context absorption), a few rounds per call from the real
post-prefill state of the batch being decoded, median of interleaved
repeats. The figures depend on the device, the models, the branch budgets,
the batch and the cache capacity, which together key the cache file
(`$TAPS_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/taps-jax`, else
`~/.cache/taps-jax`; `adaptive_costs.json`). Delete that file to measure
again (e.g. after a hardware change the key does not see).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from taps_jax.engine import speculative as spec
from taps_jax.engine.stages import init_jit

CACHE_FILE = "adaptive_costs.json"
_memory: dict[str, tuple[float, ...]] = {}


def cache_dir() -> Path:
    if os.environ.get("TAPS_JAX_CACHE_DIR"):
        return Path(os.environ["TAPS_JAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "taps-jax"


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter_graphdef", "scorer_graphdef", "config"))
def _branch_rounds(target_graphdef, target_params, drafter_graphdef, drafter_params, state, branch, rounds, *,
                   config, scorer_graphdef=None, scorer_params=None):
    """`rounds` rounds of branch `branch` from `state` (finished sequences still compute, as in the loop)."""
    target, drafter, scorer = spec._merge(target_graphdef, target_params, drafter_graphdef, drafter_params,
                                          scorer_graphdef, scorer_params, config)
    branches = [functools.partial(spec.branch_step, target, drafter, scorer, config=config, budget=m)
                for m in config.adaptive.budgets]
    return jax.lax.fori_loop(0, rounds, lambda _, s: spec.commit_branch(s, jax.lax.switch(branch, branches, s)[0]),
                             state)


def cost_key(args, kwargs) -> str:
    """Device kind, models, branches, batch and capacity: what a round's cost depends on."""
    _, target_params, _, _, prompt, *_ = args
    config = kwargs["config"]
    leaves = jax.tree_util.tree_leaves(target_params)
    devices = jax.devices()
    facts = {
        "device": f"{devices[0].platform}:{devices[0].device_kind}",
        "devices": len(devices),
        # Parameter shapes of target, drafter and scorer (a graphdef's repr is not stable across processes).
        "models": hashlib.sha256(repr([[tuple(x.shape) for x in jax.tree_util.tree_leaves(p)]
                                       for p in (target_params, args[3], kwargs.get("scorer_params"))]).encode())
                  .hexdigest()[:16],
        "target_params": sum(int(np.prod(x.shape)) for x in leaves),
        "dtype": str(leaves[0].dtype),
        "tree": dataclasses.asdict(config.tree) | {"budget": None},
        "budgets": list(config.adaptive.budgets),
        "batch": int(prompt.shape[0]),
        "capacity": config.decode.capacity,
    }
    return json.dumps(facts, sort_keys=True)


def measure(args, kwargs, repeats: int = 5) -> tuple[float, ...]:
    """Milliseconds per round of each branch (median of `repeats`, interleaved across branches)."""
    tg, tp, dg, dp, prompt, lens, active, key = args
    config = kwargs["config"]
    static = dict(target_graphdef=tg, drafter_graphdef=dg, scorer_graphdef=kwargs.get("scorer_graphdef"),
                  config=config)
    params = (tp, dp, kwargs.get("scorer_params"))
    state = init_jit(params, prompt, lens, active, key, **static)
    extra = {"scorer_graphdef": kwargs.get("scorer_graphdef"), "scorer_params": kwargs.get("scorer_params")}
    A = state.ctx_taps_BAF.shape[1]
    budgets = config.adaptive.budgets
    # AR steps: A + 1 rounds include one absorption of the pending context, as a run of AR steps does.
    rounds = [A + 1 if m == 0 else 4 for m in budgets]

    def run(k):
        return _branch_rounds(tg, tp, dg, dp, state, k, rounds[k], config=config, **extra)

    for k in range(len(budgets)):
        jax.block_until_ready(run(k))  # compile once, warm every branch
    times = [[] for _ in budgets]
    for _ in range(repeats):
        for k in range(len(budgets)):
            start = time.perf_counter()
            jax.block_until_ready(run(k))
            times[k].append((time.perf_counter() - start) * 1e3 / rounds[k])
    return tuple(statistics.median(t) for t in times)


def branch_costs(args, kwargs) -> tuple[float, ...]:
    """Cached per-branch costs (ms per round) for these inputs of `spec_generate`, measured on a miss."""
    key = cost_key(args, kwargs)
    if key in _memory:
        return _memory[key]
    path = cache_dir() / CACHE_FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry = table.get(key) if isinstance(table, dict) else None
    if entry and len(entry.get("ms", ())) == len(kwargs["config"].adaptive.budgets):
        costs = tuple(float(c) for c in entry["ms"])
    else:
        costs = measure(args, kwargs)
        table = table if isinstance(table, dict) else {}
        table[key] = {"ms": list(costs), "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home still decodes; it measures again next process
    _memory[key] = costs
    return costs
