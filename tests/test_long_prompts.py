"""Long prompts: chunked prefill, in-place cache writes, blockwise attention.

Chunked prefill must give the same last-token logits, cache and tap features
(what the drafter's context cache holds) as a single-chunk prefill, for every
chunk size, including ones that do not divide the prompt; the blockwise
attention must equal dense attention; and greedy speculative decoding after
prompts of 2k-4k tokens must equal AR, batch 1 and a batch of mixed lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spec_helpers import tiny_pair
from taps_jax.decoder import SpeculativeDecoder, load_model_set
from taps_jax.engine.ar import DecodeConfig
from taps_jax.engine.batching import pad_batch
from taps_jax.engine.prefill import prefill
from taps_jax.engine.speculative import prefill_both
from taps_jax.models import layers
from taps_jax.models.cache import KVCache

TOL = 1e-5


@functools.partial(jax.jit, static_argnames=("tg", "dg", "chunk", "capacity"))
def _prefill_both(tg, tp, dg, dp, prompt, lens, *, chunk, capacity):
    config = DecodeConfig(8, capacity, prefill_chunk=chunk)
    return prefill_both(nnx.merge(tg, tp), nnx.merge(dg, dp), prompt, lens, config)


@functools.partial(jax.jit, static_argnames=("tg", "chunk", "capacity", "taps"))
def _prefill_taps(tg, tp, prompt, lens, *, chunk, capacity, taps):
    """Prefill collecting every chunk's tap features into one [B, T, F] buffer."""
    model = nnx.merge(tg, tp)
    B, T = prompt.shape
    F = len(taps) * model.config.hidden_size

    def absorb(buf, taps_BCF, start, count_B):
        return jax.lax.dynamic_update_slice(buf, taps_BCF, (0, start, 0))

    buf = jnp.zeros((B, T + chunk, F))  # room for the padding of the last chunk
    return prefill(model, prompt, lens, capacity, taps, chunk=chunk, absorb=absorb, carry=buf)


def _split(target, drafter):
    tg, tp = nnx.split(target.model)
    dg, dp = nnx.split(drafter.module)
    return tg, tp, dg, dp


@pytest.mark.parametrize("chunk", [7, 16, 48])
def test_chunked_prefill_matches_one_chunk(chunk):
    """Logits, target cache, drafter cache and tap features equal the single-chunk prefill (mixed lengths)."""
    target, drafter = tiny_pair(16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 16, n).tolist() for n in (61, 23, 40)]
    prompt, lens, _ = pad_batch(prompts, 128)
    prompt, lens = jnp.asarray(prompt), jnp.asarray(lens)
    tg, tp, dg, dp = _split(target, drafter)
    ref_logits, ref_cache, ref_dcache = _prefill_both(tg, tp, dg, dp, prompt, lens, chunk=64, capacity=128)
    logits, cache, dcache = _prefill_both(tg, tp, dg, dp, prompt, lens, chunk=chunk, capacity=128)
    np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=TOL)
    for got, want in ((cache, ref_cache), (dcache, ref_dcache)):
        np.testing.assert_array_equal(got.lengths_B, lens)
        for b, n in enumerate(np.asarray(lens)):
            np.testing.assert_allclose(got.k_LBKHS[:, b, ..., :n], want.k_LBKHS[:, b, ..., :n], atol=TOL, rtol=TOL)
            np.testing.assert_allclose(got.v_LBKSH[:, b, :, :n], want.v_LBKSH[:, b, :, :n], atol=TOL, rtol=TOL)
    taps = drafter.config.target_layer_ids
    _, ref_taps, _ = _prefill_taps(tg, tp, prompt, lens, chunk=64, capacity=128, taps=taps)
    _, got_taps, _ = _prefill_taps(tg, tp, prompt, lens, chunk=chunk, capacity=128, taps=taps)
    for b, n in enumerate(np.asarray(lens)):
        np.testing.assert_allclose(got_taps[b, :n], ref_taps[b, :n], atol=TOL, rtol=TOL)


def test_chunked_prefill_matches_full_forward():
    """The last-token logits of a chunked prefill equal a plain causal forward (no cache)."""
    target, _ = tiny_pair(16)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 16, n).tolist() for n in (50, 13)]
    prompt, lens, _ = pad_batch(prompts, 64)
    logits = jax.jit(lambda p, x, n: prefill(nnx.merge(target.graphdef, p), x, n, 64, chunk=16)[0])(
        target.params, jnp.asarray(prompt), jnp.asarray(lens))
    for b, ids in enumerate(prompts):
        full = target.logits(np.asarray(ids)[None])[0, -1]
        np.testing.assert_allclose(logits[b], full, atol=TOL, rtol=TOL)


def test_blockwise_attention_equals_dense(monkeypatch):
    """attend_cached over many small key blocks == dense attention over [committed; new], finite when empty."""
    monkeypatch.setattr(layers, "KEY_BLOCK", 8)  # read at trace time: 40 committed slots span 5-6 blocks
    monkeypatch.setattr(layers, "SMALL_CACHE_KEY_BLOCK", 8)
    rng = np.random.default_rng(2)
    B, T, N, K, H, S, L = 3, 5, 4, 2, 16, 50, 2
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32)
    lengths = jnp.asarray([40, 3, 0], jnp.int32)
    cache = KVCache(jnp.asarray(rng.normal(size=(L, B, K, H, S)), jnp.float32),
                    jnp.asarray(rng.normal(size=(L, B, K, S, H)), jnp.float32), lengths)
    mask = jnp.asarray(rng.random((B, T, T)) < 0.6) | jnp.eye(T, dtype=bool)[None]
    mask = mask.at[2, 1].set(False)  # sequence 2 has no committed slots: row 1 sees nothing at all
    out, same = jax.jit(layers.attend_cached, static_argnums=5)(q, k_new, v_new, mask, cache, 1)
    assert same is not None and np.all(np.isfinite(out))
    for b in range(B):
        n = int(lengths[b])
        k_committed, v_committed = cache.layer_kv(1, b, n)
        keys = jnp.concatenate([k_committed, k_new[b]])[None]
        values = jnp.concatenate([v_committed, v_new[b]])[None]
        visible = jnp.concatenate([jnp.ones((T, n), bool), mask[b]], axis=1)[None]
        want = layers.attend(q[b:b + 1], keys, values, visible)[0]
        rows = [t for t in range(T) if bool(visible[0, t].any())]
        np.testing.assert_allclose(np.asarray(out)[b, rows], np.asarray(want)[rows], atol=TOL, rtol=TOL)


# --------------------------------------------------------------------------- real lengths, the lite set


@pytest.fixture(scope="module")
def models(lite_set_dir):
    """The default set cut to a 2-layer target (conftest): real text and vocabulary at a third of the compile."""
    return load_model_set(lite_set_dir)


@pytest.fixture(scope="module")
def long_ids(models):
    from decode.long_prompts import long_prompts

    return long_prompts(models.target, [4000], 2)[4000]


def test_greedy_after_long_prompts_is_lossless(models, long_ids):
    """chain / ddtree / taps == AR after 2k-4k-token prompts: a mixed batch and batch 1 (4000 tokens)."""
    mixed = [long_ids[0][:2100], long_ids[1][:3000]]
    kw = dict(max_new_tokens=24, prefill_chunk=384)  # 384 divides neither prompt; 6-8 chunks, 5-6 key blocks
    want = models.target.generate(mixed, **kw).tokens
    for policy in ("chain", "ddtree", "taps"):
        extra = {"scorer": models.greedy_scorer} if policy == "taps" else {}
        got = SpeculativeDecoder(models.target, models.drafter, policy, 16, **extra).generate(mixed, **kw)
        assert got.tokens == want, policy
        assert got.stats["tau"] > 1.0, policy
    single = [long_ids[0]]
    want = models.target.generate(single, **kw).tokens
    got = SpeculativeDecoder(models.target, models.drafter, "ddtree", 16).generate(single, **kw)
    assert got.tokens == want and len(want[0]) == 24
