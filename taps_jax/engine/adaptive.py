"""Adaptive tree size: each round picks one of a few static budgets, down to a plain AR step.

Speculation pays only when a round's expected accepted length beats its cost
in AR steps, and that break-even moves with the hardware, the batch, the
temperature and the text. The adaptive policy compiles a small static set of
budgets (0 = one plain target step, no draft) as branches of the one
generate loop (`taps_jax.engine.speculative.adaptive_loop`); every branch is
an exact round, so the choice never changes what is sampled, only how fast.

Choice (one branch per round for the whole batch): maximise expected tokens
per unit cost. Expected tokens of branch k = sum over running sequences of an
EWMA of their accepted length under budget k; cost = a per-branch vector
(`taps_jax.engine.calibrate` measures it once per device kind and shape).
Trees of one pool are nested (the top-m of a ranking is a prefix of its
top-M), so a round of budget M also tells what every smaller budget would
have accepted from the same draft and target samples: the accepted path's
nodes ranked below m. Larger budgets are re-measured by probing the largest
branch once the cost spent since its last run exceeds cost_max /
probe_fraction (so probing costs at most about that fraction), the wait
doubling each time a probe leaves the choice unchanged. The first round
probes it too, unless the call starts from a prior (the estimates a
previous call of the same decoder and sampling settings ended with), so
exploration is not paid again on every call.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from taps_jax.tree.select import Tree


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
    """Static settings of the adaptive policy (hashable: part of the jit-static SpecConfig).

    budgets: increasing, 0 first (the AR step); the last is the tree budget
      the state and cache headroom are sized for.
    alpha: EWMA weight of the newest round.
    probe_fraction: target share of the cost spent probing the largest branch.
    max_backoff: the probe wait doubles at most this many times.
    force_cycle: test hook, every branch in turn (largest first, down to the AR step).
    """

    budgets: tuple[int, ...]
    alpha: float = 0.25
    probe_fraction: float = 0.05
    max_backoff: int = 4
    force_cycle: bool = False

    @classmethod
    def for_budget(cls, budget: int, **kw) -> AdaptiveConfig:
        """0 (AR) plus budget, budget/2, budget/4, budget/8 (those >= 1)."""
        return cls(tuple(sorted({0} | {budget >> i for i in range(4) if budget >> i >= 1})), **kw)

    def validate(self) -> None:
        b = self.budgets
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"adaptive budgets must start with 0 (the AR step) and increase, got {b!r}")
        if not 0 < self.alpha <= 1 or not 0 < self.probe_fraction <= 1:
            raise ValueError(f"adaptive alpha and probe_fraction must be in (0, 1], got {self.alpha}, "
                             f"{self.probe_fraction}")


@flax.struct.dataclass
class AdaptiveState:
    est_BK: jax.Array  # [B, K] f32 EWMA of accepted length (root included) per sequence and branch
    seen_K: jax.Array  # [K] bool: branch k has an estimate
    spent: jax.Array  # f32 cost spent since the largest branch last ran
    wait: jax.Array  # f32 cost to spend before the next probe
    backoff: jax.Array  # int32 probes in a row that left the choice unchanged
    round: jax.Array  # int32 rounds so far
    branch_R: jax.Array  # [R] int32 branch index of each round (-1: none)

    @classmethod
    def init(cls, batch: int, rounds: int, config: AdaptiveConfig, prior_K=None, costs_K=None) -> AdaptiveState:
        """prior_K: [K] accepted-length estimates to start from (NaN: none; e.g. the previous call's)."""
        K = len(config.budgets)
        prior_K = jnp.full((K,), jnp.nan, jnp.float32) if prior_K is None else jnp.asarray(prior_K, jnp.float32)
        seen_K = ~jnp.isnan(prior_K) | (jnp.arange(K) == 0)  # an AR step emits exactly one token
        known = jnp.all(seen_K)
        return cls(
            est_BK=jnp.broadcast_to(jnp.where(jnp.isnan(prior_K), 1.0, prior_K), (batch, K)),
            seen_K=seen_K,
            spent=jnp.zeros((), jnp.float32),
            # With every branch estimated (a prior), the first probe waits as after two that changed
            # nothing (calls are short: a wait reset per call would probe in each); else round 0 probes.
            wait=jnp.where(known, costs_K[-1] / config.probe_fraction * 2.0 ** min(2, config.max_backoff), 0.0)
            if costs_K is not None else jnp.zeros((), jnp.float32),
            backoff=jnp.where(known, min(2, config.max_backoff), 0).astype(jnp.int32),
            round=jnp.zeros((), jnp.int32),
            branch_R=jnp.full((rounds,), -1, jnp.int32),
        )


def best_branch(st: AdaptiveState, running_B, costs_K) -> jax.Array:
    """argmax_k (sum of running sequences' expected tokens) / cost_k; ties go to the cheaper (lower) branch."""
    tokens_K = jnp.sum(jnp.where(running_B[:, None], st.est_BK, 0.0), axis=0)
    value_K = jnp.where(st.seen_K, tokens_K / costs_K, -jnp.inf)
    return jnp.argmax(value_K).astype(jnp.int32)


def choose(st: AdaptiveState, running_B, costs_K, config: AdaptiveConfig) -> tuple[jax.Array, jax.Array]:
    """(branch index, whether it is a probe of the largest branch)."""
    K = len(config.budgets)
    if config.force_cycle:  # largest first, then each smaller one down to the AR step, and again
        k = (K - 1 - st.round % K).astype(jnp.int32)
        return k, k == K - 1
    probe = ((st.round == 0) & ~jnp.all(st.seen_K)) | (st.spent >= st.wait)
    return jnp.where(probe, K - 1, best_branch(st, running_B, costs_K)), probe


def update(st: AdaptiveState, k, probe, accepted_BK, running_B, costs_K, config: AdaptiveConfig) -> AdaptiveState:
    """Fold one round into the statistics.

    accepted_BK: what each branch j <= k would have accepted this round (the
    branch that ran and the smaller ones; columns j > k are ignored).
    """
    K = len(config.budgets)
    before = best_branch(st, running_B, costs_K)
    fresh_K = jnp.arange(K) <= k
    a_BK = accepted_BK.astype(jnp.float32)
    ewma_BK = jnp.where(st.seen_K, (1 - config.alpha) * st.est_BK + config.alpha * a_BK, a_BK)
    est_BK = jnp.where(fresh_K[None] & running_B[:, None], ewma_BK, st.est_BK)
    st = st.replace(est_BK=est_BK, seen_K=st.seen_K | fresh_K)
    # After a probe: wait (cost_max / fraction) * 2^backoff, backing off while probes change nothing.
    after = best_branch(st, running_B, costs_K)
    largest = k == K - 1
    confirmed = probe & (st.round > 0) & (before != K - 1) & (after == before)
    backoff = jnp.where(largest, jnp.where(confirmed, jnp.minimum(st.backoff + 1, config.max_backoff), 0),
                        st.backoff)
    wait = costs_K[-1] / config.probe_fraction * (2.0 ** backoff.astype(jnp.float32))
    R = st.branch_R.shape[0]
    return st.replace(
        spent=jnp.where(largest, 0.0, st.spent + costs_K[k]),
        wait=jnp.where(largest, wait, st.wait),
        backoff=backoff,
        round=st.round + 1,
        branch_R=st.branch_R.at[jnp.minimum(st.round, R)].set(k, mode="drop"),
    )


def estimates(st: AdaptiveState, ran_B) -> jax.Array:
    """[K] mean estimate over the sequences that ran (NaN for branches never seen): the next call's prior."""
    w_B = ran_B.astype(jnp.float32)
    mean_K = jnp.sum(st.est_BK * w_B[:, None], axis=0) / jnp.maximum(jnp.sum(w_B), 1.0)
    return jnp.where(st.seen_K & jnp.any(ran_B), mean_K, jnp.nan)


def tree_ranks(tree: Tree, score_BN) -> jax.Array:
    """[B, T] rank of each tree node in the selection order (score desc, then pool index asc); root -1.

    Equals the node's position in `select_tree`'s top-k, so the tree of budget
    m drawn from the same pool and scores is exactly the nodes of rank < m.
    """
    idx_BT = tree.pool_index_BT
    s_BT = jnp.take_along_axis(score_BN.astype(jnp.float32), jnp.maximum(idx_BT, 0), axis=1)
    node_BT = tree.valid_BT & (idx_BT >= 0)
    s_BT = jnp.where(node_BT, jnp.where(s_BT == 0.0, 0.0, s_BT), -jnp.inf)
    before_BTT = (s_BT[:, None, :] > s_BT[:, :, None]) | (
        (s_BT[:, None, :] == s_BT[:, :, None]) & (idx_BT[:, None, :] < idx_BT[:, :, None]))
    rank_BT = jnp.sum(before_BTT & node_BT[:, None, :], axis=-1, dtype=jnp.int32)
    return jnp.where(node_BT, rank_BT, -1)


def accepted_by_budget(rank_BT, path_BA, path_valid_BA, budgets: tuple[int, ...]) -> jax.Array:
    """[B, K] accepted length (root included) the round would have had with each budget's tree.

    Ranks grow along a path (a parent scores >= its child and has a lower pool
    index), so the nodes of rank < m on the accepted path are its first ones.
    """
    rank_BA = jnp.take_along_axis(rank_BT, path_BA, axis=1)[:, 1:]
    node_BA = path_valid_BA[:, 1:]
    cols = [1 + jnp.sum(node_BA & (rank_BA < m), axis=1, dtype=jnp.int32) for m in budgets]
    return jnp.stack(cols, axis=1)
