"""Tiny random target + drafter pairs shared by the speculative-engine tests."""

from __future__ import annotations

import functools

from flax import nnx

from taps_jax.api import Target
from taps_jax.config import DrafterConfig, ModelConfig
from taps_jax.decoder import DrafterModel
from taps_jax.models.drafter import Drafter
from taps_jax.models.transformer import Transformer


@functools.lru_cache(maxsize=None)
def tiny_pair(vocab: int = 16, block_size: int = 8, seed: int = 0, eos: tuple[int, ...] = (),
              draft_vocab: tuple[int, ...] | None = None):
    """A random 2-layer target and a 1-layer drafter tapping layers (0, 1) (drafting over `draft_vocab` ids only,
    when given).

    A small vocabulary makes random drafts agree with the target often, so
    rounds accept several tokens and the commit path is exercised.
    """
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    target = Target(Transformer(cfg, nnx.Rngs(seed)), None, eos)
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, block_size=block_size, mask_token_id=vocab - 1,
                         target_layer_ids=(0, 1), num_target_layers=2, vocab_size=vocab, rope_theta=10000.0,
                         draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    module = Drafter(dcfg, nnx.Rngs(seed + 1))
    if draft_vocab is not None:
        module.set_draft_vocab(draft_vocab)
    drafter = DrafterModel(module)
    return target, drafter


def primitives(jaxpr):
    """Every primitive name in a jaxpr, nested jaxprs (loops, jits, conds) included."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from primitives(sub)


def two_token_law(target, prompt, vocab: int):
    """[V, V] the target's exact probability of each first two tokens after `prompt` (temperature 1)."""
    import numpy as np

    def probs(ids):
        logits = np.asarray(target.logits([ids]))[0, -1]
        p = np.exp(logits - logits.max())
        return p / p.sum()

    p1 = probs(prompt)
    return np.stack([p1[a] * probs(prompt + [a]) for a in range(vocab)])


def assert_follows(counts, exact):
    """Chi-square: sample counts match the exact law (cells expecting >= 5), at the 99.9% level."""
    import numpy as np

    expected = exact * counts.sum()
    keep = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[keep]).sum()
    dof = keep.sum() - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3  # Wilson-Hilferty: no scipy needed
    assert chi2 < crit, (chi2, crit)
