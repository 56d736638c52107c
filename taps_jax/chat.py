"""Chat templates: a model's jinja2 template, rendered as transformers' `apply_chat_template` renders it.

A template is code that arrives inside a model file, so it runs in jinja2's
immutable sandbox (no attribute access to Python internals, no mutation of
what it is given). Conventions follow transformers: `messages`,
`add_generation_prompt`, the special tokens by name (`bos_token`,
`eos_token`, ...), `raise_exception`, a `tojson` filter and `strftime_now`;
trim_blocks and lstrip_blocks on.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

ROLES_HINT = 'messages are [{"role": "system" | "user" | "assistant", "content": "..."}, ...]'
_MARK = "\u2063taps-jax-end-of-turn\u2063"  # text no real answer contains


class ChatTemplate:
    """A compiled chat template plus the special tokens it may name."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, where: str = "chat template"):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{where}: the chat template must be a non-empty string")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.where = where

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"{where}: the chat template does not compile ({e})") from None

    def render(self, messages, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (ends with the assistant's turn opening by default)."""
        import jinja2

        messages = check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.special_tokens)
        except jinja2.exceptions.SecurityError as e:
            raise ValueError(f"{self.where}: the chat template tried something the sandbox forbids ({e})") from None
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"{self.where}: the chat template refused these messages ({e}); {ROLES_HINT}") from None

    def end_of_turn(self, tokenizer) -> int | None:
        """The special token the template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`), if any.

        Found by rendering a finished assistant turn: the first token after its
        content, when that token is one of the tokenizer's special tokens.
        """
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}],
                               add_generation_prompt=False)
        except ValueError:
            return None
        after = text.partition(_MARK)[2]
        ids = tokenizer.encode(after) if after else []
        if ids and ids[0] in tokenizer.special_ids():
            return ids[0]
        return None


def check_messages(messages) -> list[dict]:
    """A conversation as plain dicts of strings; ValueError saying what is wrong otherwise."""
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation must be a non-empty list of messages; {ROLES_HINT}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be an object with string \"role\" and \"content\", got {m!r}; "
                             f"{ROLES_HINT}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def is_conversation(prompt) -> bool:
    """True for one conversation (a list of message dicts), as opposed to a list of them or a prompt."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def hf_chat_template(path: Path) -> tuple[str | None, dict[str, str]]:
    """(template source, special tokens) of a Hugging Face model dir: chat_template.jinja or
    tokenizer_config.json's `chat_template` (a string, or a list of named templates: "default")."""
    from taps_jax.checkpoints.hf import read_json  # the checkpoint dirs' one JSON reader

    config_file = path / "tokenizer_config.json"
    raw = read_json(config_file) if config_file.is_file() else {}
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = raw.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(), special
    source = raw.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise ValueError(f"{config_file}: chat_template must be a string or a list of named templates")
    return source, special
