"""Your training data: prompt files, their held-out split, overlap and mask-token checks.

A prompts file is JSONL, one object per line:

    {"prompt": "def f(x):\\n"}                      a text prompt: the target continues it
    {"ids": [12, 7, 99]}                             the same as token ids
    {"prompt": "...", "response": "..."}             continuation given: no generation
    {"ids": [...], "response_ids": [...]}            the same as token ids

The validation split, when no separate file is given, is a stable hash of the
line's record (sha1 of its canonical JSON), so it does not move when lines are
added, removed or reordered. Every check here runs before any model is traced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from taps_jax.prompt_file import _parse_line, check_text

EXPECTED = ('each line must be {"prompt": "..."} or {"ids": [...]}, optionally with "response" '
            '(text) or "response_ids" (token ids)')
PROMPT_DIGESTS = "distill_prompts.json"  # written beside the exported drafter
MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>", "<MASK>", "<|mask_token|>")


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str | tuple[int, ...]
    response: str | tuple[int, ...] | None = None
    key: str = ""  # sha1 of the record: the split key

    @property
    def has_response(self) -> bool:
        return self.response is not None


def _ids(value, where: str, field: str) -> tuple[int, ...]:
    if not (isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in value)):
        raise ValueError(f"{where}: {field!r} must be a non-empty list of token ids (integers >= 0)")
    return tuple(value)


def read_examples(path) -> list[Example]:
    """The examples of a prompts JSONL file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {str(path)!r} does not exist; write one {EXPECTED.removeprefix('each ')}")
    out = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        rec = _parse_line(raw, where)
        if ("prompt" in rec) == ("ids" in rec):
            raise ValueError(f"{where}: give exactly one of \"prompt\" and \"ids\"; {EXPECTED}")
        if "prompt" in rec:
            prompt = rec["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: \"prompt\" must be a non-empty string; {EXPECTED}")
            check_text(prompt, f"{where}: the prompt")
        else:
            prompt = _ids(rec["ids"], where, "ids")
        if "response" in rec and "response_ids" in rec:
            raise ValueError(f"{where}: give at most one of \"response\" and \"response_ids\"")
        response = None
        if "response" in rec:
            response = rec["response"]
            if not isinstance(response, str) or not response:
                raise ValueError(f"{where}: \"response\" must be a non-empty string")
            check_text(response, f"{where}: the response")
        elif "response_ids" in rec:
            response = _ids(rec["response_ids"], where, "response_ids")
        key = hashlib.sha1(json.dumps([prompt, response], ensure_ascii=False).encode()).hexdigest()
        out.append(Example(prompt, response, key))
    if not out:
        raise ValueError(f"{path}: no prompts found; {EXPECTED}")
    with_response = sum(e.has_response for e in out)
    if 0 < with_response < len(out):
        raise ValueError(f"{path}: {with_response} of {len(out)} lines have a response; give a response on every "
                         f"line (no generation) or on none (the target continues every prompt)")
    return out


def add_data_flags(parser, prompts: str, corpus: str, val_prompts: bool = True) -> None:
    """--prompts FILE.jsonl [--val-prompts FILE.jsonl] | --corpus DIR, in one group ("your data")."""
    group = parser.add_argument_group("your data")
    group.add_argument("--prompts", type=Path, help=prompts)
    if val_prompts:
        group.add_argument("--val-prompts", type=Path,
                           help="validation prompts in the same format (default: the --val-fraction of --prompts "
                                "lines picked by a stable hash of each line); a line in both files is refused")
    group.add_argument("--corpus", type=Path, help=corpus)


def hash_split(examples: Sequence[Example], val_fraction: float) -> tuple[list[Example], list[Example]]:
    """(train, validation): an example is validation when its record hash falls below val_fraction."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction!r}")
    val = [e for e in examples if int(e.key[:8], 16) / 16**8 < val_fraction]
    keys = {e.key for e in val}
    return [e for e in examples if e.key not in keys], val


def read_split(prompts: Path, val_prompts: Path | None, val_fraction: float) -> tuple[list[Example], list[Example]]:
    """(train, validation) from --prompts and --val-prompts (else a hash split of --prompts); no overlap allowed."""
    examples = read_examples(prompts)
    if val_prompts is not None:
        train, val = examples, read_examples(val_prompts)
        both = {e.key for e in train} & {e.key for e in val}
        if both:
            raise ValueError(f"{len(both)} lines of --val-prompts {val_prompts} are also in --prompts {prompts}; "
                             f"validation must be held out, so remove them from one file")
        if len({e.has_response for e in train + val}) > 1:
            raise ValueError("--prompts and --val-prompts must both have responses or both have none")
        return train, val
    train, val = hash_split(examples, val_fraction)
    if not train:
        raise ValueError(f"{prompts}: every line fell in the held-out split; lower --val-fraction or give "
                         f"--val-prompts")
    return train, val


def encode(text_or_ids, tokenizer, vocab_size: int, where: str) -> list[int]:
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError(f"{where}: text needs the target's tokenizer.json; add it or give token ids")
        ids = tokenizer.encode(text_or_ids)
    else:
        ids = list(text_or_ids)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} is outside the target's vocabulary [0, {vocab_size})")
    if not ids:
        raise ValueError(f"{where}: encodes to no tokens")
    return ids


def encode_examples(examples: Sequence[Example], tokenizer, vocab_size: int,
                    source: str = "prompts") -> list[tuple[list[int], list[int] | None]]:
    """[(prompt ids, response ids or None)] with every id checked against the vocabulary."""
    return [(encode(e.prompt, tokenizer, vocab_size, f"{source}: example {i}"),
             None if e.response is None else encode(e.response, tokenizer, vocab_size, f"{source}: example {i}"))
            for i, e in enumerate(examples)]


def prompt_digest(ids: Iterable[int]) -> str:
    return hashlib.sha1(json.dumps([int(t) for t in ids]).encode()).hexdigest()


def write_prompt_digests(directory: Path, prompt_ids: Iterable[Sequence[int]]) -> Path:
    """Digests of the prompts a drafter was distilled on, beside its export (traces refuse them)."""
    path = Path(directory) / PROMPT_DIGESTS
    path.write_text(json.dumps({"sha1_of_prompt_ids": sorted({prompt_digest(p) for p in prompt_ids})}))
    return path


def read_prompt_digests(directory: Path) -> set[str]:
    path = Path(directory) / PROMPT_DIGESTS
    if not path.is_file():
        return set()
    return set(json.loads(path.read_text())["sha1_of_prompt_ids"])


def check_disjoint(prompt_ids: Sequence[Sequence[int]], distilled: set[str], source: str) -> None:
    """ValueError if any prompt is one the drafter was distilled on (traces would show it memorised)."""
    hits = [i for i, p in enumerate(prompt_ids) if prompt_digest(p) in distilled]
    if hits:
        raise ValueError(f"{source}: {len(hits)} of {len(prompt_ids)} prompts (first: #{hits[0]}) are ones the "
                         f"drafter was distilled on; trace prompts must be other prompts (the scorer has to learn "
                         f"how the drafter drafts on new text), so remove them or use another prompts file")


# --------------------------------------------------------------------------- the mask token


def _added_tokens(tokenizer) -> list[tuple[int, str, bool]]:
    """(id, content, special) of the tokenizer's added tokens, by id."""
    raw = getattr(tokenizer, "_tok", tokenizer)
    if raw is None or not hasattr(raw, "get_added_tokens_decoder"):
        return []
    return sorted((int(i), t.content, bool(t.special)) for i, t in raw.get_added_tokens_decoder().items())


def mask_candidates(tokenizer, vocab_size: int, exclude: Iterable[int] = ()) -> str:
    """Ids that could serve as the mask: unused special tokens and embedding rows past the tokenizer."""
    exclude = set(exclude)
    parts = [f"{i} {c!r}" for i, c, special in _added_tokens(tokenizer) if special and i not in exclude]
    n_tok = tokenizer.vocab_size if tokenizer is not None else vocab_size
    if n_tok < vocab_size:
        parts.append(f"{n_tok}..{vocab_size - 1} (embedding rows past the tokenizer's {n_tok} tokens)")
    return ", ".join(parts[:12]) + (" ..." if len(parts) > 12 else "") if parts else "none found"


def resolve_mask_token(tokenizer, vocab_size: int, requested: int | None, data_ids: Iterable[Sequence[int]] = (),
                       reserved: Iterable[int] = (), flag: str = "--mask-token-id") -> int:
    """The drafter's mask token id: `requested`, else the tokenizer's mask special token; checked.

    Refused: no tokenizer mask token and none requested (the message lists
    candidates); an id outside [0, vocab_size); an id that occurs in the
    training data `data_ids` (the drafter would learn a frequent token as
    "unknown"); one of `reserved` (EOS).
    """
    reserved = set(reserved)
    if requested is None:
        found = [(i, c) for i, c, _ in _added_tokens(tokenizer) if c in MASK_NAMES]
        if not found:
            raise ValueError(f"the target's tokenizer has no mask special token ({' / '.join(MASK_NAMES[:3])}); "
                             f"pass {flag} ID with an id the data never uses; candidates: "
                             f"{mask_candidates(tokenizer, vocab_size, reserved)}")
        mask = found[0][0]
        how = f"the tokenizer's {found[0][1]!r}"
    else:
        mask = requested
        how = f"{flag} {mask}"
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab_size:
        raise ValueError(f"{how} is outside the target's vocabulary [0, {vocab_size}); candidates: "
                         f"{mask_candidates(tokenizer, vocab_size, reserved)}")
    if mask in reserved:
        raise ValueError(f"{how} is the target's EOS token; pass {flag} with another id; candidates: "
                         f"{mask_candidates(tokenizer, vocab_size, reserved)}")
    count = sum(sum(1 for t in ids if t == mask) for ids in data_ids)
    if count:
        raise ValueError(f"{how} occurs {count} times in the training data: the drafter would learn that token as "
                         f"'masked'; pass {flag} with an id the data never uses; candidates: "
                         f"{mask_candidates(tokenizer, vocab_size, reserved)}")
    return mask
