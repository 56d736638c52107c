"""The pretraining corpus: the `.py` files of the running interpreter's stdlib.

The embedded default model set (target, drafter, scorer) is trained on Python
source that every machine already has, so no download is needed and the data
is identical wherever the same Python version runs.

Split: by file, from sha1 of the relative path (`taps_jax/corpus.py` says how).

Another tree of Python code can stand in for the stdlib: pass `--corpus DIR`
to `python -m train.target / train.distill / train.traces / train.recipe`
(or set TAPS_CORPUS_ROOT=DIR); the same hash splits its files.

Files that are not valid UTF-8 (a few deliberately mis-encoded test inputs)
are skipped and counted, never decoded with replacement characters.

    python -m train.corpus                                  # stats per split
    python -m train.corpus --prompts runs/default/prompts_heldout.jsonl
    python -m train.corpus --root DIR --kind rewrite --prompts rewrite.jsonl   # answers that repeat the prompt
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import random
import re
from collections.abc import Collection, Iterator
from pathlib import Path

# The split itself (files, hash buckets, the corpus root) is taps_jax.corpus, shared with decode/.
from taps_jax.corpus import (CORPUS_ROOT_ENV, SPLITS, SourceFile, Split, files_of, iter_documents,  # noqa: F401
                             iter_texts, list_stdlib_files, split_of, stdlib_root)


@contextlib.contextmanager
def root_override(root: Path | None) -> Iterator[None]:
    """Inside the block the corpus is the .py tree under `root` (None: unchanged); the environment is restored."""
    if root is None:
        yield
        return
    previous = os.environ.get(CORPUS_ROOT_ENV)
    os.environ[CORPUS_ROOT_ENV] = str(Path(root).resolve())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(CORPUS_ROOT_ENV, None)
        else:
            os.environ[CORPUS_ROOT_ENV] = previous


@dataclasses.dataclass(frozen=True)
class SplitStats:
    files: int  # decodable files
    bytes: int  # UTF-8 bytes of decodable files
    skipped: int  # files that are not valid UTF-8


def corpus_stats(root: Path | None = None) -> dict[str, SplitStats]:
    counts = {s: [0, 0, 0] for s in SPLITS}
    for f in list_stdlib_files(root):
        data = f.path.read_bytes()
        c = counts[f.split]
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            c[2] += 1
            continue
        c[0] += 1
        c[1] += len(data)
    return {s: SplitStats(*c) for s, c in counts.items()}


# ---------------------------------------------------------------- prompts


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """kind "signature": a function's def line(s) and first body line, the model writes the rest.
    kind "rewrite": a whole function, a blank line, then its signature prompt again: the model writes the
    function a second time (an edit or refactoring request in miniature; most of the answer repeats text
    the prompt holds, which is where prompt lookup and trees pay)."""

    max_lines: int = 6  # def line(s) + first body line; longer signatures are skipped
    max_chars: int = 400
    kind: str = "signature"
    rewrite_lines: tuple[int, int] = (8, 30)  # "rewrite": functions of this many lines, def line included
    rewrite_chars: int = 1200

    def __post_init__(self):
        if self.kind not in PROMPT_KINDS:
            raise ValueError(f"prompt kind {self.kind!r} is not one of {', '.join(PROMPT_KINDS)}")


PROMPT_KINDS = ("signature", "rewrite")


def source_lines(text: str) -> list[str]:
    """Lines with their endings, numbered as `ast` numbers them.

    str.splitlines would also break at form feeds and other Unicode separators
    that Python's tokenizer treats as ordinary characters, shifting line numbers.
    """
    return [line for line in re.split(r"(?<=\n)|(?<=\r)(?!\n)", text) if line]


def _function_prompts(f: SourceFile, text: str, config: PromptConfig) -> list[dict]:
    """One prompt per plain `def`: source lines from `def` through the first body line, dedented (a "rewrite"
    prompt puts the whole function before them)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # the test suite holds deliberately broken files
        return []
    lines = source_lines(text)
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        first, last = node.lineno, node.body[0].lineno  # 1-based; decorators excluded
        if last <= first:  # one-line `def f(): ...` has no body line to predict from
            continue
        block = lines[first - 1 : last]
        indent = block[0][: node.col_offset]  # col_offset counts bytes; leading whitespace is ASCII
        if indent.strip() or not block[0][node.col_offset :].startswith("def "):
            continue
        # Strip exactly the def's indentation; a continuation line shallower than it
        # (odd hanging indents, multi-line strings) would not survive, so skip those.
        if not all(line.startswith(indent) or not line.strip() for line in block):
            continue
        prompt = "".join(line[len(indent) :] if line.strip() else line.lstrip(" \t") for line in block)
        if not prompt.endswith("\n"):
            prompt += "\n"
        if len(block) > config.max_lines or len(prompt) > config.max_chars:
            continue
        if config.kind == "rewrite":
            whole = lines[first - 1 : node.end_lineno]
            low, high = config.rewrite_lines
            if not low <= len(whole) <= high or not all(line.startswith(indent) or not line.strip() for line in whole):
                continue
            body = "".join(line[len(indent) :] if line.strip() else "\n" for line in whole).rstrip("\n") + "\n"
            if len(body) > config.rewrite_chars:
                continue
            prompt = body + "\n\n" + prompt
        prompts.append({"prompt": prompt, "file": f.rel, "lineno": first, "indent": indent})
    return prompts


def build_prompts(
        split: Split = "heldout",
        n: int | None = 200,
        seed: int = 0,
        config: PromptConfig = PromptConfig(),
        root: Path | None = None,
        exclude: Collection[str] = (),
) -> list[dict]:
    """A deterministic sample of function-signature prompts from one split.

    Each dict has "prompt" plus provenance ("file", "lineno", "indent") so tests
    and reports can point back at the source. Duplicate prompt texts (trivial
    `__init__`s etc.) are kept once. The sample is in random (seeded) order, so
    any prefix of the list is itself a random subset (n=None: the whole split). Prompt texts in `exclude`
    are never drawn (e.g. the drafter's distillation prompts, when sampling
    prompts to measure it on).
    """
    candidates: dict[str, dict] = {}
    for f, text in iter_documents(split, root):
        for p in sorted(_function_prompts(f, text, config), key=lambda p: p["lineno"]):
            candidates.setdefault(p["prompt"], p)
    exclude = set(exclude)
    pool = [p for p in candidates.values() if p["prompt"] not in exclude]  # (file, lineno) order: deterministic
    if n is None:  # all of them, shuffled
        n = len(pool)
    if n > len(pool):
        left = f" after excluding {len(candidates) - len(pool)}" if exclude else ""
        raise ValueError(f"Asked for {n} prompts but split {split!r} only has {len(pool)}{left}; lower n.")
    return random.Random(seed).sample(pool, n)


def write_prompts_jsonl(path: str | Path, prompts: list[dict]) -> Path:
    """Writes one `{"prompt": ...}` object per line (provenance fields are not written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p["prompt"]}, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, help="write a heldout prompt set here (.jsonl)")
    parser.add_argument("--n", type=int, default=200, help="how many heldout prompts")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the prompts")
    parser.add_argument("--root", type=Path, default=None,
                        help="a tree of .py files other than the stdlib (e.g. an installed package: code no "
                             "shipped model was trained on)")
    parser.add_argument("--split", choices=SPLITS, default="heldout", help="split of the prompts (default heldout)")
    parser.add_argument("--kind", choices=PROMPT_KINDS, default="signature",
                        help="signature: def line(s) + first body line; rewrite: a whole function of 8 to 30 lines, "
                             "then its signature again, so the answer repeats the prompt (default signature)")
    args = parser.parse_args(argv)
    config = PromptConfig(kind=args.kind)
    if args.root is not None:
        try:
            prompts = build_prompts(args.split, n=args.n, seed=args.seed, config=config, root=args.root)
        except ValueError as e:
            raise SystemExit(f"python -m train.corpus: error: {e}") from None
        write_prompts_jsonl(args.prompts or Path("prompts.jsonl"), prompts)
        print(f"wrote {len(prompts)} prompts from {args.root} to {args.prompts or 'prompts.jsonl'}")
        return

    print(f"stdlib: {stdlib_root()}")
    for split, s in corpus_stats().items():
        print(f"{split:>10}: {s.files:5d} files {s.bytes / 1e6:8.2f} MB  ({s.skipped} skipped: not UTF-8)")
    if args.prompts:
        prompts = build_prompts(args.split, n=args.n, seed=args.seed, config=config)
        write_prompts_jsonl(args.prompts, prompts)
        print(f"wrote {len(prompts)} prompts to {args.prompts}")


if __name__ == "__main__":
    main()
