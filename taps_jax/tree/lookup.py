"""Prompt lookup inside the draft: the text's own earlier continuation as a candidate path.

Answers repeat their prompt and themselves (a function's signature and
docstring, a variable name, a list's pattern), and a small drafter trained
on little data does not learn to copy. The committed text shows where a copy
is likely at no model cost: find the latest earlier occurrence of its
longest suffix (up to `longest` tokens, the adaptive policy's text signal)
and read the H tokens that followed it. Each drafted position's distribution
is then mixed with that continuation's token:

    q'(x at depth d) = (1 - w) * q(x) + w * [x == continuation_d],

with w = W[match length, d]: how often, on the target's own text, the
continuation's d-th token was the target's when the ones before it were
(fitted by `LookupTable.fit`, shipped as a model set's lookup.json). The
tree policies then rank the copy path against the drafter's (DDTree's
product of per-depth probabilities is exactly W's chain of conditionals
along it). Verification is unchanged, so every round stays exact: the mix
only moves which nodes the budget buys.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

LOOKUP_FILE = "lookup.json"
KINDS = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    """The mixing weights of one call (static: part of the jit-static SpecConfig).

    weights[q][d]: weight of the continuation's token at depth d + 1 when the
    suffix match is q tokens long (q capped at len(weights) - 1; q = 0, no
    match, has weight 0).
    """

    weights: tuple[tuple[float, ...], ...]

    @property
    def longest(self) -> int:
        return len(self.weights) - 1

    def validate(self, horizon: int) -> None:
        w = np.asarray(self.weights, np.float64)
        if w.ndim != 2 or w.shape[0] < 2 or w.shape[1] < horizon or not np.all((w >= 0) & (w < 1)):
            raise ValueError(f"lookup weights must be [Q >= 2][H >= {horizon}] numbers in [0, 1), got shape "
                             f"{w.shape}; fit them with LookupTable.fit (a model set's {LOOKUP_FILE})")


def committed_text(prompt_BP, prompt_len_B, out_BN) -> jax.Array:
    """[B, P + N] prompt + output as one contiguous row (the prompt's padding skipped; the tail is filler)."""
    P = prompt_BP.shape[1]
    S = P + out_BN.shape[1]
    s_S = jnp.arange(S)
    src_BS = jnp.where(s_S[None] < prompt_len_B[:, None], s_S[None], P + s_S[None] - prompt_len_B[:, None])
    return jnp.take_along_axis(jnp.concatenate([prompt_BP, out_BN], axis=1), jnp.minimum(src_BS, S - 1), axis=1)


def match_runs(text_BS, length_B, longest: int) -> jax.Array:
    """[B, S] int32: for each earlier end position j, how many of text[:length]'s last tokens (<= longest)
    also end at j. O(S * longest) compares, no model call."""
    B, S = text_BS.shape
    padded_BS = jnp.pad(text_BS, ((0, 0), (longest, 0)), constant_values=-1)  # text[j - d] = -1 for j < d
    alive_BS = jnp.arange(S)[None] < length_B[:, None] - 1  # an earlier end position
    run_BS = jnp.zeros((B, S), jnp.int32)
    for d in range(longest):
        tail_B = jnp.take_along_axis(text_BS, jnp.maximum(length_B - 1 - d, 0)[:, None], axis=1)[:, 0]
        alive_BS = alive_BS & (padded_BS[:, longest - d: longest - d + S] == tail_B[:, None]) & \
            (length_B[:, None] - 1 - d >= 0)
        run_BS = run_BS + alive_BS
    return run_BS


def match_lengths(text_BS, length_B, longest: int) -> jax.Array:
    """[B] int32: the longest m <= `longest` such that the last m tokens of text[:length] also end earlier."""
    if longest == 0:
        return jnp.zeros(length_B.shape, jnp.int32)
    return jnp.max(match_runs(text_BS, length_B, longest), axis=1).astype(jnp.int32)


def continuation(text_BS, length_B, longest: int, horizon: int):
    """The latest longest earlier match and what followed it.

    Returns (match length [B], continuation tokens [B, H], valid [B, H]: the
    token exists within text[:length]).
    """
    S = text_BS.shape[1]
    run_BS = match_runs(text_BS, length_B, longest)
    end_B = S - 1 - jnp.argmax(run_BS[:, ::-1], axis=1)  # the latest of the longest
    q_B = jnp.take_along_axis(run_BS, end_B[:, None], axis=1)[:, 0]
    src_BH = end_B[:, None] + 1 + jnp.arange(horizon)[None]
    cont_BH = jnp.take_along_axis(text_BS, jnp.minimum(src_BH, S - 1), axis=1)
    return q_B, cont_BH, (src_BH < length_B[:, None]) & (q_B[:, None] > 0)


def mix(logits_BHV, cont_BH, weight_BH) -> jax.Array:
    """[B, H, V] log((1 - w) softmax(logits) + w onehot(cont)): the draft with the continuation mixed in."""
    logp_BHV = jax.nn.log_softmax(logits_BHV.astype(jnp.float32), axis=-1)
    w_BH = weight_BH[..., None]
    scaled_BHV = logp_BHV + jnp.log1p(-w_BH)
    at_BH1 = jnp.take_along_axis(scaled_BHV, cont_BH[..., None], axis=-1)
    boosted_BH1 = jnp.logaddexp(at_BH1, jnp.log(w_BH))
    return jnp.put_along_axis(scaled_BHV, cont_BH[..., None], boosted_BH1, axis=-1, inplace=False)


def lookup_draft(config: LookupConfig, logits_BHV, prompt_BP, prompt_len_B, out_BN, generated_B) -> jax.Array:
    """The round's draft logits with the committed text's continuation mixed in (`mix`)."""
    H = logits_BHV.shape[1]
    text_BS = committed_text(prompt_BP, prompt_len_B, out_BN)
    q_B, cont_BH, valid_BH = continuation(text_BS, prompt_len_B + generated_B, config.longest, H)
    weights_QH = jnp.asarray(config.weights, jnp.float32)[:, :H]
    return mix(logits_BHV, cont_BH, jnp.where(valid_BH, weights_QH[q_B], 0.0))


# ----------------------------------------------------------------------------- the fitted weights


@dataclasses.dataclass(frozen=True)
class LookupTable:
    """How often the continuation's token at depth d was the target's, per match length: the weights' data.

    agreed / tried: {kind: [Q][H]} for kind "greedy" (the target's greedy
    text) and "sampled" (its text at temperature 1): tried counts depths
    whose earlier tokens all agreed, agreed those that agreed too.
    """

    agreed: dict
    tried: dict
    meta: dict = dataclasses.field(default_factory=dict)

    def weights(self, greedy: bool) -> np.ndarray:
        """[Q, H] agreed / (tried + 1) (one pseudo-miss keeps rare cells modest); no match: 0."""
        kind = KINDS[0] if greedy else KINDS[1]
        w = np.asarray(self.agreed[kind], np.float64) / (np.asarray(self.tried[kind], np.float64) + 1.0)
        w[0] = 0.0
        return w

    def config(self, greedy: bool) -> LookupConfig:
        return LookupConfig(tuple(tuple(round(float(x), 4) for x in row) for row in self.weights(greedy)))

    def save(self, path) -> None:
        tmp = Path(path).with_name(Path(path).name + ".tmp")  # a reader never sees half a table
        tmp.write_text(json.dumps({"agreed": self.agreed, "tried": self.tried, "meta": self.meta}, indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path) -> "LookupTable":
        try:
            raw = json.loads(Path(path).read_text())
            table = cls(raw["agreed"], raw["tried"], raw.get("meta", {}))
            shapes = {np.asarray(table.agreed[k]).shape for k in KINDS} | {np.asarray(table.tried[k]).shape
                                                                           for k in KINDS}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a lookup table ({e}); refit it with python -m train.lookup_table") from None
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"{path}: the lookup table's arrays must all be [Q][H]; refit it with "
                             f"python -m train.lookup_table")
        return table

    @classmethod
    def of_set(cls, directory) -> "LookupTable | None":
        path = Path(directory) / LOOKUP_FILE
        return cls.load(path) if path.is_file() else None


@functools.partial(jax.jit, static_argnames=("longest", "horizon"))
def count_agreement(text_BS, start_B, length_B, *, longest: int, horizon: int):
    """(agreed [Q, H], tried [Q, H]) over every round start of text[start:length] (what a draft there would
    see: the committed text up to and including each output token, the target's next tokens after it)."""
    S = text_BS.shape[1]
    Q = longest + 1
    h_H = jnp.arange(horizon)

    def at(offset):  # committed length start + 1 + offset, for every row
        L_B = start_B + 1 + offset
        live_B = L_B < length_B  # a next token exists
        q_B, cont_BH, valid_BH = continuation(text_BS, L_B, longest, horizon)
        truth_idx_BH = L_B[:, None] + h_H[None]
        truth_BH = jnp.take_along_axis(text_BS, jnp.minimum(truth_idx_BH, S - 1), axis=1)
        usable_BH = valid_BH & (truth_idx_BH < length_B[:, None]) & live_B[:, None]
        agree_BH = usable_BH & (cont_BH == truth_BH)
        before_BH = jnp.cumprod(jnp.pad(agree_BH, ((0, 0), (1, 0)), constant_values=True)[:, :-1], axis=1)
        tried_BH = usable_BH & before_BH.astype(bool)
        onehot_BQ = jax.nn.one_hot(q_B, Q, dtype=jnp.float32)
        return (jnp.einsum("bq,bh->qh", onehot_BQ, (tried_BH & agree_BH).astype(jnp.float32)),
                jnp.einsum("bq,bh->qh", onehot_BQ, tried_BH.astype(jnp.float32)))

    agreed_OQH, tried_OQH = jax.lax.map(at, jnp.arange(S))
    return agreed_OQH.sum(0), tried_OQH.sum(0)
