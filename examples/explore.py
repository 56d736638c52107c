"""Explore speculative decoding from Python (paste into a notebook cell by cell).

    python examples/explore.py [--model DIR] [--prompt TEXT]

Loads a model set (the embedded default unless --model), decodes one prompt
with AR and each speculative policy, prints tau (mean tokens accepted per
target forward) and draws the first round's draft tree with the accepted
path marked '*'.
"""

import argparse

from taps_jax.decoder import DEFAULT_MODEL_DIR, SpeculativeDecoder, load_model_set
from taps_jax.engine.stages import first_round, format_tree

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
parser.add_argument("--prompt", default="def fibonacci(n):\n")
parser.add_argument("--budget", type=int, default=16)
args = parser.parse_args()

models = load_model_set(args.model)
ar = SpeculativeDecoder(models.target, None, "ar").generate([args.prompt], 64)
print("AR:", repr(ar.texts[0]))

policies = ["chain", "ddtree"] + (["taps"] if models.scorer is not None else [])
for policy in policies:
    extra = {"scorer": models.scorer} if policy == "taps" else {}
    dec = SpeculativeDecoder(models.target, models.drafter, policy, args.budget, **extra)
    res = dec.generate([args.prompt], 64)
    same = "identical to AR" if res.tokens == ar.tokens else "DIFFERS from AR"
    print(f"{policy:>6}: tau={res.stats['tau']:.2f} over {res.stats['rounds'][0]} rounds ({same})")

dec = SpeculativeDecoder(models.target, models.drafter, "ddtree", args.budget)
view = first_round(dec, args.prompt)
print(f"\nFirst ddtree round ({len(view['tokens']) - 1} draft nodes, {len(view['accepted'])} accepted incl. root):")
print(format_tree(view, models.target.tokenizer.decode if models.target.tokenizer else str))
