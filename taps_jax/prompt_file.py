"""Prompt files: JSONL, one {"prompt": "..."}, {"ids": [...]} or {"messages": [...]} per line, optional "id".

A "messages" line is a conversation ([{"role": ..., "content": ...}, ...]),
always rendered by the target's chat template; with chat=True a "prompt"
line becomes one user turn of its own conversation.

One reader for every tool (taps-decode jobs, taps-bench, trace collection),
so a malformed line gets the same message, naming the file and line, everywhere.
The file must be UTF-8 text; raw token ids go in "ids", never as bytes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

EXPECTED = ("each line must be {\"prompt\": \"...\"}, {\"ids\": [...]} or {\"messages\": [{\"role\": ..., "
            "\"content\": ...}, ...]} with an optional \"id\"")
IDS_HINT = "prompts are UTF-8 text; for raw token ids use {\"ids\": [...]} lines"


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    id: str | int
    prompt: str | list[int] | list[dict]  # text, token ids, or a conversation


def read_prompt_file(path, chat: bool = False) -> list[PromptRecord]:
    """The prompts of a JSONL job file; errors name the file and line.

    chat: a text "prompt" becomes the conversation [{"role": "user", "content": prompt}].
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist")
    out, seen = [], {}
    # Bytes, split at "\n" only: a decode error then names its line, not the whole file.
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        record = _parse_line(raw, f"{path}:{lineno}")
        if "messages" in record:
            out.append(PromptRecord(_record_id(record, out, seen, path, lineno), _messages(record, path, lineno)))
            continue
        prompt = record.get("prompt", record.get("ids"))
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or is_ids):
            raise ValueError(f"{path}:{lineno}: expected a string \"prompt\" field "
                             "(or \"ids\": a list of token ids)")
        if not prompt:
            raise ValueError(f"{path}:{lineno}: empty prompt")
        if isinstance(prompt, str):
            check_text(prompt, f"{path}:{lineno}: the prompt")
            if chat:
                prompt = [{"role": "user", "content": prompt}]
        out.append(PromptRecord(_record_id(record, out, seen, path, lineno), prompt))
    if not out:
        raise ValueError(f"{path}: no prompts found")
    return out


def _record_id(record: dict, out: list, seen: dict, path, lineno: int):
    """The line's id (default: its index), checked and unique."""
    pid = record.get("id", len(out))
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise ValueError(f"{path}:{lineno}: \"id\" must be a string or an integer, got {pid!r}")
    if isinstance(pid, str):
        check_text(pid, f"{path}:{lineno}: the id")
    key = prompt_key(pid)
    if key in seen:
        raise ValueError(f"{path}:{lineno}: duplicate id {pid!r} (first on line {seen[key]}); "
                         "ids must be unique")
    seen[key] = lineno
    return pid


def _messages(record: dict, path, lineno: int) -> list[dict]:
    from taps_jax.chat import check_messages

    if "prompt" in record or "ids" in record:
        raise ValueError(f"{path}:{lineno}: give \"messages\" or \"prompt\"/\"ids\", not both")
    try:
        messages = check_messages(record["messages"])
    except ValueError as e:
        raise ValueError(f"{path}:{lineno}: {e}") from None
    for m in messages:
        check_text(m["content"], f"{path}:{lineno}: a message")
    return messages


def _parse_line(raw: bytes, where: str) -> dict:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                         f"{IDS_HINT}") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({json_error(e)}); {EXPECTED}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with a string \"prompt\" field")
    return record


def json_error(e: json.JSONDecodeError) -> str:
    """The whole reason with its column (e.msg alone may end mid-sentence: 'Invalid control character at')."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def check_text(text: str, what: str, hint: str = IDS_HINT, from_argv: bool = False) -> None:
    """ValueError if `text` cannot be encoded as UTF-8 (a lone surrogate, e.g. from a "\\ud800" escape).

    from_argv: Python hands undecodable command-line bytes over as U+DC80..U+DCFF
    (surrogateescape), so those are named as the bytes they were.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        escaped = from_argv and 0xDC80 <= ch <= 0xDCFF
        shown = f"byte 0x{ch - 0xDC00:02x}" if escaped else f"unpaired surrogate \\u{ch:04x}"
        raise ValueError(f"{what} is not valid UTF-8 text ({shown} at character {e.start + 1}); {hint}") from None


def prompt_key(pid) -> str:
    return json.dumps(pid)  # 1 and "1" stay distinct
