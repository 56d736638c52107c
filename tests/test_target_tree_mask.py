"""Tree verification: ancestor-only mask + positions len + depth == causal paths.

After a committed prefix, a tree of tokens is fed in one forward. Every node
must get exactly the logits of a plain causal forward over prefix + that
node's root-to-node path. Batch 2, different prefix lengths, different trees.
Then committing one accepted path with `KVCache.gather_commit` must leave a
cache that continues exactly like the causal sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from taps_jax.engine.prefill import prefill

TOL = 1e-5
CAPACITY = 32
PREFIX_LENS = (4, 11)
# Parents-first trees of 7 nodes (root = index 0), depths up to 3, with branching.
PARENTS = (
    (-1, 0, 0, 1, 1, 2, 3),  # depths 0 1 1 2 2 2 3
    (-1, 0, 1, 0, 3, 3, 4),  # depths 0 1 2 1 2 2 3
)


def depths_of(parents):
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def path_to(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def ancestor_mask(parents):
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        mask[i, path_to(parents, i)] = True
    return mask


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def _prefill(graphdef, params, prompt_BT, lens_B, capacity):
    return prefill(nnx.merge(graphdef, params), prompt_BT, lens_B, capacity)[2]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, tokens_BT, positions_BT, mask_BTT, cache):
    logits_BTV, _, cache = nnx.merge(graphdef, params)(tokens_BT, positions_BT, mask_BTT, cache)
    return logits_BTV, cache


@pytest.fixture(scope="module")
def tree_case(tiny_target):
    rng = np.random.default_rng(7)
    V = tiny_target.config.vocab_size
    prefixes = [rng.integers(0, V, n).tolist() for n in PREFIX_LENS]
    trees = [rng.integers(0, V, len(p)).tolist() for p in PARENTS]
    prompt = np.zeros((2, 16), np.int32)
    for b, p in enumerate(prefixes):
        prompt[b, : len(p)] = p
    cache = _prefill(tiny_target.graphdef, tiny_target.params, jnp.asarray(prompt), jnp.asarray(PREFIX_LENS, jnp.int32), CAPACITY)
    positions = np.stack([np.asarray(PREFIX_LENS[b]) + depths_of(p) for b, p in enumerate(PARENTS)])
    mask = np.stack([ancestor_mask(p) for p in PARENTS])
    logits, cache = _forward(
        tiny_target.graphdef, tiny_target.params, jnp.asarray(trees, jnp.int32),
        jnp.asarray(positions, jnp.int32), jnp.asarray(mask), cache,
    )
    return prefixes, trees, np.asarray(logits), cache


def test_tree_layout_is_what_we_claim():
    for parents in PARENTS:
        assert max(depths_of(parents)) == 3
        assert all(p < i for i, p in enumerate(parents))  # parents first
        assert len(set(p for p in parents if p >= 0)) < len(parents) - 1  # some node has 2+ children


def test_tree_logits_equal_causal_path_logits(tiny_target, tree_case):
    prefixes, trees, logits, cache = tree_case
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), PREFIX_LENS)  # verify does not commit
    # One causal forward over every prefix + root-to-node path, right-padded
    # to one length (causal, so padding after a row's end cannot change it).
    rows, ends = [], []
    for b, parents in enumerate(PARENTS):
        for node in range(len(parents)):
            rows.append(prefixes[b] + [trees[b][i] for i in path_to(parents, node)])
            ends.append(len(rows[-1]) - 1)
    batch = np.zeros((len(rows), 16), np.int32)
    for r, row in enumerate(rows):
        batch[r, : len(row)] = row
    ref = np.asarray(tiny_target.logits(batch))[np.arange(len(rows)), ends]
    got = logits.reshape(len(rows), -1)
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOL)
    # The check has teeth: sibling nodes at the same depth differ.
    assert np.abs(got[1] - got[2]).max() > 1e-2


def test_commit_accepted_path_then_continue(tiny_target, tree_case):
    prefixes, trees, _, cache = tree_case
    leaves = (6, 5)  # accept root -> ... -> this node in each sequence
    accepted = [path_to(p, leaf) for p, leaf in zip(PARENTS, leaves)]
    count = np.asarray([len(a) for a in accepted], np.int32)
    index = np.zeros((2, 4), np.int32)
    for b, a in enumerate(accepted):
        index[b, : len(a)] = a
    cache = cache.gather_commit(jnp.asarray(index), jnp.asarray(count))
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), np.asarray(PREFIX_LENS) + count)
    nxt = np.asarray([[17], [42]], np.int32)
    logits, _ = _forward(
        tiny_target.graphdef, tiny_target.params, jnp.asarray(nxt),
        cache.lengths_B[:, None], jnp.ones((2, 1, 1), bool), cache,
    )
    batch = np.zeros((2, 16), np.int32)
    ends = []
    for b in range(2):
        seq = prefixes[b] + [trees[b][i] for i in accepted[b]] + nxt[b].tolist()
        batch[b, : len(seq)] = seq
        ends.append(len(seq) - 1)
    ref = np.asarray(tiny_target.logits(batch))[np.arange(2), ends]
    np.testing.assert_allclose(np.asarray(logits[:, 0]), ref, rtol=0, atol=TOL)
