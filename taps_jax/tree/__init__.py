"""Pure-array tree machinery: lattice, pool, reach + select, mask, accept walk.

Knows nothing of models; everything is batched over B with static shapes.
"""

from taps_jax.tree.accept import Acceptance, accept_walk
from taps_jax.tree.lattice import Lattice, build_lattice
from taps_jax.tree.policies import KNOWN_POLICIES, DraftAux, TreeConfig, draft_tree
from taps_jax.tree.pool import Pool, build_pool
from taps_jax.tree.select import Tree, ancestor_mask, positions, reach, select_tree

__all__ = [
    "Acceptance",
    "DraftAux",
    "KNOWN_POLICIES",
    "Lattice",
    "Pool",
    "Tree",
    "TreeConfig",
    "accept_walk",
    "ancestor_mask",
    "build_lattice",
    "build_pool",
    "draft_tree",
    "positions",
    "reach",
    "select_tree",
]
