"""Tree policies: drafter logits -> draft tree.

Every policy runs the same slots: lattice -> pool -> log q_cond -> reach ->
select. A policy only decides the lattice/pool sizes and how log q_cond is
estimated, so a learned scorer (TAPS) plugs in as a `log_qcond_fn`
(`taps_jax.tree.scorer.taps_log_qcond_fn`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from taps_jax.tree.lattice import Lattice, build_lattice
from taps_jax.tree.pool import Pool, build_pool
from taps_jax.tree.select import Tree, reach, select_tree

KNOWN_POLICIES = ("chain", "ddtree", "taps")
SELECTIONS = ("reach", "utility")

# (lattice, pool) -> log q_cond [B, N].
LogQcondFn = Callable[[Lattice, Pool], jax.Array]


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static tree settings (hashable: pass to jit as a static argument).

    policy: "chain" (DFlash: the argmax path, truncated to the budget),
      "ddtree" (top-M prefixes by cumulative draft log-prob) or "taps"
      (top-M by the reach of a learned scorer's q_cond; needs a scorer).
    budget: M, the non-root nodes verified per round.
    lattice_k: K, top tokens kept per drafted position (tree policies).
    beam_width: W, beam slots per depth of the candidate pool (tree policies).
    selection: "reach" (top-M by q_reach) or "utility" (top-M by the
      cost-aware q_reach / (lambda_node + lambda_depth * depth)); tree
      policies only. Both never increase along a path, so the set stays
      prefix-closed (and select_tree clamps along paths regardless).

    For "ddtree", beam_width >= budget and lattice_k >= min(budget, vocab)
    reproduce the DDTree best-first heap exactly (`reproduces_ddtree`);
    smaller values are allowed and trade exactness for a smaller pool.
    """

    policy: str = "ddtree"
    budget: int = 32
    lattice_k: int = 32
    beam_width: int = 32
    selection: str = "reach"
    lambda_node: float = 1.0
    lambda_depth: float = 0.0

    @classmethod
    def exact_ddtree(cls, budget: int, vocab_size: int) -> TreeConfig:
        """The smallest ddtree config that reproduces the DDTree heap."""
        return cls("ddtree", budget, min(budget, vocab_size), budget)

    def validate(self, horizon: int, vocab_size: int) -> None:
        """Raises ValueError saying what is wrong and how to fix it."""
        if self.policy not in KNOWN_POLICIES:
            raise ValueError(
                f"Unknown tree policy {self.policy!r}; choose one of {', '.join(KNOWN_POLICIES)}."
            )
        # Sizes become array shapes inside jit: a float or bool would fail deep in tracing.
        for name in ("budget", "lattice_k", "beam_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Tree {name} must be an integer, got {type(value).__name__} {value!r}; "
                                 f"pass a whole number.")
        if self.budget < 1:
            raise ValueError(f"Tree budget must be >= 1, got {self.budget}; raise the budget.")
        if self.policy == "chain":
            return  # K, W and the selection are unused by the chain.
        if self.selection not in SELECTIONS:
            raise ValueError(
                f"Unknown selection {self.selection!r}; choose one of {', '.join(SELECTIONS)}."
            )
        if self.selection == "utility" and not (self.lambda_node > 0 and self.lambda_depth >= 0):
            raise ValueError(
                f"Utility selection needs lambda_node > 0 and lambda_depth >= 0, got "
                f"lambda_node={self.lambda_node}, lambda_depth={self.lambda_depth}."
            )
        if not 1 <= self.lattice_k <= vocab_size:
            raise ValueError(
                f"lattice_k must be between 1 and the vocabulary size {vocab_size}, "
                f"got {self.lattice_k}; set lattice_k in that range."
            )
        if self.beam_width < 1:
            raise ValueError(
                f"beam_width must be >= 1, got {self.beam_width}; for an exact DDTree "
                f"use beam_width >= budget ({self.budget})."
            )
        pool_size = horizon * self.beam_width
        if self.budget > pool_size:
            raise ValueError(
                f"Tree budget {self.budget} exceeds the candidate pool of {pool_size} nodes "
                f"(horizon {horizon} x beam_width {self.beam_width}); the largest allowed "
                f"budget is {pool_size}: lower the budget or raise beam_width."
            )
        # Depth d holds at most min(W, K^d) distinct prefixes: a budget beyond their sum could not be filled.
        distinct, paths = 0, 1
        for _ in range(horizon):
            paths = min(paths * self.lattice_k, self.beam_width)
            distinct += paths
        if self.budget > distinct:
            raise ValueError(
                f"Tree budget {self.budget} cannot be filled: a lattice of the top {self.lattice_k} tokens at "
                f"each of {horizon} drafted positions, beam width {self.beam_width}, holds at most {distinct} "
                f"distinct prefixes; lower the budget to {distinct} or raise lattice_k."
            )

    def reproduces_ddtree(self, vocab_size: int) -> bool:
        """True when the static-shape ddtree equals the best-first heap."""
        return (
            self.policy == "ddtree"
            and self.selection == "reach"
            and self.beam_width >= self.budget
            and self.lattice_k >= min(self.budget, vocab_size)
        )

    def tree_size(self, horizon: int) -> int:
        """T = 1 + non-root nodes (root included)."""
        if self.policy == "chain":
            return 1 + min(self.budget, horizon)
        return 1 + self.budget


@flax.struct.dataclass
class DraftAux:
    """Intermediates a later scorer or the statistics may reuse."""

    lattice: Lattice
    pool: Pool
    log_reach_BN: jax.Array  # [B, N] f32 selection score of every pool node


def _step_logprob(lattice: Lattice, pool: Pool) -> jax.Array:
    del lattice
    return pool.step_logprob_BN


def draft_tree(
    config: TreeConfig,
    logits_BHV: jax.Array,
    root_token_B: jax.Array,
    log_qcond_fn: LogQcondFn | None = None,
) -> tuple[Tree, DraftAux]:
    """Builds the draft tree for one round.

    logits_BHV: drafter logits for the H drafted positions (any float dtype;
      computed in float32). root_token_B: the pending bonus token, tree slot 0.
    log_qcond_fn: optional override of the edge estimate (defaults to the
      drafter's own step log-prob); must not increase along a path's reach.
    Returns the tree (T = config.tree_size(H)) and the lattice/pool/reach.
    Policy "taps" requires `log_qcond_fn` (see `taps_jax.tree.scorer`).
    """
    _, horizon, vocab = logits_BHV.shape
    config.validate(horizon, vocab)
    if config.policy == "taps" and log_qcond_fn is None:
        raise ValueError(
            "Tree policy 'taps' needs a trained scorer (log_qcond_fn); train one with "
            "`python -m train.scorer ...` or use policy 'ddtree'."
        )
    if config.policy == "chain":
        # A width-1 pool of the rank-0 tokens is the argmax path; selecting
        # its first min(M, H) nodes (reach never increases) truncates it.
        k, width, budget = 1, 1, min(config.budget, horizon)
    else:
        k, width, budget = config.lattice_k, config.beam_width, config.budget
    lattice = build_lattice(logits_BHV, k)
    pool = build_pool(lattice, width)
    log_qcond_BN = (log_qcond_fn or _step_logprob)(lattice, pool)
    log_reach_BN = reach(pool, log_qcond_BN)
    score_BN = log_reach_BN
    if config.policy != "chain" and config.selection == "utility":
        cost_BN = config.lambda_node + config.lambda_depth * pool.depth_BN.astype(jnp.float32)
        score_BN = log_reach_BN - jnp.log(cost_BN)
    tree = select_tree(pool, score_BN, root_token_B, budget)
    return tree, DraftAux(lattice=lattice, pool=pool, log_reach_BN=log_reach_BN)
