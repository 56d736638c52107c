"""Adaptive tree size: each round picks one of a few static budgets, down to a plain AR step.

Speculation pays only when a round's expected accepted length beats its cost
in AR steps, and that break-even moves with the hardware, the batch, the
temperature and the text. The adaptive policy compiles a small static set of
budgets (0 = one plain target step, no draft) as branches of the one
generate loop (`taps_jax.engine.speculative.adaptive_loop`); every branch is
an exact round, so the choice never changes what is sampled, only how fast.

Choice (one branch per round for the whole batch): maximise expected tokens
per unit cost. Cost = a per-branch vector (`taps_jax.engine.calibrate`
measures it once per device kind and shape). Expected tokens of branch k =
sum over running sequences of E[accepted length | the sequence's signal,
budget k], where the signal is read every round from the committed text at
no model cost: the length of the longest suffix of prompt + output that
occurred earlier in it (the prompt-lookup signal, capped at
`match_buckets - 1`; repeated text is where drafts are accepted). The table
E[bucket, budget] is a decayed mean of observed accepted lengths per
(bucket, budget), started from a prior: a table fitted on traces
(`train.adaptive_table`, shipped as a model set's adaptive.json) or the
previous call's table. A bucket with no observation of a budget falls back
to that budget's mean over all buckets.

Trees of one pool are nested (the top-m of a ranking is a prefix of its
top-M), so a round of budget M also tells what every smaller budget would
have accepted from the same draft and target samples: the accepted path's
nodes ranked below m. Larger budgets are re-measured by probing the largest
branch once the cost spent since its last run exceeds cost_max /
probe_fraction (so probing costs at most about that fraction), the wait
doubling each time a probe leaves the choice unchanged; with `carry_clock`
that clock carries from call to call like the table (`clock`), so short
calls probe at the pace of a decoder's life. Without any prior the first
round probes it. An AR choice runs AR steps until the signal changes the
choice or a probe is due (`speculative.ar_run`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from taps_jax.tree.lookup import committed_text, match_lengths
from taps_jax.tree.select import Tree


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
    """Static settings of the adaptive policy (hashable: part of the jit-static SpecConfig).

    budgets: increasing, 0 first (the AR step); the last is the tree budget
      the state and cache headroom are sized for.
    alpha: weight of the newest observation in a (bucket, budget) mean once
      it has 1 / alpha observations (a decayed mean); 0: a plain mean (fitting).
    probe_fraction: target share of the cost spent probing the largest branch.
    max_backoff: the probe wait doubles at most this many times.
    match_buckets: signal buckets: suffix-match lengths 0 .. match_buckets - 1
      (the last bucket: that long or longer); 1 turns the signal off.
    prior_weight: a fitted prior counts as at most this many observations per
      (bucket, budget), so the call's own rounds soon outweigh it.
    carry_clock: the probe schedule runs over a decoder's life (each call
      resumes the previous one's clock, `clock`) instead of restarting with
      every call. Off by default: measured on the 2-core CPU (2026-12-02) it
      paid in one setting and cost in two (docs/benchmarks.md).
    force_cycle: test hook, every branch in turn (largest first, down to the AR step).
    """

    budgets: tuple[int, ...]
    alpha: float = 0.25
    probe_fraction: float = 0.05
    max_backoff: int = 4
    match_buckets: int = 9
    prior_weight: float = 4.0
    carry_clock: bool = False
    force_cycle: bool = False

    @classmethod
    def for_budget(cls, budget: int, **kw) -> AdaptiveConfig:
        """0 (AR) plus budget, budget/2, budget/4, budget/8 (those >= 1)."""
        return cls(tuple(sorted({0} | {budget >> i for i in range(4) if budget >> i >= 1})), **kw)

    def validate(self) -> None:
        b = self.budgets
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"adaptive budgets must start with 0 (the AR step) and increase, got {b!r}")
        if not 0 <= self.alpha <= 1 or not 0 < self.probe_fraction <= 1:
            raise ValueError(f"adaptive alpha must be in [0, 1] and probe_fraction in (0, 1], got {self.alpha}, "
                             f"{self.probe_fraction}")
        if self.match_buckets < 1 or not self.prior_weight > 0:
            raise ValueError(f"adaptive match_buckets must be >= 1 and prior_weight > 0, got {self.match_buckets}, "
                             f"{self.prior_weight}")

    def empty_prior(self):
        """A prior of no observations, [2, Q, K] (sums, counts): what `estimates` returns, as numpy."""
        return np.zeros((2, self.match_buckets, len(self.budgets)), np.float32)


def every_tree_seen(count_QK) -> jax.Array:
    """Whether every tree branch has an observation in some bucket (else the first round probes)."""
    return jnp.all(jnp.sum(count_QK, axis=0)[1:] > 0)


@flax.struct.dataclass
class AdaptiveState:
    sum_QK: jax.Array  # [Q, K] f32 decayed sum of accepted lengths (root included) per signal bucket and branch
    count_QK: jax.Array  # [Q, K] f32 decayed number of those observations
    spent: jax.Array  # f32 cost spent since the largest branch last ran
    wait: jax.Array  # f32 cost to spend before the next probe
    backoff: jax.Array  # int32 probes in a row that left the choice unchanged
    round: jax.Array  # int32 rounds so far
    branch_R: jax.Array  # [R] int32 branch index of each round (-1: none)

    @classmethod
    def init(cls, rounds: int, config: AdaptiveConfig, prior=None, costs_K=None, clock=None) -> AdaptiveState:
        """prior: [2, Q, K] (sums, counts) to start from (e.g. a fitted table or the previous call's); None: none.

        clock: [3] (spent, wait, backoff) of the probe schedule, carried from
        the previous call (`clock`) so that the probes keep their pace over a
        decoder's life, not restarting with each call; None: `start_clock`.
        """
        Q, K = config.match_buckets, len(config.budgets)
        prior = jnp.zeros((2, Q, K), jnp.float32) if prior is None else jnp.asarray(prior, jnp.float32)
        # The prior counts as at most prior_weight observations per cell (its mean kept).
        scale_QK = jnp.minimum(1.0, config.prior_weight / jnp.maximum(prior[1], 1e-9))
        count_QK = (prior[1] * scale_QK).at[:, 0].set(0.0)
        sum_QK = (prior[0] * scale_QK).at[:, 0].set(0.0)
        clock = start_clock(config, prior, costs_K) if clock is None else jnp.asarray(clock, jnp.float32)
        return cls(
            sum_QK=sum_QK,
            count_QK=count_QK,
            spent=clock[0],
            wait=clock[1],
            backoff=clock[2].astype(jnp.int32),
            round=jnp.zeros((), jnp.int32),
            branch_R=jnp.full((rounds,), -1, jnp.int32),
        )


def start_clock(config: AdaptiveConfig, prior=None, costs_K=None) -> jax.Array:
    """[3] (spent, wait, backoff) of a decoder's first call: with every tree branch estimated by the prior the
    first probe waits a full period (cost_max / probe_fraction); else (or without costs) round 0 probes."""
    known = prior is not None and costs_K is not None
    wait = jnp.where(every_tree_seen(jnp.asarray(prior, jnp.float32)[1]), costs_K[-1] / config.probe_fraction,
                     0.0) if known else 0.0
    return jnp.stack([jnp.float32(0.0), jnp.asarray(wait, jnp.float32), jnp.float32(0.0)])


def clock(st: AdaptiveState) -> jax.Array:
    """[3] (spent, wait, backoff) at the end of a call: where the next call's probe schedule resumes."""
    return jnp.stack([st.spent, st.wait, st.backoff.astype(jnp.float32)])


# ----------------------------------------------------------------------------- the signal


def signal_buckets(prompt_BP, prompt_len_B, out_BN, generated_B, config: AdaptiveConfig) -> jax.Array:
    """[B] int32 signal bucket of each sequence: its suffix-match length over prompt + output, capped."""
    if config.match_buckets == 1:
        return jnp.zeros(generated_B.shape, jnp.int32)
    text_BS = committed_text(prompt_BP, prompt_len_B, out_BN)
    return match_lengths(text_BS, prompt_len_B + generated_B, config.match_buckets - 1)


# ----------------------------------------------------------------------------- estimates and the choice


def expected_BK(st: AdaptiveState, q_B) -> jax.Array:
    """[B, K] expected accepted length of each branch for each sequence's bucket (NaN: no estimate; AR: 1)."""
    overall_K = jnp.sum(st.sum_QK, axis=0) / jnp.sum(st.count_QK, axis=0)  # NaN where never seen
    count_BK, sum_BK = st.count_QK[q_B], st.sum_QK[q_B]
    e_BK = jnp.where(count_BK > 0, sum_BK / jnp.maximum(count_BK, 1e-9), overall_K[None])
    return e_BK.at[:, 0].set(1.0)  # an AR step emits exactly one token


def best_branch(st: AdaptiveState, q_B, running_B, costs_K) -> jax.Array:
    """argmax_k (sum of running sequences' expected tokens) / cost_k; ties go to the cheaper (lower) branch."""
    e_BK = expected_BK(st, q_B)
    seen_K = ~jnp.any(jnp.isnan(e_BK), axis=0)
    tokens_K = jnp.sum(jnp.where(running_B[:, None], jnp.nan_to_num(e_BK), 0.0), axis=0)
    value_K = jnp.where(seen_K, tokens_K / costs_K, -jnp.inf)
    return jnp.argmax(value_K).astype(jnp.int32)


def choose(st: AdaptiveState, q_B, running_B, costs_K, config: AdaptiveConfig) -> tuple[jax.Array, jax.Array]:
    """(branch index, whether it is a probe of the largest branch)."""
    K = len(config.budgets)
    if config.force_cycle:  # largest first, then each smaller one down to the AR step, and again
        k = (K - 1 - st.round % K).astype(jnp.int32)
        return k, k == K - 1
    unseen = ~every_tree_seen(st.count_QK)
    probe = ((st.round == 0) & unseen) | (st.spent >= st.wait)
    return jnp.where(probe, K - 1, best_branch(st, q_B, running_B, costs_K)), probe


def trees_never_pay(prior, costs_K, config: AdaptiveConfig) -> bool:
    """Whether a call starting from `prior` can run a tree only as a probe, whatever its text says.

    True when every branch has an estimate (no first-round probe) and in no
    signal bucket does any tree's expected accepted length per cost beat an
    AR step's one token per cost: AR rounds change no estimate, so the choice
    can never move. With no probe due within the call (`probe_due`) every
    round is an AR step, and the decoder runs the AR program itself, which
    carries no drafter context or tap queue (on a CPU at batch 8, where a
    tree round costs 6 to 12 AR steps, that is the whole call).
    """
    if config.force_cycle:
        return False
    costs_K = jnp.asarray(costs_K, jnp.float32)
    st = AdaptiveState.init(1, config, prior, costs_K)
    if not bool(every_tree_seen(st.count_QK)):
        return False
    e_QK = expected_BK(st, jnp.arange(config.match_buckets))
    return bool(jnp.all(e_QK[:, 1:] / costs_K[1:] <= 1.0 / costs_K[0]))


def probe_due(clock, costs_K, max_new_tokens: int) -> bool:
    """Whether a call starting at `clock` could reach its probe: its spent cost plus at most max_new_tokens AR
    steps reaches the wait (host floats: no device work)."""
    spent, wait = float(clock[0]), float(clock[1])
    return spent + max_new_tokens * float(costs_K[0]) >= wait


def after_ar_steps(clock, costs_K, steps: int) -> np.ndarray:
    """[3] the clock after `steps` AR rounds run outside the adaptive program (they add to the cost spent)."""
    out = np.array(clock, np.float32)
    out[0] += steps * float(costs_K[0])
    return out


def update(st: AdaptiveState, k, probe, accepted_BK, running_B, q_B, costs_K, config: AdaptiveConfig) -> AdaptiveState:
    """Fold one round into the statistics.

    accepted_BK: what each branch j <= k would have accepted this round (the
    branch that ran and the smaller ones; columns j > k are ignored), for
    sequences in signal buckets q_B.
    """
    K, Q = len(config.budgets), config.match_buckets
    before = best_branch(st, q_B, running_B, costs_K)
    seen = every_tree_seen(st.count_QK)  # else this is the first probe: it had no choice to confirm
    w_BQ = (jax.nn.one_hot(q_B, Q, dtype=jnp.float32) * running_B[:, None])
    fresh_K = (jnp.arange(K) <= k) & (jnp.arange(K) > 0)
    obs_QK = w_BQ.T @ accepted_BK.astype(jnp.float32)
    n_Q = jnp.sum(w_BQ, axis=0)
    hit_QK = (n_Q[:, None] > 0) & fresh_K[None]
    keep = 1.0 - config.alpha
    st = st.replace(sum_QK=jnp.where(hit_QK, keep * st.sum_QK + obs_QK, st.sum_QK),
                    count_QK=jnp.where(hit_QK, keep * st.count_QK + n_Q[:, None], st.count_QK))
    # After a probe: wait (cost_max / fraction) * 2^backoff, backing off while probes change nothing.
    after = best_branch(st, q_B, running_B, costs_K)
    largest = k == K - 1
    confirmed = probe & seen & (before != K - 1) & (after == before)
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


def estimates(st: AdaptiveState) -> jax.Array:
    """[2, Q, K] (sums, counts) of the observations: the next call's prior (or, fitted, a model set's table)."""
    return jnp.stack([st.sum_QK, st.count_QK])


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


# ----------------------------------------------------------------------------- fitted tables


TABLE_FILE = "adaptive.json"  # in a model set's directory


@dataclasses.dataclass(frozen=True)
class AdaptiveTable:
    """Accepted-length statistics per signal bucket and budget, fitted on traces (`train.adaptive_table`).

    A model set's adaptive.json: what its drafter accepts from its target, not
    what a round costs (that is the device's: `taps_jax.engine.calibrate`).
    sums/counts: {"greedy" | "sampled": [Q][len(budgets)] lists}, the
    observations of forced largest-budget rounds (every smaller budget's
    accepted length comes from the same rounds).
    """

    budgets: tuple[int, ...]
    match_buckets: int
    sums: dict
    counts: dict
    meta: dict = dataclasses.field(default_factory=dict, compare=False)

    def prior(self, config: AdaptiveConfig, greedy: bool) -> np.ndarray:
        """[2, Q, K] prior for `config`'s budgets (a budget the table lacks: no observations)."""
        out = config.empty_prior()
        kind = "greedy" if greedy else "sampled"
        if kind not in self.sums or self.match_buckets != config.match_buckets:
            return out
        sums, counts = np.asarray(self.sums[kind], np.float32), np.asarray(self.counts[kind], np.float32)
        for k, b in enumerate(config.budgets):
            if k and b in self.budgets:
                j = self.budgets.index(b)
                out[0, :, k], out[1, :, k] = sums[:, j], counts[:, j]
        return out

    def means(self, kind: str) -> np.ndarray:
        """[Q, len(budgets)] mean accepted length (NaN: no observation), for reports."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(self.sums[kind], np.float64) / np.asarray(self.counts[kind], np.float64)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"budgets": list(self.budgets), "match_buckets": self.match_buckets,
                                          "sums": self.sums, "counts": self.counts, "meta": self.meta}, indent=1))

    @classmethod
    def of_set(cls, directory) -> AdaptiveTable | None:
        """A model set directory's adaptive.json, or None when it has none."""
        path = Path(directory) / TABLE_FILE
        return cls.load(path) if path.is_file() else None

    @classmethod
    def load(cls, path) -> AdaptiveTable:
        """Read adaptive.json; a malformed file is a ValueError naming it."""
        try:
            raw = json.loads(Path(path).read_text())
            table = cls(tuple(int(b) for b in raw["budgets"]), int(raw["match_buckets"]), dict(raw["sums"]),
                        dict(raw["counts"]), dict(raw.get("meta", {})))
            for kind in table.sums:
                shape = (table.match_buckets, len(table.budgets))
                if np.shape(table.sums[kind]) != shape or np.shape(table.counts[kind]) != shape:
                    raise ValueError(f"{kind} tables are not {shape[0]} x {shape[1]}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not an adaptive table ({e}); refit it with python -m train.adaptive_table")
        return table
