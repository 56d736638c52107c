"""Sizes checked before anything compiles: context, tree budget, memory; out-of-memory as one line.

Every refusal here must come from the host-side checks: the jitted generate
functions are replaced by ones that fail the test if they are ever called.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest

from spec_helpers import tiny_pair
from taps_jax.decoder import DEFAULT_MODEL_DIR, SpeculativeDecoder, load_model_set
from taps_jax.engine import sizing
from taps_jax.engine.sizing import capacity_bucket, estimate_memory, plan_capacity


@pytest.fixture(scope="module")
def models():
    return load_model_set(DEFAULT_MODEL_DIR)


def test_prompt_beyond_the_context_is_refused(models, no_tracing):
    limit = models.target.config.max_position_embeddings  # 32768
    prompt = [5] * (limit - 100)
    with pytest.raises(ValueError, match=rf"a prompt of {limit - 100} tokens \+ max_new_tokens 128 needs "
                                         rf"{limit + 28} positions, but the target has max_position_embeddings="
                                         rf"{limit}; shorten the prompt to at most {limit - 128} tokens"):
        models.target.generate([prompt], 128)
    spec = SpeculativeDecoder(models.target, models.drafter, "ddtree", 32)
    with pytest.raises(ValueError, match=r"\+ 33 slots of tree headroom needs .* shorten the prompt to at most "
                                         rf"{limit - 128 - 33} tokens"):
        spec.generate([[5] * (limit - 150)], 128)


def test_max_new_tokens_beyond_the_context_is_refused(models, no_tracing):
    with pytest.raises(ValueError, match=r"max_new_tokens=40000 exceeds the target's context of 32768 positions"):
        models.target.generate(["x"], 40000)
    with pytest.raises(ValueError, match=r"capacity=40000 exceeds the target's max_position_embeddings=32768"):
        models.target.generate(["x"], 8, capacity=40000)


def test_budget_the_lattice_cannot_fill_is_refused():
    target, drafter = tiny_pair(16)  # H = 7 drafted positions
    with pytest.raises(ValueError, match=r"Tree budget 12 cannot be filled: a lattice of the top 1 tokens at each of "
                                         r"7 drafted positions, beam width 12, holds at most 7 distinct prefixes"):
        SpeculativeDecoder(target, drafter, "ddtree", 12, lattice_k=1)


def test_memory_beyond_the_machine_is_refused(models, no_tracing):
    prompts = [[5] * 30000] * 256  # caches alone: 256 x 30k-slot caches of 8 KiB per slot, ~62 GiB
    with pytest.raises(ValueError, match=r"this call needs about [0-9.]+ GiB: KV caches [0-9.]+ GiB for 256 "
                                         r"sequences x [0-9]+ slots, .* more than this machine's free RAM .*"
                                         r"decode fewer prompts at once"):
        SpeculativeDecoder(models.target, models.drafter, "ddtree", 32).generate(prompts, 64)
    with pytest.raises(ValueError, match=r"KV caches [0-9.]+ GiB for 256 sequences"):
        models.target.generate(prompts, 64)


def test_capacity_buckets_stay_within_a_quarter():
    assert [capacity_bucket(n) for n in (10, 100, 4096)] == [16, 128, 4096]
    for n in (4097, 5000, 16545, 32177, 70000):
        assert n <= capacity_bucket(n) <= 1.25 * n
    assert plan_capacity(32000, 128, 49, load_model_set(DEFAULT_MODEL_DIR).target.config) == 32768


def test_estimate_counts_the_caches(models):
    c = models.target.config
    est = estimate_memory(c, 0, 2, 8192, 8192, drafter=models.drafter.config, tree_size=33)
    target_cache = 2 * c.num_layers * 2 * 8192 * c.num_kv_heads * c.head_dim * 4
    d = models.drafter.config
    assert est.caches == target_cache + 2 * d.num_layers * 2 * 8192 * d.num_kv_heads * d.head_dim * 4
    assert est.total == est.params + est.caches + est.largest_step and est.largest_step > 0


def test_allocator_failure_becomes_one_line_memory_error():
    estimate = estimate_memory(tiny_pair(16)[0].config, 0, 1, 16, 64)
    with pytest.raises(MemoryError, match=r"^out of memory while decoding \(estimated need .* for 1 sequences x "
                                          r"64 slots.*\): RESOURCE_EXHAUSTED: .*decode fewer prompts"):
        with sizing.raise_out_of_memory(estimate):
            jax.block_until_ready(jax.jit(lambda: jax.numpy.zeros((1 << 46,), "int8"))())  # 64 TiB


def test_cli_refuses_before_compiling():
    """taps-decode: exit 2 and one line, in seconds (nothing compiles)."""
    proc = subprocess.run([sys.executable, "-m", "decode.cli", "--prompt", "def f():", "--max-new-tokens", "40000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_new_tokens=40000 exceeds the target's context of 32768 positions" in lines[0]
