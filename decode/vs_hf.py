"""Long prompts side by side with Hugging Face transformers + torch on the same checkpoint.

    python -m decode.vs_hf --prompt-tokens 128,1024,4096,16384 [--target DIR] [--repeats 3] [--json OUT]

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

from decode.common import Parser, positive_int, run
from decode.long_prompts import long_prompts
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
    p.add_argument("--target", type=Path, default=None,
                   help="target checkpoint dir in Hugging Face layout (default: the embedded set's target)")
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    compile_cache.setup(args)
    from decode.common import check_output_path

    check_output_path(args.json)
    try:
        import torch
        import transformers
    except ImportError:
        raise ValueError("this comparison needs torch and transformers: pip install -e \".[test]\"") from None
    from taps_jax import load_target
    from taps_jax.decoder import DEFAULT_MODEL_DIR

    target_dir = args.target or DEFAULT_MODEL_DIR / "target"
    ours = load_target(target_dir)
    torch.set_num_threads(os.cpu_count() or 1)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
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


if __name__ == "__main__":
    run(main, "python -m decode.vs_hf")
