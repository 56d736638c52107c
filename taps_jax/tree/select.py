"""Reach, top-M selection of a prefix-closed tree, its attention mask.

Scores live in log space: log q_reach is a sum of log q_cond along the path,
which neither underflows over 15 depths nor loses the ordering of small
reaches the way a product of probabilities in float32 would.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from taps_jax.tree.pool import Pool


@flax.struct.dataclass
class Tree:
    """A draft tree of static size T = 1 + M, root at slot 0, parents first.

    Valid nodes come first, sorted by pool index (so by depth, and every
    parent index < child index); padding slots, if fewer than M pool nodes
    could be selected, are at the end with valid False, token 0, parent -1,
    depth 0 and pool_index -1.
    """

    tokens_BT: jax.Array  # [B, T] int32; slot 0 = the root (bonus) token
    parents_BT: jax.Array  # [B, T] int32 tree index of the parent; -1 root/padding
    depths_BT: jax.Array  # [B, T] int32; root 0
    valid_BT: jax.Array  # [B, T] bool
    pool_index_BT: jax.Array  # [B, T] int32; -1 for root and padding
    max_depth: int = flax.struct.field(pytree_node=False)  # static bound on depths


def _propagate(pool: Pool, x_BN: jax.Array, combine: Callable, root_value: float) -> jax.Array:
    """out(v) = combine(out(parent(v)), x(v)), out(root) = root_value.

    One scan step per depth over the depth-major layout; a depth's parents are
    all in the previous depth, at slot parent % W.
    """
    batch, n = x_BN.shape
    width = pool.width
    horizon = n // width
    slot_BN = jnp.where(pool.parent_BN >= 0, pool.parent_BN % width, 0)

    def to_hbw(a_BN):
        return jnp.swapaxes(a_BN.reshape(batch, horizon, width), 0, 1)

    def step(prev_BW, xs):
        xd_BW, slot_BW = xs
        out_BW = combine(jnp.take_along_axis(prev_BW, slot_BW, axis=-1), xd_BW)
        return out_BW, out_BW

    # Depth 1 reads slot 0 of this row, i.e. the root.
    root_BW = jnp.full((batch, width), root_value, x_BN.dtype)
    _, out_HBW = lax.scan(step, root_BW, (to_hbw(x_BN), to_hbw(slot_BN)))
    return jnp.swapaxes(out_HBW, 0, 1).reshape(batch, n)


def reach(pool: Pool, log_qcond_BN: jax.Array) -> jax.Array:
    """log q_reach(v) = log q_reach(parent) + log q_cond(v); -inf if invalid.

    For log q_cond = pool.step_logprob_BN this reproduces cum_logprob_BN
    bit for bit (same float32 additions in the same order).
    """
    log_qcond_BN = jnp.where(pool.valid_BN, log_qcond_BN.astype(jnp.float32), -jnp.inf)
    return _propagate(pool, log_qcond_BN, jnp.add, 0.0)


def select_tree(pool: Pool, score_BN: jax.Array, root_token_B: jax.Array, budget: int) -> Tree:
    """The `budget` valid pool nodes with the highest score, as a Tree.

    Ties go to the shallower node, then to the lower pool index: with the
    depth-major layout both are "lower pool index", which `lax.top_k` already
    prefers, so the tie-break is exact. Each score is first clamped to the
    minimum along its path; for reach-like scores (never increasing along a
    path) that is a no-op, and for any other score it keeps the selection
    prefix-closed: a parent then scores >= its child and has a lower index.
    Nodes that are invalid in the pool or score -inf are never selected.
    """
    batch, n = score_BN.shape
    if not 1 <= budget <= n:
        raise ValueError(
            f"Tree budget {budget} must be between 1 and the pool size {n}; "
            f"lower the budget or widen the pool (beam_width)."
        )
    score_BN = score_BN.astype(jnp.float32)
    # NaN -> -inf; -0.0 -> +0.0 (top_k orders -0.0 below +0.0, which would be
    # an order among equal scores that is not ours).
    score_BN = jnp.where(jnp.isnan(score_BN) | ~pool.valid_BN, -jnp.inf, score_BN)
    score_BN = jnp.where(score_BN == 0.0, 0.0, score_BN)
    score_BN = _propagate(pool, score_BN, jnp.minimum, jnp.inf)

    top_BM, idx_BM = lax.top_k(score_BN, budget)
    picked_BM = top_BM > -jnp.inf
    # Parents-first order: picked nodes by pool index, padding after them.
    key_BM = jnp.sort(jnp.where(picked_BM, idx_BM, n + idx_BM), axis=-1)
    valid_BM = key_BM < n
    idx_BM = jnp.where(valid_BM, key_BM, key_BM - n)

    # Pool index -> tree index (slot 1 + j), -1 where not in the tree.
    tree_index_BM = jnp.broadcast_to(jnp.arange(1, budget + 1, dtype=jnp.int32), (batch, budget))
    batch_B1 = jnp.arange(batch)[:, None]
    scatter_BM = jnp.where(valid_BM, idx_BM, n)  # n is out of range: dropped
    pool_to_tree_BN = jnp.full((batch, n), -1, jnp.int32).at[batch_B1, scatter_BM].set(
        tree_index_BM, mode="drop"
    )
    parent_pool_BM = jnp.take_along_axis(pool.parent_BN, idx_BM, axis=-1)
    parent_tree_BM = jnp.where(
        parent_pool_BM < 0,
        0,
        jnp.take_along_axis(pool_to_tree_BN, jnp.maximum(parent_pool_BM, 0), axis=-1),
    )

    def with_root(root_B, nodes_BM, pad):
        return jnp.concatenate([root_B[:, None], jnp.where(valid_BM, nodes_BM, pad)], axis=1)

    zeros_B = jnp.zeros((batch,), jnp.int32)
    return Tree(
        tokens_BT=with_root(
            root_token_B.astype(jnp.int32), jnp.take_along_axis(pool.token_BN, idx_BM, axis=-1), 0
        ),
        parents_BT=with_root(zeros_B - 1, parent_tree_BM, -1),
        depths_BT=with_root(zeros_B, jnp.take_along_axis(pool.depth_BN, idx_BM, axis=-1), 0),
        valid_BT=with_root(jnp.ones((batch,), bool), valid_BM, False),
        pool_index_BT=with_root(zeros_B - 1, idx_BM, -1),
        max_depth=min(budget, pool.horizon),
    )


def ancestor_mask(tree: Tree) -> jax.Array:
    """[B, T, T] bool: [i, j] = node j is node i or one of its ancestors.

    Only valid nodes see and are seen; a padding row sees only itself so that
    no attention row is empty. Built by max_depth steps of pointer chasing.
    """
    t = tree.parents_BT.shape[1]
    index_T = jnp.arange(t, dtype=jnp.int32)
    node_BT = jnp.broadcast_to(index_T, tree.parents_BT.shape)
    mask_BTT = node_BT[:, :, None] == index_T
    for _ in range(tree.max_depth):
        node_BT = jnp.where(
            node_BT >= 0,
            jnp.take_along_axis(tree.parents_BT, jnp.maximum(node_BT, 0), axis=-1),
            -1,
        )
        mask_BTT = mask_BTT | (node_BT[:, :, None] == index_T)
    both_valid_BTT = tree.valid_BT[:, :, None] & tree.valid_BT[:, None, :]
    return mask_BTT & (both_valid_BTT | jnp.eye(t, dtype=bool))


def positions(tree: Tree, lengths_B: jax.Array) -> jax.Array:
    """[B, T] positions of the tree tokens: committed length + depth."""
    return lengths_B[:, None].astype(jnp.int32) + tree.depths_BT
