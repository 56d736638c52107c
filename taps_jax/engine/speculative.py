"""Speculative decoding: prefill + ONE `lax.while_loop` over draft/verify rounds.

One round, per sequence (all batched, static shapes, on device):
  draft (drafter on [bonus, MASK x H]) -> tree (policy: lattice, pool,
  q_cond, reach, select) -> verify (one target forward over the tree with an
  ancestor mask) -> sample the target at every node -> acceptance walk ->
  commit (gather accepted K/V, emit tokens, keep their tap features).
Every emitted token is a target sample given its exact prefix, so the output
follows the target's distribution at any temperature.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from taps_jax.engine.ar import DecodeConfig, bounded_loop, running
from taps_jax.engine.prefill import RUNNING, cache_slots, prefill, stop_reason
from taps_jax.engine.sampling import sample
from taps_jax.models.cache import KVCache
from taps_jax.sharding import constrain_batch, constrain_kv_cache
from taps_jax.models.drafter import DrafterCache, draft_logits
from taps_jax.tree.accept import accept_walk
from taps_jax.tree.policies import TreeConfig, draft_tree
from taps_jax.tree.scorer import taps_log_qcond_fn
from taps_jax.tree.select import ancestor_mask


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of one speculative generate call."""

    decode: DecodeConfig
    tree: TreeConfig


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
    key: jax.Array


def _merge(target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config):
    target = nnx.merge(target_graphdef, target_params)
    drafter = nnx.merge(drafter_graphdef, drafter_params)
    scorer = None
    if config.tree.policy == "taps":
        if scorer_graphdef is None or scorer_params is None:
            raise ValueError("Tree policy 'taps' needs a trained scorer: pass scorer_graphdef/scorer_params "
                             "(train one with `python -m train.scorer ...`) or use policy 'ddtree'.")
        scorer = nnx.merge(scorer_graphdef, scorer_params)
    return target, drafter, scorer


def _pin(state: SpecState) -> SpecState:
    """Keep caches on (-, data, model, -, -) and per-sequence fields on data (no-op without a mesh)."""
    caches = dict(cache=constrain_kv_cache(state.cache), dcache=constrain_kv_cache(state.dcache))
    rest = {f: constrain_batch(getattr(state, f)) for f in
            ("ctx_taps_BAF", "ctx_count_B", "bonus_B", "out_BN", "generated_B", "finish_B", "rounds_B", "accepted_BR")}
    return state.replace(**caches, **rest)


def _sizes(drafter, config: SpecConfig) -> tuple[int, int, int]:
    """(H drafted positions, T tree size, A accepted-path bound)."""
    H = drafter.config.block_size - 1
    T = config.tree.tree_size(H)
    return H, T, min(H + 1, T)


def prefill_both(target, drafter, prompt_BT, prompt_len_B, config: DecodeConfig):
    """Chunked prefill of the target that feeds each chunk's tap features straight to the drafter's context.

    Returns (logits [B, V] at each prompt's last token, target cache, drafter cache).
    """
    B, T = prompt_BT.shape
    slots = cache_slots(config.capacity, T, config.prefill_chunk)

    def absorb(dcache, taps_BCF, start, count_B):
        return drafter.append_context(taps_BCF, count_B, dcache, start)

    logits_BV, dcache, cache = prefill(
        target, prompt_BT, prompt_len_B, config.capacity, drafter.config.target_layer_ids,
        chunk=config.prefill_chunk, absorb=absorb, carry=DrafterCache.zeros(drafter.config, B, slots),
    )
    return logits_BV, cache, dcache


def init_state(target, drafter, prompt_BT, prompt_len_B, active_B, key, config: SpecConfig) -> SpecState:
    """Prefill: the prompt fills the target cache and the drafter's context; sample the first token."""
    dc = config.decode
    B = prompt_BT.shape[0]
    N = dc.max_new_tokens
    _, T, A = _sizes(drafter, config)
    logits_BV, cache, dcache = prefill_both(target, drafter, prompt_BT, prompt_len_B, dc)
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
        key=key,
    ))


def draft_stage(target, drafter, s: SpecState):
    """Add last round's context to the drafter cache, then one non-causal block pass.

    Returns (drafter cache, draft logits [B, H, V], drafter hidden [B, H, D]).
    """
    B = s.bonus_B.shape[0]
    Kb = drafter.config.block_size
    dcache = drafter.append_context(s.ctx_taps_BAF, s.ctx_count_B, s.dcache)
    mask_BH = jnp.full((B, Kb - 1), drafter.config.mask_token_id, jnp.int32)
    block_BK = jnp.concatenate([s.bonus_B[:, None], mask_BH], axis=1)
    block_pos_BK = s.cache.lengths_B[:, None] + jnp.arange(Kb, dtype=jnp.int32)
    draft_BHV, hidden_BHD = draft_logits(drafter, target, block_BK, block_pos_BK, dcache)
    return dcache, draft_BHV, hidden_BHD


def select_stage(tree_config: TreeConfig, target, scorer, draft_BHV, hidden_BHD, bonus_B):
    """The policy picks T - 1 nodes (lattice, pool, q_cond, reach, select); the root is the bonus."""
    log_qcond_fn = None
    if tree_config.policy == "taps":
        embed_VD = target.embed_tokens.embedding.get_value()
        log_qcond_fn = taps_log_qcond_fn(scorer, hidden_BHD, embed_VD, bonus_B)
    tree, _ = draft_tree(tree_config, draft_BHV, bonus_B, log_qcond_fn)
    return tree


def verify_stage(target, drafter, s: SpecState, dcache, tree, config: SpecConfig):
    """Verify the tree in one target forward, accept, emit and commit.

    Returns (next state, the round's Acceptance: accepted path and bonus).
    """
    dc = config.decode
    B = s.bonus_B.shape[0]
    N = dc.max_new_tokens
    _, T, A = _sizes(drafter, config)
    batch_B = jnp.arange(B)
    running_B = s.finish_B == RUNNING

    # Verify: one target forward over the tree (ancestor-only mask, positions len + depth).
    positions_BT = s.cache.lengths_B[:, None] + tree.depths_BT
    logits_BTV, taps_BTF, cache = target(
        tree.tokens_BT, positions_BT, ancestor_mask(tree), s.cache, drafter.config.target_layer_ids
    )

    # Accept: sample the target once at every node, walk the tree.
    key, sub = jax.random.split(s.key)
    target_BT = sample(logits_BTV, sub, dc.sampling)
    acc = accept_walk(tree, target_BT, max_depth=A - 1)
    a_B = acc.num_accepted_B

    # Emit: the accepted drafted tokens, then the new bonus; stop at EOS / length.
    path_BA = acc.path_BA[:, :A]
    drafted_BA = jnp.take_along_axis(tree.tokens_BT, path_BA, axis=1)
    # emit[i] = token of path node i+1 for i < a-1, the bonus at i = a-1.
    next_BA = jnp.concatenate([drafted_BA[:, 1:], drafted_BA[:, -1:]], axis=1)
    emit_BA = jnp.where(jnp.arange(A)[None] == (a_B - 1)[:, None], acc.bonus_token_B[:, None], next_BA)
    in_round_BA = jnp.arange(A)[None] < a_B[:, None]
    is_eos_BA = jnp.isin(emit_BA, jnp.asarray(dc.eos_ids or (-1,), jnp.int32)) & in_round_BA
    hit_eos_B = jnp.any(is_eos_BA, axis=1)
    n_emit_B = jnp.where(hit_eos_B, jnp.argmax(is_eos_BA, axis=1) + 1, a_B)
    n_emit_B = jnp.minimum(n_emit_B, N - s.generated_B)
    n_emit_B = jnp.where(running_B, n_emit_B, 0)
    dest_BA = jnp.where(jnp.arange(A)[None] < n_emit_B[:, None], s.generated_B[:, None] + jnp.arange(A), N + A)
    out_BN = s.out_BN.at[batch_B[:, None], dest_BA].set(emit_BA, mode="drop")
    generated_B = s.generated_B + n_emit_B

    # Commit: accepted K/V into [len, len + a); their taps feed the next draft.
    commit_B = jnp.where(running_B, a_B, 0)
    cache = cache.gather_commit(path_BA, commit_B)
    ctx_taps_BAF = jnp.take_along_axis(taps_BTF, path_BA[..., None], axis=1)

    last_B = out_BN[batch_B, jnp.maximum(generated_B - 1, 0)]
    reason_B = stop_reason(last_B, generated_B, cache.lengths_B + T, dc.eos_ids, N, dc.capacity)
    accepted_BR = s.accepted_BR.at[batch_B, jnp.where(running_B, s.rounds_B, N)].set(a_B, mode="drop")
    next_state = SpecState(
        cache=cache,
        dcache=dcache,
        ctx_taps_BAF=ctx_taps_BAF.astype(s.ctx_taps_BAF.dtype),
        ctx_count_B=commit_B,
        bonus_B=jnp.where(running_B, acc.bonus_token_B, s.bonus_B),
        out_BN=out_BN,
        generated_B=generated_B,
        finish_B=jnp.where(running_B, reason_B, s.finish_B),
        rounds_B=s.rounds_B + running_B,
        accepted_BR=accepted_BR,
        key=key,
    )
    return _pin(next_state), acc


def round_step(target, drafter, scorer, s: SpecState, config: SpecConfig) -> SpecState:
    """One speculative round: draft -> select -> verify/accept/commit."""
    dcache, draft_BHV, hidden_BHD = draft_stage(target, drafter, s)
    tree = select_stage(config.tree, target, scorer, draft_BHV, hidden_BHD, s.bonus_B)
    return verify_stage(target, drafter, s, dcache, tree, config)[0]


def spec_outputs(s: SpecState, config: SpecConfig):
    """(tokens [B, N], generated [B], finish [B], rounds [B], accepted [B, R])."""
    return s.out_BN[:, : config.decode.max_new_tokens], s.generated_B, s.finish_B, s.rounds_B, s.accepted_BR


_STATIC = ("target_graphdef", "drafter_graphdef", "config", "scorer_graphdef")


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_generate(
    target_graphdef, target_params, drafter_graphdef, drafter_params,
    prompt_BT, prompt_len_B, active_B, key, *, config: SpecConfig,
    scorer_graphdef=None, scorer_params=None,
):
    """Returns (tokens [B, N], generated [B], finish [B], rounds [B], accepted [B, R]).

    scorer_graphdef/scorer_params: the TAPS scorer (`nnx.split` of a
    `taps_jax.tree.scorer.Scorer`), required by policy "taps", None otherwise.
    """
    target, drafter, scorer = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    state = init_state(target, drafter, prompt_BT, prompt_len_B, active_B, key, config)
    state = jax.lax.while_loop(running, lambda s: round_step(target, drafter, scorer, s, config), state)
    return spec_outputs(state, config)


# Streaming: the same prefill and rounds as `spec_generate`, run as a start
# program and an advance program of at most `rounds` rounds.


@functools.partial(jax.jit, static_argnames=_STATIC)
def spec_start(
    target_graphdef, target_params, drafter_graphdef, drafter_params,
    prompt_BT, prompt_len_B, active_B, key, *, config: SpecConfig,
    scorer_graphdef=None, scorer_params=None,
) -> SpecState:
    target, drafter, _ = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    return init_state(target, drafter, prompt_BT, prompt_len_B, active_B, key, config)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def spec_advance(
    target_graphdef, target_params, drafter_graphdef, drafter_params, state: SpecState, rounds, *,
    config: SpecConfig, scorer_graphdef=None, scorer_params=None,
) -> SpecState:
    target, drafter, scorer = _merge(
        target_graphdef, target_params, drafter_graphdef, drafter_params, scorer_graphdef, scorer_params, config
    )
    return bounded_loop(lambda s: round_step(target, drafter, scorer, s, config), state, rounds)
