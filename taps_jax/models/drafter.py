"""DFlash-style block-diffusion drafter (checkpoint-compatible with DFlashDraftModel).

The drafter has no embedding or head of its own: a block [anchor, MASK x H]
is embedded with the TARGET's table, runs through a few Qwen3-style layers
non-causally, and the final-normed hidden states go through the TARGET's
lm_head. Block slot k predicts the token at position anchor + k (no shift).

Context comes from the target: the outputs of `target_layer_ids`,
concatenated, then `fc` + `hidden_norm`. The fused context is extra keys and
values in every layer (it skips the layer's input norm) and is never a query.
Because context K/V depend only on the context, they are cached
(`DrafterCache`); block K/V never are.

Inference (`Drafter.__call__`) attends to the cached context blockwise plus
the whole block (`layers.attend_cached`); parity checks use
`Drafter.forward_masked`, dense attention under a general visibility mask
over [context; block] keys, and training `Drafter.forward_blocks`, the same
for many anchor blocks side by side (an anchor-keyed mask, DESIGN 4) without
scoring one block against another.
Attribute names follow the checkpoint (fc, hidden_norm, layers.{i}..., norm).

A draft vocabulary (`draft_vocab_size` K, the `draft_vocab` ids) restricts
the drafter's logits to K target ids: the head costs K/V of the full one, in
training and in every round. Its proposals are scattered back to the full
vocabulary (the other ids at `OUTSIDE`), so trees, the lookup and verification
never see it and decoding stays lossless.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
import numpy as np
from flax import nnx

from taps_jax.config import DrafterConfig
from taps_jax.models.cache import KVCache
from taps_jax.models.layers import (
    MLP, Buffer, RMSNorm, apply_rope, attend, attend_blocks, attend_cached, linear, rope_inv_freq, rope_table,
)

OUTSIDE = -1e30  # draft logit of an id outside the draft vocabulary: probability 0, finite (no inf - inf)


@flax.struct.dataclass
class DrafterCache(KVCache):
    """Per-layer K/V of the fused context only; slot c of sequence b holds position c.

    Slots [0, lengths[b]) are valid and equal the target's committed tokens
    (the drafter has seen the tap features of all of them). Same layout and
    in-place writes as the target's `KVCache` (built from a DrafterConfig).
    """


class DrafterAttention(nnx.Module):
    """Qwen3 attention whose keys/values are [context; block] and queries the block only."""

    def __init__(self, config: DrafterConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, bias=False, dtype=dt, rngs=rngs)
        self.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=dt, rngs=rngs)
        self.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=dt, rngs=rngs)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dt, rngs=rngs)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)

    def key_value(self, x_BTD, rope):
        """Rotated k and v [B, T, K, H] of context or block tokens (same weights for both)."""
        B, T, _ = x_BTD.shape
        k = self.k_norm(self.k_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        return apply_rope(k, rope), v

    def _block_qkv(self, x_BTD, rope):
        B, T, _ = x_BTD.shape
        q = self.q_norm(self.q_proj(x_BTD).reshape(B, T, self.num_heads, self.head_dim))
        k, v = self.key_value(x_BTD, rope)
        return apply_rope(q, rope), k, v

    def __call__(self, x_BTD, rope, ctx_k_BSKH, ctx_v_BSKH, mask_BTR):
        """Dense (training): x_BTD normed block states; mask_BTR over R = S context + T block keys."""
        B, T, _ = x_BTD.shape
        q, k, v = self._block_qkv(x_BTD, rope)
        keys = jnp.concatenate([ctx_k_BSKH.astype(k.dtype), k], axis=1)
        values = jnp.concatenate([ctx_v_BSKH.astype(v.dtype), v], axis=1)
        out_BTNH = attend(q, keys, values, mask_BTR)
        return self.o_proj(out_BTNH.reshape(B, T, -1))

    def blocks(self, x_BTD, rope, ctx_k_BSKH, ctx_v_BSKH, ctx_visible_BAS):
        """Training: T = A blocks side by side, each seeing its visible context and its own slots (`attend_blocks`)."""
        B, T, _ = x_BTD.shape
        A = ctx_visible_BAS.shape[1]
        q, k, v = self._block_qkv(x_BTD, rope)
        split = lambda x: x.reshape(B, A, T // A, *x.shape[2:])
        out_BAQNH = attend_blocks(split(q), split(k), split(v), ctx_k_BSKH, ctx_v_BSKH, ctx_visible_BAS)
        return self.o_proj(out_BAQNH.reshape(B, T, -1))

    def cached(self, x_BTD, rope, cache: "DrafterCache", layer: int):
        """Inference: the block sees cached context slots [0, lengths) and the whole block, blockwise."""
        B, T, _ = x_BTD.shape
        q, k, v = self._block_qkv(x_BTD, rope)
        out_BTNH, _ = attend_cached(q, k, v, jnp.ones((B, T, T), bool), cache, layer)  # read only
        return self.o_proj(out_BTNH.reshape(B, T, -1))


class DrafterLayer(nnx.Module):
    def __init__(self, config: DrafterConfig, rngs: nnx.Rngs):
        dt = config.jnp_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.self_attn = DrafterAttention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dt, rngs)

    def __call__(self, x_BTD, rope, ctx_k_BSKH, ctx_v_BSKH, visible, blockwise: bool = False):
        """Dense attention under a [context; block] visibility mask [B, T, C + T], or with `blockwise` blocks side
        by side, each seeing its context visible[:, j] [B, A, C] and itself (training)."""
        h = self.input_layernorm(x_BTD)
        attention = self.self_attn.blocks if blockwise else self.self_attn
        x_BTD = x_BTD + attention(h, rope, ctx_k_BSKH, ctx_v_BSKH, visible)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))

    def cached(self, x_BTD, rope, cache: "DrafterCache", layer: int):
        """Blockwise attention over the cached context + the whole block (inference)."""
        h = self.input_layernorm(x_BTD)
        x_BTD = x_BTD + self.self_attn.cached(h, rope, cache, layer)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


class Drafter(nnx.Module):
    def __init__(self, config: DrafterConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        self.config = config
        n_taps = len(c.target_layer_ids)
        self.fc = linear(n_taps * c.hidden_size, c.hidden_size, bias=False, dtype=dt, rngs=rngs)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt)
        self.layers = nnx.List([DrafterLayer(c, rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt)
        if c.draft_vocab_size is not None:
            # Target ids of the K draft logits, ascending; set by `set_draft_vocab` (fitted on training answers).
            self.draft_vocab = Buffer(jnp.arange(c.draft_vocab_size, dtype=jnp.int32))

    def set_draft_vocab(self, ids) -> None:
        """Use these K distinct target ids as the draft vocabulary (K = the config's draft_vocab_size)."""
        ids = np.asarray(ids)
        K, V = self.config.draft_vocab_size, self.config.vocab_size
        if K is None:
            raise ValueError("this drafter has no draft vocabulary (draft_vocab_size is None)")
        if ids.shape != (K,) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"a draft vocabulary is {K} integer ids, got shape {ids.shape} of {ids.dtype}")
        if len(np.unique(ids)) != K or ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"draft vocabulary ids must be distinct ids in [0, {V})")
        self.draft_vocab.set_value(jnp.asarray(np.sort(ids), jnp.int32))

    def head(self, target, hidden_BXD):
        """Logits [..., K] over the draft vocabulary ([..., V] without one), float32, from the target's head."""
        if self.config.draft_vocab_size is None:
            return target.unembed(hidden_BXD).astype(jnp.float32)
        return target.unembed_rows(hidden_BXD, self.draft_vocab[...]).astype(jnp.float32)

    def full_vocab(self, logits_BXK):
        """Draft-vocabulary logits scattered into the full vocabulary ([..., V]; other ids at OUTSIDE)."""
        if self.config.draft_vocab_size is None:
            return logits_BXK
        full = jnp.full(logits_BXK.shape[:-1] + (self.config.vocab_size,), OUTSIDE, logits_BXK.dtype)
        return full.at[..., self.draft_vocab[...]].set(logits_BXK)

    def _rope(self, positions_BT):
        c = self.config
        return rope_table(positions_BT, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))

    def fuse(self, taps_BCF):
        """Concatenated tap features [B, C, n_taps*D] -> fused context [B, C, D]."""
        return self.hidden_norm(self.fc(taps_BCF.astype(self.config.jnp_dtype)))

    def context_kv(self, taps_BCF, ctx_positions_BC):
        """Per-layer context K/V [L, B, C, K, H] of raw tap features at their positions."""
        rope = self._rope(ctx_positions_BC)
        ctx_BCD = self.fuse(taps_BCF)
        ks, vs = zip(*(layer.self_attn.key_value(ctx_BCD, rope) for layer in self.layers))
        return jnp.stack(ks), jnp.stack(vs)

    def _run(self, x_BTD, positions_BT, ctx_k_LBSKH, ctx_v_LBSKH, visible, blockwise: bool = False):
        """The layer stack + final norm, given every layer's context K/V and the visibility: a [context; block]
        mask [B, T, C + T], or with `blockwise` each block's context [B, A, C] (`DrafterAttention.blocks`)."""
        rope = self._rope(positions_BT)
        x_BTD = x_BTD.astype(self.config.jnp_dtype)
        for i, layer in enumerate(self.layers):
            x_BTD = layer(x_BTD, rope, ctx_k_LBSKH[i], ctx_v_LBSKH[i], visible, blockwise)
        return self.norm(x_BTD)

    def append_context(self, taps_BCF, count_B, cache: DrafterCache, start=None) -> DrafterCache:
        """Add new context tokens to the cache.

        taps_BCF: target tap features [B, C, n_taps*D] of the tokens committed
        since the last call (C static, right-padded; the first count_B[b] are
        valid). They sit at absolute positions lengths + c, or start + c when
        `start` (a scalar slot shared by the batch, as for a prefill chunk) is
        given. All C are written in place at those slots (dropped past
        capacity); the padding lands beyond the new lengths, so it stays
        invisible and is overwritten later. lengths += count_B.
        """
        C = taps_BCF.shape[1]
        first_B1 = cache.lengths_B[:, None] if start is None else jnp.full((taps_BCF.shape[0], 1), start, jnp.int32)
        k_LBCKH, v_LBCKH = self.context_kv(taps_BCF, first_B1 + jnp.arange(C, dtype=jnp.int32)[None, :])
        cache = cache.write(k_LBCKH, v_LBCKH, start)
        return cache.replace(lengths_B=cache.lengths_B + count_B.astype(cache.lengths_B.dtype))

    def __call__(self, block_embeds_BKD, block_positions_BK, cache: DrafterCache):
        """Run a block non-causally against the cached context.

        block_embeds_BKD: the block embedded with the target's table;
        block_positions_BK: its absolute positions (normally lengths + k).
        Queries come from the block only; keys/values are the cached context
        slots < lengths plus the whole block, with no mask among block tokens
        (blockwise over the cache, `layers.attend_cached`).
        Returns the final-normed hidden states [B, Kb, D]; apply the target's
        lm_head (see `draft_logits`).
        """
        rope = self._rope(block_positions_BK)
        x_BKD = block_embeds_BKD.astype(self.config.jnp_dtype)
        for i, layer in enumerate(self.layers):
            x_BKD = layer.cached(x_BKD, rope, cache, i)
        return self.norm(x_BKD)

    def forward_masked(self, block_embeds_BTD, block_positions_BT, taps_BCF, ctx_positions_BC, mask_BTR):
        """The general forward: T block tokens against C context tokens, any visibility.

        mask_BTR: bool [B, T, C + T], which [context; block] keys each block
        token sees. For training, T holds many anchor blocks side by side and
        the mask is keyed on anchor positions (block j sees context positions
        < anchor_j and its own block only). Every row should see at least one
        key. Returns final-normed hidden states [B, T, D].
        """
        C, T = taps_BCF.shape[1], block_embeds_BTD.shape[1]
        if mask_BTR.shape[-2:] != (T, C + T):
            raise ValueError(
                f"mask must be [B, {T}, {C + T}] over [context; block] keys, got {tuple(mask_BTR.shape)}"
            )
        k_LBCKH, v_LBCKH = self.context_kv(taps_BCF, ctx_positions_BC)
        return self._run(block_embeds_BTD, block_positions_BT, k_LBCKH, v_LBCKH, mask_BTR)

    def forward_blocks(self, block_embeds_BTD, block_positions_BT, taps_BCF, ctx_positions_BC, ctx_visible_BAC):
        """`forward_masked` for T = A blocks side by side where block j sees the context ctx_visible_BAC[:, j] and
        its own T / A slots only (the training layout, `anchor_block_mask`), without scoring the other blocks'
        keys. Returns final-normed hidden states [B, T, D]."""
        T, A = block_embeds_BTD.shape[1], ctx_visible_BAC.shape[1]
        if T % A or ctx_visible_BAC.shape[2] != taps_BCF.shape[1]:
            raise ValueError(f"{A} blocks over {T} block tokens and {taps_BCF.shape[1]} context tokens need a "
                             f"[B, {A}, {taps_BCF.shape[1]}] visibility with T a multiple of A, got "
                             f"{tuple(ctx_visible_BAC.shape)}")
        k_LBCKH, v_LBCKH = self.context_kv(taps_BCF, ctx_positions_BC)
        return self._run(block_embeds_BTD, block_positions_BT, k_LBCKH, v_LBCKH, ctx_visible_BAC, blockwise=True)

    def forward_uncached(self, block_embeds_BKD, block_positions_BK, taps_BCF, ctx_positions_BC, ctx_valid_BC):
        """Same as `__call__` without a cache: context given as raw tap features.

        ctx_valid_BC (bool) hides context padding. For parity tests and notebooks.
        """
        B, K, _ = block_embeds_BKD.shape
        C = taps_BCF.shape[1]
        mask_BKR = jnp.concatenate(
            [jnp.broadcast_to(ctx_valid_BC[:, None, :], (B, K, C)), jnp.ones((B, K, K), bool)], axis=-1
        )
        return self.forward_masked(block_embeds_BKD, block_positions_BK, taps_BCF, ctx_positions_BC, mask_BKR)


def draft_logits(drafter: Drafter, target, block_tokens_BK, block_positions_BK, cache: DrafterCache):
    """Drafter proposals for one round.

    target: the target `Transformer` (its embedding table and lm_head are
    shared with the drafter). block_tokens_BK: [anchor, MASK x H].
    Returns (logits [B, H, V] float32, hidden [B, H, D]) of block slots
    1..Kb-1; slot k predicts the token at position block_positions[:, 0] + k.
    """
    embeds_BKD = target.embed(block_tokens_BK)
    hidden_BKD = drafter(embeds_BKD, block_positions_BK, cache)
    hidden_BHD = hidden_BKD[:, 1:]
    return drafter.full_vocab(drafter.head(target, hidden_BHD)), hidden_BHD
