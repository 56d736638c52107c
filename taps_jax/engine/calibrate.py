"""Cost of one round of each adaptive branch, measured once per device kind and shape, cached on disk.

A branch's round is timed in the generate program itself (so nothing more
compiles): forced to one branch every round and stopped after a few
rounds, on the batch being decoded, least of interleaved repeats. The
figures depend on the device, the models, the branch budgets, the batch,
the kind of sampling, the cache capacity and the engine version, which together key the cache file
(`$TAPS_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/taps-jax`, else
`~/.cache/taps-jax`; `adaptive_costs.json`). Delete that file to measure
again (e.g. after a hardware change the key does not see). A calibration
is announced on stderr (it compiles the generate program it times, and that
program is then cached on disk too: `taps_jax.compile_cache`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from taps_jax import compile_cache
from taps_jax.calls import describe, program_id, program_key
from taps_jax.compile_cache import cache_dir
from taps_jax.engine import speculative as spec

CACHE_FILE = "adaptive_costs.json"
# Part of the cache key: bump when a change to the engine changes what a round costs.
ENGINE_VERSION = 4  # 2: AR runs, in-place branches; 3: key blocks of 128 in small caches; 4: the text signal
_memory: dict[str, tuple[float, ...]] = {}


def cost_key(args, kwargs) -> str:
    """Device kind, models, branches, batch, sampling and capacity: what a round's cost depends on."""
    _, target_params, _, _, prompt, *_ = args
    config = kwargs["config"]
    leaves = jax.tree_util.tree_leaves(target_params)
    devices = jax.devices()
    facts = {
        "engine": ENGINE_VERSION,
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
        # Sampling costs more than an argmax (top-p sorts the vocabulary), at every tree node.
        "sampling": [config.decode.sampling.greedy, config.decode.sampling.top_k > 0,
                     config.decode.sampling.top_p < 1.0],
        "capacity": config.decode.capacity,
        "lookup": config.lookup is not None,  # its match and mix run in every tree round's draft
    }
    return json.dumps(facts, sort_keys=True)


def forced_run(args, kwargs, branch: int, rounds: int) -> tuple[float, int]:
    """(seconds, rounds run) of `spec_generate` forced to one branch and stopped after `rounds` rounds."""
    budgets = kwargs["config"].adaptive.budgets
    # Device arrays and a host prior and clock, as `SpeculativeDecoder.prepare` passes them: the same jit entry.
    kw = dict(kwargs, costs_K=jnp.ones(len(budgets), jnp.float32), force=jnp.int32(branch),
              max_rounds=jnp.int32(rounds), prior=kwargs["config"].adaptive.empty_prior(),
              clock=np.zeros(3, np.float32))
    start = time.perf_counter()
    out = jax.block_until_ready(spec.spec_generate(*args, **kw))
    return time.perf_counter() - start, int((np.asarray(out[5]) >= 0).sum())


def measure(args, kwargs, max_new_tokens: int, repeats: int = 5,
            retries: int = 3) -> tuple[tuple[float, ...], bool]:
    """(milliseconds per round of each branch (least of `repeats`, interleaved across branches), whether the
    rounds could be timed).

    The generate program itself (no second compile) runs one branch every
    round (`force`), stopped after r1 and after r2 rounds (`max_rounds`);
    the difference divided by the rounds between leaves out the prefill.
    The least time of the repeats for each, not the median: on a shared
    machine other work only ever adds time, and a busy moment must not make
    one branch look dearer than the others for as long as the figures stay
    cached. Every branch runs once before the timing (its first run is slow).
    A branch whose difference is lost in that noise (a round of a small model
    costs less than the jitter of a loaded machine) is timed `repeats` more
    times, up to `retries` times; if it is still unresolved, its long run's
    time per round, prefill included, stands in: an upper bound, never the
    near-zero cost that would make the policy pick that branch for good.
    Rounds cannot be timed where the batch stops before a second round
    (max_new_tokens <= 2, or every sequence at EOS at once): then every
    figure is its run's time, prefill and all, and the second value is False.
    """
    budgets = kwargs["config"].adaptive.budgets

    def run(k, rounds):
        return forced_run(args, kwargs, k, rounds)

    # 16 AR steps include about one absorption of the queued taps (block size 16); trees: 5 rounds.
    r1, r2 = 1, max(2, min(max_new_tokens, 17))
    rounds = [r2 if b == 0 else min(r2, 6) for b in budgets]
    for k in range(len(budgets)):  # compile (the program generate runs) and warm: a branch's first run is slow
        run(k, rounds[k])
    short, long = [[] for _ in budgets], [[] for _ in budgets]
    costs: list[float | None] = [None] * len(budgets)
    todo = list(range(len(budgets)))
    for _ in range(1 + retries):
        for _ in range(repeats):
            for k in todo:
                short[k].append(run(k, r1))
                long[k].append(run(k, rounds[k]))
        for k in todo:
            costs[k] = per_round_ms(min(short[k]), min(long[k]))
        todo = [k for k in todo if costs[k] is None]
        if not todo:
            break
    for k in todo:
        costs[k] = whole_run_ms(min(long[k]))
    timed = all(n2 > n1 for (_, n1), (_, n2) in zip(map(min, short), map(min, long)))
    return tuple(costs), timed


def whole_run_ms(run: tuple[float, int]) -> float:
    """ms per round of a (seconds, rounds) run, prefill included: an upper bound on a round's cost."""
    t, n = run
    return t / max(n, 1) * 1e3


def per_round_ms(short: tuple[float, int], long: tuple[float, int]) -> float | None:
    """(t2 - t1) / (n2 - n1) in ms from (seconds, rounds) of a short and a long run; None where noise hides it.

    Resolved means the long run took at least 1% longer than the short one:
    a smaller (or negative) difference is timing noise, not a round's cost.
    """
    (t1, n1), (t2, n2) = short, long
    if n2 <= n1:
        return whole_run_ms(long)
    if t2 - t1 <= 0.01 * t1:
        return None
    return (t2 - t1) / (n2 - n1) * 1e3


def branch_costs(args, kwargs, max_new_tokens: int) -> tuple[tuple[float, ...], bool]:
    """(per-branch costs (ms per round) for these inputs of `spec_generate`, cached or measured on a miss,
    whether they are final). Figures of a batch that stopped before its rounds could be timed (`measure`) serve
    the call that measured them and are not cached: the next call of that shape measures again."""
    key = cost_key(args, kwargs)
    if key in _memory:
        return _memory[key], True
    path = cache_dir() / CACHE_FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry = table.get(key) if isinstance(table, dict) else None
    if entry and len(entry.get("ms", ())) == len(kwargs["config"].adaptive.budgets):
        costs = tuple(float(c) for c in entry["ms"])
    else:
        # First the generate program compiles (the one `SpeculativeDecoder.prepare` hands on: booked as
        # compiled, so no second notice), then every branch is timed: always a wait worth announcing.
        program = program_id(spec.spec_generate.__name__, args, kwargs)
        compile_cache.ensure()
        compile_cache.announce(f"{describe(kwargs['config'], program[3])} and timing its branches", "calibration")
        compiled_s, _ = forced_run(args, kwargs, 0, 1)
        compile_cache.mark_compiled(program, program_key(program, args, kwargs), program[0], compiled_s)
        begin = time.perf_counter()
        costs, timed = measure(args, kwargs, max_new_tokens)
        compile_cache.mark_compiled(("calibration", key), hashlib.sha256(key.encode()).hexdigest()[:24],
                                    "calibration", compiled_s + time.perf_counter() - begin)
        if not timed:
            return costs, False
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
    return costs, True
