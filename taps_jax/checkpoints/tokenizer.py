"""Tokenizer from tokenizer.json (the `tokenizers` library) plus stop ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


def _as_list(value, source: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    # int() would turn 2.5 into 2 and "2" into 2: a wrong stop id silently never stops.
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ValueError(f"{source}: eos_token_id must be a token id or a list of them (integers >= 0), "
                         f"got {type(bad[0]).__name__} {bad[0]!r}; fix it in that file")
    return list(values)


def stop_ids(path: Path, raw_config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (preferred) and config.json."""
    ids = _as_list(raw_config.get("eos_token_id"), str(path / "config.json"))
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            raw = json.loads(gen.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{gen}: cannot read JSON ({e}); fix or delete the file") from e
        ids = _as_list(raw.get("eos_token_id") if isinstance(raw, dict) else None, str(gen)) + ids
    return tuple(dict.fromkeys(ids))


class Tokenizer:
    """Thin wrapper: encode/decode without adding special tokens implicitly."""

    def __init__(self, tokenizer: _HFTokenizer, eos_ids: tuple[int, ...] = ()):
        self._tok = tokenizer
        self.eos_ids = eos_ids

    @classmethod
    def from_file(cls, file, eos_ids: tuple[int, ...] = ()) -> "Tokenizer":
        try:
            return cls(_HFTokenizer.from_file(str(file)), eos_ids)
        except Exception as e:
            raise ValueError(f"{file}: cannot load tokenizer ({e})") from e

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def save(self, file) -> None:
        self._tok.save(str(file))
