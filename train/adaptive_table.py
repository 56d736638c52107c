"""Fit the adaptive policy's prior: accepted length per text signal bucket and budget, on traces.

    python -m train.adaptive_table --model DIR --prompts FILE.jsonl [--chat] [--num-prompts N]
        [--max-new-tokens T] [--batch-size B] [--budgets 0,1,2,4,8,16,32] [--out DIR/adaptive.json]

Decodes the prompts with the largest budget's tree every round (the adaptive
program forced to its largest branch, so the trees are the ones the policy
draws), greedy and at temperature 1, and records what every budget would
have accepted in each round (the trees are nested: `adaptive.accepted_by_budget`)
under the signal bucket of the text at that round (`adaptive.signal_buckets`).
The sums and counts are the table (`taps_jax.engine.adaptive.AdaptiveTable`);
a model set ships it as adaptive.json and `SpeculativeDecoder` starts from
it. Fit on prompts the benchmarks do not use (a set's traces split).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from taps_jax.decoder import SpeculativeDecoder, load_model_set
from taps_jax.engine.adaptive import TABLE_FILE, AdaptiveConfig, AdaptiveTable
from taps_jax.engine.speculative import spec_generate
from taps_jax.model_sets import resolve_set
from taps_jax.tree.lookup import LookupTable

FIT_BUDGETS = (0, 1, 2, 4, 8, 16, 32)  # covers AdaptiveConfig.for_budget(8), (16) and (32)
KINDS = (("greedy", 0.0), ("sampled", 1.0))


def fit_kind(models, prompts, max_new_tokens: int, temperature: float, budgets=FIT_BUDGETS,
             batch_size: int = 8, seed: int = 0, desc: str = "fit") -> tuple[np.ndarray, np.ndarray]:
    """(sums [Q, K], counts [Q, K]) of accepted lengths over `prompts`, every round a largest-budget tree."""
    config = AdaptiveConfig(tuple(budgets), alpha=0.0)  # a plain mean
    K = len(budgets)
    decoder = SpeculativeDecoder(models.target, models.drafter, "adaptive", budgets[-1], adaptive=config,
                                 scorer=models.scorer_for(temperature), costs=(1.0,) * K, lookup=models.lookup)
    sums, counts = np.zeros((config.match_buckets, K)), np.zeros((config.match_buckets, K))
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", dynamic_ncols=True):
        call = decoder.prepare(prompts[i: i + batch_size], max_new_tokens, temperature=temperature, seed=seed + i)
        kwargs = dict(call.kwargs, force=jnp.int32(K - 1), prior=config.empty_prior())
        est = np.asarray(jax.block_until_ready(spec_generate(*call.args, **kwargs))[6], np.float64)
        sums, counts = sums + est[0], counts + est[1]
    return sums, counts


def fit(models, prompts, max_new_tokens: int = 128, budgets=FIT_BUDGETS, batch_size: int = 8,
        meta: dict | None = None) -> AdaptiveTable:
    """Both kinds (greedy, temperature 1) into one table."""
    sums, counts = {}, {}
    for kind, temperature in KINDS:
        s, c = fit_kind(models, prompts, max_new_tokens, temperature, budgets, batch_size, desc=f"fit {kind}")
        sums[kind], counts[kind] = s.round(3).tolist(), c.round(3).tolist()
    return AdaptiveTable(tuple(budgets), AdaptiveConfig(tuple(budgets)).match_buckets, sums, counts,
                         dict(meta or {}, prompts=len(prompts), max_new_tokens=max_new_tokens,
                              fitted=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))


def fit_stage(target_path: Path, drafter_dir: Path, scorer_dirs, prompts_file: Path, out: Path, *,
              num_prompts: int = 64, max_new_tokens: int = 128, batch_size: int = 16,
              lookup_file: Path | None = None) -> None:
    """The recipes' adaptive stage: fit on a training run's parts (scorer_dirs: (sampled, greedy), None if
    missing; the lookup weights the set will ship, if any) and the prompts of `prompts_file` the benchmarks do
    not use; writes `out`."""
    from decode.common import read_prompts
    from taps_jax import load_scorer, load_target
    from taps_jax.decoder import ModelSet, load_drafter

    scorers = [load_scorer(d) if d is not None and Path(d).is_dir() else None for d in scorer_dirs]
    lookup = LookupTable.load(lookup_file) if lookup_file is not None and Path(lookup_file).is_file() else None
    models = ModelSet(load_target(target_path), load_drafter(drafter_dir), *scorers, lookup=lookup)
    table = fit(models, read_prompts(prompts_file, limit=num_prompts), max_new_tokens, batch_size=batch_size,
                meta={"prompts_file": Path(prompts_file).name})
    print_table(table)
    table.save(out)


def print_table(table: AdaptiveTable) -> None:
    for kind in table.sums:
        counts = np.asarray(table.counts[kind])[:, -1]
        print(f"{kind}: mean accepted length (root included) per suffix-match bucket; share of rounds")
        print("  match " + " ".join(f"{b:>6}" for b in table.budgets[1:]) + "   rounds")
        for q, row in enumerate(table.means(kind)):
            label = f"{q}+" if q == table.match_buckets - 1 else str(q)
            cells = " ".join("     -" if np.isnan(x) else f"{x:6.2f}" for x in row[1:])
            print(f"  {label:>5} {cells}   {counts[q] / max(counts.sum(), 1):5.1%}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.adaptive_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model set dir (target, drafter, scorers) or a shipped name")
    p.add_argument("--prompts", required=True, help="prompt file (JSONL) the benchmarks do not use")
    p.add_argument("--chat", action="store_true", help="wrap {'prompt'} lines in the target's chat template")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--budgets", default=",".join(map(str, FIT_BUDGETS)),
                   help="0 and increasing tree budgets (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help=f"output file (default MODEL/{TABLE_FILE})")
    args = p.parse_args(argv)
    try:
        from decode.common import check_output_path, read_prompts

        budgets = tuple(int(b) for b in args.budgets.split(","))
        AdaptiveConfig(budgets).validate()
        prompts = read_prompts(args.prompts, args.chat, args.num_prompts)
        models = load_model_set(args.model)
        if models.drafter is None:
            raise ValueError(models.missing_drafter())
        out = args.out or resolve_set(args.model) / TABLE_FILE
        check_output_path(out)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    table = fit(models, prompts, args.max_new_tokens, budgets, args.batch_size,
                meta={"prompts_file": str(args.prompts), "chat": args.chat})
    print_table(table)
    table.save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
