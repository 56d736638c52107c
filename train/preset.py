"""Training presets: JSON files shipped with the package (configs/train/<stage>_<name>.json).

`--preset NAME` finds configs/train/<stage>_NAME.json wherever the package is
installed (a wheel carries configs/ as package data, `taps_jax.config.CONFIGS_DIR`);
a value with a suffix or a path separator is read as a file path instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from taps_jax.config import CONFIGS_DIR

PRESET_DIR = CONFIGS_DIR / "train"


def known_presets(stage: str) -> list[str]:
    return sorted(p.stem.removeprefix(f"{stage}_") for p in PRESET_DIR.glob(f"{stage}_*.json"))


def preset_path(stage: str, name_or_path: str) -> Path:
    """The preset file of `stage` ("target", "drafter") named `name_or_path`; ValueError listing the known ones."""
    path = Path(name_or_path)
    if path.suffix or len(path.parts) > 1:
        if not path.is_file():
            raise ValueError(f"preset file {str(path)!r} does not exist; give a JSON file or one of the "
                             f"{stage} presets: {', '.join(known_presets(stage))}")
        return path
    path = PRESET_DIR / f"{stage}_{name_or_path}.json"
    if not path.is_file():
        raise ValueError(f"no {stage} preset {name_or_path!r}; known: {', '.join(known_presets(stage))} "
                         f"(or give the path of a JSON file)")
    return path


def read_preset(stage: str, name_or_path: str, _chain: tuple[Path, ...] = ()) -> tuple[Path, dict]:
    """The preset's sections. `"base": NAME` (a preset of the same stage, or a JSON path relative to this file)
    starts from that preset: each section of this file updates the base's section key by key, and a key that is
    not a section replaces the base's (so a drafter leg's preset holds only what differs from leg 1's)."""
    path = preset_path(stage, name_or_path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the preset ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a preset is a JSON object of sections")
    base = raw.pop("base", None)
    if base is None:
        return path, raw
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: 'base' names the preset this one extends (a {stage} preset name or a JSON path), "
                         f"got {base!r}")
    chain = _chain + (path.resolve(),)
    if (Path(base).suffix or len(Path(base).parts) > 1) and not Path(base).is_absolute():
        base = str(path.parent / base)
    try:
        below = preset_path(stage, base).resolve()
    except ValueError as e:
        raise ValueError(f"{path}: its 'base': {e}") from None
    if below in chain:
        raise ValueError(f"{path}: 'base' {base!r} leads back to itself ({' -> '.join(p.name for p in chain)})")
    _, merged = read_preset(stage, base, chain)
    for key, value in raw.items():
        below = merged.get(key)
        merged[key] = {**below, **value} if isinstance(value, dict) and isinstance(below, dict) else value
    return path, merged


def add_preset_flag(parser, stage: str, tiny: str) -> None:
    """--preset NAME|FILE for a stage's CLI, listing the shipped presets."""
    parser.add_argument("--preset", default="default",
                        help=f"{stage} preset: one of {', '.join(known_presets(stage))} "
                             f"(configs/train/{stage}_NAME.json, shipped with the package; 'tiny' {tiny}) or a JSON "
                             f"file path; a preset overrides the built-in values below, a flag overrides the preset")
