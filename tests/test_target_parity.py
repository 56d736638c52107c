"""Logit parity with `transformers` (torch CPU, float32) for every family.

Each checkpoint is written by `save_pretrained` (transformers 5.x layout:
`rope_parameters`, `dtype`) and read by `taps_jax.load_target`. Checked: a
full forward, and incremental decoding through the KV cache (right-padded
prefill of different prompt lengths, then chunks of several sizes, 1
included), batch 2, max abs diff <= 1e-4.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import taps_jax
from taps_jax.engine.prefill import prefill
from taps_jax.models.layers import rope_inv_freq

from conftest import SPECS, hf_logits

TOL = 1e-4
PREFIX_LENS = (5, 9)  # different prompt lengths, right-padded in one prefill
CHUNKS = (1, 3, 7, 1, 7, 3, 1, 3, 7, 1)  # then fed in chunks of these sizes (3 shapes, 1 included)
CAPACITY = 48
EXPECTED = {  # name -> (family, tied, heads, kv heads, head_dim)
    "qwen3": ("qwen3", False, 4, 2, 16),
    "qwen3_tied": ("qwen3", True, 4, 2, 16),
    "llama3": ("llama", False, 4, 2, 16),
    "qwen2_tied": ("qwen2", True, 4, 2, 8),
}


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def _prefill(graphdef, params, prompt_BT, lens_B, capacity):
    return prefill(nnx.merge(graphdef, params), prompt_BT, lens_B, capacity)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _chunk(graphdef, params, tokens_BT, positions_BT, mask_BTT, cache):
    logits_BTV, _, cache = nnx.merge(graphdef, params)(tokens_BT, positions_BT, mask_BTT, cache)
    return logits_BTV, cache.replace(lengths_B=cache.lengths_B + tokens_BT.shape[1])


@pytest.fixture(scope="module", params=sorted(SPECS))
def case(request, hf_checkpoint):
    name = request.param
    path, hf_model = hf_checkpoint(name)
    target = taps_jax.load_target(path)
    rng = np.random.default_rng(len(name))
    total = [p + sum(CHUNKS) for p in PREFIX_LENS]
    seqs = [rng.integers(0, target.config.vocab_size, n).tolist() for n in total]
    refs = [hf_logits(hf_model, s) for s in seqs]
    return name, path, target, seqs, refs


def test_config_read_from_transformers_layout(case):
    name, path, target, _, _ = case
    raw = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in raw  # transformers 5.x layout, not rope_theta/rope_scaling
    family, tied, heads, kv, head_dim = EXPECTED[name]
    c = target.config
    assert (c.family, c.tie_embeddings, c.num_heads, c.num_kv_heads, c.head_dim) == (family, tied, heads, kv, head_dim)
    assert c.rope_theta == raw["rope_parameters"]["rope_theta"]
    assert (target.model.lm_head is None) == tied
    if name == "llama3":
        s = c.rope_scaling
        assert s is not None
        assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (8.0, 1.0, 4.0, 16)
        # The scaling really changes the frequencies used at these positions.
        scaled, plain = rope_inv_freq(c.head_dim, c.rope_theta, s), rope_inv_freq(c.head_dim, c.rope_theta, None)
        assert np.max(np.abs(scaled - plain) * max(len(x) for x in case[3])) > 1.0
    else:
        assert c.rope_scaling is None


def test_full_forward_matches_transformers(case):
    _, _, target, seqs, refs = case
    T = max(map(len, seqs))
    batch = np.zeros((len(seqs), T), np.int32)  # right padding: causal, so valid positions are unaffected
    for b, s in enumerate(seqs):
        batch[b, : len(s)] = s
    logits = np.asarray(target.logits(batch))
    assert logits.dtype == np.float32
    for b, (s, ref) in enumerate(zip(seqs, refs)):
        np.testing.assert_allclose(logits[b, : len(s)], ref, rtol=0, atol=TOL)


def test_incremental_decoding_matches_transformers(case):
    _, _, target, seqs, refs = case
    B, P = len(seqs), max(PREFIX_LENS)
    prompt = np.zeros((B, 16), np.int32)
    for b, n in enumerate(PREFIX_LENS):
        prompt[b, :n] = seqs[b][:n]
    lens = jnp.asarray(PREFIX_LENS, jnp.int32)
    last_BV, _, cache = _prefill(target.graphdef, target.params, jnp.asarray(prompt), lens, CAPACITY)
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), PREFIX_LENS)
    for b, n in enumerate(PREFIX_LENS):
        np.testing.assert_allclose(np.asarray(last_BV[b]), refs[b][n - 1], rtol=0, atol=TOL)

    offset = 0
    for T in CHUNKS:
        tokens = np.stack([seqs[b][n + offset: n + offset + T] for b, n in enumerate(PREFIX_LENS)])
        positions = np.asarray(cache.lengths_B)[:, None] + np.arange(T)[None]
        np.testing.assert_array_equal(positions[:, 0], np.asarray(PREFIX_LENS) + offset)
        mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
        logits, cache = _chunk(
            target.graphdef, target.params, jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32), jnp.asarray(mask), cache,
        )
        for b, n in enumerate(PREFIX_LENS):
            want = refs[b][n + offset: n + offset + T]
            np.testing.assert_allclose(np.asarray(logits[b]), want, rtol=0, atol=TOL, err_msg=f"chunk {T} at offset {offset}, seq {b}")
        offset += T
    assert offset + P == max(map(len, seqs))
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), [len(s) for s in seqs])
