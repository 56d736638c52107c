"""A decoding job with continuous batching beside the same job in static batches, in one process.

    python -m decode.job_bench [--model default] [--policy ar] [--num-prompts 64] [--batch-size 8]
        [--max-new-tokens 128] [--stop-text " def"] [--refill-rows 1,2,4] [--repeats 3]

Each mode first runs the whole job once untimed (compiles; adaptive: the
cost calibration), then `--repeats` timed runs in which the modes take
turns, each into a fresh output. Reports per mode the median tokens/s, the
slot utilisation (the share of batch-row loop steps that decoded a prompt)
and the ratio to static batches, and checks that greedy texts agree.
--stop-text adds the token(s) of that text as stop ids, so that answers
end at mixed lengths on a model whose EOS rarely comes (the embedded
default stops at " def": where the next function would begin).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from decode import jobs
from decode.common import positive_int
from taps_jax.api import Target
from taps_jax.decoder import POLICIES, load_model_set

HELDOUT = Path(__file__).resolve().parent.parent / "taps_jax" / "assets" / "default" / "prompts_heldout.jsonl"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode.job_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a model set (name or directory; default: default)")
    p.add_argument("--policy", choices=POLICIES, default="ar")
    p.add_argument("--budget", type=positive_int, default=16)
    p.add_argument("--prompts", type=Path, default=HELDOUT, help="a job prompt file (default: the default set's)")
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--stop-text", default=" def", help="text whose tokens also stop an answer ('' for EOS only)")
    p.add_argument("--refill-rows", type=_ints, default=[2], help="continuous runs to time, by K (default 2)")
    p.add_argument("--repeats", type=positive_int, default=3)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    models = load_model_set(args.model)
    target = models.target
    stops = tuple(target.tokenizer.encode(args.stop_text)) if args.stop_text else ()
    target = Target(target.model, target.tokenizer, tuple(dict.fromkeys(target.eos_ids + stops)))
    models.target = target
    decoder = models.decoder(args.policy, args.budget)
    work = Path(tempfile.mkdtemp(prefix="job_bench"))
    lines = args.prompts.read_text().splitlines(keepends=True)[:args.num_prompts]
    prompts = work / "in.jsonl"
    prompts.write_text("".join(lines))
    modes = {"static": dict(static_batches=True), **{f"refill {k}": dict(refill_rows=k) for k in args.refill_rows}}
    runs = {name: [] for name in modes}
    texts = {}
    for repeat in range(args.repeats + 1):  # repeat 0: compiles, untimed
        for name, options in modes.items():
            out = work / f"{name.replace(' ', '_')}_{repeat}.jsonl"
            summary = jobs.run_job(decoder, prompts, out, batch_size=args.batch_size,
                                   max_new_tokens=args.max_new_tokens, progress=False, **options)
            if repeat:
                runs[name].append(summary)
            texts[name] = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    reasons = [json.loads(line)["finish_reason"] for line in (work / "static_0.jsonl").read_text().splitlines()]
    print(f"{args.num_prompts} prompts, {args.policy} at batch {args.batch_size}, max_new_tokens "
          f"{args.max_new_tokens}, stop ids {target.eos_ids}: {reasons.count('eos')} stop early, "
          f"{reasons.count('length')} run to the limit")
    base = statistics.median(s["tokens"] / s["seconds"] for s in runs["static"])
    for name, summaries in runs.items():
        rate = statistics.median(s["tokens"] / s["seconds"] for s in summaries)
        print(f"{name:>10}: {rate:8.1f} tokens/s (x{rate / base:.2f} of static), slot utilisation "
              f"{summaries[0]['utilisation']:.0%}, {summaries[0]['tokens']} tokens")
    same = all(texts[name] == texts["static"] for name in texts)
    print("greedy texts agree across modes" if same else "texts differ across modes (sampled, or a float tie)")
    return 0 if same or decoder.policy != "ar" else 1


if __name__ == "__main__":
    sys.exit(main())
