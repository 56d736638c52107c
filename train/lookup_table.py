"""Fit the lookup weights: how often the text's earlier continuation is what the target writes next.

    python -m train.lookup_table --model DIR --prompts FILE.jsonl [--chat] [--num-prompts N]
        [--max-new-tokens T] [--batch-size B] [--out DIR/lookup.json]

The target alone decodes the prompts (plain AR, greedy and at temperature 1;
no drafter is involved, so the table belongs to the target and its kind of
text). At every round start of each answer, the committed text's latest
longest earlier match gives a continuation (`taps_jax.tree.lookup`); the
table counts, per match length and depth, how often the continuation's
token was the target's when the tokens before it were. A model set ships it
as lookup.json and every speculative policy mixes the continuation into its
drafts with those weights. Fit on prompts the benchmarks do not use.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from taps_jax.api import Target
from taps_jax.tree.lookup import KINDS, LOOKUP_FILE, LookupTable, count_agreement

LONGEST = 8  # the adaptive policy's signal cap (match_buckets - 1)
TEMPERATURES = {"greedy": 0.0, "sampled": 1.0}


def count_texts(prompt_ids, output_ids, longest: int = LONGEST, horizon: int = 15) -> tuple[np.ndarray, np.ndarray]:
    """(agreed [Q, H], tried [Q, H]) over answers `output_ids` to `prompt_ids` (lists of token id lists)."""
    B = len(prompt_ids)
    lengths = [len(p) + len(o) for p, o in zip(prompt_ids, output_ids)]
    S = max(lengths)
    text = np.full((B, S), -1, np.int32)  # -1: no token (never matches one)
    for b, (p, o) in enumerate(zip(prompt_ids, output_ids)):
        text[b, : lengths[b]] = list(p) + list(o)
    agreed, tried = count_agreement(jnp.asarray(text), jnp.asarray([len(p) for p in prompt_ids], jnp.int32),
                                    jnp.asarray(lengths, jnp.int32), longest=longest, horizon=horizon)
    return np.asarray(agreed, np.float64), np.asarray(tried, np.float64)


def fit(target: Target, prompts, max_new_tokens: int = 128, batch_size: int = 16, horizon: int = 15,
        meta: dict | None = None) -> LookupTable:
    """Both kinds (the target's greedy text and its temperature-1 text) into one table."""
    ids = target.encode(prompts)
    agreed, tried = {}, {}
    for kind in KINDS:
        a, t = np.zeros((LONGEST + 1, horizon)), np.zeros((LONGEST + 1, horizon))
        for i in tqdm(range(0, len(ids), batch_size), desc=f"lookup {kind}", unit="batch", dynamic_ncols=True):
            batch = ids[i: i + batch_size]
            out = target.generate(batch, max_new_tokens, temperature=TEMPERATURES[kind], seed=i)
            da, dt = count_texts(batch, out.tokens, horizon=horizon)
            a, t = a + da, t + dt
        agreed[kind], tried[kind] = a.tolist(), t.tolist()
    return LookupTable(agreed, tried, dict(meta or {}, prompts=len(prompts), max_new_tokens=max_new_tokens,
                                           fitted=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))


def print_table(table: LookupTable) -> None:
    for kind in KINDS:
        w, tried = table.weights(kind == "greedy"), np.asarray(table.tried[kind])
        print(f"{kind}: weight of the continuation's token at depth 1, 2, 4, 8, 15 per match length; rounds")
        for q in range(1, w.shape[0]):
            label = f"{q}+" if q == w.shape[0] - 1 else str(q)
            print(f"  {label:>3} " + " ".join(f"{w[q, d]:5.2f}" for d in (0, 1, 3, 7, 14) if d < w.shape[1])
                  + f"   {int(tried[q, 0])}")


def fit_stage(target_path: Path, drafter_dir: Path, prompts_file: Path, out: Path, *, num_prompts: int = 64,
              max_new_tokens: int = 128, batch_size: int = 16) -> None:
    """The recipes' lookup stage: fit on prompts the benchmarks do not use, as deep as the set's drafter
    drafts (the decoder refuses a table shallower than its horizon); writes `out`."""
    from decode.common import read_prompts
    from taps_jax import load_target
    from taps_jax.checkpoints.dflash import read_drafter_config

    horizon = read_drafter_config(drafter_dir).block_size - 1
    table = fit(load_target(target_path), read_prompts(prompts_file, limit=num_prompts), max_new_tokens, batch_size,
                horizon, meta={"prompts_file": Path(prompts_file).name})
    print_table(table)
    table.save(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.lookup_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model set dir (its target) or a shipped name")
    p.add_argument("--prompts", required=True, help="prompt file (JSONL) the benchmarks do not use")
    p.add_argument("--chat", action="store_true", help="wrap {'prompt'} lines in the target's chat template")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help=f"output file (default MODEL/{LOOKUP_FILE})")
    args = p.parse_args(argv)
    try:
        from decode.common import check_output_path, read_prompts
        from taps_jax.decoder import load_model_set
        from taps_jax.model_sets import resolve_set

        prompts = read_prompts(args.prompts, args.chat, args.num_prompts)
        models = load_model_set(args.model)
        horizon = models.drafter.config.block_size - 1 if models.drafter is not None else 15
        out = args.out or resolve_set(args.model) / LOOKUP_FILE
        check_output_path(out)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    table = fit(models.target, prompts, args.max_new_tokens, args.batch_size, horizon,
                meta={"prompts_file": str(args.prompts), "chat": args.chat})
    print_table(table)
    table.save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
