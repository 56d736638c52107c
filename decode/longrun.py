"""Long-run check: many tokens per prompt with every policy, watching memory and compiles.

    python -m decode.longrun --num-prompts 16 --max-new-tokens 2000 --json longrun.json

Each policy decodes the prompts one at a time (a decoding job's shape). The
prompts are taken from ONE prompt-length bucket (the most populated one), so
every call has the same shapes: the first prompt is the warm-up (it
compiles), and any compile after it would be a real recompilation (prompts
of other buckets compile once per bucket, by design). Memory is compared from
the end of the third prompt on. The script records the
process RSS and JAX's live device bytes after every prompt and the number of
compiled programs. It reports, per policy: tokens/s, tau, memory growth
after warm-up, compiles after warm-up, and whether every greedy output equals
AR's token for token. Exit status 1 if any policy grew, recompiled or differed.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from decode.common import Parser, add_model_args, check_output_path, choice_list, load_models, positive_int, run
from taps_jax import compile_cache
from taps_jax.decoder import DEFAULT_MODEL_DIR, POLICIES, SpeculativeDecoder
from taps_jax.engine.ar import ar_generate
from taps_jax.engine.batching import bucket
from taps_jax.engine.speculative import spec_generate
from taps_jax.prompt_file import read_prompt_file

# Growth below this is allocator noise (RSS pages come and go by a few MiB).
RSS_SLACK_MIB = 16.0
# RSS is measured from the end of this many prompts: the first executions of a
# program still grow the allocator's arenas (AR on the default set: +24 MiB
# after each of the first two prompts, then +0.5 MiB over the next 13).
RSS_WARMUP_PROMPTS = 3


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def live_device_mib() -> float:
    return sum(a.nbytes for a in jax.live_arrays()) / 2**20


def compiles() -> int:
    return ar_generate._cache_size() + spec_generate._cache_size()


def same_bucket(target, prompts: list, n: int) -> list:
    """The first n prompts of the most populated prompt-length bucket (ties: the shorter bucket)."""
    groups: dict[int, list] = {}
    for prompt, ids in zip(prompts, target.encode(prompts)):
        groups.setdefault(bucket(len(ids)), []).append(prompt)
    best = max(sorted(groups), key=lambda b: len(groups[b]))
    return groups[best][:n]


def build_parser():
    p = Parser(prog="python -m decode.longrun", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompts", type=Path, default=None, help="JSONL prompts (default: the embedded held-out set)")
    p.add_argument("--num-prompts", type=positive_int, default=16)
    p.add_argument("--max-new-tokens", type=positive_int, default=2000)
    p.add_argument("--policies", type=choice_list(POLICIES), default=["ar", "chain", "ddtree", "taps"])
    p.add_argument("--budget", type=positive_int, default=32, help="tree budget (default 32)")
    p.add_argument("--json", type=Path, help="write the figures as JSON here")
    compile_cache.add_flag(p)
    return p


def decode_all(decoder, prompts, max_new_tokens: int, desc: str) -> dict:
    tokens, rounds, accepted, rss, live, seconds = [], 0, 0, [], [], 0.0
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        start = time.perf_counter()
        res = decoder.generate([prompt], max_new_tokens, stop_at_eos=False)
        if i:  # the first prompt compiles: not timed
            seconds += time.perf_counter() - start
        tokens += res.tokens
        rounds += sum(res.stats.get("rounds", [0]))
        accepted += sum(map(sum, res.stats.get("accepted_lengths", [[]])))
        if i == 0:
            compiles_after_warmup = compiles()
        gc.collect()
        rss.append(rss_mib())
        live.append(live_device_mib())
    timed = sum(map(len, tokens[1:]))
    base = min(RSS_WARMUP_PROMPTS, len(rss)) - 1  # RSS settles over the first few calls (allocator arenas)
    return {
        "tokens": tokens,
        "tokens_per_s": timed / seconds if seconds else float("nan"),
        "tau": accepted / rounds if rounds else 1.0,
        "rss_mib_after_warmup": rss[base], "rss_mib_end": rss[-1],
        "rss_growth_mib": rss[-1] - rss[base],
        "live_device_mib_after_warmup": live[0], "live_device_growth_mib": live[-1] - live[0],
        "compiles_after_warmup": compiles() - compiles_after_warmup,
        "rss_mib_per_prompt": [round(r, 1) for r in rss],
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    compile_cache.setup(args)
    check_output_path(args.json)  # before the long run, not after it
    prompts_file = args.prompts or DEFAULT_MODEL_DIR / "prompts_heldout.jsonl"
    models = load_models(args)
    prompts = same_bucket(models.target, [r.prompt for r in read_prompt_file(prompts_file)], args.num_prompts)
    if any(p != "ar" for p in args.policies) and models.drafter is None:
        raise ValueError("speculative policies need a drafter: pass --drafter DIR or a --model dir with drafter/")
    scorer = models.scorer_for(0.0)  # greedy decoding
    if "taps" in args.policies and scorer is None:
        raise ValueError("policy taps needs a scorer: pass --scorer DIR or drop taps from --policies")
    decoders = {"ar": SpeculativeDecoder(models.target, None, "ar")}
    for p in args.policies:
        if p != "ar":
            decoders[p] = SpeculativeDecoder(models.target, models.drafter, p, args.budget, **models.options(p, 0.0))

    results = {name: decode_all(dec, prompts, args.max_new_tokens, name) for name, dec in decoders.items()}
    ar_tokens = results["ar"]["tokens"]
    ok = True
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, budget {args.budget}, {args.dtype}")
    print(f"{'policy':<8} {'tau':>6} {'tok/s':>8} {'rss MiB':>8} {'rss +MiB':>9} {'dev +MiB':>9} "
          f"{'compiles':>9} {'same as ar':>10}")
    for name, r in results.items():
        r["identical_to_ar"] = r.pop("tokens") == ar_tokens
        r["ok"] = (r["identical_to_ar"] and r["compiles_after_warmup"] == 0
                   and r["rss_growth_mib"] <= RSS_SLACK_MIB and r["live_device_growth_mib"] <= 0.0)
        ok &= r["ok"]
        print(f"{name:<8} {r['tau']:>6.2f} {r['tokens_per_s']:>8.1f} {r['rss_mib_after_warmup']:>8.0f} "
              f"{r['rss_growth_mib']:>9.1f} {r['live_device_growth_mib']:>9.2f} {r['compiles_after_warmup']:>9} "
              f"{str(r['identical_to_ar']):>10}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {"prompts": str(prompts_file), "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                  "budget": args.budget, "dtype": args.dtype, "rss_slack_mib": RSS_SLACK_MIB}
        args.json.write_text(json.dumps({"config": config, "results": results, "ok": ok}, indent=2))
    print("ok" if ok else "FAILED: a policy grew in memory, recompiled or differed from AR")
    return 0 if ok else 1


if __name__ == "__main__":
    run(main, "python -m decode.longrun")
