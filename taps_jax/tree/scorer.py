"""TAPS scorer: a small learned estimate of q_cond over the candidate pool.

For every pool edge u -> v the scorer emits an edge logit, and for every
parent slot u (the root and each pool node) an "other" logit standing for
all the target's next tokens that are NOT pool children of u. A softmax over
{pool children of u} U {other} gives q_cond(v) = P(target's next token after
the path to u is x_v), so q_cond is path-conditioned and target-aware; reach
and selection then run exactly as for the marginal policies.

Inputs (DESIGN.md section 6), all arrays the round already has:
  edge u -> v: projected target embedding of x_v and of x_u (the root token at
    depth 1), depth embedding of d_v, 7 scalars [step log-prob, entropy(d_v),
    margin(d_v), top-K mass(d_v), d_v / H, cum log-prob, cum log-prob / d_v],
    projected drafter hidden state of the position that produced v (d_v - 1).
  other at u: projected embedding of x_u, depth embedding of d_u, the same
    scalars at u with the step log-prob set to 0 (all zeros for the root),
    projected drafter hidden state at index d_u (the one that predicts u's
    children).
  heads: LayerNorm -> Dense(mlp_dim) -> SiLU -> Dense(1), one per kind.

Parent slots are numbered s = parent + 1 (root 0, pool node n -> 1 + n), so a
batch row has S = N + 1 static segments and the grouped softmax is two
segment reductions (max, sum) keyed by parent slot.

The token table is the FROZEN target embedding [V, D]: it is an input, not a
parameter, so the scorer stays ~1e5 parameters for any vocabulary. Gathered
rows (and drafter hidden states) are RMS-normalised before their projection,
and the scalars get a fixed rescaling, so that no input group dominates the
heads' LayerNorm whatever the models' activation scales are.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from taps_jax.tree.lattice import Lattice
from taps_jax.tree.pool import Pool

NUM_SCALARS = 7
# Log-probs below this carry no extra information for the heads.
_LOGPROB_FLOOR = -50.0


@dataclasses.dataclass(frozen=True)
class ScorerConfig:
    """Shapes of a TAPS scorer (hashable, so usable as a static jit argument).

    vocab_size, embed_dim: the target's embedding table [V, D] the scorer reads.
    drafter_hidden_size: width of the drafter hidden states it reads.
    horizon: H = drafter block_size - 1 (depth embedding has H + 1 rows).
    """

    vocab_size: int
    embed_dim: int
    drafter_hidden_size: int
    horizon: int
    token_dim: int = 32
    hidden_dim: int = 32
    depth_dim: int = 16
    mlp_dim: int = 64
    # Residual: the heads learn a correction to the drafter's own conditional
    # (edge logit = step log-prob + head, other = log drafter mass outside the
    # pool children + head); the heads start at zero, i.e. at DDTree's ranking.
    residual: bool = False

    def __post_init__(self):
        if not isinstance(self.residual, bool):
            raise ValueError(f"scorer residual must be true or false, got {self.residual!r}")
        for f in dataclasses.fields(self):
            if f.name == "residual":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"scorer {f.name} must be a positive integer, got {type(value).__name__} {value!r}")

    @property
    def edge_features(self) -> int:
        return 2 * self.token_dim + self.depth_dim + NUM_SCALARS + self.hidden_dim

    @property
    def other_features(self) -> int:
        return self.token_dim + self.depth_dim + NUM_SCALARS + self.hidden_dim

    def check_models(self, target_config, drafter_config) -> None:
        """ValueError naming both values if the scorer cannot run with these models."""
        fix = ("; this scorer was trained for another target/drafter pair: train one for this pair "
               "(python -m train.traces ... then python -m train.scorer ...) or use policy 'ddtree'")
        if self.embed_dim != target_config.hidden_size:
            raise ValueError(f"scorer embed_dim={self.embed_dim} differs from the target's embedding width "
                             f"hidden_size={target_config.hidden_size}{fix}")
        if self.vocab_size != target_config.vocab_size:
            raise ValueError(f"scorer vocab_size={self.vocab_size} differs from the target's "
                             f"vocab_size={target_config.vocab_size}{fix}")
        if self.drafter_hidden_size != drafter_config.hidden_size:
            raise ValueError(f"scorer drafter_hidden_size={self.drafter_hidden_size} differs from the drafter's "
                             f"hidden_size={drafter_config.hidden_size}{fix}")
        if self.horizon != drafter_config.block_size - 1:
            raise ValueError(f"scorer horizon={self.horizon} differs from the drafter's horizon "
                             f"block_size - 1={drafter_config.block_size - 1}{fix}")


@flax.struct.dataclass
class ScorerInputs:
    """Everything the scorer reads for one round (also what a trace stores)."""

    pool: Pool
    entropy_BH: jax.Array  # [B, H] f32 entropy of the drafter's softmax per depth
    margin_BH: jax.Array  # [B, H] f32 top1 - top2 probability
    topk_mass_BH: jax.Array  # [B, H] f32 mass of the lattice's K tokens
    hidden_BHD: jax.Array  # [B, H, Dd] drafter hidden state of block slots 1..H
    root_token_B: jax.Array  # [B] int32 the pending bonus token (tree root)

    @classmethod
    def from_round(cls, lattice: Lattice, pool: Pool, hidden_BHD, root_token_B) -> "ScorerInputs":
        return cls(pool, lattice.entropy_BH, lattice.margin_BH, lattice.topk_mass_BH, hidden_BHD,
                   root_token_B.astype(jnp.int32))


def _rms_normalize(x):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class _Head(nnx.Module):
    """LayerNorm -> Dense(mlp) -> SiLU -> Dense(1) (zero-initialised output when zero_init)."""

    def __init__(self, features: int, mlp_dim: int, rngs: nnx.Rngs, zero_init: bool = False):
        self.norm = nnx.LayerNorm(features, rngs=rngs)
        self.fc1 = nnx.Linear(features, mlp_dim, rngs=rngs)
        kernel_init = nnx.initializers.zeros_init() if zero_init else nnx.nn.linear.default_kernel_init
        self.fc2 = nnx.Linear(mlp_dim, 1, kernel_init=kernel_init, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.silu(self.fc1(self.norm(x))))[..., 0]


class Scorer(nnx.Module):
    """Edge and "other" logits for a candidate pool (float32, ~1e5 params)."""

    def __init__(self, config: ScorerConfig, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.token_proj = nnx.Linear(c.embed_dim, c.token_dim, use_bias=False, rngs=rngs)
        self.hidden_proj = nnx.Linear(c.drafter_hidden_size, c.hidden_dim, use_bias=False, rngs=rngs)
        self.depth_embed = nnx.Embed(c.horizon + 1, c.depth_dim, rngs=rngs)
        self.edge_head = _Head(c.edge_features, c.mlp_dim, rngs, zero_init=c.residual)
        self.other_head = _Head(c.other_features, c.mlp_dim, rngs, zero_init=c.residual)

    def __call__(self, inputs: ScorerInputs, embed_VD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns (edge logits [B, N], other logits [B, N + 1] by parent slot)."""
        pool = inputs.pool
        B, N = pool.token_BN.shape
        H = pool.horizon
        if H != self.config.horizon:
            raise ValueError(f"scorer horizon={self.config.horizon} differs from the pool's horizon {H}")
        valid_BN = pool.valid_BN
        depth_BN = pool.depth_BN

        # Tokens of the N + 1 parent slots (root, then pool nodes); one gather + projection.
        slot_tok_BS = jnp.concatenate([inputs.root_token_B[:, None], pool.token_BN], axis=1)
        tok_BSP = self.token_proj(_rms_normalize(jnp.take(embed_VD, slot_tok_BS, axis=0)))
        parent_slot_BN = jnp.maximum(pool.parent_BN + 1, 0)
        tok_v_BNP = tok_BSP[:, 1:]
        tok_u_BNP = jnp.take_along_axis(tok_BSP, parent_slot_BN[..., None], axis=1)

        hid_BHP = self.hidden_proj(_rms_normalize(inputs.hidden_BHD))
        # Node v was produced by hidden index d_v - 1; parent u's children by index d_u.
        hid_v_BNP = jnp.take_along_axis(hid_BHP, jnp.clip(depth_BN - 1, 0, H - 1)[..., None], axis=1)
        slot_depth_BS = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), depth_BN], axis=1)
        hid_u_BSP = jnp.take_along_axis(hid_BHP, jnp.clip(slot_depth_BS, 0, H - 1)[..., None], axis=1)

        scal_BNF = node_scalars(inputs, self.config.vocab_size)
        # "other" at u reads u's scalars with the step log-prob zeroed (it is no
        # edge); the root's are all zeros.
        scal_BSF = jnp.concatenate([jnp.zeros((B, 1, NUM_SCALARS), jnp.float32), scal_BNF.at[..., 0].set(0.0)],
                                   axis=1)

        edge_in = jnp.concatenate(
            [tok_v_BNP, tok_u_BNP, self.depth_embed(jnp.clip(depth_BN, 0, H)), scal_BNF, hid_v_BNP], axis=-1)
        other_in = jnp.concatenate(
            [tok_BSP, self.depth_embed(jnp.clip(slot_depth_BS, 0, H)), scal_BSF, hid_u_BSP], axis=-1)
        edge_BN = self.edge_head(edge_in.astype(jnp.float32))
        other_BS = self.other_head(other_in.astype(jnp.float32))
        if self.config.residual:
            edge_base_BN, other_base_BS = drafter_logits(pool)
            edge_BN, other_BS = edge_BN + edge_base_BN, other_BS + other_base_BS
        return jnp.where(valid_BN, edge_BN, -jnp.inf), other_BS


def drafter_logits(pool: Pool) -> tuple[jax.Array, jax.Array]:
    """The drafter's own grouped logits: (step log-prob [B, N], log of the mass outside u's pool children [B, N+1]).

    Their grouped softmax is the drafter's marginal at each child's depth,
    renormalised over {pool children, other}: the residual scorer's start.
    """
    B, N = pool.token_BN.shape
    step_BN = jnp.where(pool.valid_BN, jnp.maximum(pool.step_logprob_BN.astype(jnp.float32), _LOGPROB_FLOOR), 0.0)
    seg_BN = jnp.maximum(pool.parent_BN + 1, 0)
    mass_BS = jax.vmap(lambda p, s: jax.ops.segment_sum(p, s, num_segments=N + 1))(
        jnp.where(pool.valid_BN, jnp.exp(step_BN), 0.0), seg_BN)
    other_BS = jnp.log(jnp.maximum(1.0 - mass_BS, math.exp(_LOGPROB_FLOOR / 5)))
    return step_BN, other_BS


def node_scalars(inputs: ScorerInputs, vocab_size: int) -> jax.Array:
    """[B, N, 7] scalar features of every pool node (zeros for invalid nodes).

    [step lp, entropy(d), margin(d), top-K mass(d), d / H, cum lp, cum lp / d],
    log-probs floored at -50 and divided by 10, entropy divided by log V.
    """
    pool = inputs.pool
    H = pool.horizon
    valid = pool.valid_BN
    d_idx = jnp.clip(pool.depth_BN - 1, 0, H - 1)

    def at_depth(x_BH):
        return jnp.take_along_axis(x_BH.astype(jnp.float32), d_idx, axis=1)

    depth = jnp.maximum(pool.depth_BN, 1).astype(jnp.float32)
    step = jnp.where(valid, jnp.maximum(pool.step_logprob_BN.astype(jnp.float32), _LOGPROB_FLOOR), 0.0)
    cum = jnp.where(valid, jnp.maximum(pool.cum_logprob_BN.astype(jnp.float32), _LOGPROB_FLOOR * H), 0.0)
    feats = [
        step / 10.0,
        at_depth(inputs.entropy_BH) / math.log(max(vocab_size, 2)),
        at_depth(inputs.margin_BH),
        at_depth(inputs.topk_mass_BH),
        depth / H,
        cum / (10.0 * math.sqrt(H)),
        jnp.maximum(cum / depth, _LOGPROB_FLOOR) / 10.0,
    ]
    out = jnp.stack(feats, axis=-1)
    return jnp.where(valid[..., None], out, 0.0)


def grouped_log_softmax(edge_BN, other_BS, parent_BN, valid_BN) -> tuple[jax.Array, jax.Array]:
    """log_softmax over {pool children of u} U {other(u)} for every parent slot u.

    edge_BN: [B, N] edge logits (invalid nodes are ignored). other_BS: [B, N+1]
    "other" logits, slot 0 = root, 1 + n = pool node n. parent_BN: pool index
    of each node's parent, -1 for the root. Returns (log q_cond [B, N], -inf
    for invalid nodes; log q_other [B, N+1]). Numerically stable: each group is
    shifted by its own max (segment_max), and sums are segment_sums.
    """
    B, N = edge_BN.shape
    S = N + 1
    seg_BN = jnp.maximum(parent_BN + 1, 0).astype(jnp.int32)
    edge_BN = jnp.where(valid_BN, edge_BN.astype(jnp.float32), -jnp.inf)
    other_BS = other_BS.astype(jnp.float32)
    seg_max_BS = jax.vmap(lambda e, s: jax.ops.segment_max(e, s, num_segments=S))(edge_BN, seg_BN)
    shift_BS = jax.lax.stop_gradient(jnp.maximum(other_BS, seg_max_BS))  # finite: other is finite
    shift_v_BN = jnp.take_along_axis(shift_BS, seg_BN, axis=1)
    shifted_BN = jnp.where(valid_BN, edge_BN - shift_v_BN, 0.0)
    exp_BN = jnp.where(valid_BN, jnp.exp(shifted_BN), 0.0)
    sum_BS = jnp.exp(other_BS - shift_BS) + jax.vmap(
        lambda e, s: jax.ops.segment_sum(e, s, num_segments=S))(exp_BN, seg_BN)
    # (x - shift) - log(sum): the shifted logit is exact when x is near the
    # shift, so large logits lose no precision to a large log-normaliser.
    log_sum_BS = jnp.log(sum_BS)
    log_sum_v_BN = jnp.take_along_axis(log_sum_BS, seg_BN, axis=1)
    log_qcond_BN = jnp.where(valid_BN, shifted_BN - log_sum_v_BN, -jnp.inf)
    return log_qcond_BN, (other_BS - shift_BS) - log_sum_BS


def scorer_log_qcond(scorer: Scorer, inputs: ScorerInputs, embed_VD) -> tuple[jax.Array, jax.Array]:
    """(log q_cond [B, N], log q_other [B, N + 1]) of a scorer on one round."""
    edge_BN, other_BS = scorer(inputs, embed_VD)
    return grouped_log_softmax(edge_BN, other_BS, inputs.pool.parent_BN, inputs.pool.valid_BN)


def taps_log_qcond_fn(
    scorer: Scorer, hidden_BHD, embed_VD, root_token_B
) -> Callable[[Lattice, Pool], jax.Array]:
    """The `log_qcond_fn` that `draft_tree` calls for policy "taps"."""

    def fn(lattice: Lattice, pool: Pool) -> jax.Array:
        inputs = ScorerInputs.from_round(lattice, pool, hidden_BHD, root_token_B)
        return scorer_log_qcond(scorer, inputs, embed_VD)[0]

    return fn
