"""The pretraining corpus: the `.py` files of the running interpreter's stdlib.

The embedded default model set (target, drafter, scorer) is trained on Python
source that every machine already has, so no download is needed and the data
is identical wherever the same Python version runs.

Split: BY FILE, from sha1 of the posix relative path (stable across machines
and across runs, independent of file order or contents):

    bucket = int(sha1(rel_path)[:8 bytes]) % 10_000
    bucket <  200  -> "validation"  (~2% of files)
    bucket <  400  -> "heldout"     (~2% of files; prompts for decode benchmarks)
    otherwise      -> "train"       (~96% of files)

Splitting by file (not by line or window) means no training window ever
contains text from a heldout file. Near-duplicates across files
(e.g. `lib2to3/tests/data/*` vs `lib2to3/*`) can still cross splits.

Another tree of Python code can stand in for the stdlib: pass `--corpus DIR`
to `python -m train.target / train.distill / train.traces / train.recipe`
(or set TAPS_CORPUS_ROOT=DIR); the same hash splits its files.

Files that are not valid UTF-8 (a few deliberately mis-encoded test inputs)
are skipped and counted, never decoded with replacement characters.

    python -m train.corpus                                  # stats per split
    python -m train.corpus --prompts runs/default/prompts_heldout.jsonl
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import re
import sysconfig
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Literal

Split = Literal["train", "validation", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "validation", "heldout")

_BUCKETS = 10_000
_VALIDATION_BUCKETS = 200  # 2%
_HELDOUT_BUCKETS = 200  # 2%
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One corpus document: an absolute path plus its posix path relative to the stdlib root."""

    root: Path
    rel: str  # posix, e.g. "asyncio/tasks.py"; the split key

    @property
    def path(self) -> Path:
        return self.root / self.rel

    @property
    def split(self) -> Split:
        return split_of(self.rel)

    def read_text(self) -> str | None:
        """The file as text, or None if it is not valid UTF-8."""
        try:
            return self.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            return None


CORPUS_ROOT_ENV = "TAPS_CORPUS_ROOT"


def stdlib_root() -> Path:
    """The corpus root: $TAPS_CORPUS_ROOT when set (any tree of .py files), else this interpreter's stdlib."""
    override = os.environ.get(CORPUS_ROOT_ENV)
    if override:
        root = Path(override)
        if not root.is_dir():
            raise ValueError(f"{CORPUS_ROOT_ENV}={override!r} is not a directory; point it at a tree of .py files "
                             f"or unset it to use the standard library")
        return root
    return Path(sysconfig.get_paths()["stdlib"])


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


def list_stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """All stdlib `.py` files (test suite included, third-party packages excluded), sorted by rel path."""
    root = stdlib_root() if root is None else Path(root)
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts) or not path.is_file():
            continue
        files.append(SourceFile(root=root, rel=rel.as_posix()))
    return sorted(files, key=lambda f: f.rel)


def split_of(rel_path: str) -> Split:
    """Deterministic split of a file from its posix relative path (see module docstring)."""
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % _BUCKETS
    if bucket < _VALIDATION_BUCKETS:
        return "validation"
    if bucket < _VALIDATION_BUCKETS + _HELDOUT_BUCKETS:
        return "heldout"
    return "train"


def files_of(split: Split, root: Path | None = None) -> list[SourceFile]:
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; use one of {SPLITS}.")
    return [f for f in list_stdlib_files(root) if f.split == split]


def iter_documents(split: Split, root: Path | None = None) -> Iterator[tuple[SourceFile, str]]:
    """(file, text) for every decodable file of a split, in rel-path order."""
    for f in files_of(split, root):
        text = f.read_text()
        if text is not None:
            yield f, text


def iter_texts(split: Split, root: Path | None = None) -> Iterator[str]:
    for _, text in iter_documents(split, root):
        yield text


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
    max_lines: int = 6  # def line(s) + first body line; longer signatures are skipped
    max_chars: int = 400


def source_lines(text: str) -> list[str]:
    """Lines with their endings, numbered as `ast` numbers them.

    str.splitlines would also break at form feeds and other Unicode separators
    that Python's tokenizer treats as ordinary characters, shifting line numbers.
    """
    return [line for line in re.split(r"(?<=\n)|(?<=\r)(?!\n)", text) if line]


def _function_prompts(f: SourceFile, text: str, config: PromptConfig) -> list[dict]:
    """One prompt per plain `def`: source lines from `def` through the first body line, dedented."""
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
    args = parser.parse_args(argv)

    print(f"stdlib: {stdlib_root()}")
    for split, s in corpus_stats().items():
        print(f"{split:>10}: {s.files:5d} files {s.bytes / 1e6:8.2f} MB  ({s.skipped} skipped: not UTF-8)")
    if args.prompts:
        prompts = build_prompts("heldout", n=args.n, seed=args.seed)
        write_prompts_jsonl(args.prompts, prompts)
        print(f"wrote {len(prompts)} prompts to {args.prompts}")


if __name__ == "__main__":
    main()
