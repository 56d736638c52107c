"""`taps-decode`: generate a continuation with AR or speculative decoding.

    taps-decode --prompt TEXT [--policy P] [--mesh D,M] ...
    taps-decode --prompts IN.jsonl --out OUT.jsonl [--batch-size B] [--mesh D,M] ...   (a decoding job)

The job mode (decode/jobs.py) writes one JSON line per prompt as its batch
finishes and, rerun after an interruption, skips the prompts already written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from decode.common import Parser, add_mesh_args, add_model_args, load_models, positive_int, run, setup_mesh
from taps_jax import sharding
from taps_jax.decoder import POLICIES, SpeculativeDecoder


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="taps-decode",
        description="Generate text with lossless speculative decoding (block-diffusion drafter + tree verification).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts", type=Path, metavar="IN.jsonl",
                     help='decoding job: one {"prompt": "...", "id": ...} per line (needs --out)')
    p.add_argument("--out", type=Path, metavar="OUT.jsonl",
                   help="job output: one JSON line per prompt (id, text, num_tokens, finish_reason, tau); "
                        "rerunning skips prompts already written")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="job mode: prompts per batch (default 8; padded to a multiple of the mesh's data axis)")
    add_model_args(p)
    add_mesh_args(p)
    p.add_argument("--policy", choices=POLICIES, default="ddtree",
                   help="ar: plain autoregressive; chain: DFlash argmax path; ddtree: best-first tree (default); "
                        "taps: learned target-aware tree (needs a scorer)")
    p.add_argument("--budget", type=positive_int, default=32, help="non-root tree nodes verified per round (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the top-k tokens when sampling (default 0 = off)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stats", action="store_true", help="print mean accepted length (tau), tokens/s and rounds")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompts is None and not args.prompt:
        raise ValueError("--prompt is empty; give some text to continue")
    if args.prompts is not None and args.out is None:
        raise ValueError("--prompts needs --out OUT.jsonl (where the results go)")
    if args.prompts is None and args.out is not None:
        raise ValueError("--out is for job mode; pass --prompts IN.jsonl too, or drop --out")
    mesh = setup_mesh(args)
    models = load_models(args, mesh)
    if args.prompt is not None and models.target.tokenizer is None:
        raise ValueError("the target has no tokenizer.json, so text prompts cannot be encoded")
    scorer = models.scorer_for(args.temperature)
    if args.policy == "taps" and scorer is None:
        raise ValueError("--policy taps needs a scorer: pass --scorer DIR or a --model dir with scorer/ "
                         "(train one with python -m train.scorer), or use --policy ddtree")
    if args.policy != "ar" and models.drafter is None:
        raise ValueError("speculative policies need a drafter: pass --drafter DIR or a --model dir with drafter/, or use --policy ar")
    decoder = SpeculativeDecoder(models.target, models.drafter, args.policy, args.budget, mesh=mesh,
                                 **({"scorer": scorer} if args.policy == "taps" else {}))
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.prompts is not None:
        from decode.jobs import run_job

        try:
            run_job(decoder, args.prompts, args.out, batch_size=args.batch_size,
                    max_new_tokens=args.max_new_tokens, **kwargs)
        except KeyboardInterrupt:
            print(f"interrupted: finished prompts are in {args.out}; rerun the same command to do the rest",
                  file=sys.stderr)
            return 130
        return 0
    decoder.generate([args.prompt], args.max_new_tokens, **kwargs)  # compile (not timed)
    start = time.perf_counter()
    result = decoder.generate([args.prompt], args.max_new_tokens, **kwargs)
    seconds = time.perf_counter() - start
    if not sharding.is_main_process():
        return 0
    print(args.prompt + result.texts[0])
    if args.stats:
        n = len(result.tokens[0])
        rounds = result.stats.get("rounds", [n])[0]
        tau = result.stats.get("tau", 1.0)
        print(f"[{args.policy}] tokens={n} rounds={rounds} tau={tau:.2f} tokens/s={n / seconds:.1f} "
              f"finish={result.finish_reasons[0]}", file=sys.stderr)
    return 0


def entry() -> None:
    run(main, "taps-decode")


if __name__ == "__main__":
    entry()
