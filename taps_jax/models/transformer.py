"""Decoder-only target transformer (Qwen3 / Llama 3 / Qwen2) with a KV cache.

One entry point, `Transformer.__call__` (`hidden` without the head), serves
prefill chunks, one-token decoding and tree verification: it takes a chunk of
T new tokens per sequence with explicit positions and a visibility mask among
the new tokens; each new token also sees the committed cache slots
[0, lengths). Each layer writes the chunk's K/V into the cache in place, then
attends blockwise (`layers.attend_cached`). Module and attribute names follow
the Hugging Face layout so checkpoint mapping is mechanical.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from taps_jax.config import ModelConfig
from taps_jax.models.cache import KVCache
from taps_jax.models.layers import (
    MLP, RMSNorm, apply_rope, attend, attend_cached, linear, rope_inv_freq, rope_table,
)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias, dtype=dt, rngs=rngs)
        self.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, dtype=dt, rngs=rngs)
        self.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, dtype=dt, rngs=rngs)
        self.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dt, rngs=rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x_BTD, rope):
        """Rotated q [B,T,N,H] and k, v [B,T,K,H] of the new tokens."""
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        dt = config.jnp_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dt, rngs)

    def __call__(self, x_BTD, rope, mask_BTT, cache: KVCache | None, layer: int, write_at):
        """Returns the layer output and the cache holding this chunk's K/V (None without a cache)."""
        B, T, _ = x_BTD.shape
        q, k, v = self.self_attn.project(self.input_layernorm(x_BTD), rope)
        if cache is None:
            attn_BTNH = attend(q, k, v, mask_BTT)
        else:
            # Write first (in place), then attend to committed slots + the new tokens: no cache copy.
            cache = cache.write_layer(layer, k, v, write_at)
            attn_BTNH, cache = attend_cached(q, k, v, mask_BTT, cache, layer)
        x_BTD = x_BTD + self.self_attn.o_proj(attn_BTNH.reshape(B, T, -1))
        x_BTD = x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))
        return x_BTD, cache


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, dt = config, config.jnp_dtype
        self.config = config
        self.embed_tokens = nnx.Embed(
            c.vocab_size, c.hidden_size, dtype=dt, param_dtype=dt,
            embedding_init=nnx.initializers.normal(stddev=0.02), rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(c, rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt)
        self.lm_head = None if c.tie_embeddings else linear(
            c.hidden_size, c.vocab_size, bias=False, dtype=dt, rngs=rngs
        )

    def embed(self, tokens_BT):
        return self.embed_tokens(tokens_BT)

    def head(self, x_BTD):
        """Final norm + lm_head (or the tied embedding), logits in float32."""
        x_BTD = self.norm(x_BTD)
        if self.lm_head is None:
            return self.embed_tokens.attend(x_BTD).astype(jnp.float32)
        return self.lm_head(x_BTD).astype(jnp.float32)

    def unembed(self, x_BTD):
        """lm_head only (the drafter applies its own final norm first)."""
        if self.lm_head is None:
            return self.embed_tokens.attend(x_BTD).astype(jnp.float32)
        return self.lm_head(x_BTD).astype(jnp.float32)

    def unembed_rows(self, x_BXD, ids_K):
        """`unembed` restricted to the vocabulary ids `ids_K`: logits [..., K] float32 (a draft vocabulary)."""
        dt = self.config.jnp_dtype  # as the full head computes (its modules promote to the model dtype)
        if self.lm_head is None:
            w_DK = self.embed_tokens.embedding[...][ids_K].T
        else:
            w_DK = jnp.take(self.lm_head.kernel[...], ids_K, axis=1)
        return jnp.dot(x_BXD.astype(dt), w_DK.astype(dt)).astype(jnp.float32)

    def hidden(self, tokens_BT, positions_BT, mask_BTT, cache: KVCache | None = None, taps: tuple[int, ...] = (),
               write_at=None):
        """The layer stack over a chunk of new tokens, without the head.

        tokens_BT, positions_BT: int32 [B, T]. mask_BTT: bool [B, T, T], which
        new tokens each new token sees (causal for prefill, ancestor-only for a
        tree). With a cache, every new token also sees committed slots
        [0, lengths), and the chunk's K/V are written in place at
        [lengths, lengths + T), or at [write_at, write_at + T) for every
        sequence when `write_at` (a scalar slot) is given. taps: static layer
        ids whose OUTPUTS are returned, concatenated [B, T, len(taps) * D].

        Returns (last layer's output [B, T, D] before the final norm, taps or None, cache).
        """
        c = self.config
        rope = rope_table(positions_BT, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))
        x_BTD = self.embed(tokens_BT)
        tapped = {}
        for i, layer in enumerate(self.layers):
            x_BTD, cache = layer(x_BTD, rope, mask_BTT, cache, i, write_at)
            if i in taps:
                # HF hidden_states[L] (what DFlash reads) is the final-normed output of the last layer.
                tapped[i] = self.norm(x_BTD) if i == c.num_layers - 1 else x_BTD
        taps_BTF = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
        return x_BTD, taps_BTF, cache

    def __call__(
        self,
        tokens_BT,
        positions_BT,
        mask_BTT,
        cache: KVCache | None = None,
        taps: tuple[int, ...] = (),
        logits_index_BI=None,
    ):
        """Forward a chunk of new tokens (see `hidden`) and apply the head.

        logits_index_BI: optional [B, I] positions whose logits are wanted
        (saves the [B, T, V] head when only a few rows matter).

        Returns (logits [B, T or I, V] float32, taps [B, T, n*D] or None, cache).
        """
        x_BTD, taps_BTF, cache = self.hidden(tokens_BT, positions_BT, mask_BTT, cache, taps)
        if logits_index_BI is not None:
            x_BTD = jnp.take_along_axis(x_BTD, logits_index_BI[..., None], axis=1)
        return self.head(x_BTD), taps_BTF, cache

    def logits(self, tokens_BT):
        """Plain causal full-sequence logits [B, T, V] (no cache)."""
        B, T = tokens_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        causal_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        return self(tokens_BT, positions_BT, causal_BTT)[0]


def causal_mask(valid_len_B, T: int):
    """[B, T, T] causal mask that also hides right-padding beyond valid_len."""
    j = jnp.arange(T)
    causal_TT = j[:, None] >= j[None, :]
    return causal_TT[None] & (j[None, None, :] < valid_len_B[:, None, None])
