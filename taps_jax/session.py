"""`ChatSession`: a conversation that keeps its caches on device from turn to turn.

A chat turn's prompt is the whole conversation so far, rendered by the chat
template. Decoded as a fresh call, each turn would prefill the whole history
again, in a prompt bucket that grows with it (a new compile per bucket). A
session instead keeps the last turn's loop state: the target's KV cache
(and, for a speculative policy, the drafter's context) already holds the
conversation up to the last answer, so a turn prefills only the tokens that
follow the longest common prefix of what the cache holds and the new
prompt (the template's end of the answer, the new user message and the
opened assistant turn), then decodes as a call would (`extend` + `advance`
programs of the engine).

Shapes are fixed when the session opens: batch, a prompt buffer of
`context` tokens and `context + chunk` cache slots (a prefill chunk may begin
at any slot), so both programs compile once, ahead of time, however the
conversation grows within the context. Attention reads the cache only up
to the longest committed length, so a large context costs little per step.
Tokens are those of a fresh call on the whole conversation (greedy: the same
argmax path; sampled: the target's law at every step).
"""

from __future__ import annotations

import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from taps_jax import compile_cache, sharding
from taps_jax.calls import STREAM_CHUNK, GenerateCall, GenerateResult, describe, program_id, program_key
from taps_jax.engine.prefill import RUNNING

SESSION_CONTEXT = 4096  # conversation tokens a session holds by default (or the target's context, when shorter)
SESSION_CHUNK = 128  # prefill chunk: a turn's new tokens are a few dozen to a few hundred


def session_sizes(config, context: int | None, max_new_tokens: int, headroom: int, chunk: int) -> tuple[int, int]:
    """(context, cache capacity) of a session, checked against the target's positions.

    context: the conversation tokens (prompts and answers) it may hold; None: SESSION_CONTEXT, or what the target's
    max_position_embeddings leaves after one chunk of landing room.
    """
    limit = config.max_position_embeddings
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive integer (prefill tokens per step), got {chunk!r}")
    if context is None:
        context = min(SESSION_CONTEXT, limit - chunk)
    elif isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise ValueError(f"context must be a positive integer (conversation tokens), got {context!r}")
    if context + chunk > limit:
        raise ValueError(f"a session of {context} context tokens needs {context + chunk} positions (one prefill chunk "
                         f"of {chunk} past it), but the target has max_position_embeddings={limit}; ask for a "
                         f"context of at most {limit - chunk}")
    if max_new_tokens + headroom + 1 > context:
        raise ValueError(f"max_new_tokens={max_new_tokens}" + (f" + {headroom} slots of tree headroom" if headroom
                                                                 else "")
                         + f" leaves no room for a prompt in a session context of {context} tokens; raise the "
                         "context or lower max_new_tokens")
    return context, context + chunk


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatSession:
    """Turns of one conversation on one decoder, the caches kept between them (see the module doc).

    Make one with `Target.session(...)` or `SpeculativeDecoder.session(...)`.
    `turn(prompt)` streams a turn (a `GenerateResult` after the prefill and
    every `chunk` rounds, the last one final), `send(prompt)` returns its last
    result; prompt is the whole conversation (a list of {"role", "content"}
    messages, rendered by the chat template), a text or token ids. Each
    result's stats add `cached_tokens` (prompt tokens the cache already
    held), `prefill_tokens` (the ones this turn ran), `compile_s` (the wait
    for compiles in this turn: the first turn's, unless `compile()` ran) and
    `decode_s`.
    """

    def __init__(self, target, call: GenerateCall, context: int, headroom: int, before_turn=None):
        if call.programs.extend is None:
            raise ValueError("this decoder's programs cannot extend a cache; decode each turn as a call")
        self.target, self.call, self.context, self.headroom = target, call, context, headroom
        config = call.kwargs["config"]
        self.max_new_tokens = getattr(config, "decode", config).max_new_tokens  # a SpecConfig holds a DecodeConfig
        self.rows = call.args[-4].shape[0]
        self._before_turn = before_turn  # updates call.kwargs for the next turn (adaptive: the last turn's estimates)
        self._carry = None  # the loop state on device (None: none yet, or lost to an error)
        self._cached: list[int] = []  # the tokens whose K/V the carry's cache holds, in order (a prefix of it)
        self._shapes = None
        self.compile_s: float | None = None
        self.turns = 0

    @property
    def cached_tokens(self) -> int:
        """Tokens of the conversation the caches hold now."""
        return len(self._cached) if self._carry is not None else 0

    def _buffers(self, ids: list[int]):
        prompt = np.zeros((self.rows, self.context), np.int32)
        prompt[0, :len(ids)] = ids
        lens = np.zeros((self.rows,), np.int32)
        lens[0] = len(ids)
        return prompt, lens

    def _start_args(self, prompt, lens) -> tuple:
        """The start program's arguments for these buffers (what identifies and shapes the session's programs)."""
        put = lambda x: sharding.put_batch(x, self.call.mesh)
        return (*self.call._model_args, put(prompt), put(lens), put(lens > 0), self.call.args[-1])

    def _compiling(self, args):
        p = self.call.programs
        name = f"{p.extend.__name__}+{p.advance.__name__}"
        program = program_id(name, args, self.call.kwargs)
        return compile_cache.compiling(describe(self.call.kwargs["config"], program[3]), name, program,
                                       lambda: program_key(program, args, self.call.kwargs))

    def compile(self) -> float:
        """Compile the session's extend and advance programs ahead of time; returns the seconds it took."""
        if self.compile_s is not None:
            return 0.0
        call, p = self.call, self.call.programs
        begin = time.perf_counter()
        args = self._start_args(*self._buffers([0]))
        with self._compiling(args), sharding.use_mesh(call.mesh):
            # The loop state's shapes (no compile): the caches of `context + chunk` slots, the prompt buffer.
            self._shapes = jax.eval_shape(lambda: p.start(*args, **call.kwargs))
            model = call._model_args
            call._compiled["extend"] = call._ahead_of_time(p.extend, (*model, self._shapes, *args[-4:-2],
                                                                      np.int32(0)))
            state = call._compiled["extend"].out_info
            call._compiled["advance"] = call._ahead_of_time(p.advance, (*model, state, 0))
        self.compile_s = time.perf_counter() - begin
        return self.compile_s

    def _empty(self):
        """A zero loop state of the session's shapes (its key: the call's seed), on the call's devices."""
        def zero(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return self.call.args[-1]
            return jnp.zeros(x.shape, x.dtype)

        with sharding.use_mesh(self.call.mesh):
            return jax.tree.map(zero, self._shapes)

    def check(self, prompt) -> list[int]:
        """The prompt's token ids, refused (ValueError) when it and a whole answer do not fit the context."""
        ids = self.target.encode([prompt])[0]
        need = len(ids) + self.max_new_tokens + self.headroom
        if need > self.context:
            raise ValueError(f"the conversation is {len(ids)} tokens; with max_new_tokens={self.max_new_tokens}"
                             + (f" and {self.headroom} slots of tree headroom" if self.headroom else "")
                             + f" it needs {need} of the session's {self.context} context tokens: start a new "
                             "session (dropping early turns) or open one with a larger context")
        return ids

    def turn(self, prompt, chunk: int = STREAM_CHUNK) -> Iterator[GenerateResult]:
        """Stream one turn: the result after the prefill and after every `chunk` rounds (the last: final)."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive number of rounds, got {chunk!r}")
        return self._turn(self.check(prompt), chunk)

    def send(self, prompt) -> GenerateResult:
        """One turn to the end; its final result."""
        for result in self.turn(prompt, chunk=1 << 30):
            pass
        return result

    def _turn(self, ids: list[int], chunk: int) -> Iterator[GenerateResult]:
        call = self.call
        waited = self.compile()
        if self._before_turn is not None and self.turns:
            self._before_turn(call.kwargs)
        begin = time.perf_counter()
        carry = self._carry if self._carry is not None else self._empty()
        cached = self._cached if self._carry is not None else []
        start = min(_common_prefix(cached, ids), len(ids) - 1)  # a turn runs at least its last token
        prompt, lens = self._buffers(ids)
        args = self._start_args(prompt, lens)
        self._carry = None  # donated: lost if the call fails, and the next turn starts from an empty state
        carry = call._on_devices(call._call, "extend", *call._model_args, carry, *args[-4:-2], np.int32(start))
        self._carry, self._cached = carry, list(ids)
        self.turns += 1
        while True:
            outputs = call._on_devices(lambda: tuple(map(sharding.to_host, call.programs.outputs(carry, call.kwargs))))
            result = call.finish(outputs)
            # The cache holds the prompt and every emitted token but the last (not yet fed to the target).
            self._cached = list(ids) + result.tokens[0][:-1]
            result.stats.update(cached_tokens=start, prefill_tokens=len(ids) - start)
            if bool((outputs[2] != RUNNING).all()):
                result.stats.update(compile_s=waited, decode_s=time.perf_counter() - begin)
                yield result
                return
            yield result
            self._carry = None
            carry = call._on_devices(call._call, "advance", *call._model_args, carry, chunk)
            self._carry = carry
