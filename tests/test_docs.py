"""The documentation: the README stays a page, every docs/ page is linked, links resolve, and the blocks that
claim to run do.

A fenced block right after a line `<!-- doc-test -->` runs as written: the python blocks of one page in order, as
one script (a page is one session: later blocks use what earlier ones defined), each bash block with
`bash -euo pipefail` in a fresh directory. They run on the embedded set, in subprocesses that share a private
cache directory with the compile cache on, so a program two blocks need compiles once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "CHANGELOG.md", *DOCS]
MARK = "<!-- doc-test -->"
README_MAX_LINES = 250


def marked_blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, line of the opening fence, code) of each block right after the marker."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        assert fence.startswith("```") and fence[3:].strip() in ("python", "bash"), (
            f"{page.name}:{i + 1}: {MARK} must come right before a ```python or ```bash block")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        found.append((fence[3:].strip(), i + 2, "\n".join(lines[i + 2:end]) + "\n"))
    return found


def test_readme_is_a_page():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text(encoding="utf-8")
    assert DOCS, "no docs/ pages"
    missing = [p.name for p in DOCS if f"](docs/{p.name})" not in text]
    assert not missing, f"README.md does not link {missing}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_quick_start_is_marked():
    blocks = marked_blocks(README)
    assert any(lang == "bash" and "taps-decode --prompt" in code for lang, _, code in blocks)  # the decode command
    assert any(lang == "python" and "import taps_jax" in code for lang, _, code in blocks)  # the Python snippet
    assert any(lang == "python" for page in DOCS for lang, _, _ in marked_blocks(page))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("doc-cache")
    return {**os.environ, "TAPS_JAX_CACHE_DIR": str(cache), "TAPS_JAX_COMPILE_CACHE": "1", "PYTHONPATH": str(ROOT)}


def _run(command, cwd, env, where: str):
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{where} failed (status {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


PYTHON_PAGES = [p for p in PAGES if any(lang == "python" for lang, _, _ in marked_blocks(p))]
BASH_BLOCKS = [(p, line, code) for p in PAGES for lang, line, code in marked_blocks(p) if lang == "bash"]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page, env):
    script = "".join(f"# {page.name}:{line}\n{code}" for lang, line, code in marked_blocks(page) if lang == "python")
    _run([sys.executable, "-c", script], ROOT, env, f"the python blocks of {page.name}")


@pytest.mark.parametrize("page, line, code", BASH_BLOCKS, ids=[f"{p.name}:{line}" for p, line, _ in BASH_BLOCKS])
def test_bash_blocks_run(page, line, code, env, tmp_path):
    _run(["bash", "-euo", "pipefail", "-c", code], tmp_path, env, f"{page.name}:{line}")
