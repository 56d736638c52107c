"""Host-side prompt checks and padding into static (batch, length) buckets.

Everything here runs before tracing, so bad input fails fast with a clear
message, and prompts of nearby lengths share one compiled program.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from taps_jax.chat import is_conversation
from taps_jax.prompt_file import check_text


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    size = minimum
    while size < n:
        size *= 2
    return size


def encode_prompts(prompts, tokenizer, vocab_size: int) -> list[list[int]]:
    """Strings (needs a tokenizer), token-id sequences or conversations -> checked id lists.

    A conversation (a list of {"role", "content"} dicts) is rendered by the
    tokenizer's chat template with the assistant's turn opened.
    """
    if isinstance(prompts, (str, bytes)) or (hasattr(prompts, "ndim") and prompts.ndim == 1) or is_conversation(prompts):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given; pass at least one prompt (a string or a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        if is_conversation(p):
            if tokenizer is None:
                raise ValueError("chat prompts need a tokenizer with a chat template; this model has no tokenizer")
            p = tokenizer.render_chat(p)
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this model has none, pass token ids instead")
            check_text(p, f"prompt {i}", hint="pass str text, or a list of token ids")
            ids = tokenizer.encode(p)
        else:
            arr = np.asarray(p)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"prompt {i}: token ids must be a 1-D sequence of integers, got {arr.dtype} with shape {arr.shape}")
            ids = arr.astype(np.int64).tolist()
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token, so drop it or add some")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size}); "
                             "encode prompts with this target's tokenizer")
        out.append(ids)
    return out


def check_lengths(max_new_tokens, temperature=0.0) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def check_call(seed, capacity, stop_at_eos, prefill_chunk=512) -> None:
    """The non-sampling generate arguments (sampling ones are checked by SamplingConfig)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    # 0 is not "use the default": `capacity or default` would hide the mistake.
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity <= 0):
        raise ValueError(f"capacity must be a positive integer (KV-cache slots per sequence) or None, got {capacity!r}")
    if not isinstance(stop_at_eos, (bool, np.bool_)):
        raise ValueError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk must be a positive integer (prompt tokens per prefill step), "
                         f"got {prefill_chunk!r}")


def pad_batch(ids: Sequence[Sequence[int]], capacity: int, min_batch: int = 1):
    """Right-pad prompts to a length bucket and the batch to a power of two.

    Returns (prompt [Bp, T] int32, prompt_len [Bp] int32, active [Bp] bool);
    padded batch slots repeat the first prompt and are marked inactive.
    """
    longest = max(len(p) for p in ids)
    if longest > capacity:
        i = next(i for i, p in enumerate(ids) if len(p) == longest)
        raise ValueError(
            f"prompt {i} has {longest} tokens but the cache holds {capacity} (capacity); "
            "shorten the prompt or raise capacity"
        )
    T = bucket(longest)  # the prompt buffer only; prefill runs whole chunks up to the longest prompt
    B = bucket(len(ids), minimum=min_batch)
    prompt = np.zeros((B, T), np.int32)
    lens = np.zeros((B,), np.int32)
    for b in range(B):
        p = ids[b] if b < len(ids) else ids[0]
        prompt[b, : len(p)] = p
        lens[b] = len(p)
    active = np.arange(B) < len(ids)
    return prompt, lens, active
