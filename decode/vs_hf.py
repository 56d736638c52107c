"""Side by side with Hugging Face transformers + torch on the same checkpoint: long prompts, or generation.

    python -m decode.vs_hf --prompt-tokens 128,1024,4096,16384 [--target DIR] [--repeats 3] [--json OUT]
    python -m decode.vs_hf --model smollm2 --prompts humaneval [--num-prompts 32] [--policies ar,ddtree] ...

Generation mode (--prompts FILE or humaneval): every prompt decoded at batch
1 for --max-new-tokens (stopping at EOS / end of turn) by each of our
policies, by Hugging Face greedy `generate` and by its prompt-lookup decoding
(`prompt_lookup_num_tokens`), on the same token ids; tokens/s over all
prompts per repeat, and whether our greedy tokens equal Hugging Face's.

Needs the test extra (`pip install -e ".[test]"`: torch and transformers are
test-only references, never runtime dependencies). For each prompt length
both sides run what a user would: a greedy generate of 1 token (= prefill)
and of 1 + `--decode-tokens` tokens; decode ms per token is the difference.
Repeats are interleaved (ours, theirs, ours, ...) so machine drift hits both,
with a pause before each timing so neither side's idle worker threads spin
into the other's;
medians with min-max are printed, and the ratios are of medians. Both run in
float32 on the CPU threads this process has (torch.set_num_threads = the
core count, as XLA uses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from decode.common import (Parser, add_model_args, choice_list, load_models, model_part_dirs, positive_int,
                           read_prompts, run)
from decode.long_prompts import long_prompts
from taps_jax.decoder import DEFAULT_MODEL_DIR, POLICIES, SpeculativeDecoder
from taps_jax import compile_cache


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m decode.vs_hf", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    g = p.add_argument_group("generation mode")
    g.add_argument("--prompts", type=Path, default=None, metavar="FILE|humaneval",
                   help="generation mode: a prompt file (JSONL) or 'humaneval' (its problems as chat turns)")
    g.add_argument("--chat", action="store_true", help="render text prompts as one user turn of the chat template")
    g.add_argument("--num-prompts", type=positive_int, default=None, help="use only the first N prompts")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per prompt (default 128)")
    g.add_argument("--policies", type=choice_list(POLICIES), default=["ar"],
                   help="our policies to time (default ar; speculative ones need the set's drafter)")
    g.add_argument("--budget", type=positive_int, default=8, help="tree budget of our tree policies (default 8)")
    g.add_argument("--lookup-tokens", type=positive_int, default=10,
                   help="Hugging Face prompt lookup: prompt_lookup_num_tokens (default 10)")
    p.add_argument("--prompt-tokens", type=_int_list, default=[128, 1024, 4096, 16384],
                   help="prompt lengths (default 128,1024,4096,16384)")
    p.add_argument("--decode-tokens", type=positive_int, default=128,
                   help="new tokens timed after the prompt (default 128)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats per side (default 3)")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text to cut prompts from (default: held-out corpus)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    compile_cache.add_flag(p)
    return p


def _timed(fn) -> float:
    time.sleep(0.5)  # let the other side's worker threads stop spinning (torch's OpenMP pool busy-waits)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def hf_model(target_path: Path):
    """transformers' model of the same checkpoint: a HF dir, or a GGUF file through its own GGUF loader."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    if Path(target_path).is_file():  # GGUF (transformers dequantizes it itself; needs accelerate)
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(Path(target_path).parent), gguf_file=Path(target_path).name, dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32).eval()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    compile_cache.setup(args)
    from decode.common import check_output_path

    check_output_path(args.json)
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("this comparison needs torch and transformers: pip install -e \".[test]\"") from None
    if args.prompts is not None:
        return generation(args)
    from taps_jax import load_target

    target_dir = args.target or DEFAULT_MODEL_DIR / "target"
    ours = load_target(target_dir)
    theirs = hf_model(target_dir)
    prompts = long_prompts(ours, args.prompt_tokens, 1, args.text)
    D = args.decode_tokens

    def hf_generate(ids, n):
        with torch.no_grad():
            return theirs.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=0)

    rows = []
    for n, (ids,) in prompts.items():
        ours.generate([ids], 1, stop_at_eos=False), ours.generate([ids], 1 + D, stop_at_eos=False)  # compile
        hf_generate(ids, 1)  # warm up
        t = {k: [] for k in ("ours_prefill", "ours_total", "hf_prefill", "hf_total")}
        for _ in range(args.repeats):
            t["ours_prefill"].append(_timed(lambda: ours.generate([ids], 1, stop_at_eos=False)))
            t["hf_prefill"].append(_timed(lambda: hf_generate(ids, 1)))
            t["ours_total"].append(_timed(lambda: ours.generate([ids], 1 + D, stop_at_eos=False)))
            t["hf_total"].append(_timed(lambda: hf_generate(ids, 1 + D)))
        med = {k: statistics.median(v) for k, v in t.items()}
        row = {
            "prompt_tokens": n,
            "ours_prefill_ms": med["ours_prefill"] * 1e3, "hf_prefill_ms": med["hf_prefill"] * 1e3,
            "ours_prefill_ms_range": [min(t["ours_prefill"]) * 1e3, max(t["ours_prefill"]) * 1e3],
            "hf_prefill_ms_range": [min(t["hf_prefill"]) * 1e3, max(t["hf_prefill"]) * 1e3],
            "ours_prefill_tokens_per_s": n / med["ours_prefill"], "hf_prefill_tokens_per_s": n / med["hf_prefill"],
            "prefill_speedup_vs_hf": med["hf_prefill"] / med["ours_prefill"],
            "ours_decode_ms_per_token": (med["ours_total"] - med["ours_prefill"]) * 1e3 / D,
            "hf_decode_ms_per_token": (med["hf_total"] - med["hf_prefill"]) * 1e3 / D,
        }
        row["decode_speedup_vs_hf"] = row["hf_decode_ms_per_token"] / row["ours_decode_ms_per_token"]
        rows.append(row)
        print(f"{n:>6} tokens  prefill ours {row['ours_prefill_ms']:9.1f} ms "
              f"({row['ours_prefill_ms_range'][0]:.0f}-{row['ours_prefill_ms_range'][1]:.0f})  "
              f"hf {row['hf_prefill_ms']:9.1f} ms ({row['hf_prefill_ms_range'][0]:.0f}-{row['hf_prefill_ms_range'][1]:.0f})"
              f"  x{row['prefill_speedup_vs_hf']:.2f}   decode ours {row['ours_decode_ms_per_token']:6.2f} "
              f"hf {row['hf_decode_ms_per_token']:6.2f} ms/token  x{row['decode_speedup_vs_hf']:.2f}", flush=True)
    base = rows[0]["ours_decode_ms_per_token"]
    for row in rows:
        row["ours_decode_vs_shortest"] = row["ours_decode_ms_per_token"] / base
    print(f"ours, decode ms/token relative to the {rows[0]['prompt_tokens']}-token prompt: "
          + ", ".join(f"{r['prompt_tokens']}: x{r['ours_decode_vs_shortest']:.2f}" for r in rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": str(target_dir), "repeats": args.repeats,
                                         "decode_tokens": D, "rows": rows}, indent=2))
    return 0


def generation(args) -> int:
    """Our policies, HF greedy and HF prompt lookup on the same prompts: tokens/s, interleaved repeats."""
    import torch

    args.temperature = 0.0
    models = load_models(args)
    if any(p != "ar" for p in args.policies) and models.drafter is None:
        raise ValueError(models.missing_drafter())
    target = models.target
    prompts = read_prompts(args.prompts, args.chat, args.num_prompts)
    ids = target.encode(prompts)
    theirs = hf_model(model_part_dirs(args)["target"])
    N, eos = args.max_new_tokens, list(target.eos_ids) or None
    decoders = {}
    for policy in args.policies:
        extra = models.options(policy, 0.0)
        if policy == "taps" and extra["scorer"] is None:
            raise ValueError("--policies taps needs a scorer in the model set")
        decoders[policy] = SpeculativeDecoder(target, models.drafter, policy, args.budget, **extra)

    def hf(prompt_ids, **kw):
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt_ids]), max_new_tokens=N, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos[0] if eos else 0, **kw)
        return out[0, len(prompt_ids):].tolist()

    sides = {f"ours {p}": (lambda x, d=d: d.generate([x], N).tokens[0]) for p, d in decoders.items()}
    sides["hf greedy"] = hf
    sides["hf prompt lookup"] = lambda x: hf(x, prompt_lookup_num_tokens=args.lookup_tokens)
    tokens = {name: [fn(x) for x in ids] for name, fn in sides.items()}  # warm-up pass: compiles, and the outputs
    times = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            times[name].append(_timed(lambda fn=fn: [fn(x) for x in ids]))
    reference = tokens["hf greedy"]
    rows = []
    for name in sides:
        n = sum(map(len, tokens[name]))
        rates = [n / t for t in times[name]]
        rows.append({"side": name, "tokens": n, "tokens_per_s": statistics.median(rates),
                     "tokens_per_s_range": [min(rates), max(rates)],
                     "equal_to_hf_greedy": sum(a == b for a, b in zip(tokens[name], reference))})
    hf_rate = next(r["tokens_per_s"] for r in rows if r["side"] == "hf greedy")
    lookup_rate = next(r["tokens_per_s"] for r in rows if r["side"] == "hf prompt lookup")
    print(f"{len(ids)} prompts ({args.prompts}), {N} new tokens at most, batch 1, float32, {args.repeats} "
          f"interleaved repeats (median, min-max); equal: prompts whose tokens equal HF greedy's")
    print(f"{'side':<22}{'tokens':>8}{'tok/s':>9}{'(min-max)':>15}{'x hf greedy':>13}{'x hf lookup':>13}{'equal':>7}")
    for r in rows:
        r["vs_hf_greedy"], r["vs_hf_lookup"] = r["tokens_per_s"] / hf_rate, r["tokens_per_s"] / lookup_rate
        lo, hi = r["tokens_per_s_range"]
        print(f"{r['side']:<22}{r['tokens']:>8}{r['tokens_per_s']:>9.1f}{f'{lo:.1f}-{hi:.1f}':>15}"
              f"{r['vs_hf_greedy']:>13.2f}{r['vs_hf_lookup']:>13.2f}{r['equal_to_hf_greedy']:>4}/{len(ids)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"prompts": str(args.prompts), "num_prompts": len(ids), "max_new_tokens": N,
                                         "budget": args.budget, "repeats": args.repeats, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    run(main, "python -m decode.vs_hf")
