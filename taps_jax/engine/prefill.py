"""Prefill and the stop rules shared by the AR and speculative loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from taps_jax.models.cache import KVCache
from taps_jax.models.transformer import Transformer, causal_mask

# Per-sequence finish reasons (int32 codes carried in the loop state).
RUNNING, EOS, LENGTH, CAPACITY = 0, 1, 2, 3
FINISH_NAMES = {RUNNING: "running", EOS: "eos", LENGTH: "length", CAPACITY: "capacity"}


PREFILL_CHUNK = 512  # prompt tokens per prefill step: activations O(chunk x context), not O(prompt^2)


def prefill_chunk(prompt_T: int, chunk: int) -> int:
    """The static chunk length for a prompt buffer of prompt_T tokens (a short prompt is one chunk)."""
    return min(chunk, prompt_T)


def cache_slots(capacity: int, prompt_T: int, chunk: int) -> int:
    """Slots to allocate: the capacity rounded up to whole chunks, so a chunk's in-place write always fits."""
    C = prefill_chunk(prompt_T, chunk)
    return -(-capacity // C) * C


def prefill(model: Transformer, prompt_BT, prompt_len_B, capacity: int, taps: tuple[int, ...] = (), *,
            chunk: int = PREFILL_CHUNK, absorb=None, carry=None, cache: KVCache | None = None, start=None):
    """Run right-padded prompts through a fresh cache, `chunk` tokens at a time.

    One compiled chunk step, looped over ceil(longest prompt / chunk) chunks
    (a dynamic trip count: the padding of the prompt buffer beyond the
    longest prompt is never run). Chunk c writes its K/V in place at slots
    [c*chunk, (c+1)*chunk) and attends to the cache so far plus itself
    (causal); sequences whose prompt ended earlier ride along invisibly.

    taps + absorb: each chunk's tap features [B, chunk, n*D] go to
    `absorb(carry, taps_BCF, start, count_B) -> carry` (count_B: valid tokens
    of the chunk per sequence), e.g. the drafter's context cache; the whole
    prompt's features are never held at once.

    cache + start (a traced scalar): go on from a cache whose slots [0, start)
    already hold the first `start` tokens of every prompt (a conversation's
    earlier turns, `taps_jax.session`): only tokens [start, prompt_len) run,
    in chunks written at start + c*chunk, so the cache needs `chunk` slots of
    room past the longest prompt (the session sizes it so). Every prompt must
    have a token at or past `start`.

    Returns (logits [B, V] at each prompt's last token, carry, cache with
    lengths = prompt_len; its slots are `cache_slots(capacity, ...)`).
    """
    B, T = prompt_BT.shape
    C = prefill_chunk(T, chunk)
    # Pad the buffer to whole chunks (static), one more when resuming (a chunk may begin anywhere before the end);
    # the loop never reaches the padding anyway.
    pad = -T % C + (C if cache is not None else 0)
    if pad:
        prompt_BT = jnp.pad(prompt_BT, ((0, 0), (0, pad)))
    prompt_len_B = prompt_len_B.astype(jnp.int32)
    if cache is None:
        cache, start = KVCache.zeros(model.config, B, cache_slots(capacity, T, chunk)), 0
    start = jnp.asarray(start, jnp.int32)

    def step(c, state):
        cache, last_BD, carry = state
        begin = start + c * C
        tokens_BC = jax.lax.dynamic_slice(prompt_BT, (0, begin), (B, C))
        positions_BC = jnp.broadcast_to(begin + jnp.arange(C, dtype=jnp.int32), (B, C))
        count_B = jnp.clip(prompt_len_B - begin, 0, C)
        cache = cache.replace(lengths_B=jnp.minimum(prompt_len_B, begin))
        x_BCD, taps_BCF, cache = model.hidden(tokens_BC, positions_BC, causal_mask(count_B, C), cache, taps, begin)
        # Keep the hidden state of each prompt's last token when it falls in this chunk.
        last_B = prompt_len_B - 1 - begin
        x_BD = jnp.take_along_axis(x_BCD, jnp.clip(last_B, 0, C - 1)[:, None, None], axis=1)[:, 0]
        last_BD = jnp.where(((last_B >= 0) & (last_B < C))[:, None], x_BD, last_BD)
        if absorb is not None:
            carry = absorb(carry, taps_BCF, begin, count_B)
        return cache, last_BD, carry

    num_chunks = jnp.maximum(jnp.max(prompt_len_B) - start + C - 1, 0) // C
    last_BD = jnp.zeros((B, model.config.hidden_size), model.config.jnp_dtype)
    cache, last_BD, carry = jax.lax.fori_loop(0, num_chunks, step, (cache, last_BD, carry))
    logits_BV = model.head(last_BD[:, None])[:, 0]
    return logits_BV, carry, cache.replace(lengths_B=prompt_len_B)


def stop_reason(token_B, generated_B, length_after_B, eos_ids: tuple[int, ...], max_new_tokens: int, capacity: int):
    """Finish reason after emitting `token_B` (RUNNING if the sequence goes on).

    length_after_B is the cache length needed to process one more token.
    """
    is_eos = jnp.isin(token_B, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros_like(token_B, bool)
    return jnp.where(
        is_eos, EOS,
        jnp.where(generated_B >= max_new_tokens, LENGTH,
                  jnp.where(length_after_B > capacity, CAPACITY, RUNNING)),
    ).astype(jnp.int32)
