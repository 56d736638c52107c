"""Prompt files: JSONL, one {"prompt": "..."} (or {"ids": [...]}) per line, optional "id".

One reader for every tool (taps-decode jobs, taps-bench, trace collection),
so a malformed line gets the same message, naming the file and line, everywhere.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    id: str | int
    prompt: str | list[int]


def read_prompt_file(path) -> list[PromptRecord]:
    """The prompts of a JSONL job file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist")
    out, seen = [], {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg}); each line must be "
                                 "{\"prompt\": \"...\"} with an optional \"id\"") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected an object with a string \"prompt\" field")
            prompt = record.get("prompt", record.get("ids"))
            is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            if not (isinstance(prompt, str) or is_ids):
                raise ValueError(f"{path}:{lineno}: expected a string \"prompt\" field "
                                 "(or \"ids\": a list of token ids)")
            if not prompt:
                raise ValueError(f"{path}:{lineno}: empty prompt")
            pid = record.get("id", len(out))
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise ValueError(f"{path}:{lineno}: \"id\" must be a string or an integer, got {pid!r}")
            key = prompt_key(pid)
            if key in seen:
                raise ValueError(f"{path}:{lineno}: duplicate id {pid!r} (first on line {seen[key]}); "
                                 "ids must be unique")
            seen[key] = lineno
            out.append(PromptRecord(pid, prompt))
    if not out:
        raise ValueError(f"{path}: no prompts found")
    return out


def prompt_key(pid) -> str:
    return json.dumps(pid)  # 1 and "1" stay distinct
