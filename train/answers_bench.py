"""Answer generation (the distillation data) with refilled rows beside static batches, in one process.

    python -m train.answers_bench --model smollm2 --prompts WORK/prompts_train.jsonl [--num-prompts 256]
        [--gen-tokens 160] [--batch-size 32] [--refill-rows 4] [--repeats 2]

What `train.set_recipe`'s drafter stage runs (`generate_sequences`: half the
prompts greedy, half sampled at T = 1, every prompt cut to the data's prompt
length), once per mode untimed (compiles), then `--repeats` timed runs in
which the two modes take turns. Prints each mode's median tokens/s with its
spread, the ratio, the static batches' slot utilisation (answer tokens over
rows x loop steps: what bounds the gain) and whether the greedy answers agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from decode.common import positive_int
from taps_jax.decoder import load_model_set
from train.distill_data import Sequences, generate_sequences


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.answers_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a model set whose target answers (name or directory)")
    p.add_argument("--prompts", type=Path, required=True,
                   help='prompt JSONL, one {"prompt": ...} per line (e.g. a set recipe\'s WORK/prompts_train.jsonl)')
    p.add_argument("--num-prompts", type=positive_int, default=256)
    p.add_argument("--gen-tokens", type=positive_int, default=160, help="new tokens per answer at most")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--refill-rows", type=positive_int, default=4, help="rows per refill (the data stage: batch / 8)")
    p.add_argument("--repeats", type=positive_int, default=2)
    return p


def static_utilisation(seqs: Sequences, batch_size: int, greedy: int) -> float:
    """Answer tokens over rows x loop steps of static batches (each half batched on its own, as generated)."""
    answers = seqs.lengths - seqs.prompt_lens
    slots = 0
    for lo, hi in ((0, greedy), (greedy, len(answers))):
        for b in range(lo, hi, batch_size):
            slots += batch_size * int(answers[b:min(b + batch_size, hi)].max())
    return float(answers.sum()) / max(slots, 1)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.refill_rows > args.batch_size:
        raise SystemExit(f"--refill-rows {args.refill_rows} is more than the batch ({args.batch_size} rows)")
    lines = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][:args.num_prompts]
    if not lines or any("prompt" not in line for line in lines):
        raise SystemExit(f"{args.prompts}: need JSONL lines with a \"prompt\" field")
    target = load_model_set(args.model).target
    prompts = target.encode([line["prompt"] for line in lines])
    greedy = round(0.5 * len(prompts))
    modes = {"static": dict(static_batches=True), "refilled": dict(refill_rows=args.refill_rows)}
    rates = {name: [] for name in modes}
    answers = {}
    for repeat in range(args.repeats + 1):  # repeat 0: compiles, untimed
        for name, options in modes.items():
            t0 = time.perf_counter()
            seqs = generate_sequences(target, prompts, args.gen_tokens, batch_size=args.batch_size,
                                      greedy_fraction=0.5, temperature=1.0, seed=0, name=name, **options)
            seconds = time.perf_counter() - t0
            if repeat:
                rates[name].append(float((seqs.lengths - seqs.prompt_lens).sum()) / seconds)
            answers[name] = seqs
    s = answers["static"]
    stopped = int(np.sum(s.lengths - s.prompt_lens < args.gen_tokens))
    print(f"{len(prompts)} prompts ({greedy} greedy, the rest sampled at T = 1), batch {args.batch_size}, up to "
          f"{args.gen_tokens} new tokens: {stopped} answers stop before the limit; static batches' slot "
          f"utilisation {static_utilisation(s, args.batch_size, greedy):.0%}")
    base = statistics.median(rates["static"])
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:>9}: {med:7.1f} tokens/s (runs {', '.join(f'{x:.1f}' for x in r)}), x{med / base:.2f} of static")
    g = slice(0, greedy)
    same = all(np.array_equal(answers[n].tokens[g], s.tokens[g]) and np.array_equal(answers[n].lengths[g],
                                                                                    s.lengths[g]) for n in answers)
    print("greedy answers agree across modes" if same else "greedy answers differ across modes")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
