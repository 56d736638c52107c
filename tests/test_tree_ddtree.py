"""The static-shape ddtree policy against DDTree's best-first heap.

DESIGN 5.2: the heap pops the best prefix, then pushes its next sibling and
its first child, M times. It yields the M best prefixes in a total order of
(score desc, then a tie-break). DESIGN 3.6 lets the tie-break be either the
reference's or ours as long as both sides use the same and it stays
prefix-closed; the heap here uses ours: shallower first, then the
lexicographically smaller rank tuple.
"""

import functools
import heapq
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taps_jax.tree import TreeConfig, ancestor_mask, draft_tree

GOLDEN = Path(__file__).resolve().parent / "golden" / "ddtree-tiny" / "golden.npz"  # tests/golden/README.md


def heap_ddtree(logprobs_HK: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """Rank tuples of the DDTree tree, in pop order.

    logprobs_HK: log-probs per depth sorted descending; the first
    min(budget, V) ranks are the per-depth candidates. Scores are float32
    sums in root-to-leaf order, as on device, so exact ties are the same.
    """
    horizon, k = logprobs_HK.shape
    lp = logprobs_HK.astype(np.float32)
    # Entries: (-score, depth, rank tuple, parent score).
    heap = [(-lp[0, 0], 1, (0,), np.float32(0.0))]
    popped = []
    while heap and len(popped) < budget:
        neg_score, depth, ranks, parent_score = heapq.heappop(heap)
        score = -neg_score
        if not np.isfinite(score):
            break  # zero-probability prefixes are never drafted
        popped.append(ranks)
        if ranks[-1] + 1 < k:  # next sibling
            sib = np.float32(parent_score + lp[depth - 1, ranks[-1] + 1])
            heapq.heappush(heap, (-sib, depth, ranks[:-1] + (ranks[-1] + 1,), parent_score))
        if depth < horizon:  # first child
            child = np.float32(score + lp[depth, 0])
            heapq.heappush(heap, (-child, depth + 1, ranks + (0,), score))
    return popped


def tree_paths(tokens, parents, valid):
    """Root-to-node token paths of the valid non-root nodes, by tree index."""
    out = {}
    for i in range(1, len(tokens)):
        if not valid[i]:
            continue
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        assert j == 0, "every valid node must reach the root"
        out[i] = tuple(reversed(path))
    return out


@functools.lru_cache(maxsize=None)
def _draft(config):
    return jax.jit(functools.partial(draft_tree, config))


def random_logits(rng, batch, horizon, vocab):
    """Logit rows of several kinds, most of them rich in exact ties."""
    out = np.empty((batch, horizon, vocab), np.float32)
    for b in range(batch):
        kind = b % 5
        if kind == 0:  # continuous
            x = rng.normal(size=(horizon, vocab)) * rng.uniform(0.5, 3.0)
        elif kind == 1:  # quantised: ties inside a position
            x = rng.integers(-3, 4, size=(horizon, vocab)).astype(np.float64)
        elif kind == 2:  # one quantised row, permuted: ties across paths
            base = rng.integers(-2, 3, size=vocab)
            x = np.stack([rng.permutation(base) for _ in range(horizon)])
        elif kind == 3:  # near-certain positions: step log-prob exactly 0, so a child ties its parent
            x = rng.integers(-2, 3, size=(horizon, vocab)).astype(np.float64)
            spike = rng.random(horizon) < 0.5
            x[spike, rng.integers(0, vocab, size=spike.sum())] = 200.0
        else:  # 1 or 2 possible tokens per position: often fewer prefixes than M
            x = rng.integers(-1, 2, size=(horizon, vocab)).astype(np.float64)
            keep = 1 + (rng.random((horizon, 1)) < 0.3)
            x[np.argsort(rng.random((horizon, vocab)), axis=-1) >= keep] = -np.inf
        out[b] = x
    return out


# (horizon H, vocab V, budget M, lattice K, beam W, lattices). Varied
# effective vocabularies (K = V < M, padding) come from the masked rows.
CASES = [
    (6, 12, 10, 10, 10, 48),  # the smallest exact setting
    (8, 20, 24, 20, 32, 32),  # W > M, K = V > M
    (15, 40, 64, 40, 64, 24),  # the golden geometry: K = V < M
]  # M = 1 (K = W = 1) is covered by golden tree 0.


@pytest.mark.parametrize("horizon,vocab,budget,k,width,batch", CASES)
def test_matches_heap(horizon, vocab, budget, k, width, batch):
    config = TreeConfig("ddtree", budget, k, width)
    assert config.reproduces_ddtree(vocab)
    rng = np.random.default_rng(horizon * 1000 + budget)
    logits = random_logits(rng, batch, horizon, vocab)
    root = rng.integers(0, vocab, size=batch)
    tree, aux = jax.device_get(_draft(config)(jnp.asarray(logits), jnp.asarray(root)))
    n_cand = min(budget, vocab)
    n_padding = 0
    for b in range(batch):
        lattice_lp = aux.lattice.logprobs_BHK[b, :, :n_cand]
        lattice_tok = aux.lattice.tokens_BHK[b, :, :n_cand]
        want = {
            tuple(int(lattice_tok[d, r]) for d, r in enumerate(ranks))
            for ranks in heap_ddtree(lattice_lp, budget)
        }
        got = tree_paths(tree.tokens_BT[b], tree.parents_BT[b], tree.valid_BT[b])
        assert len(got) == len(set(got.values())), "duplicate prefixes"
        assert set(got.values()) == want, f"row {b} (kind {b % 5})"
        assert tree.tokens_BT[b, 0] == root[b]
        n_padding += budget - len(want)
    if horizon == 6:
        assert n_padding > 0, "no lattice exercised the padding"


@pytest.mark.parametrize("i", range(4))
def test_golden_ddtree(i):
    golden = np.load(GOLDEN)
    logits = golden[f"ddtree{i}_logits"]
    budget = int(golden[f"ddtree{i}_budget"])
    gold_tokens = np.concatenate([[-1], golden[f"ddtree{i}_tokens"]])
    gold_depths = np.concatenate([[0], golden[f"ddtree{i}_depths"]])
    gold_parents = golden[f"ddtree{i}_parents"]
    gold_vis = golden[f"ddtree{i}_visibility"]

    config = TreeConfig.exact_ddtree(budget, logits.shape[-1])
    tree, _ = _draft(config)(jnp.asarray(logits)[None], jnp.array([7]))
    mask = np.asarray(ancestor_mask(tree))[0]
    tree = jax.device_get(tree)
    assert tree.valid_BT[0].all(), "the golden trees are full"

    ours = tree_paths(tree.tokens_BT[0], tree.parents_BT[0], tree.valid_BT[0])
    gold = tree_paths(gold_tokens, gold_parents, np.ones(budget + 1, bool))
    assert set(ours.values()) == set(gold.values())

    gold_index = {path: j for j, path in gold.items()}
    perm = np.array([0] + [gold_index[ours[i]] for i in range(1, budget + 1)])
    np.testing.assert_array_equal(tree.depths_BT[0], gold_depths[perm])
    # Parent links: our parent of i is the node the reference calls i's parent.
    np.testing.assert_array_equal(perm[tree.parents_BT[0][1:]], gold_parents[perm[1:]])
    np.testing.assert_array_equal(mask, gold_vis[np.ix_(perm, perm)])
