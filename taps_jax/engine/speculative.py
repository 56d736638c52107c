"""Speculative decoding: prefill + ONE `lax.while_loop` over draft/verify rounds.

One round, per sequence (all batched, static shapes, on device):
  draft (drafter on [bonus, MASK x H]) -> tree (policy: lattice, pool,
  q_cond, reach, select) -> verify (one target forward over the tree with an
  ancestor mask) -> sample the target at every node -> acceptance walk ->
  commit (gather accepted K/V, emit tokens, keep their tap features).
Every emitted token is a target sample given its exact prefix, so the output
follows the target's distribution at any temperature.

With `SpecConfig.adaptive` each round runs one of a few tree budgets, 0
being a plain AR step (`ar_round`), chosen per round from the loop's own
statistics (`taps_jax.engine.adaptive`); every branch is one of these exact
rounds, and the state is sized for the largest.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from taps_jax.engine import adaptive as adapt
from taps_jax.engine.ar import DecodeConfig, bounded_loop, running
from taps_jax.engine.prefill import RUNNING, cache_slots, prefill, stop_reason
from taps_jax.engine.refill import put_rows, stopped, until_finished
from taps_jax.engine.sampling import sample
from taps_jax.engine.static import merge
from taps_jax.models.cache import KVCache
from taps_jax.sharding import constrain_batch, constrain_kv_cache
from taps_jax.models.drafter import DrafterCache, draft_logits
from taps_jax.tree.accept import accept_walk
from taps_jax.tree.lookup import LookupConfig, lookup_draft
from taps_jax.tree.policies import TreeConfig, draft_tree
from taps_jax.tree.scorer import taps_log_qcond_fn
from taps_jax.tree.select import ancestor_mask


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of one speculative generate call."""

    decode: DecodeConfig
    tree: TreeConfig  # for adaptive: the largest branch's tree (its pool is every branch's)
    adaptive: adapt.AdaptiveConfig | None = None
    lookup: LookupConfig | None = None  # mix the text's earlier continuation into every draft


@flax.struct.dataclass
class SpecState:
    cache: KVCache  # target K/V; lengths = committed tokens
    dcache: DrafterCache  # drafter context K/V; lengths == cache.lengths after append
    ctx_taps_BAF: jax.Array  # [B, A, n_taps*D] tap features of last round's committed tokens
    ctx_count_B: jax.Array  # [B] how many of them are valid
    bonus_B: jax.Array  # [B] pending token: emitted, not yet processed by the target
    out_BN: jax.Array  # [B, N + A] emitted tokens (headroom for one full round)
    generated_B: jax.Array  # [B] tokens emitted so far
    finish_B: jax.Array  # [B] RUNNING, EOS, LENGTH, CAPACITY (-1: padded batch slot)
    rounds_B: jax.Array  # [B] rounds in which the sequence was running
    accepted_BR: jax.Array  # [B, R] accepted length (root included) of each round
    prompt_BP: jax.Array  # [B, P] int32 the prompts (the text signal and the lookup read prompt + output)
    prompt_len_B: jax.Array  # [B] int32
    key: jax.Array


def _merge(target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config):
    target = merge(target_graphdef, target_params)
    drafter = merge(drafter_graphdef, drafter_params)
    scorer = None
    if config.tree.policy == "taps":
        if scorer_graphdef is None or scorer_params is None:
            raise ValueError("Tree policy 'taps' needs a trained scorer: pass scorer_graphdef/scorer_params "
                             "(train one with `python -m train.scorer ...`) or use policy 'ddtree'.")
        scorer = merge(scorer_graphdef, scorer_params)
    return target, drafter, scorer


# SpecState's per-sequence fields besides the caches (what a refill replaces; `key` is shared).
ROW_FIELDS = ("ctx_taps_BAF", "ctx_count_B", "bonus_B", "out_BN", "generated_B", "finish_B", "rounds_B", "accepted_BR",
              "prompt_BP", "prompt_len_B")


def _pin(state: SpecState) -> SpecState:
    """Keep caches on (-, data, model, -, -) and per-sequence fields on data (no-op without a mesh)."""
    caches = dict(cache=constrain_kv_cache(state.cache), dcache=constrain_kv_cache(state.dcache))
    rest = {f: constrain_batch(getattr(state, f)) for f in ROW_FIELDS}
    return state.replace(**caches, **rest)


def _sizes(drafter, config: SpecConfig) -> tuple[int, int, int]:
    """(H drafted positions, T tree size, A accepted-path bound)."""
    H = drafter.config.block_size - 1
    T = config.tree.tree_size(H)
    return H, T, min(H + 1, T)


def prefill_both(target, drafter, prompt_BT, prompt_len_B, config: DecodeConfig, resume=None):
    """Chunked prefill of the target that feeds each chunk's tap features straight to the drafter's context.

    resume: (target cache, drafter cache, start): both hold the prompts' first `start` tokens already (the
    drafter's context absorbed up to there: `spec_extend`); only the rest is prefilled.

    Returns (logits [B, V] at each prompt's last token, target cache, drafter cache).
    """
    B, T = prompt_BT.shape
    if resume is None:
        cache, start = None, None
        dcache = DrafterCache.zeros(drafter.config, B, cache_slots(config.capacity, T, config.prefill_chunk))
    else:
        cache, dcache, start = resume
        dcache = dcache.replace(lengths_B=jnp.minimum(prompt_len_B.astype(jnp.int32), start))

    def absorb(dcache, taps_BCF, begin, count_B):
        return drafter.append_context(taps_BCF, count_B, dcache, begin)

    logits_BV, dcache, cache = prefill(
        target, prompt_BT, prompt_len_B, config.capacity, drafter.config.target_layer_ids,
        chunk=config.prefill_chunk, absorb=absorb, carry=dcache, cache=cache, start=start,
    )
    return logits_BV, cache, dcache


def init_state(target, drafter, prompt_BT, prompt_len_B, active_B, key, config: SpecConfig,
               resume=None) -> SpecState:
    """Prefill: the prompt fills the target cache and the drafter's context; sample the first token.
    resume: as `prefill_both`'s."""
    dc = config.decode
    B = prompt_BT.shape[0]
    N = dc.max_new_tokens
    _, T, A = _sizes(drafter, config)
    logits_BV, cache, dcache = prefill_both(target, drafter, prompt_BT, prompt_len_B, dc, resume)
    key, sub = jax.random.split(key)
    bonus_B = sample(logits_BV, sub, dc.sampling)
    generated_B = jnp.ones((B,), jnp.int32)
    finish_B = stop_reason(bonus_B, generated_B, cache.lengths_B + T, dc.eos_ids, N, dc.capacity)
    taps_F = len(drafter.config.target_layer_ids) * target.config.hidden_size
    return _pin(SpecState(
        cache=cache,
        dcache=dcache,
        ctx_taps_BAF=jnp.zeros((B, A, taps_F), target.config.jnp_dtype),
        ctx_count_B=jnp.zeros((B,), jnp.int32),
        bonus_B=bonus_B,
        out_BN=jnp.zeros((B, N + A), jnp.int32).at[:, 0].set(bonus_B),
        generated_B=generated_B,
        finish_B=jnp.where(active_B, finish_B, -1),
        rounds_B=jnp.zeros((B,), jnp.int32),
        accepted_BR=jnp.zeros((B, N), jnp.int32),
        prompt_BP=prompt_BT.astype(jnp.int32),
        prompt_len_B=prompt_len_B.astype(jnp.int32),
        key=key,
    ))


def draft_stage(target, drafter, s: SpecState, lookup: LookupConfig | None = None):
    """Add last round's context to the drafter cache, then one non-causal block pass (and, with `lookup`, the
    text's earlier continuation mixed in: `taps_jax.tree.lookup`).

    Returns (drafter cache, draft logits [B, H, V], drafter hidden [B, H, D]).
    """
    B = s.bonus_B.shape[0]
    Kb = drafter.config.block_size
    dcache = drafter.append_context(s.ctx_taps_BAF, s.ctx_count_B, s.dcache)
    mask_BH = jnp.full((B, Kb - 1), drafter.config.mask_token_id, jnp.int32)
    block_BK = jnp.concatenate([s.bonus_B[:, None], mask_BH], axis=1)
    block_pos_BK = s.cache.lengths_B[:, None] + jnp.arange(Kb, dtype=jnp.int32)
    draft_BHV, hidden_BHD = draft_logits(drafter, target, block_BK, block_pos_BK, dcache)
    if lookup is not None:
        draft_BHV = lookup_draft(lookup, draft_BHV, s.prompt_BP, s.prompt_len_B, s.out_BN, s.generated_B)
    return dcache, draft_BHV, hidden_BHD


def _select(tree_config: TreeConfig, target, scorer, draft_BHV, hidden_BHD, bonus_B):
    log_qcond_fn = None
    if tree_config.policy == "taps":
        embed_VD = target.embed_tokens.embedding.get_value()
        log_qcond_fn = taps_log_qcond_fn(scorer, hidden_BHD, embed_VD, bonus_B)
    return draft_tree(tree_config, draft_BHV, bonus_B, log_qcond_fn)


def select_stage(tree_config: TreeConfig, target, scorer, draft_BHV, hidden_BHD, bonus_B):
    """The policy picks T - 1 nodes (lattice, pool, q_cond, reach, select); the root is the bonus."""
    return _select(tree_config, target, scorer, draft_BHV, hidden_BHD, bonus_B)[0]


def _accept_emit(s: SpecState, tree, logits_BTV, config: SpecConfig, A_tree: int, T: int):
    """Sample the target at every node, walk the tree, emit the accepted tokens and the bonus.

    Returns (Acceptance, accepted path [B, A_tree], tokens to commit [B], the
    new per-sequence fields of the state except the caches and the context).
    """
    dc = config.decode
    B = s.bonus_B.shape[0]
    N = dc.max_new_tokens
    A = s.ctx_taps_BAF.shape[1]
    batch_B = jnp.arange(B)
    running_B = s.finish_B == RUNNING

    key, sub = jax.random.split(s.key)
    target_BT = sample(logits_BTV, sub, dc.sampling)
    acc = accept_walk(tree, target_BT, max_depth=A_tree - 1)
    a_B = acc.num_accepted_B

    # Emit: the accepted drafted tokens, then the new bonus; stop at EOS / length.
    path_BA = acc.path_BA[:, :A_tree]
    drafted_BA = jnp.take_along_axis(tree.tokens_BT, path_BA, axis=1)
    # emit[i] = token of path node i+1 for i < a-1, the bonus at i = a-1.
    next_BA = jnp.concatenate([drafted_BA[:, 1:], drafted_BA[:, -1:]], axis=1)
    emit_BA = jnp.where(jnp.arange(A_tree)[None] == (a_B - 1)[:, None], acc.bonus_token_B[:, None], next_BA)
    in_round_BA = jnp.arange(A_tree)[None] < a_B[:, None]
    is_eos_BA = jnp.isin(emit_BA, jnp.asarray(dc.eos_ids or (-1,), jnp.int32)) & in_round_BA
    hit_eos_B = jnp.any(is_eos_BA, axis=1)
    n_emit_B = jnp.where(hit_eos_B, jnp.argmax(is_eos_BA, axis=1) + 1, a_B)
    n_emit_B = jnp.minimum(n_emit_B, N - s.generated_B)
    n_emit_B = jnp.where(running_B, n_emit_B, 0)
    dest_BA = jnp.where(jnp.arange(A_tree)[None] < n_emit_B[:, None], s.generated_B[:, None] + jnp.arange(A_tree),
                        N + A)
    out_BN = s.out_BN.at[batch_B[:, None], dest_BA].set(emit_BA, mode="drop")
    generated_B = s.generated_B + n_emit_B

    commit_B = jnp.where(running_B, a_B, 0)
    last_B = out_BN[batch_B, jnp.maximum(generated_B - 1, 0)]
    # Headroom for the next round: the largest tree's T (an adaptive round may pick it).
    reason_B = stop_reason(last_B, generated_B, s.cache.lengths_B + commit_B + T, dc.eos_ids, N, dc.capacity)
    accepted_BR = s.accepted_BR.at[batch_B, jnp.where(running_B, s.rounds_B, N)].set(a_B, mode="drop")
    fields = dict(
        bonus_B=jnp.where(running_B, acc.bonus_token_B, s.bonus_B),
        out_BN=out_BN,
        generated_B=generated_B,
        finish_B=jnp.where(running_B, reason_B, s.finish_B),
        rounds_B=s.rounds_B + running_B,
        accepted_BR=accepted_BR,
        key=key,
    )
    return acc, path_BA, commit_B, fields


def verify_stage(target, drafter, s: SpecState, dcache, tree, config: SpecConfig):
    """Verify the tree in one target forward, accept, emit and commit.

    Returns (next state, the round's Acceptance: accepted path and bonus).
    """
    H, T, A = _sizes(drafter, config)
    A_tree = min(H + 1, tree.tokens_BT.shape[1])

    # Verify: one target forward over the tree (ancestor-only mask, positions len + depth).
    positions_BT = s.cache.lengths_B[:, None] + tree.depths_BT
    logits_BTV, taps_BTF, cache = target(
        tree.tokens_BT, positions_BT, ancestor_mask(tree), s.cache, drafter.config.target_layer_ids
    )
    acc, path_BA, commit_B, fields = _accept_emit(s, tree, logits_BTV, config, A_tree, T)

    # Commit: accepted K/V into [len, len + a); their taps feed the next draft.
    cache = cache.gather_commit(path_BA, commit_B)
    ctx_taps_BAF = jnp.take_along_axis(taps_BTF, path_BA[..., None], axis=1).astype(s.ctx_taps_BAF.dtype)
    next_state = s.replace(
        cache=cache,
        dcache=dcache,
        ctx_taps_BAF=jnp.pad(ctx_taps_BAF, ((0, 0), (0, A - A_tree), (0, 0))),
        ctx_count_B=commit_B,
        **fields,
    )
    return _pin(next_state), acc


def round_step(target, drafter, scorer, s: SpecState, config: SpecConfig) -> SpecState:
    """One speculative round: draft -> select -> verify/accept/commit."""
    dcache, draft_BHV, hidden_BHD = draft_stage(target, drafter, s, config.lookup)
    tree = select_stage(config.tree, target, scorer, draft_BHV, hidden_BHD, s.bonus_B)
    return verify_stage(target, drafter, s, dcache, tree, config)[0]


# Adaptive rounds. The chosen branch runs inside a `lax.while_loop` of zero or
# one trips (`run_if`), not a `lax.switch`: a loop body updates its carry in
# place, where a conditional branch that wrote a loop-carried cache would make
# XLA copy the whole cache every round. So every branch is the fixed policy's
# round, caches written in place, and an AR step is `ar_round`.


def run_if(pred, fn, carry):
    """`fn(carry)` if `pred` else `carry`, as a while loop of 0 or 1 trips (in place, unlike `lax.cond`)."""
    return jax.lax.while_loop(lambda c: c[1], lambda c: (fn(c[0]), jnp.zeros((), bool)), (carry, pred))[0]


def ar_round(target, drafter, s: SpecState, config: SpecConfig, slot) -> SpecState:
    """A plain AR step (one target token, no draft) that keeps the drafter's context whole.

    The new token's tap features go to slot `slot` of the pending queue
    (`ctx_taps_BAF`, which the next draft absorbs); `ar_run` does the per-round
    bookkeeping for its whole run. Same stop rules as a tree round (headroom
    for the largest tree).
    """
    B, A = s.ctx_taps_BAF.shape[:2]
    _, T, _ = _sizes(drafter, config)
    dc = config.decode
    N = dc.max_new_tokens
    running_B = s.finish_B == RUNNING
    logits_B1V, taps_B1F, cache = target(s.bonus_B[:, None], s.cache.lengths_B[:, None], jnp.ones((B, 1, 1), bool),
                                         s.cache, drafter.config.target_layer_ids)
    cache = cache.replace(lengths_B=cache.lengths_B + running_B)
    key, sub = jax.random.split(s.key)
    token_B = sample(logits_B1V[:, 0], sub, dc.sampling)
    out_BN = s.out_BN.at[jnp.arange(B), jnp.where(running_B, s.generated_B, N + A)].set(token_B, mode="drop")
    generated_B = s.generated_B + running_B
    reason_B = stop_reason(token_B, generated_B, cache.lengths_B + T, dc.eos_ids, N, dc.capacity)
    return _pin(s.replace(
        cache=cache,
        ctx_taps_BAF=jax.lax.dynamic_update_slice(s.ctx_taps_BAF, taps_B1F.astype(s.ctx_taps_BAF.dtype), (0, slot, 0)),
        bonus_B=jnp.where(running_B, token_B, s.bonus_B),
        out_BN=out_BN,
        generated_B=generated_B,
        finish_B=jnp.where(running_B, reason_B, s.finish_B),
        key=key,
    ))


def absorb_context(drafter, s: SpecState) -> SpecState:
    """Move the pending tap features into the drafter's context cache (what a draft does first)."""
    dcache = drafter.append_context(s.ctx_taps_BAF, s.ctx_count_B, s.dcache)
    return _pin(s.replace(dcache=dcache, ctx_count_B=jnp.zeros_like(s.ctx_count_B)))


def tree_round(target, drafter, scorer, s: SpecState, config: SpecConfig, budget: int):
    """A speculative round with a tree of `budget` nodes drawn from the largest tree's pool.

    Also returns [B, K]: what each budget <= this one would have accepted
    from the same draft and target samples (`adaptive.accepted_by_budget`).
    """
    dcache, draft_BHV, hidden_BHD = draft_stage(target, drafter, s, config.lookup)
    tree, aux = _select(dataclasses.replace(config.tree, budget=budget), target, scorer, draft_BHV, hidden_BHD,
                        s.bonus_B)
    s, acc = verify_stage(target, drafter, s, dcache, tree, config)
    accepted_BK = adapt.accepted_by_budget(adapt.tree_ranks(tree, aux.log_reach_BN), acc.path_BA,
                                           acc.path_valid_BA, config.adaptive.budgets)
    return s, accepted_BK


SIGNAL_EVERY = 4  # AR steps between reads of the text signal inside an AR run


def ar_run(target, drafter, carry, costs_K, config: SpecConfig, force, limit, need=None):
    """Consecutive AR rounds (branch 0), as many as the per-round choice would make in a row.

    While branch 0 is chosen, an AR round changes no estimate, only the cost
    spent, the text (so the signal) and which sequences run; so the run goes
    on until the signal (read every SIGNAL_EVERY steps) makes another branch
    the best, a probe is due (spent >= wait), every sequence stops, `need`
    rows are stopped (a refill is due) or `limit` rounds. The pending tap
    queue holds A steps: when it is full the run hands it to the drafter's
    context and goes on (a run of a forced AR branch, the calibration's, is
    A steps). The choice and the statistics are paid once per run, not per
    step: a sequence's AR rounds are the tokens it emitted in the run.
    """
    ac = config.adaptive
    s, st = carry
    A = s.ctx_taps_BAF.shape[1]
    N = s.accepted_BR.shape[1]
    R = st.branch_R.shape[0]
    s = absorb_context(drafter, s)  # step i's tap features go to slot i % A of every row
    generated0_B = s.generated_B
    # AR rounds until a probe is due (a call emits at most N tokens, so at most N rounds; wait may be inf).
    due = jnp.ceil(jnp.clip((st.wait - st.spent) / costs_K[0], 1, N)).astype(jnp.int32)
    steps = jnp.where(force == 0, A, jnp.where(force < 0, due, 1))
    steps = jnp.minimum(1 if ac.force_cycle else steps, limit - st.round)

    def stay(i, s):  # the text's signal still makes the AR step the best branch (always, when forced)
        def best_is_ar(_):
            q_B = adapt.signal_buckets(s.prompt_BP, s.prompt_len_B, s.out_BN, s.generated_B, ac)
            return adapt.best_branch(st, q_B, s.finish_B == RUNNING, costs_K) == 0

        # Read every SIGNAL_EVERY steps: its few dozen small ops cost ~5% of a small model's AR step.
        return run_if((force < 0) & (i % SIGNAL_EVERY == 0) & (i > 0), best_is_ar, jnp.ones((), bool))

    def step(c):
        s, i, absorbed_B = c

        def absorb(c):  # the queue is full: its A steps go to the drafter's context, in place
            s, absorbed_B = c
            s = absorb_context(drafter, s.replace(ctx_count_B=s.generated_B - absorbed_B))
            return s, s.generated_B

        s, absorbed_B = run_if((i % A == 0) & (i > 0), absorb, (s, absorbed_B))
        return ar_round(target, drafter, s, config, i % A), i + 1, absorbed_B

    def go(c):
        more = (c[1] < steps) & running(c[0])
        return (more if need is None else more & (stopped(c[0]) < need)) & stay(c[1], c[0])

    s, ran, absorbed_B = jax.lax.while_loop(go, step, (s, jnp.int32(0), generated0_B))
    ran_B = s.generated_B - generated0_B  # one token per round while running
    r_BN = jnp.arange(N)[None] - s.rounds_B[:, None]
    r_R = jnp.arange(R) - st.round
    s = s.replace(ctx_count_B=s.generated_B - absorbed_B, rounds_B=s.rounds_B + ran_B,
                  accepted_BR=jnp.where((r_BN >= 0) & (r_BN < ran_B[:, None]), 1, s.accepted_BR))
    st = st.replace(spent=st.spent + ran.astype(jnp.float32) * costs_K[0], round=st.round + ran,
                    branch_R=jnp.where((r_R >= 0) & (r_R < ran), 0, st.branch_R))
    return _pin(s), st


def adaptive_loop(target, drafter, scorer, carry, costs_K, config: SpecConfig, force, limit, need=None):
    """The loop of the adaptive policy: per round, choose a branch, run it, update the statistics.

    carry: (SpecState, AdaptiveState); runs while a sequence runs and the
    round count is below `limit`. force >= 0: run that branch every round
    (data, for the calibration: `taps_jax.engine.calibrate`). A choice of
    branch 0 runs AR rounds until the choice could change (`ar_run`). need:
    also stop once that many rows are stopped (continuous batching,
    `taps_jax.engine.refill`; None: never).
    """
    ac = config.adaptive

    def body(carry):
        s, st = carry
        running_B = s.finish_B == RUNNING
        q_B = adapt.signal_buckets(s.prompt_BP, s.prompt_len_B, s.out_BN, s.generated_B, ac)
        k, probe = adapt.choose(st, q_B, running_B, costs_K, ac)
        k = jnp.where(force >= 0, force, k)
        carry = run_if(k == 0, lambda c: ar_run(target, drafter, c, costs_K, config, force, limit, need), carry)
        for i, budget in enumerate(ac.budgets[1:], start=1):
            def branch(c, i=i, budget=budget):
                s, accepted_BK = tree_round(target, drafter, scorer, c[0], config, budget)
                return s, adapt.update(c[1], i, probe, accepted_BK, running_B, q_B, costs_K, ac)
            carry = run_if(k == i, branch, carry)
        return carry

    def go(c):
        more = running(c[0]) & (c[1].round < limit)
        return more if need is None else more & (stopped(c[0]) < need)

    return jax.lax.while_loop(go, body, carry)


# The loop carry: SpecState for a fixed policy, (SpecState, AdaptiveState)
# for the adaptive one. `spec_generate` runs prefill + the whole loop; for
# streaming, `spec_start` (prefill) and `spec_advance` (at most `rounds` more
# rounds) run the same prefill and loop body in pieces.


def start_carry(target, drafter, prompt_BT, prompt_len_B, active_B, key, config: SpecConfig, costs_K, prior,
                clock, resume=None):
    state = init_state(target, drafter, prompt_BT, prompt_len_B, active_B, key, config, resume)
    if config.adaptive is None:
        return state
    st = adapt.AdaptiveState.init(config.decode.max_new_tokens, config.adaptive, prior,
                                  jnp.asarray(costs_K, jnp.float32), clock)
    return state, st


def _round_limit(max_rounds, config: SpecConfig):
    return jnp.asarray(config.decode.max_new_tokens if max_rounds is None else max_rounds, jnp.int32)


def spec_outputs(carry, config: SpecConfig):
    """(tokens [B, N], generated [B], finish [B], rounds [B], accepted [B, R], branch [R], estimates [2, Q, K],
    clock [3]); the last three adaptive only (else -1s and empty)."""
    N = config.decode.max_new_tokens
    if config.adaptive is None:
        state, branch_R = carry, jnp.full((N,), -1, jnp.int32)
        est_K = clock_3 = jnp.zeros((0,), jnp.float32)
    else:
        state, st = carry
        branch_R, est_K, clock_3 = st.branch_R, adapt.estimates(st), adapt.clock(st)
    return (state.out_BN[:, :N], state.generated_B, state.finish_B, state.rounds_B, state.accepted_BR, branch_R,
            est_K, clock_3)


_STATIC = ("target_graphdef", "drafter_graphdef", "config", "scorer_graphdef")


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_generate(
    target_graphdef, target_params, drafter_graphdef, drafter_params,
    prompt_BT, prompt_len_B, active_B, key, *, config: SpecConfig,
    scorer_graphdef=None, scorer_params=None, costs_K=None, force=-1, max_rounds=None, prior=None, clock=None,
):
    """Returns (tokens [B, N], generated [B], finish [B], rounds [B], accepted [B, R], branch [R], estimates, clock).

    scorer_graphdef/scorer_params: the TAPS scorer (`nnx.split` of a
    `taps_jax.tree.scorer.Scorer`), required by policy "taps" (and adaptive
    TAPS trees), None otherwise. costs_K: adaptive only, the cost of one round
    of each branch (any unit; an array, so new costs do not recompile).
    branch: adaptive only, the branch index of each round (-1 after the last).
    force, max_rounds: adaptive only, for the cost calibration (one branch
    every round, at most that many rounds); data, so no new program.
    prior / estimates: adaptive only, [2, Q, K] sums and counts of accepted
    lengths per signal bucket and branch that the loop starts from (zeros:
    none) / ends with (the next call's prior; `taps_jax.engine.adaptive`).
    clock: adaptive only, [3] (spent, wait, backoff) of the probe schedule the
    loop starts from (None: a decoder's first call) / ends with.
    """
    target, drafter, scorer = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    carry = start_carry(target, drafter, prompt_BT, prompt_len_B, active_B, key, config, costs_K, prior, clock)
    if config.adaptive is None:
        carry = jax.lax.while_loop(running, lambda s: round_step(target, drafter, scorer, s, config), carry)
    else:
        carry = adaptive_loop(target, drafter, scorer, carry, jnp.asarray(costs_K, jnp.float32), config,
                              jnp.asarray(force, jnp.int32), _round_limit(max_rounds, config))
    return spec_outputs(carry, config)


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_start(
    target_graphdef, target_params, drafter_graphdef, drafter_params,
    prompt_BT, prompt_len_B, active_B, key, *, config: SpecConfig,
    scorer_graphdef=None, scorer_params=None, costs_K=None, force=-1, max_rounds=None, prior=None, clock=None,
):
    """`spec_generate`'s prefill: the loop carry before the first round."""
    target, drafter, _ = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    return start_carry(target, drafter, prompt_BT, prompt_len_B, active_B, key, config, costs_K, prior, clock)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("carry",))
def spec_advance(
    target_graphdef, target_params, drafter_graphdef, drafter_params, carry, rounds, *, config: SpecConfig,
    scorer_graphdef=None, scorer_params=None, costs_K=None, force=-1, max_rounds=None, prior=None, clock=None,
):
    """At most `rounds` more rounds of `spec_generate`'s loop (same body, same order)."""
    target, drafter, scorer = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    if config.adaptive is None:
        return bounded_loop(lambda s: round_step(target, drafter, scorer, s, config), carry, rounds)
    limit = jnp.minimum(carry[1].round + rounds, _round_limit(max_rounds, config))
    return adaptive_loop(target, drafter, scorer, carry, jnp.asarray(costs_K, jnp.float32), config,
                         jnp.asarray(force, jnp.int32), limit)


# Continuous batching (`taps_jax.engine.refill`): run until `need` rows are stopped, then refill K rows. The
# adaptive statistics and probe clock are the batch's, so they run on across refills (one branch per round for
# the whole batch: every row shares the round's forward).


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("carry",))
def spec_until(
    target_graphdef, target_params, drafter_graphdef, drafter_params, carry, need, rounds, *, config: SpecConfig,
    scorer_graphdef=None, scorer_params=None, costs_K=None, force=-1, max_rounds=None, prior=None, clock=None,
):
    """`spec_advance` that also stops once `need` rows are stopped (finished or padding)."""
    target, drafter, scorer = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    if config.adaptive is None:
        return until_finished(lambda s: round_step(target, drafter, scorer, s, config), carry, need, rounds)
    limit = jnp.minimum(carry[1].round + rounds, _round_limit(max_rounds, config))
    return adaptive_loop(target, drafter, scorer, carry, jnp.asarray(costs_K, jnp.float32), config,
                         jnp.asarray(force, jnp.int32), limit, need)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("carry",))
def spec_refill(
    target_graphdef, target_params, drafter_graphdef, drafter_params, carry, prompt_KT, prompt_len_K, rows_K, *,
    config: SpecConfig, scorer_graphdef=None, scorer_params=None, costs_K=None, force=-1, max_rounds=None,
    prior=None, clock=None,
):
    """Prefill K new prompts into rows `rows_K` (an index >= B: a padding entry, dropped); other rows untouched.
    prompt_KT may be narrower than the run's prompt buffer (not its cache slots: `calls.Refilled`).

    A refilled row is exactly `init_state`'s row for its prompt: target cache, drafter context, first token,
    pending taps (none) and counters; a neighbour mid-way through its rounds keeps all of its own.
    """
    target, drafter, _ = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    state = carry if config.adaptive is None else carry[0]
    B = state.bonus_B.shape[0]
    key, sub = jax.random.split(state.key)
    part = init_state(target, drafter, prompt_KT, prompt_len_K, rows_K < B, sub, config)
    P = state.prompt_BP.shape[1]  # a refill's prompt buffer may be narrower than the run's (short prompts)
    part = part.replace(prompt_BP=jnp.pad(part.prompt_BP, ((0, 0), (0, P - part.prompt_BP.shape[1]))))
    state = _pin(put_rows(state, part, rows_K, ROW_FIELDS, ("cache", "dcache")).replace(key=key))
    return state if config.adaptive is None else (state, carry[1])


# A conversation that goes on (`taps_jax.session`): the next turn's prompt reuses the caches of the last one.


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("carry",))
def spec_extend(
    target_graphdef, target_params, drafter_graphdef, drafter_params, carry, prompt_BT, prompt_len_B, start, *,
    config: SpecConfig, scorer_graphdef=None, scorer_params=None, costs_K=None, force=-1, max_rounds=None,
    prior=None, clock=None,
):
    """`spec_start` for prompts whose first `start` tokens (a traced scalar) already sit in `carry`'s caches.

    The pending tap features go to the drafter's context first, so both caches hold every committed token; then
    only tokens [start, prompt_len) are prefilled into both, and the state is `init_state`'s (first token, no
    pending taps, fresh counters; the key goes on from the carry's). Adaptive: the statistics start again from
    `prior` and `clock`, as a new call's (the decoder keeps the last turn's). Rows with prompt_len 0 are padding.
    """
    target, drafter, _ = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    state = absorb_context(drafter, carry if config.adaptive is None else carry[0])
    key, sub = jax.random.split(state.key)
    new = start_carry(target, drafter, prompt_BT, prompt_len_B, prompt_len_B > 0, sub, config, costs_K, prior, clock,
                      (state.cache, state.dcache, start))
    return new.replace(key=key) if config.adaptive is None else (new[0].replace(key=key), new[1])
