"""TAPS: lossless decoding with a (random) scorer, the scorer's math, oracle optimality."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_helpers import tiny_pair
from taps_helpers import path_tokens, random_scorer, sharp_pair
from taps_jax import load_scorer
from taps_jax.checkpoints.scorer import ScorerModel
from taps_jax.decoder import SpeculativeDecoder, load_model_set
from taps_jax.tree.lattice import build_lattice
from taps_jax.tree.policies import TreeConfig, draft_tree
from taps_jax.tree.pool import build_pool
from taps_jax.tree.scorer import ScorerInputs, grouped_log_softmax, taps_log_qcond_fn
from taps_jax.tree.select import reach, select_tree

PROMPTS = [[3, 1, 4, 1, 5], [6, 2, 6], [5, 3, 5, 0, 1, 7, 2, 3, 2], [2, 7]]
VOCAB = 8

# Jitted once per shape: op-by-op dispatch of the tree code is slower to compile.
_grouped = jax.jit(grouped_log_softmax)
_reach = jax.jit(reach)
_select = jax.jit(select_tree, static_argnames="budget")


# ------------------------------------------------------------------ lossless


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_is_lossless_with_a_random_scorer(budget):
    target, drafter = tiny_pair(VOCAB)
    scorer = random_scorer(target, drafter, seed=budget, scale=3.0)
    want = target.generate(PROMPTS, 24).tokens
    dec = SpeculativeDecoder(target, drafter, "taps", budget, scorer=scorer)
    result = dec.generate(PROMPTS, 24)
    assert result.tokens == want
    assert all(r == "length" for r in result.finish_reasons)
    if budget > 1:
        assert max(max(r) for r in result.stats["accepted_lengths"]) >= 2, "no draft token accepted"
    one = dec.generate(PROMPTS[2:3], 24)  # batch of one
    assert one.tokens == want[2:3]


def _chi_square_ok(counts, exact):
    expected = exact * counts.sum()
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[keep]).sum()
    dof = keep.sum() - 1
    z = 3.09  # 99.9% quantile, Wilson-Hilferty
    crit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    return chi2 < crit, (chi2, crit)


def test_sampling_follows_the_target_distribution():
    """Chi-square on the first two tokens under taps at T=1 (as for ddtree in test_speculative)."""
    target, drafter = tiny_pair(vocab=6, block_size=4, seed=3)
    prompt = [1, 2, 3]

    def probs(ctx):
        logits = np.asarray(target.logits([ctx]))[0, -1].astype(np.float64)
        p = np.exp(logits - logits.max())
        return p / p.sum()

    p1 = probs(prompt)
    exact = np.stack([p1[a] * probs(prompt + [a]) for a in range(6)])
    dec = SpeculativeDecoder(target, drafter, "taps", 8, scorer=random_scorer(target, drafter, seed=5, scale=3.0))
    counts = np.zeros((6, 6))
    for seed in range(2):  # rows of one batch sample independently
        for t in dec.generate([prompt] * 2048, 2, temperature=1.0, seed=seed).tokens:
            counts[t[0], t[1]] += 1
    ok, info = _chi_square_ok(counts, exact)
    assert ok, info


def test_taps_needs_a_matching_scorer():
    target, drafter = tiny_pair(VOCAB)
    with pytest.raises(ValueError, match=r"train\.scorer.*ddtree"):
        SpeculativeDecoder(target, drafter, "taps", 8)
    with pytest.raises(ValueError, match="trained scorer"):
        draft_tree(TreeConfig("taps", 4, 4, 4), jnp.zeros((1, 3, VOCAB)), jnp.zeros((1,), jnp.int32))


# ------------------------------------------------------------------ scorer math


def _random_pool(seed=0, batch=2, horizon=3, vocab=7, k=3, width=5):
    """A pool with invalid nodes (width > k leaves depth-1 slots empty)."""
    logits = jax.random.normal(jax.random.key(seed), (batch, horizon, vocab)) * 2.0
    return _lattice_pool(logits, k, width)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _lattice_pool(logits, k, width):
    lattice = build_lattice(logits, k)
    return lattice, build_pool(lattice, width)


def test_grouped_softmax_sums_to_one_and_matches_a_loop():
    lattice, pool = _random_pool()
    B, N = pool.token_BN.shape
    k1, k2 = jax.random.split(jax.random.key(1))
    # Large offsets: a naive exp would overflow.
    edge = jax.random.normal(k1, (B, N)) * 5.0 + 500.0
    other = jax.random.normal(k2, (B, N + 1)) * 5.0 + 500.0
    log_q, log_qo = _grouped(edge, other, pool.parent_BN, pool.valid_BN)
    log_q, log_qo = np.asarray(log_q, np.float64), np.asarray(log_qo, np.float64)
    edge, other = np.asarray(edge, np.float64), np.asarray(other, np.float64)
    parent, valid = np.asarray(pool.parent_BN), np.asarray(pool.valid_BN)
    assert not valid.all(), "the test pool should contain invalid nodes"
    assert np.all(np.isneginf(log_q[~valid]))
    for b in range(B):
        for slot in range(N + 1):
            kids = [n for n in range(N) if valid[b, n] and parent[b, n] + 1 == slot]
            logits = np.array([edge[b, n] for n in kids] + [other[b, slot]])
            ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            got = np.array([log_q[b, n] for n in kids] + [log_qo[b, slot]])
            np.testing.assert_allclose(got, ref, atol=1e-5)
            assert abs(np.exp(got).sum() - 1.0) < 1e-5


def test_reach_is_the_product_along_the_path():
    lattice, pool = _random_pool(seed=2)
    B, N = pool.token_BN.shape
    edge = jax.random.normal(jax.random.key(3), (B, N)) * 2.0
    other = jax.random.normal(jax.random.key(4), (B, N + 1)) * 2.0
    log_q, _ = _grouped(edge, other, pool.parent_BN, pool.valid_BN)
    got = np.exp(np.asarray(_reach(pool, log_q)))
    q, parent, valid = np.exp(np.asarray(log_q, np.float64)), np.asarray(pool.parent_BN), np.asarray(pool.valid_BN)
    for b in range(B):
        for n in range(N):
            want, m = 1.0, n
            while m >= 0:
                want *= q[b, m] if valid[b, n] else 0.0
                m = parent[b, m]
            np.testing.assert_allclose(got[b, n], want, rtol=1e-5, atol=1e-30)


def _prefix_closed(tree):
    parents, valid = np.asarray(tree.parents_BT), np.asarray(tree.valid_BT)
    for b in range(parents.shape[0]):
        for i in range(1, parents.shape[1]):
            if valid[b, i]:
                assert 0 <= parents[b, i] < i and valid[b, parents[b, i]]


def test_taps_tree_is_prefix_closed():
    target, drafter = tiny_pair(VOCAB)
    scorer = random_scorer(target, drafter, seed=7, scale=4.0)
    B, H = 3, drafter.config.block_size - 1
    logits = jax.random.normal(jax.random.key(0), (B, H, VOCAB)) * 2.0
    hidden = jax.random.normal(jax.random.key(1), (B, H, drafter.config.hidden_size))
    root = jnp.array([1, 2, 3], jnp.int32)
    embed = target.model.embed_tokens.embedding.get_value()
    configs = [TreeConfig("taps", 12, 6, 12, selection=s, lambda_node=1.0, lambda_depth=0.5)
               for s in ("reach", "utility")]

    @jax.jit
    def run(logits, hidden, embed, root):
        fn = taps_log_qcond_fn(scorer.module, hidden, embed, root)
        return [draft_tree(c, logits, root, fn) for c in configs]

    for tree, aux in run(logits, hidden, embed, root):
        assert np.asarray(tree.valid_BT).all()
        _prefix_closed(tree)
        # The scorer, not the drafter's marginal, drives the reach.
        assert not np.allclose(np.asarray(aux.log_reach_BN), np.asarray(aux.pool.cum_logprob_BN))


def test_untrained_residual_scorer_is_the_drafters_conditional():
    """A residual scorer starts at the drafter's marginal, so TAPS starts at DDTree's tree."""
    target, drafter = tiny_pair(VOCAB)
    scorer = ScorerModel.for_models(target.config, drafter.config, seed=3, token_dim=8, hidden_dim=8, depth_dim=4,
                                    mlp_dim=16, residual=True)
    B, H = 3, drafter.config.block_size - 1
    logits = jax.random.normal(jax.random.key(5), (B, H, VOCAB)) * 2.0
    hidden = jax.random.normal(jax.random.key(6), (B, H, drafter.config.hidden_size))
    root = jnp.array([1, 2, 3], jnp.int32)
    embed = target.model.embed_tokens.embedding.get_value()

    @jax.jit
    def run(logits, hidden, embed, root):
        fn = taps_log_qcond_fn(scorer.module, hidden, embed, root)
        return (draft_tree(TreeConfig("taps", 12, 6, 12), logits, root, fn),
                draft_tree(TreeConfig("ddtree", 12, 6, 12), logits, root))

    (taps, taps_aux), (dd, dd_aux) = run(logits, hidden, embed, root)
    valid = np.asarray(taps_aux.pool.valid_BN)
    np.testing.assert_allclose(np.asarray(taps_aux.log_reach_BN)[valid], np.asarray(dd_aux.log_reach_BN)[valid],
                               atol=1e-5)
    for field in ("tokens_BT", "parents_BT", "valid_BT"):
        np.testing.assert_array_equal(np.asarray(getattr(taps, field)), np.asarray(getattr(dd, field)))


# ------------------------------------------------------------------ oracle


def _optimal_sum(parent, valid, reach_star, m):
    """Brute force: the best sum of reach* over prefix-closed sets of m valid pool nodes."""
    nodes = [n for n in range(len(parent)) if valid[n]]
    best = -1.0
    for subset in itertools.combinations(nodes, m):
        s = set(subset)
        if all(parent[n] < 0 or parent[n] in s for n in subset):
            best = max(best, float(sum(reach_star[n] for n in subset)))
    return best


def _true_conditionals(target, pool, context, root):
    """Target probabilities at every parent slot of every row, by plain causal forwards.

    Returns (p_star [R, N], p_other [R, N + 1], reach_star [R, N]) exactly as a
    trace records them (train/traces.py checks its labels against this too).
    """
    parent, token, valid = (np.asarray(x) for x in (pool.parent_BN, pool.token_BN, pool.valid_BN))
    R, N = token.shape
    seqs = []
    for r in range(R):
        seqs.append(context[r] + [int(root[r])])
        for n in range(N):
            seqs.append(context[r] + [int(root[r])] + path_tokens(parent[r], token[r], n))
    width = max(map(len, seqs))
    padded = np.zeros((len(seqs), width), np.int32)
    for i, q in enumerate(seqs):
        padded[i, : len(q)] = q
    logits = np.asarray(target.logits(padded), np.float64)
    last = logits[np.arange(len(seqs)), [len(q) - 1 for q in seqs]].reshape(R, N + 1, -1)
    probs = np.exp(last - last.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    p_star = np.zeros((R, N))
    reach_star = np.zeros((R, N))
    for r in range(R):
        for n in range(N):  # parents precede children
            if valid[r, n]:
                p_star[r, n] = probs[r, parent[r, n] + 1, token[r, n]]
                reach_star[r, n] = p_star[r, n] * (reach_star[r, parent[r, n]] if parent[r, n] >= 0 else 1.0)
    p_other = np.ones((R, N + 1))
    for r in range(R):
        for n in range(N):
            p_other[r, parent[r, n] + 1] -= p_star[r, n]
    return p_star, np.clip(p_other, 0.0, 1.0), reach_star


def test_oracle_scorer_selects_the_optimal_tree():
    """Fed the target's true conditionals, selection maximises the expected accepted length.

    Expected accepted length of a tree (root included) at temperature 1 is
    1 + sum over its nodes of reach*; brute force over the prefix-closed
    subsets of 12-node pools for M <= 4.
    """
    target, _ = sharp_pair(vocab=8, block_size=4, seed=0, head_scale=20.0)
    R, H, V = 6, 3, 8
    rng = np.random.default_rng(0)
    _, pool = _lattice_pool(jnp.asarray(rng.normal(size=(R, H, V)) * 2.0, jnp.float32), 4, 4)
    context = [rng.integers(0, V, size=rng.integers(2, 6)).tolist() for _ in range(R)]
    root = jnp.asarray(rng.integers(0, V, size=R), jnp.int32)
    p_star, p_other, reach_star = _true_conditionals(target, pool, context, root)
    parent, valid = np.asarray(pool.parent_BN), np.asarray(pool.valid_BN)
    assert valid.all() and pool.token_BN.shape[1] == 12

    # The oracle's logits are the true log-probs: the grouped softmax returns them unchanged.
    with np.errstate(divide="ignore"):
        log_q, _ = _grouped(jnp.asarray(np.log(p_star), jnp.float32),
                                       jnp.asarray(np.log(p_other), jnp.float32), pool.parent_BN, pool.valid_BN)
    np.testing.assert_allclose(np.exp(np.asarray(log_q)), p_star, atol=1e-5)
    log_reach = _reach(pool, log_q)
    np.testing.assert_allclose(np.exp(np.asarray(log_reach)), reach_star, rtol=1e-4, atol=1e-7)
    gaps = []
    for m in range(1, 5):
        picked = np.asarray(_select(pool, log_reach, root, budget=m).pool_index_BT)[:, 1:]
        marginal = np.asarray(_select(pool, pool.cum_logprob_BN, root, budget=m).pool_index_BT)[:, 1:]
        for r in range(R):
            best = 1 + _optimal_sum(parent[r], valid[r], reach_star[r], m)
            np.testing.assert_allclose(1 + reach_star[r][picked[r]].sum(), best, rtol=1e-5)
            gaps.append(best - (1 + reach_star[r][marginal[r]].sum()))
    # The drafter's marginal (ddtree) never does better, and here sometimes worse.
    assert min(gaps) >= -1e-6 and max(gaps) > 1e-3


# ------------------------------------------------------------------ checkpoints


def test_scorer_roundtrip_and_model_set(tmp_path):
    target, drafter = tiny_pair(VOCAB)
    scorer = random_scorer(target, drafter, seed=11)
    target.save(tmp_path / "set" / "target")
    drafter.save(tmp_path / "set" / "drafter")
    scorer.save(tmp_path / "set" / "scorer")
    loaded = load_scorer(tmp_path / "set" / "scorer")
    assert loaded.config == scorer.config
    models = load_model_set(tmp_path / "set")
    assert models.scorer is not None and models.scorer.config == scorer.config
    assert models.greedy_scorer is None and models.scorer_for(0.0) is models.scorer
    # A set with scorer_greedy/ uses it at temperature 0 and scorer/ otherwise.
    greedy = random_scorer(target, drafter, seed=12)
    greedy.save(tmp_path / "set" / "scorer_greedy")
    models = load_model_set(tmp_path / "set")
    assert models.scorer_for(0.0) is models.greedy_scorer and models.scorer_for(0.7) is models.scorer
    assert models.greedy_scorer.config == greedy.config
    from decode.common import Parser, add_model_args, load_models

    parser = Parser()
    add_model_args(parser)
    from_set = load_models(parser.parse_args(["--model", str(tmp_path / "set")]))
    assert from_set.greedy_scorer is not None and from_set.scorer is not None
    # --scorer DIR is one scorer for every temperature.
    explicit = load_models(parser.parse_args(["--model", str(tmp_path / "set"), "--scorer",
                                              str(tmp_path / "set" / "scorer_greedy")]))
    assert explicit.greedy_scorer is None and explicit.scorer_for(0.0) is explicit.scorer
    lattice, pool = _random_pool(vocab=VOCAB, horizon=drafter.config.block_size - 1)
    inputs = ScorerInputs.from_round(lattice, pool, jnp.ones((2, pool.horizon, 32)), jnp.array([1, 2]))
    embed = target.model.embed_tokens.embedding.get_value()
    from flax import nnx

    call = jax.jit(lambda params, graphdef: nnx.merge(graphdef, params)(inputs, embed), static_argnums=1)
    for a, b in zip(call(*nnx.split(scorer.module)[::-1]), call(*nnx.split(loaded.module)[::-1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
