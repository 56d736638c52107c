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
there yet is announced on stderr before it compiles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import time
from typing import Any, Callable, Iterator

import jax

from taps_jax import compile_cache, sharding
from taps_jax.engine.prefill import RUNNING
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
                state = p.start.eval_shape(*self.args, **self.kwargs)
                limit = 0  # a traced int32 scalar: any value compiles the same program
                self._compiled["start"] = p.start.lower(*self.args, **self.kwargs).compile()
                self._compiled["advance"] = p.advance.lower(*self._model_args, state, limit, **self.kwargs).compile()
            else:
                self._compiled["generate"] = p.generate.lower(*self.args, **self.kwargs).compile()
        self.compile_s = time.perf_counter() - begin
        return self.compile_s

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

    def _on_devices(self, fn, *args):
        # Entered per call, not across a yield: the caller's code between chunks runs outside the mesh.
        with sharding.use_mesh(self.mesh), raise_out_of_memory(self.estimate):
            return fn(*args)
