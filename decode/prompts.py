"""Prompt files: JSONL, one {"prompt": "..."} object per line."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: Path) -> list[str]:
    """All prompts of a JSONL file; errors name the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg}); each line must be {{\"prompt\": \"...\"}}") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a string \"prompt\" field")
        if not record["prompt"]:
            raise ValueError(f"{path}:{lineno}: empty prompt")
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts
