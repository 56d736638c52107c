"""Draft lattice: the top-K tokens of every drafted position, with statistics.

The lattice is the only view of the drafter's logits that the tree code
needs: per drafted position (= depth) the K most likely tokens and their
log-probs, plus cheap confidence features (entropy, margin, kept mass) that
scorers such as TAPS use.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax


@flax.struct.dataclass
class Lattice:
    """Top-K candidates of each of the H drafted positions."""

    logprobs_BHK: jax.Array  # [B, H, K] f32 log_softmax, sorted descending
    tokens_BHK: jax.Array  # [B, H, K] int32 token ids, same order
    entropy_BH: jax.Array  # [B, H] f32 entropy of the full softmax (nats)
    margin_BH: jax.Array  # [B, H] f32 top-1 minus top-2 probability
    topk_mass_BH: jax.Array  # [B, H] f32 probability mass of the K kept tokens


def build_lattice(logits_BHV: jax.Array, k: int) -> Lattice:
    """Keeps the top-`k` tokens of every position (ties: lower token id first).

    The ranking is taken on the raw logits, not on the log-probs, so rank 0 is
    exactly `argmax(logits)` even where log_softmax's rounding would merge two
    nearly equal logits into a tie. Log-probs are a monotone map of the logits,
    so they come out sorted descending all the same.
    """
    vocab = logits_BHV.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(
            f"Lattice width k={k} must be between 1 and the vocabulary size "
            f"{vocab}; lower lattice_k."
        )
    logits_BHV = logits_BHV.astype(jnp.float32)
    logp_BHV = jax.nn.log_softmax(logits_BHV, axis=-1)

    _, tokens_BHK = lax.top_k(logits_BHV, k)
    logprobs_BHK = jnp.take_along_axis(logp_BHV, tokens_BHK, axis=-1)
    # The margin needs the top two. A separate top_k(2) instead of slicing a
    # wider one: XLA:CPU turns a sliced top_k into a full sort (~100x slower).
    top2_BH2 = jnp.exp(jnp.take_along_axis(logp_BHV, lax.top_k(logits_BHV, min(2, vocab))[1], axis=-1))
    second_BH = top2_BH2[..., 1] if vocab >= 2 else jnp.zeros_like(top2_BH2[..., 0])

    probs_BHV = jnp.exp(logp_BHV)
    # 0 * log 0 = 0: masked (-inf) logits must not turn the entropy into NaN.
    plogp_BHV = jnp.where(probs_BHV > 0, probs_BHV * logp_BHV, 0.0)
    entropy_BH = -jnp.sum(plogp_BHV, axis=-1)

    return Lattice(
        logprobs_BHK=logprobs_BHK,
        tokens_BHK=tokens_BHK.astype(jnp.int32),
        entropy_BH=entropy_BH,
        margin_BH=top2_BH2[..., 0] - second_BH,
        topk_mass_BH=jnp.sum(jnp.exp(logprobs_BHK), axis=-1),
    )
