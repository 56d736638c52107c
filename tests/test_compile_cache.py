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
