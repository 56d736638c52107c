"""The speculative engine: lossless (greedy and sampled), commit, one compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_helpers import assert_follows, tiny_pair, two_token_law
from taps_jax.decoder import SpeculativeDecoder
from taps_jax.engine.ar import DecodeConfig
from taps_jax.engine.batching import pad_batch
from taps_jax.engine.prefill import prefill
from taps_jax.engine.speculative import SpecConfig, prefill_both, spec_generate
from taps_jax.models.drafter import draft_logits
from taps_jax.tree.accept import accept_walk
from taps_jax.tree.policies import TreeConfig, draft_tree
from taps_jax.tree.select import ancestor_mask

PROMPTS = [[3, 1, 4, 1, 5], [6, 2, 6], [5, 3, 5, 0, 1, 7, 2, 3, 2], [2, 7]]
VOCAB = 8  # small, so random drafts often match and rounds accept several tokens


@pytest.mark.parametrize("policy", ["chain", "ddtree"])
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_is_lossless(policy, budget):
    target, drafter = tiny_pair(VOCAB)
    want = target.generate(PROMPTS, 24).tokens
    result = SpeculativeDecoder(target, drafter, policy, budget).generate(PROMPTS, 24)
    assert result.tokens == want
    assert all(r == "length" for r in result.finish_reasons)
    longest = max(max(r) for r in result.stats["accepted_lengths"])
    if budget > 1:
        assert longest >= 2, "no draft token accepted: the commit path went untested"
    if policy == "ddtree" and budget >= 16:
        assert longest > 2 and result.stats["tau"] > 2


def test_greedy_lossless_with_eos_and_batch_of_one():
    """Sequences in one batch stop at different rounds (EOS inside accepted paths)."""
    target, drafter = tiny_pair(VOCAB, eos=(6,))
    ar = target.generate(PROMPTS, 30)
    spec = SpeculativeDecoder(target, drafter, "ddtree", 16).generate(PROMPTS, 30)
    assert spec.tokens == ar.tokens
    assert spec.finish_reasons == ar.finish_reasons
    assert "eos" in ar.finish_reasons and "length" in ar.finish_reasons
    one = SpeculativeDecoder(target, drafter, "chain", 8).generate(PROMPTS[1:2], 30)
    assert one.tokens == ar.tokens[1:2]


def test_max_new_tokens_smaller_than_a_round():
    target, drafter = tiny_pair(VOCAB)
    for n in (1, 2, 3):
        spec = SpeculativeDecoder(target, drafter, "ddtree", 64).generate(PROMPTS, n)
        assert spec.tokens == target.generate(PROMPTS, n).tokens
        assert all(len(t) == n for t in spec.tokens)


def test_commit_matches_causal_refeed():
    """After a round, the target cache equals feeding the committed tokens causally."""
    target, drafter = tiny_pair(VOCAB)
    model, dmodel = target.model, drafter.module
    prompt, lens, _ = pad_batch(PROMPTS[:2], 64)
    prompt, lens = jnp.asarray(prompt), jnp.asarray(lens)
    logits, cache, dcache = prefill_both(model, dmodel, prompt, lens, DecodeConfig(8, 64))
    bonus = jnp.argmax(logits, -1).astype(jnp.int32)
    Kb = dmodel.config.block_size
    block = jnp.concatenate([bonus[:, None], jnp.full((2, Kb - 1), dmodel.config.mask_token_id)], 1)
    pos = lens[:, None] + jnp.arange(Kb)
    draft, _ = draft_logits(dmodel, model, block, pos, dcache)
    tree, _ = draft_tree(TreeConfig("ddtree", 16, VOCAB, 16), draft, bonus)
    tlogits, _, cache = model(tree.tokens_BT, lens[:, None] + tree.depths_BT, ancestor_mask(tree), cache)
    acc = accept_walk(tree, jnp.argmax(tlogits, -1), max_depth=Kb - 1)
    cache = cache.gather_commit(acc.path_BA, acc.num_accepted_B)
    assert np.asarray(acc.num_accepted_B).max() > 1
    for b in range(2):
        n = int(acc.num_accepted_B[b])
        path = np.asarray(tree.tokens_BT[b])[np.asarray(acc.path_BA[b, :n])]
        seq = np.concatenate([np.asarray(PROMPTS[b]), path])
        _, _, ref = prefill(model, jnp.asarray(seq)[None], jnp.asarray([len(seq)]), 64)
        L = int(cache.lengths_B[b])
        assert L == len(seq)
        np.testing.assert_allclose(cache.k_LBKHS[:, b, ..., :L], ref.k_LBKHS[:, 0, ..., :L], atol=1e-5)
        np.testing.assert_allclose(cache.v_LBKSH[:, b, :, :L], ref.v_LBKSH[:, 0, :, :L], atol=1e-5)


def _first_tokens(gen, n_samples, n_tokens, vocab):
    counts = np.zeros((vocab,) * n_tokens)
    for seed in range(n_samples // 8):
        res = gen(seed)
        for t in res.tokens:
            counts[tuple(t[:n_tokens])] += 1
    return counts


@pytest.mark.parametrize("draft_vocab", [None, (0, 2, 5)])
def test_sampling_follows_the_target_distribution(draft_vocab):
    """Chi-square: the first two tokens under ddtree at T=1 match the target's exact law, also when the drafter
    can propose only 3 of the 6 ids (a draft vocabulary)."""
    target, drafter = tiny_pair(vocab=6, block_size=4, seed=3, draft_vocab=draft_vocab)
    prompt = [1, 2, 3]
    dec = SpeculativeDecoder(target, drafter, "ddtree", 8)
    counts = _first_tokens(lambda s: dec.generate([prompt] * 8, 2, temperature=1.0, seed=s), 4000, 2, 6)
    assert_follows(counts, two_token_law(target, prompt, 6))


def test_a_draft_vocabulary_is_lossless_and_drafts_only_its_ids():
    """A drafter whose logits cover 5 of the 8 ids: greedy output is AR's for every policy, the other ids get
    probability 0 in its proposals, and the ids it covers get the full head's logits."""
    ids = (0, 1, 3, 4, 6)
    target, drafter = tiny_pair(VOCAB, draft_vocab=ids)
    want = target.generate(PROMPTS, 24).tokens
    for policy in ("chain", "ddtree"):
        result = SpeculativeDecoder(target, drafter, policy, 8).generate(PROMPTS, 24)
        assert result.tokens == want, policy
        assert max(max(r) for r in result.stats["accepted_lengths"]) >= 2, policy
    d = drafter.module
    block = jnp.asarray([[3, VOCAB - 1, VOCAB - 1, VOCAB - 1]], jnp.int32)
    pos = jnp.arange(4, dtype=jnp.int32)[None]
    taps = target.model.hidden(jnp.asarray([[1, 2, 5]]), jnp.arange(3)[None], jnp.tril(jnp.ones((1, 3, 3), bool)),
                               taps=(0, 1))[1]
    hidden = d.forward_uncached(target.model.embed(block), pos + 3, taps, jnp.arange(3)[None],
                                jnp.ones((1, 3), bool))[:, 1:]
    full = np.asarray(d.full_vocab(d.head(target.model, hidden)))
    np.testing.assert_allclose(full[..., list(ids)], np.asarray(target.model.unembed(hidden))[..., list(ids)],
                               atol=1e-5)
    assert (np.asarray(jax.nn.softmax(full))[..., [2, 5, 7]] == 0).all()


def test_one_compile_and_no_host_transfer():
    target, drafter = tiny_pair(VOCAB)
    dec = SpeculativeDecoder(target, drafter, "ddtree", 8)
    dec.generate([[1, 2, 3]], 16)
    before = spec_generate._cache_size()
    dec.generate([[4, 5, 6, 7, 0, 1]], 16)
    dec.generate([[4, 5, 6, 7, 0, 1, 1]], 16)  # prompt + 16 + tree (9): one 32-slot cache
    assert spec_generate._cache_size() == before
    prompt, lens, active = (jnp.asarray(x) for x in pad_batch([[1, 2, 3]], 64))
    config = SpecConfig(DecodeConfig(16, 64), dec.tree)
    args = (target.graphdef, target.params, dec._drafter_graphdef, dec._drafter_params)
    spec_generate(*args, prompt, lens, active, jax.random.key(0), config=config)
    key = jax.random.key(1)
    with jax.transfer_guard_device_to_host("disallow"):
        out = spec_generate(*args, prompt, lens, active, key, config=config)
    jax.block_until_ready(out)
