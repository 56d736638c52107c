"""Candidate pool: a beam search over the lattice by cumulative draft log-prob.

Layout is depth-major with a static width W: pool node n = (d - 1) * W + w
holds beam slot w of depth d (1..H), so N = H * W and every parent has a lower
index than its children. Within a depth, slots are kept in candidate order,
i.e. lexicographic (parent slot, rank) order, which by induction is the
lexicographic order of the nodes' rank tuples (root-to-node lattice ranks).
Two consequences that the selector relies on:

* `lax.top_k` returns the lower index first among equal values, so "higher
  score, then lower pool index" is exactly "higher score, then shallower, then
  lexicographically smaller rank tuple" with no composite key.
* With W >= M and K >= min(M, V) the pool contains the M best prefixes under
  that order (the DDTree heap's set): a top-M node has its parent in the top-M
  set and at most M - 1 nodes of its depth ahead of it, so the beam keeps it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from taps_jax.tree.lattice import Lattice


@flax.struct.dataclass
class Pool:
    """H * W draft prefixes, depth-major. Invalid nodes: cum_logprob = -inf."""

    parent_BN: jax.Array  # [B, N] int32 pool index of the parent, -1 at depth 1
    token_BN: jax.Array  # [B, N] int32 token id
    depth_BN: jax.Array  # [B, N] int32 depth 1..H
    rank_BN: jax.Array  # [B, N] int32 lattice rank of the token at its depth
    step_logprob_BN: jax.Array  # [B, N] f32 draft log-prob of the token
    cum_logprob_BN: jax.Array  # [B, N] f32 sum of step log-probs from the root
    valid_BN: jax.Array  # [B, N] bool
    width: int = flax.struct.field(pytree_node=False)  # W (static)

    @property
    def horizon(self) -> int:
        """H, the number of depths."""
        return self.parent_BN.shape[1] // self.width


def build_pool(lattice: Lattice, width: int) -> Pool:
    """Beam search of width `width` over the lattice's top-K tokens per depth.

    Depth 1 keeps the top-W of the K root children; depth d + 1 keeps the
    top-W of the W * K children of the depth-d beam. Ties go to the lower
    flattened candidate index (parent slot, rank). Slots without a candidate
    (W > K at depth 1, or zero-probability tokens) are invalid.
    """
    if width < 1:
        raise ValueError(f"Beam width must be >= 1, got {width}; raise beam_width.")
    logprobs_BHK = lattice.logprobs_BHK
    batch, horizon, k = logprobs_BHK.shape

    def step(cum_BW, xs):
        logprobs_BK, tokens_BK = xs
        cand_BC = (cum_BW[:, :, None] + logprobs_BK[:, None, :]).reshape(batch, width * k)
        _, idx_BW = lax.top_k(cand_BC, width)
        # Back to candidate order: keeps each depth in rank-tuple order (see
        # module docstring) and parents ahead of children.
        idx_BW = jnp.sort(idx_BW, axis=-1)
        cum_BW = jnp.take_along_axis(cand_BC, idx_BW, axis=-1)
        rank_BW = idx_BW % k
        out = (
            idx_BW // k,
            rank_BW,
            jnp.take_along_axis(tokens_BK, rank_BW, axis=-1),
            jnp.take_along_axis(logprobs_BK, rank_BW, axis=-1),
            cum_BW,
        )
        return cum_BW, out

    # A virtual depth-0 beam holding only the root (slot 0): depth 1 then
    # needs no special case, and slots beyond K come out as -inf (invalid).
    root_BW = jnp.full((batch, width), -jnp.inf, jnp.float32).at[:, 0].set(0.0)
    xs = (jnp.swapaxes(logprobs_BHK, 0, 1), jnp.swapaxes(lattice.tokens_BHK, 0, 1))
    _, (slot_HBW, rank_HBW, token_HBW, step_HBW, cum_HBW) = lax.scan(step, root_BW, xs)

    def to_bn(x_HBW):
        return jnp.swapaxes(x_HBW, 0, 1).reshape(batch, horizon * width)

    depth_H11 = jnp.arange(1, horizon + 1, dtype=jnp.int32)[:, None, None]
    parent_HBW = jnp.where(depth_H11 == 1, -1, (depth_H11 - 2) * width + slot_HBW)
    cum_BN = to_bn(cum_HBW)
    return Pool(
        parent_BN=to_bn(parent_HBW).astype(jnp.int32),
        token_BN=to_bn(token_HBW).astype(jnp.int32),
        depth_BN=to_bn(jnp.broadcast_to(depth_H11, slot_HBW.shape)).astype(jnp.int32),
        rank_BN=to_bn(rank_HBW).astype(jnp.int32),
        step_logprob_BN=to_bn(step_HBW),
        cum_logprob_BN=cum_BN,
        valid_BN=cum_BN > -jnp.inf,
        width=width,
    )
