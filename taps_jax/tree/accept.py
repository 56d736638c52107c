"""Acceptance walk: the longest root path that the target agrees with."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from taps_jax.tree.select import Tree


@flax.struct.dataclass
class Acceptance:
    """Result of the walk. A = max_depth + 1 path slots."""

    num_accepted_B: jax.Array  # [B] int32 accepted nodes, root included (1..A)
    path_BA: jax.Array  # [B, A] int32 tree indices, root first, padded with the last accepted one
    path_valid_BA: jax.Array  # [B, A] bool; True for the first num_accepted slots
    bonus_token_B: jax.Array  # [B] int32 target token at the last accepted node


def accept_walk(tree: Tree, target_tokens_BT: jax.Array, max_depth: int | None = None) -> Acceptance:
    """Walks from the root while a valid child carries the target's token.

    `target_tokens_BT[b, i]` is the token the target emits after the path to
    node i (sampled or argmax). Children of one parent have distinct tokens,
    so at most one child matches. `max_depth` (static) bounds the number of
    steps; it defaults to the tree's own bound. Padding path slots repeat the
    last accepted index, so gathering along `path_BA` is always in range.
    """
    if max_depth is None:
        max_depth = tree.max_depth
    batch, t = tree.tokens_BT.shape
    target_tokens_BT = target_tokens_BT.astype(jnp.int32)
    batch_B = jnp.arange(batch)

    node_B = jnp.zeros((batch,), jnp.int32)
    alive_B = jnp.ones((batch,), bool)
    path = [node_B]
    path_valid = [alive_B]
    for _ in range(max_depth):
        want_B = target_tokens_BT[batch_B, node_B]
        match_BT = (
            tree.valid_BT
            & (tree.parents_BT == node_B[:, None])
            & (tree.tokens_BT == want_B[:, None])
        )
        alive_B = alive_B & jnp.any(match_BT, axis=-1)
        node_B = jnp.where(alive_B, jnp.argmax(match_BT, axis=-1).astype(jnp.int32), node_B)
        path.append(node_B)
        path_valid.append(alive_B)

    path_valid_BA = jnp.stack(path_valid, axis=1)
    return Acceptance(
        num_accepted_B=jnp.sum(path_valid_BA, axis=1, dtype=jnp.int32),
        path_BA=jnp.stack(path, axis=1),
        path_valid_BA=path_valid_BA,
        bonus_token_B=target_tokens_BT[batch_B, node_B],
    )
