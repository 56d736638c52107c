"""The corpus the embedded default model set was trained on: `.py` files split by a hash of their path.

By default the corpus is the running interpreter's standard library (no
download; the same data wherever the same Python version runs); any tree of
`.py` files can stand in for it ($TAPS_CORPUS_ROOT, `--corpus DIR` in
train/). `train/corpus.py` builds the training data and prompts on it;
decode's long-prompt benchmark cuts its prompts from the held-out split, text
no training window ever saw. It lives here, below both, so decode/ never
imports train/.

Split: BY FILE, from sha1 of the posix relative path (stable across machines
and across runs, independent of file order or contents):

    bucket = int(sha1(rel_path)[:8 bytes]) % 10_000
    bucket <  200  -> "validation"  (~2% of files)
    bucket <  400  -> "heldout"     (~2% of files; prompts for decode benchmarks)
    otherwise      -> "train"       (~96% of files)

Splitting by file (not by line or window) means no training window ever
contains text from a heldout file. Near-duplicates across files
(e.g. `lib2to3/tests/data/*` vs `lib2to3/*`) can still cross splits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from collections.abc import Iterator
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
