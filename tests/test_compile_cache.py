"""Compiled programs cached on disk (taps_jax.compile_cache): where, who decides, and a second process loading.

The suite runs with TAPS_JAX_COMPILE_CACHE=0 (conftest: tests compile what they test and write nothing to your
home); the tests here turn it on in a private cache dir and put JAX's settings back afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from taps_jax import compile_cache

JAX_SETTINGS = ("jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """compile_cache as in a new process, in a private cache dir; JAX's settings and the module's state restored."""
    saved = {name: getattr(jax.config, name) for name in JAX_SETTINGS}
    state = {name: getattr(compile_cache, name) for name in ("_on", "_ours", "_compiled", "_times")}
    monkeypatch.setenv("TAPS_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", compile_cache.JAX_MIN_COMPILE_S)
    compile_cache._on, compile_cache._ours, compile_cache._compiled, compile_cache._times = None, None, set(), None
    yield tmp_path / "cache"
    for name, value in saved.items():
        jax.config.update(name, value)
    for name, value in state.items():
        setattr(compile_cache, name, value)
    compile_cache._reset_jax_cache()


def test_on_by_default_under_the_cache_dir(fresh):
    compile_cache.ensure()
    assert compile_cache.enabled() and jax.config.jax_compilation_cache_dir == str(fresh / "xla")
    assert (fresh / "xla").is_dir()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0  # small CPU programs are cached too
    compile_cache.disable()
    assert not compile_cache.enabled() and jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_enable_compilation_cache is False


def test_the_environment_opts_out(fresh, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, "0")
    compile_cache.ensure()
    assert not compile_cache.enabled() and jax.config.jax_compilation_cache_dir is None
    assert not (fresh / "xla").exists()


def test_a_bad_environment_value_is_refused(fresh, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, "off")
    with pytest.raises(ValueError, match="TAPS_JAX_COMPILE_CACHE='off': set it to 0"):
        compile_cache.ensure()


def test_a_cache_dir_given_to_jax_is_kept(fresh, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    compile_cache.ensure()
    assert compile_cache.enabled() and jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0  # the user's threshold too
    assert not (fresh / "xla").exists()


def test_the_flag(fresh):
    import argparse

    parser = argparse.ArgumentParser()
    compile_cache.add_flag(parser)
    compile_cache.setup(parser.parse_args(["--no-compile-cache"]))
    assert not compile_cache.enabled()
    compile_cache._on = None
    compile_cache.setup(parser.parse_args([]))
    assert compile_cache.enabled()


# A short AR decode of the embedded set in a new process; prints how many programs JAX loaded from its cache.
CHILD = """
import jax, taps_jax
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
target = taps_jax.load_model_set("default").target
result = target.generate(["def add(a, b):"], max_new_tokens=4)
print(len(hits), result.tokens[0])
"""


def _child(cache: Path, switch: str):
    env = {**os.environ, "TAPS_JAX_CACHE_DIR": str(cache), compile_cache.ENV: switch}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    hits, tokens = done.stdout.split(maxsplit=1)
    return int(hits), tokens, done.stderr


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    hits, tokens, err = _child(cache, "1")
    assert hits == 0 and "compiling the AR decoder for batch 1, prompts up to 16 tokens, 16 cache slots" in err
    assert "cached for later runs" in err
    entries = len(list((cache / "xla").iterdir()))
    times = json.loads((cache / compile_cache.TIMES_FILE).read_text())
    assert entries > 0 and [e["kind"] for e in times.values()] == ["ar_generate"]

    hits2, tokens2, err2 = _child(cache, "1")
    assert tokens2 == tokens and hits2 > 0  # the decode program came from the cache
    assert "compiling" not in err2  # known to be cached: no notice
    assert len(list((cache / "xla").iterdir())) == entries

    hits3, tokens3, err3 = _child(cache, "0")  # opted out: compiles, says so, loads and stores nothing
    assert tokens3 == tokens and hits3 == 0 and "the compile cache is off" in err3
    assert len(list((cache / "xla").iterdir())) == entries
    assert json.loads((cache / compile_cache.TIMES_FILE).read_text()) == times


# --------------------------------------------------------------------------- lowered programs kept whole

# An AR decode of the embedded set, compiled ahead of time (run and stream, as taps-decode does); prints how many
# lowered programs came from the cache, which functions JAX traced, and the tokens.
LOWERED_CHILD = """
import json, jax, taps_jax
loaded, traced = [], []
jax.monitoring.register_event_listener(lambda event, **kw: loaded.append(event) if event.endswith("lowered_loaded")
                                       else None)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: traced.append(kw.get("fun_name")) if event.endswith("jaxpr_trace_duration") else None)
target = taps_jax.load_model_set("default").target
call = target.prepare(["def add(a, b):"], max_new_tokens=6)
call.compile()
tokens = call.run().tokens[0]
call = target.prepare(["def add(a, b):"], max_new_tokens=6)
call.compile(stream=True)
streamed = [r.tokens[0] for r in call.stream()][-1]
print(json.dumps({"loaded": len(loaded), "traced": traced, "tokens": tokens, "streamed": streamed}))
"""


def _lowered_child(cache: Path, switch: str = "1") -> dict:
    env = {**os.environ, "TAPS_JAX_CACHE_DIR": str(cache), compile_cache.ENV: switch}
    done = subprocess.run([sys.executable, "-c", LOWERED_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_second_process_compiles_the_kept_lowering_without_tracing(tmp_path):
    cache = tmp_path / "cache"
    first = _lowered_child(cache)
    assert first["loaded"] == 0 and {"ar_generate", "ar_start", "ar_advance"} <= set(first["traced"])
    assert first["streamed"] == first["tokens"]
    entries = sorted((cache / compile_cache.LOWERED).iterdir())
    assert len(entries) == 3  # generate; start and advance

    second = _lowered_child(cache)  # the same tokens, from the very programs, none of them traced
    assert second["loaded"] == 3 and second["tokens"] == second["streamed"] == first["tokens"]
    assert not {"ar_generate", "ar_start", "ar_advance"} & set(second["traced"])

    # Damaged entries (cut short, a flipped byte, garbage) are never unpickled: traced, same tokens, kept again.
    blobs = [p.read_bytes() for p in entries]
    entries[0].write_bytes(blobs[0][:len(blobs[0]) // 2])
    entries[1].write_bytes(blobs[1][:-1] + bytes([blobs[1][-1] ^ 1]))
    entries[2].write_bytes(b"not a lowered program")
    third = _lowered_child(cache)
    assert third["loaded"] == 0 and third["tokens"] == third["streamed"] == first["tokens"]
    assert [p.read_bytes() for p in entries] == blobs  # stored again, whole (deterministic pickles)

    off = _lowered_child(tmp_path / "off", "0")  # opted out: traced, nothing kept
    assert off["loaded"] == 0 and off["tokens"] == first["tokens"] and not (tmp_path / "off").exists()


def test_the_key_covers_what_shapes_the_program(fresh):
    """Same inputs, same key (and a lowering that loads back as the same module); another static config, batch
    shape, or function: another key; the source digest follows every file's path and bytes."""
    import taps_jax
    from taps_jax.calls import lowered_key

    compile_cache.ensure()
    target = taps_jax.load_model_set("default").target

    def key(call, name="generate"):
        fn = getattr(call.programs, name)
        return lowered_key(fn, call.programs.static, call.args, call.kwargs, call.mesh)

    call = target.prepare(["def add(a, b):"], max_new_tokens=6)
    same = target.prepare(["def sub(a, b):"], max_new_tokens=6)  # other tokens, same padded shape
    assert key(call) == key(same)
    assert key(call) != key(target.prepare(["def add(a, b):"], max_new_tokens=7))  # static config
    assert key(call) != key(target.prepare(["def add(a, b):", "x"], max_new_tokens=6))  # batch shape
    assert key(call) != key(call, "start")
    assert lowered_key(lambda *a, **k: None, (), (), {}, None) is None  # not a taps_jax program: never kept
    from taps_jax.calls import _plain

    assert _plain((0.1, "a")) != _plain((0.1 + 1e-17 * 2, "a"))  # statics spelled out whole, not as a repr might
    with pytest.raises(TypeError):
        _plain(object())  # not plain data: no key, nothing kept

    fn = call.programs.generate
    lowered = fn.lower(*call.args, **call.kwargs)
    compile_cache.store_lowered(key(call), lowered)
    in_tree = jax.tree_util.tree_structure(lowered.args_info)
    back = compile_cache.load_lowered(key(call), in_tree)
    assert back is not None and back.as_text() == lowered.as_text()
    assert compile_cache.load_lowered(key(call), jax.tree_util.tree_structure(((0,), {}))) is None  # other args
    compile_cache.disable()
    assert compile_cache.load_lowered(key(call), in_tree) is None


def test_the_source_digest_follows_the_code(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    before = compile_cache.source_digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    edited = compile_cache.source_digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    assert len({before, edited, compile_cache.source_digest(tmp_path / "pkg")}) == 3
    assert compile_cache.source_digest() == compile_cache.source_digest(Path(compile_cache.__file__).parent)


def test_the_cli_exits_at_once_with_everything_written(tmp_path):
    """taps-decode leaves by os._exit after flushing (decode/cli.py exit_now): block-buffered stdout and stderr
    (pipes here) arrive whole, and the exit status is the command's."""
    env = {**os.environ, "TAPS_JAX_CACHE_DIR": str(tmp_path / "cache"), compile_cache.ENV: "1"}
    command = [sys.executable, "-m", "decode.cli", "--policy", "ar", "--max-new-tokens", "8", "--stats"]
    done = subprocess.run(command + ["--prompt", "def add(a, b):"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("def add(a, b):") and done.stdout.endswith("\n")
    assert done.stderr.rstrip().splitlines()[-1].startswith("[ar] tokens=8 ")
    bad = subprocess.run(command + ["--prompt", ""], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr == "taps-decode: error: --prompt is empty; give some text to continue\n"
