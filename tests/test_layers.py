"""Dependencies point one way (DESIGN.md section 10): decode/ and train/ use taps_jax; taps_jax uses neither,
and decode/ never imports train/ (a decoding install must not need the training code's imports).
Also: pyproject's package list covers every package of the tree (it is a list, not `find`; see there)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"taps_jax": ("train", "decode"), "decode": ("train",)}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth (function-level imports too), and of
    importlib.import_module / __import__ calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def test_imports_point_one_way():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        files = sorted((ROOT / package).rglob("*.py"))
        assert len(files) > 5, f"no sources found under {ROOT / package}"
        for path in files:
            for line, module in imported_modules(path):
                if module.split(".")[0] in forbidden:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_walker_sees_every_kind_of_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import train.corpus\nfrom train import recipe\n"
                      "def f():\n    from decode.jobs import Job\n    importlib.import_module('train.scorer')\n"
                      "from . import sibling\n")
    assert [m for _, m in imported_modules(source)] == ["train.corpus", "train", "decode.jobs", "train.scorer"]


def test_pyproject_lists_every_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = set(find_packages(str(ROOT), include=["taps_jax*", "train*", "decode*"]))
    mapped = set(setuptools["package-dir"])
    assert set(setuptools["packages"]) == tree | mapped, "pyproject's packages list differs from the source tree"
    for package, folder in setuptools["package-dir"].items():
        assert (ROOT / folder).is_dir(), f"{package} maps to {folder}, which is missing"


def test_one_public_namespace():
    """`import taps_jax` gives the whole API; the modules they live in keep them (old import paths)."""
    import taps_jax
    from taps_jax import api, calls, decoder
    from taps_jax.checkpoints import scorer

    homes = {"load_target": api, "Target": api, "GenerateResult": calls, "load_scorer": scorer,
             "load_drafter": decoder, "load_model_set": decoder, "SpeculativeDecoder": decoder, "ModelSet": decoder}
    for name, module in homes.items():
        assert name in taps_jax.__all__ and getattr(taps_jax, name) is getattr(module, name), name
    assert decoder.GenerateResult is taps_jax.GenerateResult and api.GenerateResult is taps_jax.GenerateResult
    assert all(hasattr(taps_jax, name) for name in taps_jax.__all__)


def test_any_module_can_be_imported_first():
    """No import cycle: a fresh process importing a submodule first (taps_jax.decoder imports taps_jax.api)."""
    import subprocess
    import sys

    code = "; ".join(f"import {m}" for m in ("taps_jax.decoder", "taps_jax.api", "taps_jax.calls"))
    for first in ("taps_jax.decoder", "taps_jax.api", "taps_jax.engine.calibrate"):
        done = subprocess.run([sys.executable, "-c", f"import {first}; {code}; import taps_jax; taps_jax.load_model_set"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert done.returncode == 0, (first, done.stderr[-2000:])
