"""`GenerateCall`: one generate call, checked and placed: compile it ahead of time, run it, or stream it.

`Target.prepare` and `SpeculativeDecoder.prepare` do every check and all the
host work (encode, size, pad, place); what is left is device work, in one of
two forms that give the same tokens:

* `run()`: the engine's whole generate, one program with one `while_loop`;
* `stream(chunk)`: the same prefill and the same loop body, as a start
  program and an advance program that runs at most `chunk` rounds (AR steps)
  per call; the host reads the tokens between calls. Nothing runs on the
  host inside a loop (no callbacks); the cost is one dispatch and one small
  device-to-host copy per chunk, and the state is donated, so the caches are
  not copied.

`compile()` compiles the form you will use ahead of time
(`jit(...).lower(...).compile()`), so compile time and decode time are
measured apart and the prompt is decoded once.

Compiled programs are cached on disk across processes (`taps_jax.compile_cache`,
turned on by the first compile unless opted out), and a program that is not
there yet is announced on stderr before it compiles. `compile()` also keeps
each lowered program under `lowered_key` (everything that shapes it), so a
later process compiles it (from JAX's cache) without tracing it again.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import inspect
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np

from taps_jax import compile_cache, sharding
from taps_jax.engine.prefill import FINISH_NAMES, LENGTH, RUNNING
from taps_jax.engine.sizing import MemoryEstimate, raise_out_of_memory
from taps_jax.engine.static import StaticGraph

STREAM_CHUNK = 4  # rounds (AR steps) per streamed chunk


@dataclasses.dataclass
class GenerateResult:
    """Generated continuations (prompt excluded) and per-sequence facts."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    texts: list[str] | None = None
    stats: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Programs:
    """An engine's jitted programs; all take (model args..., 4 batch inputs | state, limit) + the same kwargs.

    generate(*model, prompt, lens, active, key, **kw) -> outputs
    start(*model, prompt, lens, active, key, **kw) -> state
    advance(*model, state, limit, **kw) -> state (at most `limit` more rounds)
    outputs(state, kw) -> the outputs generate returns
    """

    generate: Callable
    start: Callable
    advance: Callable
    outputs: Callable
    static: tuple[str, ...]  # static argument names: baked into an executable, not passed to it
    # Continuous batching (`taps_jax.engine.refill`; `GenerateCall.refilled`):
    until: Callable | None = None  # until(*model, state, need, limit, **kw): advance until `need` rows are stopped
    refill: Callable | None = None  # refill(*model, state, prompt [K, T], lens [K], rows [K], **kw) -> state
    # A conversation that goes on (`taps_jax.session`): prefill only what follows what the cache holds.
    extend: Callable | None = None  # extend(*model, state, prompt [B, T], lens [B], start, **kw) -> state


def _dynamic(fn, static: tuple[str, ...], args, kwargs):
    """The (args, kwargs) an ahead-of-time executable of `fn` takes: static arguments dropped."""
    signature = inspect.signature(fn)
    params, bound = signature.parameters, signature.bind(*args, **kwargs).arguments
    pos = [v for k, v in bound.items() if k not in static and params[k].kind != inspect.Parameter.KEYWORD_ONLY]
    kw = {k: v for k, v in bound.items() if k not in static and params[k].kind == inspect.Parameter.KEYWORD_ONLY}
    return tuple(pos), kw


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)  # a jitted function keeps its name; a stand-in may not


def program_id(name: str, args: tuple, kwargs: dict) -> tuple:
    """Which program an engine call runs, cheaply (hashable, no walk over the params): the program's name,
    its static config and graphs, the batch shape and its placement. args end with (prompt, lens, active, key)."""
    statics = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, StaticGraph))
    prompt = args[-4]
    return name, kwargs["config"], statics, tuple(prompt.shape), getattr(prompt, "sharding", None)


def program_key(program: tuple, args: tuple, kwargs: dict) -> str:
    """`program_id` as a digest that is the same in every process (a graph by its parameters' shapes: a
    GraphDef's repr is not stable across processes)."""
    name, config, _, shape, placement = program
    params = jax.tree_util.tree_leaves((args[:-4], kwargs.get("scorer_params")))
    device = jax.devices()[0]
    facts = [name, repr(config), shape, repr(placement), f"{device.platform}:{device.device_kind}",
             jax.device_count(), jax.__version__, [(tuple(x.shape), str(x.dtype)) for x in params if hasattr(x, "shape")]]
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:24]


def _stable_repr(value) -> str:
    # A GraphDef names the functions it holds with their addresses ("<function dot_general at 0x7f..>"); their
    # code is covered by the versions and the source digest in the key.
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


def _plain(value) -> str:
    """A static argument spelled out field by field (a repr may elide, as numpy's does, or leave fields out);
    TypeError when it is not plain data (then nothing is kept)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.generic)):
        return repr(value)  # a float's repr round-trips
    if isinstance(value, StaticGraph):
        return _stable_repr(value)
    if isinstance(value, np.dtype):
        return f"dtype({value.str})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{kind}({', '.join(f'{f.name}={_plain(getattr(value, f.name))}' for f in dataclasses.fields(value))})"
    if isinstance(value, (tuple, list)):
        return f"{kind}[{', '.join(map(_plain, value))}]"
    if isinstance(value, frozenset):
        return f"{kind}{{{', '.join(sorted(map(_plain, value)))}}}"
    if isinstance(value, dict):
        return f"{kind}{{{', '.join(sorted(f'{_plain(k)}: {_plain(v)}' for k, v in value.items()))}}}"
    raise TypeError(f"not plain data: {kind}")


def _leaf(x):
    """What a compiled program depends on of an argument leaf: its aval and placement, never its value."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        placement = getattr(x, "sharding", None)
        devices = sorted(d.id for d in placement.device_set) if placement is not None else None
        return [type(x).__name__, list(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                repr(placement), devices]  # a sharding's repr names its mesh's shape, not which devices
    return [type(x).__name__, repr(jax.typeof(x))]  # a Python scalar: a weakly typed scalar argument


def _cpu_model() -> str:
    # JAX lowers some operations per CPU feature set: keep another CPU sharing the cache dir out.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    features = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86, Arm
    return "\n".join(sorted({line for line in lines if line.startswith(features)}))


def lowered_key(fn, static: tuple[str, ...], args: tuple, kwargs: dict, mesh) -> str | None:
    """A digest of everything that shapes `fn(*args, **kwargs)`'s lowered program (None: none worth keeping):
    the function, every static argument, each dynamic leaf's path, aval and placement, the mesh and devices,
    Python's, JAX's, jaxlib's, flax's and numpy's versions, JAX's settings, XLA's flags, the CPU, and the
    taps_jax source (`compile_cache.source_digest`)."""
    import flax
    import jaxlib

    module, name = getattr(fn, "__module__", None) or "", getattr(fn, "__qualname__", "")
    inner = getattr(fn, "__wrapped__", None)
    if (jax.process_count() != 1 or not module.startswith("taps_jax.") or inner is None or inner.__closure__
            or getattr(sys.modules.get(module), name, None) is not fn):
        return None  # only taps_jax's module-level programs: name and source digest cover all they close over
    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    try:
        statics = {k: _plain(v) for k, v in bound.items() if k in static}
    except TypeError:
        return None
    dynamic = {k: v for k, v in bound.items() if k not in static}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "LIBTPU")))
    facts = [f"{module}.{name}", statics, _stable_repr(treedef),
             [[jax.tree_util.keystr(path), *_leaf(x)] for path, x in leaves], repr(mesh),
             [d.id for d in mesh.devices.flat] if mesh is not None else None, devices,
             sys.version, jax.__version__, jaxlib.__version__, flax.__version__, np.__version__, settings, env,
             _cpu_model(), compile_cache.source_digest()]
    return hashlib.sha256(json.dumps(facts, default=repr).encode()).hexdigest()[:32]


def describe(config, shape) -> str:
    """'the adaptive decoder for batch 8, prompts up to 32 tokens, 256 cache slots': what a compile notice names
    (shape: the padded prompt buffer's, [batch, prompt bucket])."""
    decode = getattr(config, "decode", config)
    if not hasattr(config, "tree"):
        kind = "AR decoder"
    else:
        kind = "adaptive decoder" if config.adaptive is not None else f"{config.tree.policy} decoder"
    return f"the {kind} for batch {shape[0]}, prompts up to {shape[1]} tokens, {decode.capacity} cache slots"


@dataclasses.dataclass
class GenerateCall:
    """One checked generate call. `run()` == the decoder's `generate(...)`; see the module doc."""

    programs: Programs
    args: tuple  # generate's positional arguments: model args + (prompt, lens, active, key)
    kwargs: dict  # generate's keyword arguments (static config, scorer)
    finish: Callable[[tuple], GenerateResult]  # host outputs -> result
    mesh: Any
    estimate: MemoryEstimate
    compile_s: float | None = None  # set by compile()
    _compiled: dict = dataclasses.field(default_factory=dict)

    @property
    def _model_args(self) -> tuple:
        return self.args[:-4]

    def _compiling(self, stream: bool):
        """compile_cache.compiling for this call's program(s): a notice first unless known to be compiled."""
        p = self.programs
        name = f"{_name(p.start)}+{_name(p.advance)}" if stream else _name(p.generate)
        program = program_id(name, self.args, self.kwargs)
        return compile_cache.compiling(describe(self.kwargs["config"], program[3]), name, program,
                                       lambda: program_key(program, self.args, self.kwargs))

    def compile(self, stream: bool = False) -> float:
        """Compile generate (or, stream=True, start + advance) ahead of time; returns the seconds it took."""
        p = self.programs
        begin = time.perf_counter()
        with self._compiling(stream), sharding.use_mesh(self.mesh), raise_out_of_memory(self.estimate):
            if stream:
                self._compiled["start"] = self._ahead_of_time(p.start, self.args)
                state = self._compiled["start"].out_info  # the state's avals, without tracing start again
                limit = 0  # a traced int32 scalar: any value compiles the same program
                self._compiled["advance"] = self._ahead_of_time(p.advance, (*self._model_args, state, limit))
            else:
                self._compiled["generate"] = self._ahead_of_time(p.generate, self.args)
        self.compile_s = time.perf_counter() - begin
        return self.compile_s

    def _ahead_of_time(self, fn, args: tuple):
        """`fn.lower(*args, **kwargs).compile()`, the lowering kept by an earlier process when there is one (no
        tracing; the same program, so JAX's cache has its executable)."""
        pos, kw = _dynamic(fn, self.programs.static, args, self.kwargs)
        key = lowered_key(fn, self.programs.static, args, self.kwargs, self.mesh)
        lowered = compile_cache.load_lowered(key, jax.tree_util.tree_structure((pos, kw))) if key else None
        if lowered is not None:
            try:
                return lowered.compile()
            except Exception:  # a kept lowering that does not compile here: the traced one decides (or raises)
                pass
        lowered = fn.lower(*args, **self.kwargs)
        compiled = lowered.compile()
        if key:
            compile_cache.store_lowered(key, lowered)
        return compiled

    def _call(self, name: str, *args):
        fn = getattr(self.programs, name)
        if name not in self._compiled:
            return fn(*args, **self.kwargs)
        pos, kw = _dynamic(fn, self.programs.static, args, self.kwargs)
        return self._compiled[name](*pos, **kw)

    def _timed(self, result: GenerateResult, seconds: float) -> GenerateResult:
        if self.compile_s is not None:
            result.stats.update(compile_s=self.compile_s, decode_s=seconds)
        return result

    def run(self) -> GenerateResult:
        """Decode to the end (the compiled executable when `compile()` ran, else the jitted program)."""
        begin = time.perf_counter()
        with self._compiling(False), sharding.use_mesh(self.mesh), raise_out_of_memory(self.estimate):
            outputs = tuple(map(sharding.to_host, self._call("generate", *self.args)))
        return self._timed(self.finish(outputs), time.perf_counter() - begin)

    def stream(self, chunk: int = STREAM_CHUNK) -> Iterator[GenerateResult]:
        """Yield the result so far after the prefill and after every `chunk` rounds (AR steps).

        Each yield is a whole `GenerateResult` of the tokens so far (unfinished
        sequences have finish reason "running"); the last one equals `run()`.
        """
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive number of rounds, got {chunk!r}")
        return self._stream(chunk)

    def _stream(self, chunk: int) -> Iterator[GenerateResult]:
        begin = time.perf_counter()
        with self._compiling(True):  # the start program (the advance program compiles at its first call, next)
            state = self._on_devices(self._call, "start", *self.args)
        while True:
            outputs = self._on_devices(lambda: tuple(map(sharding.to_host, self.programs.outputs(state, self.kwargs))))
            result = self.finish(outputs)
            if bool((outputs[2] != RUNNING).all()):
                yield self._timed(result, time.perf_counter() - begin)
                return
            yield result
            state = self._on_devices(self._call, "advance", *self._model_args, state, chunk)

    def refilled(self, ids, refill_rows: int, limit: int = 1 << 30) -> "Refilled":
        """Decode every prompt of `ids` (token lists) in this call's batch rows, a finished row taking the next
        prompt (continuous batching): see `Refilled`. The call must have been prepared for prompts at least as
        long as the longest of `ids` (its prompt buffer and cache fit them all) and its batch rows."""
        if self.programs.until is None:
            raise ValueError("this decoder's programs cannot refill rows; decode in static batches")
        return Refilled(self, [list(map(int, p)) for p in ids], refill_rows, limit)

    def _on_devices(self, fn, *args):
        # Entered per call, not across a yield: the caller's code between chunks runs outside the mesh.
        with sharding.use_mesh(self.mesh), raise_out_of_memory(self.estimate):
            return fn(*args)


@dataclasses.dataclass(frozen=True)
class Finished:
    """One prompt of a refilled run, when its row finished."""

    index: int  # its position in the run's list of prompts
    tokens: list[int]
    finish_reason: str
    rounds: int  # loop steps its row ran (AR: tokens after the first, which comes with the prefill)
    accepted_lengths: list[int] | None  # per round (speculative programs); None for AR


class Refilled:
    """Continuous batching, driven from the host: iterate it for lists of `Finished` prompts, in completion order
    (one list per return of the loop to the host: what a job writes in one append).

    The batch starts with the first B prompts (the call's start program).
    Then, repeatedly: the loop runs on device until K more rows have stopped
    (`until`: K = refill_rows, fewer when fewer run) and returns; the host
    reads the tokens (one small copy), hands out the finished rows and one
    compiled `refill` program prefills up to K pending prompts into freed
    rows, every other row staying where it was on device. K trades refill
    dispatches and prefill of padding rows (small K) against finished rows
    idling until K of them are free (large K).

    steps / row_steps: loop steps run, and the row-steps that decoded a
    prompt (the rest: finished or empty rows riding along); `utilisation`
    = row_steps / (rows x steps).
    """

    def __init__(self, call: GenerateCall, ids: list[list[int]], refill_rows: int, limit: int):
        prompt = call.args[-4]
        self.call, self.ids, self.limit = call, ids, limit
        self.rows, self.width = prompt.shape
        if isinstance(refill_rows, bool) or not isinstance(refill_rows, int) or not 1 <= refill_rows <= self.rows:
            raise ValueError(f"refill_rows must be an integer in [1, {self.rows}] (rows per refill), got "
                             f"{refill_rows!r}")
        if not ids:
            raise ValueError("no prompts given; pass at least one prompt")
        longest = max(map(len, ids))
        if longest > self.width:
            raise ValueError(f"a prompt of {longest} tokens does not fit this call's prompt buffer of {self.width}; "
                             "prepare the call with the run's longest prompts")
        self.refill_rows = refill_rows
        self.steps = self.row_steps = self.refills = 0

    @property
    def utilisation(self) -> float:
        return self.row_steps / max(self.rows * self.steps, 1)

    def _refill_width(self, indices: list[int]) -> int:
        """The prompt buffer of a refill: its prompts' own bucket, so short prompts prefill short chunks (the
        refill program compiles once per bucket), unless that would size the cache otherwise (then the run's)."""
        from taps_jax.engine.batching import bucket
        from taps_jax.engine.prefill import cache_slots

        config = self.call.kwargs["config"]
        decode = getattr(config, "decode", config)
        width = min(bucket(max(len(self.ids[i]) for i in indices)), self.width)
        same = (cache_slots(decode.capacity, width, decode.prefill_chunk)
                == cache_slots(decode.capacity, self.width, decode.prefill_chunk))
        return width if same else self.width

    def _pad(self, indices: list[int], count: int, width: int | None = None):
        """Prompts `indices` as a [count, width] buffer, lens and active (missing rows: the first prompt, inactive)."""
        prompt = np.zeros((count, width or self.width), np.int32)
        lens = np.zeros((count,), np.int32)
        for r in range(count):
            p = self.ids[indices[r] if r < len(indices) else indices[0]]
            prompt[r, :len(p)] = p
            lens[r] = len(p)
        return prompt, lens, np.arange(count) < len(indices)

    def _outputs(self, state):
        out = self.call._on_devices(lambda: tuple(map(sharding.to_host, self.call.programs.outputs(state,
                                                                                                 self.call.kwargs))))
        return out, (out[3] if len(out) > 3 else out[1])  # per-row progress: rounds (speculative), tokens (AR)

    def __iter__(self) -> Iterator[list[Finished]]:
        call, B, mesh = self.call, self.rows, self.call.mesh
        put = lambda x: sharding.put_batch(x, mesh)
        row_of = [-1] * B  # prompt index each row decodes (-1: none)
        first = list(range(min(B, len(self.ids))))
        prompt, lens, active = self._pad(first, B)
        row_of[:len(first)] = first
        following = len(first)
        state = call._on_devices(call._call, "start", *call._model_args, put(prompt), put(lens), put(active),
                                 call.args[-1])
        out, progress_B = self._outputs(state)
        while True:
            done = self._hand_out(out, row_of)
            if done:
                yield done
            free = [r for r in range(B) if row_of[r] < 0]
            if free and following < len(self.ids):  # refill, then read again (a new row may stop at once)
                taken = free[:self.refill_rows]
                indices = list(range(following, following + min(len(taken), len(self.ids) - following)))
                taken = taken[:len(indices)]
                following += len(indices)
                prompt, lens, _ = self._pad(indices, self.refill_rows, self._refill_width(indices))
                rows = np.array(taken + [B] * (self.refill_rows - len(taken)), np.int32)  # B: a dropped entry
                state = call._on_devices(call._call, "refill", *call._model_args, state, put(prompt), put(lens),
                                         put(rows))
                for r, i in zip(taken, indices):
                    row_of[r] = i
                self.refills += 1
                out, progress_B = self._outputs(state)
                continue
            running = int((out[2] == RUNNING).sum())
            if running == 0:
                break
            # Stop when K more rows are free for pending prompts; with none pending, run to the end.
            more = min(self.refill_rows, running) if following < len(self.ids) else running
            state = call._on_devices(call._call, "until", *call._model_args, state, B - running + more, self.limit)
            out, now_B = self._outputs(state)
            self.steps += int((now_B - progress_B).max())  # a row that ran the whole time ran every step
            progress_B = now_B
        # An adaptive decoder keeps the run's statistics and probe clock for its next call; rows that never held a
        # prompt (-1) read as stopped by length there (their result is dropped).
        call.finish((*out[:2], np.where(out[2] < 0, LENGTH, out[2]), *out[3:]))

    def _hand_out(self, out, row_of: list[int]) -> list[Finished]:
        tokens_BN, n_B, finish_B = out[:3]
        done = []
        for r, i in enumerate(row_of):
            if i < 0 or finish_B[r] == RUNNING:
                continue
            row_of[r] = -1
            if len(out) > 3:
                rounds = int(out[3][r])
                accepted = out[4][r, :rounds].tolist()
            else:
                rounds, accepted = int(n_B[r]) - 1, None
            self.row_steps += rounds
            done.append(Finished(i, tokens_BN[r, :n_B[r]].tolist(), FINISH_NAMES[int(finish_B[r])], rounds,
                                 accepted))
        return done


def refilled(decoder, prompts, max_new_tokens: int, *, rows: int, refill_rows: int, **options) -> Refilled:
    """Continuous batching of `prompts` on `rows` batch rows (a `Target` or a `SpeculativeDecoder`): iterate the
    result for lists of `Finished` prompts (`Refilled`). The call is prepared for the `rows` longest prompts
    (repeated up to `rows` when there are fewer), so its batch shape is the same for every run of `rows` and its
    prompt buffer, cache and memory check fit every prompt of the run; options: as `generate`'s."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive integer (batch rows), got {rows!r}")
    target = getattr(decoder, "target", decoder)
    ids = target.encode(prompts)
    longest = sorted(ids, key=len)[-rows:]
    call = decoder.prepare(longest + longest[:1] * (rows - len(longest)), max_new_tokens, **options)
    return call.refilled(ids, refill_rows)
