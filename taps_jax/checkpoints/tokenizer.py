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
    """Thin wrapper: encode/decode without adding special tokens implicitly.

    chat_template: the model's `taps_jax.chat.ChatTemplate`, or None for a
    model without one (then `render_chat` refuses).
    """

    def __init__(self, tokenizer: _HFTokenizer, eos_ids: tuple[int, ...] = (), chat_template=None):
        self._tok = tokenizer
        self.eos_ids = eos_ids
        self.chat_template = chat_template

    @classmethod
    def from_file(cls, file, eos_ids: tuple[int, ...] = (), chat_template=None) -> "Tokenizer":
        try:
            return cls(_HFTokenizer.from_file(str(file)), eos_ids, chat_template)
        except Exception as e:
            raise ValueError(f"{file}: cannot load tokenizer ({e})") from e

    def special_ids(self) -> set[int]:
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """One conversation as prompt text, by the model's chat template."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json chat_template or the GGUF's "
                             "tokenizer.chat_template); pass plain prompts instead")
        return self.chat_template.render(messages, add_generation_prompt)

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

    def save_config(self, path: Path) -> None:
        """tokenizer_config.json with the chat template and special tokens (what transformers reads)."""
        raw = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            raw.update(self.chat_template.special_tokens)
            raw["chat_template"] = self.chat_template.source
        Path(path, "tokenizer_config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False))


# --- GGUF tokenizers (tokenizer.ggml.*) --------------------------------------

# The split regexes of llama.cpp's pre-tokenizer families (`tokenizer.ggml.pre`), as tokenizers.Regex patterns.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_GPT2_STYLE = ("gpt2", "default", "smollm")  # GPT-2's own byte-level split
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gguf_tokenizer(f) -> "_HFTokenizer | None":
    """A `tokenizers` Tokenizer from a GGUF file's tokenizer.ggml.* metadata (None when it has none).

    Byte-level BPE (`tokenizer.ggml.model` gpt2): vocabulary and merges as the
    file spells them, the split regex of the file's pre-tokenizer family,
    control tokens as special added tokens and user-defined ones as plain added
    tokens, so they are matched whole in text (as llama.cpp does).
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    kind = f.get("tokenizer.ggml.model")
    if kind is None:
        return None
    where = f"{f.path}: cannot build its tokenizer"
    if kind != "gpt2":
        raise ValueError(f"{where}: tokenizer model {kind!r} is not supported (supported: gpt2, byte-level BPE); "
                         f"decode with token ids, or convert the model with its Hugging Face tokenizer.json")
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in _SPLITS and pre not in _GPT2_STYLE:
        raise ValueError(f"{where}: pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(sorted([*_SPLITS, *_GPT2_STYLE]))})")
    tokens, merges = f.get("tokenizer.ggml.tokens") or [], f.get("tokenizer.ggml.merges")
    types = f.get("tokenizer.ggml.token_type") or []
    if not tokens or merges is None or (types and len(types) != len(tokens)):
        raise ValueError(f"{where}: tokenizer.ggml.tokens, .merges and .token_type are missing or of unequal "
                         f"length; re-convert the model")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (a mislabelled control token) is spelled by its UTF-8 bytes.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
        bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False)
    except Exception as e:
        raise ValueError(f"{where}: its vocabulary or merges are malformed ({e}); re-convert the model") from None
    tok = _HFTokenizer(bpe)
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok


def with_end_of_turn(tokenizer: Tokenizer, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Stop ids plus the chat template's end-of-turn token (an instruct model's answer ends there)."""
    eot = tokenizer.chat_template.end_of_turn(tokenizer) if tokenizer.chat_template is not None else None
    return tuple(dict.fromkeys([*eos_ids, *([eot] if eot is not None else [])]))


def load_dir_tokenizer(path: Path, eos_ids: tuple[int, ...]) -> tuple[Tokenizer | None, tuple[int, ...]]:
    """A HF model dir's tokenizer.json (+ chat template), and its stop ids with the end-of-turn token."""
    from taps_jax.chat import ChatTemplate, hf_chat_template

    if not (path / "tokenizer.json").is_file():
        return None, eos_ids
    source, special = hf_chat_template(path)
    template = ChatTemplate(source, special, f"{path} chat template") if source else None
    tokenizer = Tokenizer.from_file(path / "tokenizer.json", eos_ids, template)
    eos_ids = with_end_of_turn(tokenizer, eos_ids)
    tokenizer.eos_ids = eos_ids
    return tokenizer, eos_ids


def load_gguf_tokenizer(f) -> tuple[Tokenizer | None, tuple[int, ...]]:
    """A GGUF file's tokenizer (+ tokenizer.chat_template) and stop ids (EOS, EOT, the end-of-turn token)."""
    from taps_jax.chat import ChatTemplate

    tokens = f.get("tokenizer.ggml.tokens") or []
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = f.get(key)
        if value is not None:
            if not isinstance(value, int) or not 0 <= value < max(len(tokens), 1):
                raise ValueError(f"{f.path}: {key} {value!r} is not a token id of its vocabulary")
            ids.append(value)
    eos_ids = tuple(dict.fromkeys(ids))
    hf = gguf_tokenizer(f)
    if hf is None:
        return None, eos_ids
    special = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        value = f.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int) and 0 <= value < len(tokens):
            special[name] = tokens[value]
    source = f.get("tokenizer.chat_template")
    template = ChatTemplate(source, special, f"{f.path} chat template") if source else None
    tokenizer = Tokenizer(hf, eos_ids, template)
    eos_ids = with_end_of_turn(tokenizer, eos_ids)
    tokenizer.eos_ids = eos_ids
    return tokenizer, eos_ids
