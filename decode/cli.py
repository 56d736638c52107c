"""`taps-decode`: generate a continuation with AR or speculative decoding.

    taps-decode --prompt TEXT [--policy P] [--mesh D,M] ...
    taps-decode --chat [--prompt TEXT] ...   (one user turn; without --prompt an interactive session)
    taps-decode --prompts IN.jsonl --out OUT.jsonl [--batch-size B] [--static-batches] [--shard I/N] ...   (a job)

The job mode (decode/jobs.py) writes one JSON line per prompt as it
finishes (a finished row takes the next prompt; --static-batches: as its
batch finishes) and, rerun after an interruption, skips the prompts already written.
Everything a job can refuse (its output, its settings, the scorer's target)
is checked before any model is loaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# flax asks IPython at import whether it runs in a notebook (0.35 s to import IPython): outside one the answer is
# no either way, so IPython stays unimported while the models' libraries load (and importable after).
_NO_IPYTHON = "IPython" not in sys.modules
if _NO_IPYTHON:
    sys.modules["IPython"] = None
try:
    from decode.common import (Parser, add_mesh_args, add_model_args, load_models, model_part_dirs, positive_int, run,
                               setup_mesh)
    from taps_jax import compile_cache, sharding
    from taps_jax.checkpoints.scorer import check_scorer_dir_for_target
    from taps_jax.decoder import POLICIES, SpeculativeDecoder
    from taps_jax.calls import STREAM_CHUNK
    from taps_jax.engine.prefill import PREFILL_CHUNK
    from taps_jax.prompt_file import check_text
    from taps_jax.session import SESSION_CHUNK, SESSION_CONTEXT
finally:
    if _NO_IPYTHON and sys.modules.get("IPython", 0) is None:
        del sys.modules["IPython"]


def shard_arg(text: str):
    from decode.jobs import Shard

    try:
        return Shard.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _costs(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r}") from None
    if not all(v > 0 and v != float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="taps-decode",
        description="Generate text with lossless speculative decoding (block-diffusion drafter + tree verification).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (one of --prompt, --prompts, --chat is needed)")
    src.add_argument("--prompts", type=Path, metavar="IN.jsonl",
                     help='decoding job: one {"prompt": "..."} (or {"ids": [...]} or {"messages": [...]}) per line, '
                          'each with an optional unique "id" (default: the line\'s index); needs --out')
    p.add_argument("--chat", action="store_true",
                   help="talk to an instruct model through its chat template: --prompt TEXT is one user turn and "
                        "prints the answer; a job's text prompts become user turns; without --prompt/--prompts an "
                        "interactive session that streams each answer (Ctrl-D ends it). Answers stop at the "
                        "template's end-of-turn token")
    p.add_argument("--out", type=Path, metavar="OUT.jsonl",
                   help="job output: one JSON line per prompt (id, text, num_tokens, finish_reason, tau); "
                        "rerunning skips prompts already written")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="job mode: prompts decoded at once (default 8; padded to a multiple of the mesh's data axis)")
    p.add_argument("--static-batches", action="store_true",
                   help="job mode: decode in batches that each end with their longest answer (rows that stopped "
                        "ride along) instead of the default continuous batching, where a finished row takes the next "
                        "prompt (a data-parallel mesh always uses static batches)")
    p.add_argument("--refill-rows", type=positive_int, default=None, metavar="K",
                   help="job mode: continuous batching returns to the host when K rows have finished and refills "
                        "them at once (default: an eighth of --batch-size, at least 1); at most --batch-size")
    p.add_argument("--shard", type=shard_arg, metavar="I/N",
                   help="job mode: decode only shard I of N (every N-th prompt by id, I from 0) into its own --out; "
                        "join the shards with python -m decode.merge")
    p.add_argument("--force-new", action="store_true",
                   help="job mode: start --out afresh; an existing OUT and its manifest are moved aside to "
                        "OUT.old1, ... (never deleted)")
    add_model_args(p)
    add_mesh_args(p)
    compile_cache.add_flag(p)
    p.add_argument("--policy", choices=POLICIES, default="adaptive",
                   help="ar: plain autoregressive; chain: DFlash argmax path; ddtree: best-first tree; "
                        "taps: learned target-aware tree (needs a scorer); adaptive (default): each round picks a "
                        "budget up to --budget, down to a plain AR step, by expected tokens per unit cost (TAPS "
                        "trees with a scorer, DDTree trees otherwise)")
    p.add_argument("--budget", type=positive_int, default=32,
                   help="non-root tree nodes verified per round (default 32); adaptive: the largest tree")
    p.add_argument("--adaptive-costs", type=_costs, default=None, metavar="C0,C1,...",
                   help="adaptive: cost of one round of each budget (0, budget/8, budget/4, budget/2, budget; "
                        "any unit) instead of the calibration measured once per device and shape and cached "
                        "under ~/.cache/taps-jax")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the top-k tokens when sampling (default 0 = off)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--prefill-chunk", type=positive_int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per prefill step (default {PREFILL_CHUNK}); prefill memory grows with "
                        "chunk x context, so lower it for very long prompts on small devices")
    p.add_argument("--context", type=positive_int, default=None, metavar="N",
                   help=f"chat session: conversation tokens its caches hold (default {SESSION_CONTEXT}, or what the "
                        "target's context allows); its programs compile once for this size")
    p.add_argument("--stats", action="store_true",
                   help="print mean accepted length (tau), rounds, tokens/s, compile and decode seconds to stderr")
    p.add_argument("--stream", action="store_true",
                   help=f"print the text as it is produced (every {STREAM_CHUNK} rounds; same tokens as without)")
    return p


def check_args(args) -> None:
    """Flag combinations and text, before anything is loaded."""
    if args.prompts is None and args.prompt is None and not args.chat:
        raise ValueError("give --prompt TEXT, --prompts IN.jsonl --out OUT.jsonl (a job), or --chat (a session)")
    if args.prompts is None and args.prompt is not None and not args.prompt:
        raise ValueError("--prompt is empty; give some text to continue")
    if args.prompt is not None:
        check_text(args.prompt, "--prompt", from_argv=True,
                   hint="give text, or for raw token ids use --prompts FILE with {\"ids\": [...]} lines")
    if args.prompts is not None and args.out is None:
        raise ValueError("--prompts needs --out OUT.jsonl (where the results go)")
    if args.prompts is None and args.out is not None:
        raise ValueError("--out is for job mode; pass --prompts IN.jsonl too, or drop --out")
    if args.prompts is not None and args.stream:
        raise ValueError("--stream is for a single --prompt; a job (--prompts) writes each result to --out as its "
                         "prompt finishes")
    if args.adaptive_costs is not None:
        if args.policy != "adaptive":
            raise ValueError("--adaptive-costs is for --policy adaptive; drop it or use --policy adaptive")
        from taps_jax.engine.adaptive import AdaptiveConfig

        budgets = AdaptiveConfig.for_budget(args.budget).budgets
        if len(args.adaptive_costs) != len(budgets):
            raise ValueError(f"--adaptive-costs needs {len(budgets)} values, one per budget "
                             f"{','.join(map(str, budgets))} of --budget {args.budget}; got {len(args.adaptive_costs)}")
    if args.context is not None and not (args.chat and args.prompt is None and args.prompts is None):
        raise ValueError("--context sizes an interactive chat session (--chat without --prompt/--prompts); drop it")
    for flag, value in (("--shard", args.shard), ("--force-new", args.force_new),
                        ("--static-batches", args.static_batches), ("--refill-rows", args.refill_rows)):
        if args.prompts is None and value:
            raise ValueError(f"{flag} is for job mode; pass --prompts IN.jsonl --out OUT.jsonl too, or drop {flag}")
    if args.refill_rows is not None and args.static_batches:
        raise ValueError("--refill-rows is for continuous batching; drop it or drop --static-batches")
    if args.refill_rows is not None and args.refill_rows > args.batch_size:
        raise ValueError(f"--refill-rows {args.refill_rows} is more than --batch-size {args.batch_size}: a refill "
                         "fills at most every row; lower it")


def build_decoder(args, mesh) -> SpeculativeDecoder:
    models = load_models(args, mesh)
    if args.prompt is not None and models.target.tokenizer is None:
        raise ValueError("the target has no tokenizer.json, so text prompts cannot be encoded")
    scorer = models.scorer_for(args.temperature)
    if args.policy == "taps" and scorer is None:
        raise ValueError("--policy taps needs a scorer: pass --scorer DIR or a --model dir with scorer/ "
                         "(train one with python -m train.scorer), or use --policy ddtree")
    extra = {"costs": args.adaptive_costs} if args.adaptive_costs is not None else {}
    return models.decoder(args.policy, args.budget, args.temperature, mesh=mesh, prefill_chunk=args.prefill_chunk,
                          **extra)


def open_cli_job(args, dirs: dict):
    """The job of --prompts/--out, checked and locked: its settings come from the flags and the part dirs."""
    from decode import jobs

    models = {name: jobs.part_digest(d) if d is not None else None for name, d in dirs.items()}
    settings = jobs.JobSettings.create(models, args.policy, args.budget, args.dtype, args.max_new_tokens,
                                       args.temperature, args.top_k, args.top_p, args.seed, chat=args.chat)
    return jobs.open_job(args.prompts, args.out, settings, shard=args.shard, force_new=args.force_new)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    compile_cache.setup(args)  # before anything compiles
    mesh = setup_mesh(args)
    dirs = model_part_dirs(args)
    if args.policy in ("taps", "adaptive") and dirs["scorer"] is not None:
        check_scorer_dir_for_target(dirs["scorer"], dirs["target"])
    if args.prompts is not None:
        from decode.jobs import decode_job

        with open_cli_job(args, dirs) as job:  # every refusal comes before any model is loaded
            decoder = build_decoder(args, mesh)
            try:
                decode_job(decoder, job, batch_size=args.batch_size, static_batches=args.static_batches,
                           refill_rows=args.refill_rows)
            except KeyboardInterrupt:
                print(f"interrupted: finished prompts are in {args.out}; rerun the same command to do the rest",
                      file=sys.stderr)
                return 130
        return 0
    decoder = build_decoder(args, mesh)
    if args.chat and (decoder.target.tokenizer is None or decoder.target.tokenizer.chat_template is None):
        raise ValueError("--chat needs a target with a chat template (tokenizer_config.json chat_template or a "
                         "GGUF's tokenizer.chat_template); this one has none: drop --chat")
    if args.chat and args.prompt is None:
        return chat_session(decoder, args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    result = decode_one(decoder, args, prompt, "" if args.chat else args.prompt)
    show_stats(args, result)
    return 0


def decode_one(decoder, args, prompt, echo: str):
    """Decode one prompt (text or conversation), printing `echo` + the text (streamed with --stream)."""
    begin = time.perf_counter()  # compile_s: the whole wait before decoding (prepare may calibrate, and compile)
    call = decoder.prepare([prompt], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed)
    call.compile(stream=args.stream)  # ahead of time: the prompt is decoded once, compile timed apart
    waited = time.perf_counter() - begin
    show = sharding.is_main_process()
    if args.stream:
        printed = TextDeltas(echo) if show else None  # every process decodes, one prints
        for result in call.stream():
            if printed:
                printed.show(result.texts[0])
        if printed:
            printed.show(result.texts[0], final=True)
    else:
        result = call.run()
        if show:
            print(echo + result.texts[0])
    result.stats["compile_s"] = waited
    return result


def chat_session(decoder, args) -> int:
    """A multi-turn conversation on stdin/stdout: each line is a user turn, each answer is streamed.

    The conversation's caches stay on device between turns (`taps_jax.session`): a turn prefills only its new
    tokens, and the session's programs compile once, when it opens."""
    args.stream = True
    begin = time.perf_counter()  # the wait before the first turn: an adaptive decoder's calibration, then compiles
    session = decoder.session(args.max_new_tokens, context=args.context, chunk=min(args.prefill_chunk, SESSION_CHUNK),
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    session.compile()  # before the first turn is read: no turn waits for a compile
    waited = time.perf_counter() - begin
    messages = []
    interactive = sys.stdin.isatty()
    show = sharding.is_main_process()
    if show and interactive:
        print("chat: type a message and press Enter; Ctrl-D ends the session", file=sys.stderr)
    while True:
        if show and interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:  # EOF (Ctrl-D)
            if show and interactive:
                print(file=sys.stderr)
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        check_text(text, "the message", from_argv=True, hint="type UTF-8 text")
        messages.append({"role": "user", "content": text})
        printed = TextDeltas("") if show else None  # every process decodes, one prints
        for result in session.turn(list(messages)):
            if printed:
                printed.show(result.texts[0])
        if printed:
            printed.show(result.texts[0], final=True)
        result.stats["compile_s"], waited = waited, 0.0  # the session's compile: before the first turn only
        messages.append({"role": "assistant", "content": result.texts[0]})
        show_stats(args, result)


def show_stats(args, result) -> None:
    show = sharding.is_main_process()
    if show and args.stats:
        n = len(result.tokens[0])
        rounds = result.stats.get("rounds", [n])[0]
        tau = result.stats.get("tau", 1.0)
        decode_s = result.stats["decode_s"]
        prefill = result.stats.get("prefill_tokens")  # a chat session's turn: the prompt tokens it ran, and reused
        cached = "" if prefill is None else f"prefill_tokens={prefill} cached_tokens={result.stats['cached_tokens']} "
        print(f"[{args.policy}] tokens={n} rounds={rounds} tau={tau:.2f} tokens/s={n / decode_s:.1f} "
              f"compile_s={result.stats['compile_s']:.2f} decode_s={decode_s:.2f} {cached}"
              f"finish={result.finish_reasons[0]}", file=sys.stderr)


class TextDeltas:
    """Prints a growing text as it grows: only what follows what is already out.

    A partial token sequence can end inside a multi-byte character (decoded as
    U+FFFD), so text ending in U+FFFD is held back until the next chunk;
    the final call prints the rest, so stdout is exactly what the
    non-streamed command prints.
    """

    def __init__(self, prompt: str):
        self.done = ""
        sys.stdout.write(prompt)
        sys.stdout.flush()

    def show(self, text: str, final: bool = False) -> None:
        stable = text if final else text.rstrip("\ufffd").rstrip()  # a later token may still change these
        if stable.startswith(self.done) and len(stable) > len(self.done):
            sys.stdout.write(stable[len(self.done):])
            self.done = stable
        if final:
            sys.stdout.write("\n")
        sys.stdout.flush()


def entry() -> None:
    outermost = _called_by_the_script()
    try:
        run(main, "taps-decode")
    except SystemExit as done:
        if outermost:
            exit_now(done.code)
        raise


def _called_by_the_script() -> bool:
    """Whether entry()'s caller is the program itself (the taps-decode script, or python -m decode.cli), with
    nothing above it that runs after entry() returns (a profiler, coverage, a test) and no tracer."""
    frame = sys._getframe(2).f_back  # above the caller of entry()
    while frame is not None and frame.f_code.co_filename.endswith("runpy.py"):
        frame = frame.f_back
    return frame is None and sys.gettrace() is None and sys.getprofile() is None


def exit_now(code) -> None:
    """Exit at once with `code`, skipping the interpreter's teardown and JAX's (1 s of freeing programs, backends
    and modules that the OS frees anyway), after all that exit does for the outside world: stdout and stderr
    flushed, the other atexit handlers run (logging, file locks, finalizers such as temporary directories).
    Returns, for a normal exit, after a decoding job (minutes long: nothing to gain, its files stay Python's to
    close), in a jax.distributed run (JAX's exit shuts it down), while another thread runs, or when the code is
    not a number."""
    import atexit
    import os
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if others or (code is not None and not isinstance(code, int)) or "decode.jobs" in sys.modules:
        return
    if "jax" in sys.modules:
        from jax._src import api, distributed

        if getattr(distributed.global_state, "client", True) is not None:
            return
        atexit.unregister(api.clean_up)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return  # the normal exit reports it
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        os._exit(120)  # what Python exits with when its final flush fails
    os._exit(code or 0)


if __name__ == "__main__":
    entry()
