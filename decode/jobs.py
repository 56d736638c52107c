"""Decoding jobs over a prompt file: what a pod job runs (`taps-decode --prompts IN --out OUT`).

Input: JSONL, one object per line with a string "prompt" (or "ids", a list
of token ids) and an optional "id" (a string or an integer; default: the
prompt's 0-based position among the file's prompts). Ids must be unique.

Output: JSONL, one line per prompt, appended as soon as its batch finishes:
    {"id": ..., "text": "<continuation>", "num_tokens": N, "finish_reason": "eos"|"length"|"capacity",
     "tau": <mean accepted tokens per round for this prompt; 1.0 for ar>}
(plus "token_ids" when the target has no tokenizer).
Lines are in completion order, not input order (join on "id").

Batching: prompts are tokenized, sorted by length, grouped into power-of-two
length buckets and cut into batches of --batch-size inside each bucket, so a
batch pads little and every (batch, length) bucket compiles once. A batch is
padded to a multiple of the mesh's data axis by the decoder.

Restart safety (preemption, SIGKILL, Ctrl-C): each finished batch is written
with ONE append `write` of whole lines followed by `fsync`. On start the
output file is scanned: a torn last line (no newline, or not JSON) is cut
off, and prompts whose id is already there are skipped. So after any number
of interruptions every prompt appears exactly once and every line parses.

Multi-host: all processes run the same batches (process 0 decides what is
left and broadcasts it); only process 0 writes the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

from taps_jax.engine.batching import bucket
from taps_jax.prompt_file import PromptRecord, prompt_key, read_prompt_file


def recover_output(path) -> set[str]:
    """Ids (as `_key`) already in an output file; a torn tail is truncated away.

    Everything after the last complete, parseable line is cut, so the next
    append starts on a fresh line. Prompts of cut lines are decoded again.
    """
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    done, keep, start = set(), 0, 0
    while True:
        end = data.find(b"\n", start)
        if end < 0:
            break
        line = data[start:end]
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError
        except ValueError:
            if line.strip():
                break  # a damaged line: keep what precedes it, redo the rest
            record = None
        if record is not None:
            done.add(prompt_key(record["id"]))
        keep = start = end + 1
    if keep < len(data):
        tqdm.write(f"{path}: dropping {len(data) - keep} bytes of an incomplete last line "
                   "(from an interrupted run); those prompts are decoded again", file=sys.stderr)
        with path.open("r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return done


def plan_batches(items: list[tuple[PromptRecord, int]], batch_size: int) -> list[list[PromptRecord]]:
    """(prompt, token count) pairs -> batches of one length bucket each, shortest first."""
    ordered = sorted(items, key=lambda it: (bucket(it[1]), it[1]))
    batches: list[list[PromptRecord]] = []
    current, current_bucket = [], None
    for prompt, n in ordered:
        b = bucket(n)
        if current and (b != current_bucket or len(current) == batch_size):
            batches.append(current)
            current = []
        current_bucket = b
        current.append(prompt)
    if current:
        batches.append(current)
    return batches


def _batch_seed(seed: int, batch: list[PromptRecord]) -> int:
    """A per-batch seed that does not depend on what an earlier run already finished."""
    return (seed + zlib.crc32(prompt_key(batch[0].id).encode())) % (2**31 - 1)


def _append(fd: int, lines: list[str]) -> None:
    data = "".join(lines).encode("utf-8")
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
    os.fsync(fd)


def run_job(decoder, prompts_path, out_path, *, batch_size: int = 8, max_new_tokens: int = 128,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
            progress: bool = True) -> dict:
    """Decode every prompt of `prompts_path` not yet in `out_path`; returns a summary dict."""
    import jax

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {batch_size!r}")
    prompts = read_prompt_file(prompts_path)
    out_path = Path(out_path)
    main = jax.process_index() == 0
    done = recover_output(out_path) if main else set()
    todo_mask = np.array([prompt_key(p.id) not in done for p in prompts])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        todo_mask = np.asarray(multihost_utils.broadcast_one_to_all(todo_mask))
    todo = [p for p, left in zip(prompts, todo_mask) if left]
    skipped = len(prompts) - len(todo)
    summary = {"prompts": len(prompts), "skipped": skipped, "written": 0, "tokens": 0, "seconds": 0.0}
    progress = progress and main  # one progress report per job, from process 0
    if not todo:
        if progress:
            tqdm.write(f"{out_path}: all {len(prompts)} prompts are already done", file=sys.stderr)
        return summary
    ids = decoder.target.encode([p.prompt for p in todo])  # checks every prompt before any work
    batches = plan_batches(list(zip(todo, map(len, ids))), batch_size)
    if progress and skipped:
        tqdm.write(f"{out_path}: {skipped} prompts already done (from an earlier run); {len(todo)} to go",
                   file=sys.stderr)
    if progress:
        from taps_jax.sharding import describe

        tqdm.write(f"decoding {len(todo)} prompts in {len(batches)} batches (up to {batch_size} prompts, one length "
                   f"bucket each) on {describe(getattr(decoder, 'mesh', None))}", file=sys.stderr)

    fd = None
    if main:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    bar = tqdm(total=len(todo), unit="prompt", desc="decode", disable=not progress, dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 30.0, file=sys.stderr)
    start = time.perf_counter()
    tokens = rounds = accepted = 0
    try:
        for batch in batches:
            res = decoder.generate([p.prompt for p in batch], max_new_tokens, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=_batch_seed(seed, batch))
            lines = []
            for i, p in enumerate(batch):
                n = len(res.tokens[i])
                if "accepted_lengths" in res.stats:
                    acc = res.stats["accepted_lengths"][i]
                    tau = float(sum(acc) / max(len(acc), 1))
                    rounds += len(acc)
                    accepted += sum(acc)
                else:
                    tau = 1.0
                    rounds += n
                    accepted += n
                record = {"id": p.id, "text": res.texts[i] if res.texts is not None else None,
                          "num_tokens": n, "finish_reason": res.finish_reasons[i], "tau": tau}
                if res.texts is None:
                    record["token_ids"] = res.tokens[i]
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                tokens += n
            if fd is not None:
                _append(fd, lines)
            summary["written"] += len(batch)
            elapsed = time.perf_counter() - start
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / max(elapsed, 1e-9):,.0f}", tau=f"{accepted / max(rounds, 1):.2f}",
                            refresh=False)
    finally:
        bar.close()
        if fd is not None:
            os.close(fd)
    elapsed = time.perf_counter() - start
    summary.update(tokens=tokens, seconds=elapsed, tau=accepted / max(rounds, 1))
    if progress:
        tqdm.write(f"wrote {summary['written']} prompts to {out_path} ({skipped} were already done): "
                   f"{summary['written'] / elapsed:.2f} prompts/s, {tokens / elapsed:,.1f} tokens/s, "
                   f"tau {summary['tau']:.2f}", file=sys.stderr)
    return summary
