"""Property tests of the tree machinery on random inputs of fixed shapes.

Shapes and static settings come from small fixed sets so that each jitted
function compiles only a few times across all hypothesis examples.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taps_jax.tree import (
    TreeConfig,
    accept_walk,
    ancestor_mask,
    build_lattice,
    draft_tree,
    positions,
    reach,
    select_tree,
)

B, H, V = 4, 6, 10
K, W = 5, 6  # a pool smaller than exact DDTree would need: not every prefix fits
PROPS = settings(max_examples=25, derandomize=True, deadline=None, database=None)
seeds = st.integers(0, 2**32 - 1)


def random_logits(rng):
    """Continuous or quantised (tie-rich) logits, some with masked tokens."""
    if rng.random() < 0.5:
        x = rng.normal(size=(B, H, V)) * 2.0
    else:
        x = rng.integers(-2, 3, size=(B, H, V)).astype(np.float64)
    x[rng.random((B, H, V)) < 0.1] = -np.inf  # zero-probability tokens
    x[..., 0] = np.maximum(x[..., 0], -5.0)  # keep every row normalisable
    return x.astype(np.float32)


@functools.lru_cache(maxsize=None)
def _run(config):
    """draft_tree plus everything derived from the tree, in one compile."""

    def fn(logits, root, lengths):
        tree, aux = draft_tree(config, logits, root)
        return tree, aux, ancestor_mask(tree), positions(tree, lengths)

    return jax.jit(fn)


@functools.lru_cache(maxsize=None)
def _select(budget):
    def fn(pool, score, root):
        tree = select_tree(pool, score, root, budget)
        return tree, ancestor_mask(tree)

    return jax.jit(fn)


def np_ancestor_mask(parents, valid):
    t = len(parents)
    mask = np.eye(t, dtype=bool)
    for i in range(t):
        if not valid[i]:
            continue
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def check_pool(pool, lattice):
    """Beam invariants, and the beam itself against a numpy re-run."""
    n = H * W
    depth = np.arange(n) // W + 1
    for b in range(B):
        np.testing.assert_array_equal(pool.depth_BN[b], depth)
        np.testing.assert_array_equal(pool.valid_BN[b], pool.cum_logprob_BN[b] > -np.inf)
        cum_prev = np.array([0.0] + [-np.inf] * (W - 1), np.float32)
        for d in range(1, H + 1):
            nodes = slice((d - 1) * W, d * W)
            parent = pool.parent_BN[b, nodes]
            slot = np.zeros(W, int) if d == 1 else parent - (d - 2) * W
            if d == 1:
                assert (parent == -1).all()
            assert ((slot >= 0) & (slot < W)).all()
            rank = pool.rank_BN[b, nodes]
            valid = pool.valid_BN[b, nodes]
            if d > 1:
                assert (valid <= pool.valid_BN[b, parent]).all()
            # Candidate order inside a depth, hence no duplicates. (Invalid
            # depth-1 slots hang off an empty virtual root slot: skip them.)
            flat = slot * K + rank
            assert (np.diff(flat[valid]) > 0).all() and (d == 1 or (np.diff(flat) > 0).all())
            lp = lattice.logprobs_BHK[b, d - 1]
            np.testing.assert_array_equal(pool.token_BN[b, nodes], lattice.tokens_BHK[b, d - 1, rank])
            np.testing.assert_array_equal(pool.step_logprob_BN[b, nodes], lp[rank])
            np.testing.assert_array_equal(pool.cum_logprob_BN[b, nodes][valid], (cum_prev[slot] + lp[rank])[valid])
            # Top-W by (score desc, candidate index asc).
            cand = (cum_prev[:, None] + lp[None, :]).reshape(-1)
            want = np.lexsort((np.arange(W * K), -cand))[:W]
            want = np.sort(want[cand[want] > -np.inf])
            np.testing.assert_array_equal(want, flat[valid])
            cum_prev = pool.cum_logprob_BN[b, nodes]


def np_path_min(pool, score):
    """Each score clamped to the minimum along its path (NaN -> -inf)."""
    out = np.where(np.isnan(score) | ~pool.valid_BN, -np.inf, score)
    for b in range(B):
        for n in range(H * W):  # parents first
            p = pool.parent_BN[b, n]
            if p >= 0:
                out[b, n] = min(out[b, n], out[b, p])
    return out


def check_tree(tree, pool, root, budget, score=None):
    """Structure, padding, and (given the score) the selected set."""
    t = 1 + budget
    assert tree.tokens_BT.shape == (B, t)
    for b in range(B):
        valid, parents = tree.valid_BT[b], tree.parents_BT[b]
        depths, pidx, tokens = tree.depths_BT[b], tree.pool_index_BT[b], tree.tokens_BT[b]
        n_valid = int(valid.sum())
        # Root, then valid nodes, then padding.
        np.testing.assert_array_equal(valid, np.arange(t) < n_valid)
        assert (tokens[0], parents[0], depths[0], pidx[0]) == (root[b], -1, 0, -1)
        assert n_valid - 1 <= min(budget, int(pool.valid_BN[b].sum()))
        pad = ~valid
        assert (parents[pad] == -1).all() and (depths[pad] == 0).all()
        assert (pidx[pad] == -1).all() and (tokens[pad] == 0).all()
        # Valid nodes: sorted by pool index, parents first, prefix-closed.
        sel = pidx[1:n_valid]
        assert (np.diff(sel) > 0).all()
        assert pool.valid_BN[b, sel].all()
        np.testing.assert_array_equal(tokens[1:n_valid], pool.token_BN[b, sel])
        np.testing.assert_array_equal(depths[1:n_valid], pool.depth_BN[b, sel])
        for i in range(1, n_valid):
            p = parents[i]
            assert 0 <= p < i and valid[p]
            assert depths[i] == depths[p] + 1 and 1 <= depths[i] <= H
            assert pidx[p] == pool.parent_BN[b, pidx[i]]  # -1 == -1 at depth 1
        # Children of one parent carry distinct tokens.
        pairs = {(int(parents[i]), int(tokens[i])) for i in range(1, n_valid)}
        assert len(pairs) == n_valid - 1
        if score is not None:
            s = np.where(pool.valid_BN[b], score[b], -np.inf)
            order = np.lexsort((np.arange(len(s)), -s))  # score desc, then pool index
            want = [n for n in order[:budget] if s[n] > -np.inf]
            assert n_valid - 1 == min(budget, int((s > -np.inf).sum()))
            assert set(sel.tolist()) == set(want)


@PROPS
@given(seed=seeds, budget=st.sampled_from([3, 20]))
def test_ddtree_tree_properties(seed, budget):
    rng = np.random.default_rng(seed)
    config = TreeConfig("ddtree", budget, K, W)
    logits = random_logits(rng)
    root = rng.integers(0, V, size=B)
    lengths = rng.integers(0, 50, size=B)
    out = _run(config)(jnp.asarray(logits), jnp.asarray(root), jnp.asarray(lengths))
    tree, aux, mask, pos = jax.device_get(out)
    check_pool(aux.pool, aux.lattice)
    # ddtree's reach is the cumulative log-prob, bit for bit.
    np.testing.assert_array_equal(aux.log_reach_BN, aux.pool.cum_logprob_BN)
    check_tree(tree, aux.pool, root, budget, score=aux.log_reach_BN)
    for b in range(B):
        np.testing.assert_array_equal(mask[b], np_ancestor_mask(tree.parents_BT[b], tree.valid_BT[b]))
    np.testing.assert_array_equal(pos, lengths[:, None] + tree.depths_BT)


@settings(PROPS, max_examples=15)
@given(seed=seeds, budget=st.sampled_from([3, 9]))
def test_chain_is_argmax_path(seed, budget):
    rng = np.random.default_rng(seed)
    config = TreeConfig("chain", budget)
    logits = random_logits(rng)
    root = rng.integers(0, V, size=B)
    tree, _, mask, _ = jax.device_get(
        _run(config)(jnp.asarray(logits), jnp.asarray(root), jnp.zeros(B, jnp.int32))
    )
    n = min(budget, H)
    assert config.tree_size(H) == 1 + n == tree.tokens_BT.shape[1]
    np.testing.assert_array_equal(tree.tokens_BT[:, 0], root)
    np.testing.assert_array_equal(tree.tokens_BT[:, 1:], np.argmax(logits[:, :n], axis=-1))
    np.testing.assert_array_equal(tree.parents_BT, np.broadcast_to(np.arange(-1, n), (B, n + 1)))
    np.testing.assert_array_equal(tree.depths_BT, np.broadcast_to(np.arange(n + 1), (B, n + 1)))
    assert tree.valid_BT.all()
    np.testing.assert_array_equal(mask, np.broadcast_to(np.tril(np.ones((n + 1, n + 1), bool)), mask.shape))


@PROPS
@given(seed=seeds, budget=st.sampled_from([3, 20]))
def test_reach_and_select_any_score(seed, budget):
    """Reach is the product along the path; any score gives a valid tree."""
    rng = np.random.default_rng(seed)
    config = TreeConfig("ddtree", budget, K, W)
    logits = random_logits(rng)
    root = rng.integers(0, V, size=B)
    _, aux, _, _ = _run(config)(jnp.asarray(logits), jnp.asarray(root), jnp.zeros(B, jnp.int32))
    pool = aux.pool

    qcond = rng.uniform(0.0, 1.0, size=(B, H * W)).astype(np.float32)
    qcond[rng.random(qcond.shape) < 0.05] = 1.0  # q_cond of exactly 1: child ties parent
    log_reach = np.asarray(jax.jit(reach)(pool, jnp.log(jnp.asarray(qcond))))
    pool = jax.device_get(pool)
    for b in range(B):
        for n in range(H * W):
            if not pool.valid_BN[b, n]:
                assert log_reach[b, n] == -np.inf
                continue
            prod, j = 1.0, n
            while j >= 0:
                prod *= float(qcond[b, j])
                j = pool.parent_BN[b, j]
            np.testing.assert_allclose(np.exp(log_reach[b, n]), prod, rtol=1e-5, atol=1e-30)

    # Reach-based selection: the top-M set under (score desc, pool index asc).
    tree, mask = jax.device_get(_select(budget)(pool, jnp.asarray(log_reach), jnp.asarray(root)))
    check_tree(tree, pool, root, budget, score=log_reach)

    # An arbitrary score (increasing along paths, NaN, +-0.0) still gives a
    # prefix-closed, well-formed tree.
    score = rng.normal(size=(B, H * W)).astype(np.float32)
    score[rng.random(score.shape) < 0.05] = np.nan
    score[rng.random(score.shape) < 0.1] = -0.0  # equal to +0.0: ties by pool index
    score[rng.random(score.shape) < 0.1] = 0.0
    tree, mask = jax.device_get(_select(budget)(pool, jnp.asarray(score), jnp.asarray(root)))
    check_tree(tree, pool, root, budget, score=np_path_min(pool, score))
    for b in range(B):
        np.testing.assert_array_equal(mask[b], np_ancestor_mask(tree.parents_BT[b], tree.valid_BT[b]))


@PROPS
@given(seed=seeds)
def test_lattice_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    logits = random_logits(rng)
    lat = jax.device_get(jax.jit(build_lattice, static_argnums=1)(jnp.asarray(logits), K))
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(logp)
    order = np.argsort(-logits, axis=-1, kind="stable")  # ties: lower token id first
    np.testing.assert_array_equal(lat.tokens_BHK, order[..., :K])
    np.testing.assert_allclose(lat.logprobs_BHK, np.take_along_axis(logp, order[..., :K], -1), atol=1e-5)
    assert (np.diff(lat.logprobs_BHK, axis=-1) <= 0).all()
    entropy = -np.where(p > 0, p * np.where(p > 0, logp, 0), 0).sum(-1)
    np.testing.assert_allclose(lat.entropy_BH, entropy, atol=1e-5)
    top2 = np.take_along_axis(p, order[..., :2], -1)
    np.testing.assert_allclose(lat.margin_BH, top2[..., 0] - top2[..., 1], atol=1e-6)
    np.testing.assert_allclose(lat.topk_mass_BH, np.take_along_axis(p, order[..., :K], -1).sum(-1), atol=1e-5)


def test_padding_rows_see_only_themselves():
    # Only 3 tokens have non-zero draft probability, so depth 1 holds 3 valid
    # nodes (pool slots 3..5 are invalid) and M = 5 asks for more than exist.
    config = TreeConfig("ddtree", 5, K, W)
    logits = np.random.default_rng(0).normal(size=(B, 1, V))
    logits[..., 3:] = -np.inf
    tree, aux, mask, _ = jax.device_get(_run(config)(jnp.asarray(logits, jnp.float32), jnp.zeros(B, jnp.int32),
                                                     jnp.zeros(B, jnp.int32)))
    assert not aux.pool.valid_BN[:, 3:].any()
    assert (tree.valid_BT.sum(-1) == 1 + 3).all()
    assert (mask[:, -1] == np.eye(6, dtype=bool)[-1]).all()
    assert mask.any(-1).all()


def test_validate_messages():
    TreeConfig("ddtree", 64, 40, 64).validate(15, 40)
    TreeConfig("chain", 100).validate(15, 8)  # K, W unused; M > H truncates
    bad = [
        (TreeConfig("taps2", 8), "chain, ddtree"),
        (TreeConfig("ddtree", 0), "budget must be >= 1"),
        (TreeConfig("ddtree", 100, 8, 4), "largest allowed budget is 60"),
        (TreeConfig("ddtree", 8, 0, 8), "lattice_k"),
        (TreeConfig("ddtree", 8, 41, 8), "vocabulary size 40"),
        (TreeConfig("ddtree", 8, 8, 0), "beam_width"),
        (TreeConfig("ddtree", 20, 1, 20), "budget 20 cannot be filled: .* holds at most 15 distinct prefixes"),
    ]
    for config, msg in bad:
        with pytest.raises(ValueError, match=msg):
            config.validate(15, 40)
    assert TreeConfig.exact_ddtree(64, 40) == TreeConfig("ddtree", 64, 40, 64)
    assert TreeConfig.exact_ddtree(64, 40).reproduces_ddtree(40)
    assert not TreeConfig("ddtree", 64, 32, 64).reproduces_ddtree(40)
    assert TreeConfig("ddtree", 64, 32, 64).tree_size(15) == 65


# ---------------------------------------------------------------- acceptance and commit (issue 8, item 3)

@functools.lru_cache(maxsize=None)
def _accept(max_depth):
    return jax.jit(functools.partial(accept_walk, max_depth=max_depth))


def target_tokens(rng, tree, p_follow, vocab=V):
    """Per node, the token the "target" produced: a random child's token with prob p_follow, else noise."""
    batch, t = tree.tokens_BT.shape
    out = rng.integers(0, vocab, size=(batch, t))
    for b in range(batch):
        for i in range(t):
            kids = [j for j in range(t) if tree.valid_BT[b, j] and tree.parents_BT[b, j] == i]
            if kids and rng.random() < p_follow:
                out[b, i] = tree.tokens_BT[b, rng.choice(kids)]
    return out


@PROPS
@given(seed=seeds, budget=st.sampled_from([3, 20]), p_follow=st.sampled_from([0.5, 0.9, 1.0]))
def test_accept_walk_emits_only_target_tokens(seed, budget, p_follow):
    """Every emitted token is the target's token after its exact prefix, along one valid root path."""
    rng = np.random.default_rng(seed)
    config = TreeConfig("ddtree", budget, K, W)
    root = rng.integers(0, V, size=B)
    tree, _, _, _ = jax.device_get(
        _run(config)(jnp.asarray(random_logits(rng)), jnp.asarray(root), jnp.zeros(B, jnp.int32))
    )
    target = target_tokens(rng, tree, p_follow)
    acc = jax.device_get(_accept(tree.max_depth)(tree, jnp.asarray(target)))
    for b in range(B):
        n = int(acc.num_accepted_B[b])
        path = acc.path_BA[b, :n]
        assert 1 <= n <= min(tree.max_depth, H) + 1
        assert path[0] == 0 and tree.valid_BT[b, path].all()
        assert (tree.parents_BT[b, path[1:]] == path[:-1]).all()  # a root path
        np.testing.assert_array_equal(tree.depths_BT[b, path], np.arange(n))
        # Emitted: the accepted drafted tokens, then the bonus. Each one is what
        # the target produced at the previous node of the path.
        emitted = [*tree.tokens_BT[b, path[1:]], acc.bonus_token_B[b]]
        np.testing.assert_array_equal(emitted, target[b, path])
        # And the walk stopped because no valid child carries the target's next token.
        last = path[-1]
        kids = tree.valid_BT[b] & (tree.parents_BT[b] == last)
        assert n == tree.max_depth + 1 or not (tree.tokens_BT[b][kids] == target[b, last]).any()


# Commit: a tiny target verifies a random tree on top of a random prompt,
# accepts a random root path, and commits it; the cache must equal a fresh
# prefill of prompt + path. Fixed shapes (prompt bucket 16, capacity 48).
CB, CT, CAP, CV = 2, 16, 48, 8
COMMIT_CONFIG = TreeConfig("ddtree", 12, 4, 12)


@functools.lru_cache(maxsize=None)
def _commit_fns():
    from flax import nnx

    from spec_helpers import tiny_pair
    from taps_jax.engine.prefill import prefill

    graphdef, params = nnx.split(tiny_pair(CV)[0].model)

    @jax.jit
    def verify_and_commit(params, prompt, lens, tree, target):
        model = nnx.merge(graphdef, params)
        _, _, cache = prefill(model, prompt, lens, CAP)
        _, _, cache = model(tree.tokens_BT, positions(tree, lens), ancestor_mask(tree), cache)
        acc = accept_walk(tree, target, max_depth=H)
        return acc, cache.gather_commit(acc.path_BA, acc.num_accepted_B)

    @jax.jit
    def refeed(params, seq, lens):
        return prefill(nnx.merge(graphdef, params), seq, lens, CAP)[2]

    return params, jax.jit(functools.partial(draft_tree, COMMIT_CONFIG)), verify_and_commit, refeed


@settings(PROPS, max_examples=8)
@given(seed=seeds, p_follow=st.sampled_from([0.6, 1.0]))
def test_commit_equals_causal_refeed(seed, p_follow):
    params, draft, verify_and_commit, refeed = _commit_fns()
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, CT + 1, size=CB)
    prompt = np.zeros((CB, CT), np.int32)
    for b in range(CB):
        prompt[b, : lens[b]] = rng.integers(0, CV, size=lens[b])
    logits = rng.normal(size=(CB, H, CV)).astype(np.float32) * 2
    tree, _ = jax.device_get(draft(jnp.asarray(logits), jnp.asarray(rng.integers(0, CV, size=CB))))
    target = target_tokens(rng, tree, p_follow, CV)
    acc, cache = jax.device_get(verify_and_commit(params, jnp.asarray(prompt), jnp.asarray(lens), tree,
                                                  jnp.asarray(target)))
    seqs = np.zeros((CB, CT + H + 1), np.int32)
    want = np.zeros(CB, np.int32)
    for b in range(CB):
        n = int(acc.num_accepted_B[b])
        path = tree.tokens_BT[b, acc.path_BA[b, :n]]
        want[b] = lens[b] + n
        seqs[b, : want[b]] = np.concatenate([prompt[b, : lens[b]], path])
    ref = jax.device_get(refeed(params, jnp.asarray(seqs), jnp.asarray(want)))
    np.testing.assert_array_equal(cache.lengths_B, want)
    for b in range(CB):
        L = want[b]
        np.testing.assert_allclose(cache.k_LBKHS[:, b, ..., :L], ref.k_LBKHS[:, b, ..., :L], atol=1e-5)
        np.testing.assert_allclose(cache.v_LBKSH[:, b, :, :L], ref.v_LBKSH[:, b, :, :L], atol=1e-5)
