"""Autoregressive generation: greedy parity, sampling law, stop rules, one compile.

* greedy == a naive loop over full-sequence logits, token for token, with
  EOS / length / capacity stops at different steps;
* sampling: same seed same output, other seed other output; the first
  sampled token follows softmax(logits / T) after top-k / top-p (chi-square);
* prompts of different lengths in one length bucket compile once, and the
  jitted loop moves nothing between host and device.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from taps_jax import ModelConfig, Target
from taps_jax.engine.ar import DecodeConfig, ar_generate
from taps_jax.engine.batching import pad_batch
from taps_jax.engine.sampling import SamplingConfig
from taps_jax.models.transformer import Transformer
from spec_helpers import primitives

PROMPTS = ([5, 17, 42], [9, 8, 7, 6, 5, 4, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # batch 3 -> padded to 4
N = 10
WIDTH = 32  # naive loop: one right-padded [B, 32] causal forward per step


def naive_greedy(target, prompts, n):
    """Argmax of `Target.logits` over the whole sequence, one token at a time.

    Also returns the smallest top-1/top-2 logit margin seen, so a test can
    assert it is not sitting on a near tie.
    """
    seqs = [list(p) for p in prompts]
    margin = np.inf
    for _ in range(n):
        batch = np.zeros((len(seqs), WIDTH), np.int32)
        for b, s in enumerate(seqs):
            batch[b, : len(s)] = s
        logits = np.asarray(target.logits(batch))
        for b, s in enumerate(seqs):
            row = logits[b, len(s) - 1]
            top2 = np.sort(row)[-2:]
            margin = min(margin, top2[1] - top2[0])
            s.append(int(np.argmax(row)))
    return [s[len(p):] for s, p in zip(seqs, prompts)], margin


@pytest.fixture(scope="module")
def greedy_ref(tiny_target):
    ref, margin = naive_greedy(tiny_target, PROMPTS, N)
    assert margin > 1e-4, "reference sits on a near tie; pick other prompts"
    return ref


def expected_stops(ref, prompts, eos, capacity):
    """Tokens and finish reasons the stop rules give on the greedy reference.

    A sequence stops after emitting EOS, after N tokens, or when the next
    token would not fit in the cache (prompt + fed tokens > capacity): the
    first of these wins, EOS before length before capacity on the same step.
    """
    tokens, reasons = [], []
    for s, p in zip(ref, prompts):
        for i, tok in enumerate(s, start=1):
            reason = "eos" if tok == eos else "length" if i >= N else "capacity" if len(p) + i > capacity else None
            if reason:
                tokens.append(s[:i])
                reasons.append(reason)
                break
    return tokens, reasons


def test_greedy_equals_naive_loop(tiny_target, greedy_ref):
    out = tiny_target.generate(PROMPTS, max_new_tokens=N, stop_at_eos=False)
    assert out.tokens == greedy_ref
    assert out.finish_reasons == ["length"] * len(PROMPTS)
    assert out.texts is None  # save_pretrained of a bare model writes no tokenizer


def test_greedy_stops_at_eos_length_and_capacity(tiny_target, greedy_ref):
    # capacity 16: the 12-token prompt can feed 4 more tokens, so it emits 5
    # and stops for capacity; pick an EOS id that stops one other sequence
    # early and not the third, so all three reasons occur at different steps.
    capacity = 16
    eos = None
    for tok in range(tiny_target.config.vocab_size):
        tokens, reasons = expected_stops(greedy_ref, PROMPTS, tok, capacity)
        if sorted(reasons) == ["capacity", "eos", "length"] and len(set(map(len, tokens))) == 3:
            eos = tok
            break
    assert eos is not None, greedy_ref
    target = Target(tiny_target.model, None, eos_ids=(eos,))
    out = target.generate(PROMPTS, max_new_tokens=N, capacity=capacity)
    assert out.tokens == tokens
    assert out.finish_reasons == reasons
    assert out.finish_reasons[2] == "capacity" and len(out.tokens[2]) == capacity - len(PROMPTS[2]) + 1


# One sampled decode configuration, shared with the transfer-guard test below
# (same static config and shapes, so it compiles once for both).
SAMPLED_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 9]]
SAMPLED = DecodeConfig(max_new_tokens=6, capacity=16, sampling=SamplingConfig(1.0, 10, 0.9), eos_ids=(3,))


def test_sampling_is_reproducible(tiny_target):
    target = Target(tiny_target.model, None, eos_ids=SAMPLED.eos_ids)
    s = SAMPLED.sampling
    kw = dict(max_new_tokens=SAMPLED.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    a = target.generate(SAMPLED_PROMPTS, seed=3, **kw)
    b = target.generate(SAMPLED_PROMPTS, seed=3, **kw)
    c = target.generate(SAMPLED_PROMPTS, seed=4, **kw)
    assert a.tokens == b.tokens and a.finish_reasons == b.finish_reasons
    assert a.tokens != c.tokens
    assert sum(map(len, a.tokens + c.tokens)) > 12


# ---------------------------------------------------------------- sampling law

V8 = 8
DRAWS = 4096


@pytest.fixture(scope="module")
def vocab8_target():
    """A random vocab-8 model whose lm_head is scaled so the logits spread out."""
    config = ModelConfig(vocab_size=V8, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    model = Transformer(config, nnx.Rngs(0))
    kernel = jax.random.normal(jax.random.key(1), model.lm_head.kernel[...].shape) * 0.35
    model.lm_head.kernel.set_value(kernel)
    target = Target(model)
    prompt = [1, 2, 3, 4, 5]
    logits = np.asarray(target.logits(np.asarray(prompt)[None]))[0, -1].astype(np.float64)
    assert logits.max() - logits.min() > 2.0, logits
    return target, prompt, logits


def expected_probs(logits, temperature, top_k, top_p):
    """softmax(logits / T) after top-k then top-p, in float64 (independent of sampling.py)."""
    z = logits / temperature
    keep = np.ones(len(z), bool)
    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    z = np.where(keep, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        kept = order[before < top_p]
        mask = np.zeros(len(z), bool)
        mask[kept] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8)])
def test_first_token_follows_filtered_softmax(vocab8_target, temperature, top_k, top_p):
    target, prompt, logits = vocab8_target
    out = target.generate([prompt] * DRAWS, max_new_tokens=1, temperature=temperature,
                          top_k=top_k, top_p=top_p, seed=11)
    first = np.asarray([t[0] for t in out.tokens])
    counts = np.bincount(first, minlength=V8)
    p = expected_probs(logits, temperature, top_k, top_p)
    kept = p > 0
    assert 1 < kept.sum() <= V8
    if top_k or top_p < 1:
        assert kept.sum() < V8  # the filter really removes tokens here
    assert counts[~kept].sum() == 0, (counts, p)
    # Chi-square goodness of fit over the kept tokens.
    pvalue = chi2_pvalue(counts[kept], p[kept] * DRAWS)
    assert pvalue > 1e-3, (counts, p * DRAWS, pvalue)
    # ...and the test has power: the unfiltered softmax at T=1 is rejected.
    wrong = expected_probs(logits, 1.0, 0, 1.0)
    assert chi2_pvalue(counts, wrong * DRAWS) < 1e-6


def chi2_pvalue(observed, expected):
    """Pearson chi-square p-value; bins expecting < 5 draws are pooled into one."""
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(observed, expected).pvalue


# ---------------------------------------------------------------- compiles / transfers

def test_one_compile_per_length_bucket(tiny_target):
    # These EOS ids (static in the decode config) are used by no other test,
    # so this configuration starts uncompiled whatever ran before.
    target = Target(tiny_target.model, None, eos_ids=(97, 98, 99))
    before = ar_generate._cache_size()
    for prompts in ([[1, 2, 3], [4, 5, 6, 7, 8]], [[9] * 7, [10] * 9], [[11, 12], [13] * 13]):
        target.generate(prompts, max_new_tokens=3, seed=len(prompts[1]))
    assert ar_generate._cache_size() - before == 1
    # A prompt that needs the next length bucket (14 + 3 > 16) compiles again.
    target.generate([[1] * 14, [2]], max_new_tokens=3)
    assert ar_generate._cache_size() - before == 2


def test_no_host_transfer_inside_the_loop(tiny_target):
    config = SAMPLED
    prompt, lens, active = pad_batch(SAMPLED_PROMPTS, config.capacity)
    args = jax.device_put((prompt, lens, active))
    key = jax.random.key(0)
    g, params = tiny_target.graphdef, tiny_target.params

    def run(*a):
        return ar_generate(g, params, *a, key, config=config)

    warm = jax.block_until_ready(run(*args))  # compile outside the guard
    other = jax.device_put((np.roll(prompt, 1, axis=1), lens, active))
    with jax.transfer_guard("disallow"):  # any implicit host<->device transfer raises
        out, n, finish = jax.block_until_ready(run(*other))
        again = jax.block_until_ready(run(*args))
    assert isinstance(out, jax.Array) and out.shape == (4, 6)
    assert np.asarray(finish)[3] == -1  # the padding slot never ran
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(warm[0]))
    # On CPU a device-to-host "transfer" is zero-copy and the guard cannot see
    # it, so also check the program itself: two top-level loops (prefill
    # chunks, then decoding; the other whiles are the key-block loops nested
    # inside them) and nothing in them calls back to the host.
    jaxpr = jax.make_jaxpr(lambda p, *a: ar_generate(g, p, *a, config=config))(params, *args, key)
    (generate,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    top = [e.primitive.name for e in generate.params["jaxpr"].jaxpr.eqns]
    assert top.count("while") == 2, top
    names = list(primitives(jaxpr.jaxpr))
    host = [n for n in names if "callback" in n or n in ("infeed", "outfeed")]
    assert not host, host

