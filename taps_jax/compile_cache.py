"""Compiled programs cached on disk across processes (on by default), and a notice before a long compile.

The cache is JAX's persistent compilation cache in `cache_dir() / "xla"`:
`$TAPS_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/taps-jax`, else
`~/.cache/taps-jax` (beside the adaptive calibration, `adaptive_costs.json`).
A second process loads what the first one compiled instead of compiling it
again. JAX keys every entry on the lowered program, its compile options, the
devices and the JAX version, so an entry never stands in for another program;
deleting the directory is always safe.

Who turns it on: each command at its start (taps-decode, taps-bench,
train.*: `setup(args)`), and the library the first time a decoder compiles
or calibrates (`ensure()`, from `taps_jax.calls` and the calibration), so
`import taps_jax` alone changes nothing. Off: `--no-compile-cache`,
`TAPS_JAX_COMPILE_CACHE=0`, or `disable()` before the first decode. JAX has
one cache per process: once it is on, the process's other programs are cached
there too. A cache directory you gave JAX yourself (`jax_compilation_cache_dir`,
`JAX_COMPILATION_CACHE_DIR`) is used as it is; off turns that one off too.
JAX treats its cache as trusted code: do not point `TAPS_JAX_CACHE_DIR` at a
directory that others can write.

`compiling(...)` wraps a call that may compile (taps_jax.calls, the
calibration): unless the program is known to be in the cache, it first
prints one line on stderr, "compiling WHAT (about N s the first time; cached
for later runs)", N being what the last compile of that kind took here
(`compile_times.json` in the cache dir, written by the same wrapper).

Lowered programs (`lowered/` in the cache dir): JAX's cache saves the XLA
compile, but JAX must still trace and lower a program to find its entry (3 to
4 s for the adaptive decoder). `store_lowered` / `load_lowered` keep a
`jax.stages.Lowered` (its StableHLO module and what JAX compiles it with)
under a key that the caller derives from everything that shapes the program
(`taps_jax.calls.lowered_key`: the function, its static arguments, the
inputs' paths, shapes, dtypes and placement, the devices, the versions, the
JAX and XLA settings, the CPU and `source_digest()`, a hash of taps_jax's
code), so a warm run compiles the very module the traced run compiled (JAX's
cache has its executable) without tracing. An entry that does not verify or
load is ignored: the program is traced as without it, and stored again.
Same switch as JAX's cache, and the same trust (an entry is unpickled).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import jax

ENV = "TAPS_JAX_COMPILE_CACHE"
TIMES_FILE = "compile_times.json"
LOWERED = "lowered"  # lowered programs: `store_lowered`
_MAGIC = b"taps-jax lowered 1\n"  # then the payload's sha256 (32 bytes), then the zlib-compressed payload
JAX_MIN_COMPILE_S = 1.0  # JAX's default threshold: programs compiled faster than this are not cached

_on: bool | None = None  # None: not decided yet (the first ensure() reads the environment)
_ours: str | None = None  # the directory this module gave JAX (None: off, or the user's own)
_compiled: set = set()  # program ids compiled (or loaded) in this process
_times: dict | None = None  # compile_times.json, read once
_source: str | None = None  # source_digest() of the installed package, computed once


def cache_dir() -> Path:
    """Where taps-jax keeps what it measured and compiled: $TAPS_JAX_CACHE_DIR, $XDG_CACHE_HOME/taps-jax, ~/.cache/taps-jax."""
    if os.environ.get("TAPS_JAX_CACHE_DIR"):
        return Path(os.environ["TAPS_JAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "taps-jax"


def _reset_jax_cache() -> None:
    # JAX decides at its first compile whether a cache is used and opens it once; make it look again.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def enable(path=None) -> Path | None:
    """Cache compiled programs in `path` (default: `cache_dir() / "xla"`); returns the directory in use.

    A directory the user already gave JAX wins over ours. None when the
    directory cannot be created (a read-only home still decodes, compiling
    every time).
    """
    global _on, _ours
    current = jax.config.jax_compilation_cache_dir
    if current and current != _ours and path is None:
        _on, _ours = True, None  # the user's own cache
        jax.config.update("jax_enable_compilation_cache", True)
        return Path(current)
    folder = Path(path) if path is not None else cache_dir() / "xla"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        _on = False
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if jax.config.jax_persistent_cache_min_compile_time_secs == JAX_MIN_COMPILE_S:
        # Small CPU programs compile in tens of ms and load in a few: cache them too (unless the user chose).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _reset_jax_cache()
    _on, _ours = True, str(folder)
    return folder


def disable() -> None:
    """No persistent cache in this process (ours or one given to JAX): every program compiles afresh."""
    global _on, _ours
    jax.config.update("jax_enable_compilation_cache", False)
    if _ours is not None:
        jax.config.update("jax_compilation_cache_dir", None)
    _reset_jax_cache()
    _on, _ours = False, None


def ensure() -> None:
    """On first use, enable the cache unless $TAPS_JAX_COMPILE_CACHE says 0 (then disable it); later calls do nothing."""
    if _on is not None:
        return
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: set it to 0 (compile every time) or 1 (cache compiled programs, "
                         "the default), or unset it")
    if value == "1":
        enable()
    else:
        disable()


def enabled() -> bool:
    """Whether compiled programs are cached across processes (after `ensure()`)."""
    return bool(_on) and bool(jax.config.jax_compilation_cache_dir)


def add_flag(parser) -> None:
    """--no-compile-cache for a command (pass its args to `setup`)."""
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile every program afresh: do not load or store compiled programs in the cache "
                             f"directory (~/.cache/taps-jax/xla, or $TAPS_JAX_CACHE_DIR/xla); also {ENV}=0")


def setup(args) -> None:
    """At a command's start, before anything compiles: --no-compile-cache, else the cache (unless $TAPS_JAX_COMPILE_CACHE=0)."""
    if getattr(args, "no_compile_cache", False):
        disable()
    else:
        ensure()


# --------------------------------------------------------------------------- the notice


def _read_times() -> dict:
    global _times
    if _times is None:
        try:
            _times = json.loads((cache_dir() / TIMES_FILE).read_text())
        except (OSError, ValueError):
            _times = {}
        if not isinstance(_times, dict):
            _times = {}
    return _times


def _write_times(times: dict) -> None:
    path = cache_dir() / TIMES_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{TIMES_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(times, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # only the next notice's estimate is lost


def announce(what: str, kind: str, key: str | None = None) -> None:
    """One line on stderr (process 0, above any progress bar) before a long compile or calibration, with
    how long the last one of this `kind` took here."""
    times = _read_times()
    same = [e["s"] for e in times.values() if isinstance(e, dict) and e.get("kind") == kind]
    estimate = times[key]["s"] if key in times else same[-1] if same else None
    about = f"about {max(estimate, 1):.0f} s" if estimate is not None else "up to a minute or so"
    text = (f"compiling {what} ({about} the first time; cached for later runs)" if enabled() else
            f"compiling {what} ({about}; the compile cache is off, so every run compiles)")
    if jax.process_index() == 0:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)


@contextlib.contextmanager
def compiling(what: str, kind: str, program, key: Callable[[], str]):
    """Around a call that may compile `program` (hashable: its id in this process; `taps_jax.calls.program_id`).

    Nothing to do when it was compiled in this process. Else `key()` (a digest
    that is the same in every process) says whether it is in the on-disk
    cache; if not, `announce` first. How long the call took is recorded (the
    first time anywhere), the estimate for the next program of this `kind`.
    """
    ensure()
    if program in _compiled:
        yield
        return
    key = key()
    if not (enabled() and key in _read_times() and _cache_has_entries()):
        announce(what, kind, key)
    begin = time.perf_counter()
    yield
    mark_compiled(program, key, kind, time.perf_counter() - begin)


def mark_compiled(program, key: str, kind: str, seconds: float) -> None:
    """Book `program` as compiled in this process and, the first time anywhere, how long it took (only with the
    cache on: that record says the program is on disk, and the cache off writes nothing)."""
    _compiled.add(program)
    times = _read_times()
    if enabled() and key not in times and jax.process_index() == 0:
        times[key] = {"kind": kind, "s": round(seconds, 1)}
        _write_times(times)


def _cache_has_entries() -> bool:
    folder = Path(jax.config.jax_compilation_cache_dir)
    return folder.is_dir() and any(folder.iterdir())


# --------------------------------------------------------------------------- lowered programs


def source_digest(root: Path | None = None) -> str:
    """sha256 of taps_jax's Python files (paths and bytes): any code change gives new `lowered/` keys."""
    global _source
    if root is None and _source is not None:
        return _source
    base = Path(root) if root is not None else Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(base.rglob("*.py")):
        digest.update(path.relative_to(base).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    if root is not None:
        return digest.hexdigest()
    _source = digest.hexdigest()
    return _source


def _lowered_path(key: str) -> Path:
    return cache_dir() / LOWERED / f"{key}.bin"


def _picklers():
    """(Pickler, Unpickler) for a `jax.stages.Lowered`: `jax.experimental.serialize_executable`'s (devices and
    the client by reference), plus the MLIR module as bytecode."""
    from jax._src.interpreters import mlir
    from jax.experimental import serialize_executable

    class Pickler(serialize_executable._JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, mlir.ir.Module):
                return ("module", mlir.module_to_bytecode(obj))
            return super().persistent_id(obj)

    class Unpickler(serialize_executable._JaxPjrtUnpickler):
        def persistent_load(self, pid):
            if pid[0] == "module":
                with mlir.make_ir_context():
                    return mlir.ir.Module.parse(pid[1])
            return super().persistent_load(pid)

    return Pickler, Unpickler


def load_lowered(key: str, in_tree):
    """The lowered program stored under `key` (a `jax.stages.Lowered` taking arguments of structure `in_tree`;
    its `.compile()` loads the executable from JAX's cache), or None: cache off, no entry, or an entry that does
    not verify or load (then the caller traces)."""
    if not enabled() or jax.process_count() != 1:
        return None
    try:
        blob = _lowered_path(key).read_bytes()
    except OSError:
        return None
    head, digest, body = blob[:len(_MAGIC)], blob[len(_MAGIC):len(_MAGIC) + 32], blob[len(_MAGIC) + 32:]
    if head != _MAGIC or hashlib.sha256(body).digest() != digest:
        return None  # truncated or damaged: never handed to the unpickler
    try:
        import io

        from jax._src import stages

        lowering, args_info, out_tree, no_kwargs = _picklers()[1](io.BytesIO(zlib.decompress(body)),
                                                                  jax.devices()[0].client).load()
        if jax.tree_util.tree_structure(args_info) != in_tree:
            return None
        lowered = stages.Lowered(lowering, args_info, out_tree, no_kwargs=no_kwargs)
    except Exception:  # written by another JAX or for other devices despite the key: trace instead
        return None
    jax.monitoring.record_event("/taps_jax/lowered_loaded")
    return lowered


def store_lowered(key: str, lowered) -> None:
    """Keep `lowered` (a `jax.stages.Lowered`) under `key` for the next process; quietly nothing when it cannot
    be kept (host callbacks, cache off, a directory that is not writable): the next process traces as before."""
    if not enabled() or jax.process_count() != 1 or jax.process_index() != 0:
        return
    path = _lowered_path(key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        import copy
        import io

        lowering = copy.copy(lowered._lowering)
        args = lowering.compile_args
        if args.get("host_callbacks") or args.get("keepalive") or args.get("pgle_profiler") or lowering.const_args:
            return  # Python objects a program calls back into, or constants: not data we can keep
        lowering._executable = None  # the compiled executable stays in JAX's cache
        with io.BytesIO() as file:
            _picklers()[0](file).dump((lowering, lowered.args_info, lowered.out_tree, lowered._no_kwargs))
            body = zlib.compress(file.getvalue(), 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(_MAGIC + hashlib.sha256(body).digest() + body)
        tmp.replace(path)  # atomic: a reader sees the whole entry or none
    except Exception:
        with contextlib.suppress(OSError):
            tmp.unlink()
