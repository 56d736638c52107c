"""accept_walk against a plain Python walk."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from taps_jax.tree import Tree, TreeConfig, accept_walk, draft_tree

B, H, V, M = 8, 6, 8, 16


def py_walk(tokens, parents, valid, target):
    """Root first; step to the valid child carrying the target's token."""
    path = [0]
    while True:
        node = path[-1]
        children = [i for i in range(len(tokens)) if valid[i] and parents[i] == node and tokens[i] == target[node]]
        assert len(children) <= 1
        if not children:
            return path, int(target[node])
        path.append(children[0])


def check(acc, tree, target, max_depth):
    acc, tree = jax.device_get((acc, tree))
    a = max_depth + 1
    assert acc.path_BA.shape == acc.path_valid_BA.shape == (target.shape[0], a)
    for b in range(target.shape[0]):
        path, bonus = py_walk(tree.tokens_BT[b], tree.parents_BT[b], tree.valid_BT[b], target[b])
        n = len(path)
        assert acc.num_accepted_B[b] == n
        np.testing.assert_array_equal(acc.path_BA[b], path + [path[-1]] * (a - n))
        np.testing.assert_array_equal(acc.path_valid_BA[b], np.arange(a) < n)
        assert acc.bonus_token_B[b] == bonus


@functools.lru_cache(maxsize=None)
def _draft_and_accept(config):
    def fn(logits, root, target):
        tree, _ = draft_tree(config, logits, root)
        return tree, accept_walk(tree, target)

    return jax.jit(fn)


def follow_targets(rng, tokens, parents, valid, p_follow):
    """Per node: a random valid child's token with prob p_follow, else noise."""
    t = len(tokens)
    target = rng.integers(0, V, size=t)
    for i in range(t):
        kids = [j for j in range(t) if valid[j] and parents[j] == i]
        if kids and rng.random() < p_follow:
            target[i] = tokens[rng.choice(kids)]
    return target


def test_random_trees():
    config = TreeConfig("ddtree", M, V, M)
    fn = _draft_and_accept(config)
    rng = np.random.default_rng(0)
    lengths = set()
    for _ in range(8):
        logits = jnp.asarray(rng.normal(size=(B, H, V)) * 2, jnp.float32)
        root = jnp.asarray(rng.integers(0, V, size=B))
        # Draft once to get the tree, pick targets on the host, then walk.
        tree, _ = fn(logits, root, jnp.zeros((B, M + 1), jnp.int32))
        tree = jax.device_get(tree)
        p_follow = rng.uniform(0.3, 1.0)
        target = np.stack(
            [follow_targets(rng, tree.tokens_BT[b], tree.parents_BT[b], tree.valid_BT[b], p_follow) for b in range(B)]
        )
        tree2, acc = fn(logits, root, jnp.asarray(target))
        check(acc, tree2, target, tree.max_depth)
        lengths.update(np.asarray(acc.num_accepted_B).tolist())
    assert len(lengths) >= 4, f"too little variety in accepted lengths: {lengths}"


def test_chain_full_and_partial():
    # Chain tree: rows accept everything, nothing, and a prefix.
    config = TreeConfig("chain", H)
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, H, V)), jnp.float32)
    tree, _ = jax.jit(functools.partial(draft_tree, config))(logits, jnp.array([1, 2, 3]))
    chain = np.asarray(tree.tokens_BT)
    target = np.roll(chain, -1, axis=1)  # node i predicts node i + 1: accept all
    target[:, -1] = 5
    target[1, 0] = (chain[1, 1] + 1) % V  # reject at the root
    target[2, 3] = (chain[2, 4] + 1) % V  # reject after 3 steps
    acc = jax.jit(accept_walk)(tree, jnp.asarray(target))
    np.testing.assert_array_equal(acc.num_accepted_B, [H + 1, 1, 4])
    np.testing.assert_array_equal(acc.bonus_token_B, [5, target[1, 0], target[2, 3]])
    check(acc, tree, target, H)


def test_invalid_nodes_never_accepted():
    # Node 3 is marked invalid (as padding would be) but carries a matching
    # token under the root; node 2 is the valid match one level down.
    tokens = jnp.array([[9, 4, 5, 7, 0]] * 2)
    parents = jnp.array([[-1, 0, 1, 0, -1]] * 2)
    tree = Tree(
        tokens_BT=tokens,
        parents_BT=parents,
        depths_BT=jnp.array([[0, 1, 2, 1, 0]] * 2),
        valid_BT=jnp.array([[True, True, True, False, False]] * 2),
        pool_index_BT=jnp.array([[-1, 0, 3, 1, -1]] * 2),
        max_depth=2,
    )
    target = np.array([[7, 5, 6, 1, 1], [4, 5, 6, 1, 1]])
    acc = accept_walk(tree, jnp.asarray(target))
    np.testing.assert_array_equal(acc.num_accepted_B, [1, 3])
    np.testing.assert_array_equal(acc.path_BA, [[0, 0, 0], [0, 1, 2]])
    np.testing.assert_array_equal(acc.bonus_token_B, [7, 6])
    check(acc, tree, target, 2)
    # A larger static bound only adds padding.
    check(accept_walk(tree, jnp.asarray(target), max_depth=4), tree, target, 4)


def test_round_stays_on_device():
    # Draft, mask and walk in one jit with no host transfer.
    fn = _draft_and_accept(TreeConfig("ddtree", M, V, M))
    logits = jax.device_put(jnp.zeros((B, H, V), jnp.float32))
    root = jax.device_put(jnp.zeros((B,), jnp.int32))
    target = jax.device_put(jnp.zeros((B, M + 1), jnp.int32))
    fn(logits, root, target)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        tree, acc = fn(logits, root, target)
        jax.block_until_ready((tree, acc))
