"""Helpers shared by the TAPS tests: a sharper tiny target, random scorers, small traces."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from taps_jax.api import Target
from taps_jax.checkpoints.scorer import ScorerModel
from taps_jax.config import DrafterConfig, ModelConfig
from taps_jax.decoder import DrafterModel
from taps_jax.models.drafter import Drafter
from taps_jax.models.transformer import Transformer


@functools.lru_cache(maxsize=None)
def sharp_pair(vocab: int = 8, block_size: int = 4, seed: int = 0, head_scale: float = 40.0):
    """Like spec_helpers.tiny_pair, but the target's lm_head is scaled up.

    A random target with init-scale weights is nearly uniform over its
    vocabulary; a sharper one makes the target probabilities (and thus the
    reach of deep nodes) varied enough for selection tests to mean something.
    """
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    model = Transformer(cfg, nnx.Rngs(seed))
    model.lm_head.kernel.set_value(model.lm_head.kernel.get_value() * head_scale)
    target = Target(model, None, ())
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, block_size=block_size, mask_token_id=vocab - 1,
                         target_layer_ids=(0, 1), num_target_layers=2, vocab_size=vocab, rope_theta=10000.0)
    drafter = DrafterModel(Drafter(dcfg, nnx.Rngs(seed + 1)))
    return target, drafter


def random_scorer(target, drafter, seed: int = 0, scale: float = 1.0) -> ScorerModel:
    """A scorer with random weights (optionally scaled up for spikier q_cond)."""
    model = ScorerModel.for_models(target.config, drafter.config, seed=seed, token_dim=8, hidden_dim=8,
                                   depth_dim=4, mlp_dim=16)
    if scale != 1.0:
        graphdef, state = nnx.split(model.module)
        model = ScorerModel(nnx.merge(graphdef, jax.tree.map(lambda x: x * scale, state)))
    return model


def path_tokens(parent: np.ndarray, token: np.ndarray, n: int) -> list[int]:
    """Tokens from depth 1 down to pool node n (inclusive)."""
    out = []
    while n >= 0:
        out.append(int(token[n]))
        n = int(parent[n])
    return out[::-1]
