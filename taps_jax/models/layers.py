"""Building blocks shared by the target transformer and the drafter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from taps_jax.config import RopeFactors, RopeScaling


class Buffer(nnx.Variable):
    """A saved array that training leaves alone (the drafter's draft-vocabulary ids): in the checkpoint with
    the params, never in the optimizer's state."""


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, as Hugging Face's Qwen/Llama do."""

    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def linear(d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """A Linear whose kernel is [in, out] (Hugging Face stores [out, in])."""
    init = nnx.initializers.normal(stddev=0.02)
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype,
        kernel_init=init, rngs=rngs,
    )


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(dim, hidden, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = linear(dim, hidden, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = linear(hidden, dim, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | RopeFactors | None) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (host-side): plain, Llama 3 scaled (Hugging Face's rule), or divided
    by per-frequency factors (llama.cpp's rule for a GGUF's `rope_freqs`).

    Rounded step by step in float32 exactly as transformers builds its rotary buffer (its float64 runs too:
    the buffer is made in float32 and the angles are taken in float32): the checkpoints were trained with
    these values, and one ulp off in a frequency is position x ulp off in its angle (issue 35: computed in
    float64 and rounded once, 24 of Qwen3-4B's 64 frequencies were an ulp away: past position 1,000, 4-8x
    transformers' own float32 error from its float64 run, tests/test_precision.py).
    """
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / f32(head_dim)  # torch.arange(...).float() / dim
    # theta ** exponent rounded once to float32 (a correctly rounded powf; torch's differs in ~1% of cases), then 1 / x.
    inv_freq = f32(1) / (np.float64(f32(theta)) ** exponent.astype(np.float64)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, RopeFactors):
        factors = np.asarray(scaling.factors, np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{factors.size} rope factors for head_dim {head_dim} ({inv_freq.size} frequencies)")
        return (inv_freq.astype(np.float64) / factors).astype(np.float32)
    # Llama 3 (transformers' _compute_llama3_parameters, every op in float32): keep high frequencies, divide
    # low ones by `factor`, blend between.
    original = scaling.original_max_position_embeddings
    low_wavelen = f32(original / scaling.low_freq_factor)
    high_wavelen = f32(original / scaling.high_freq_factor)
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / f32(scaling.factor), inv_freq)
    smooth = (f32(original) / wavelen - f32(scaling.low_freq_factor)) / f32(
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (f32(1) - smooth) * scaled / f32(scaling.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_table(positions_BT, inv_freq_F):
    """(cos, sin) [B, T, 1, head_dim] at explicit per-token positions.

    Computed once per forward and shared by every layer's q and k (per layer,
    the sines and cosines cost more than the rotation itself).
    """
    angles_BTF = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_F)
    angles_BTH = jnp.concatenate([angles_BTF, angles_BTF], axis=-1)
    return jnp.cos(angles_BTH)[:, :, None, :], jnp.sin(angles_BTH)[:, :, None, :]


def apply_rope(x_BTNH, rope):
    """Rotate-half RoPE (the Hugging Face convention) with a `rope_table`."""
    cos, sin = rope
    x32 = x_BTNH.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_BTNH.dtype)


MASKED = -1e30  # score of a hidden key: large and negative, not -inf, so fully hidden rows stay finite


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
    """Dense grouped-query attention; scores and softmax in float32.

    N query heads share K kv heads (N = K * G). Materialises [B, N, T, S]
    scores: meant for short spans without a cache (training, full-sequence
    logits); decoding goes through `attend_cached`.
    """
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum(
        "btkgh,bskh->bkgts", q_BTKGH.astype(jnp.float32), k_BSKH.astype(jnp.float32)
    ) * (H ** -0.5)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, MASKED)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH.astype(jnp.float32))
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def attend_blocks(q_BAQNH, k_BAQKH, v_BAQKH, ctx_k_BSKH, ctx_v_BSKH, ctx_visible_BAS):
    """`attend` for A independent blocks of Q tokens side by side (the drafter's training forward).

    Block j's queries see the context keys where ctx_visible[:, j] and the Q
    keys of block j, never another block's: what `attend` computes under the
    block-diagonal [context; blocks] mask, without the [A*Q, A*Q] block part
    (at 32 blocks of 16 and 352 context keys, 2.3x fewer scores). Scores and
    softmax in float32. Returns [B, A, Q, N, H].
    """
    B, A, Q, N, H = q_BAQNH.shape
    K = k_BAQKH.shape[3]
    S = ctx_k_BSKH.shape[1]
    q_BAQKGH = q_BAQNH.reshape(B, A, Q, K, N // K, H).astype(jnp.float32) * (H ** -0.5)
    ctx_BAKGQS = jnp.einsum("baqkgh,bskh->bakgqs", q_BAQKGH, ctx_k_BSKH.astype(jnp.float32))
    ctx_BAKGQS = jnp.where(ctx_visible_BAS[:, :, None, None, None, :], ctx_BAKGQS, MASKED)
    own_BAKGQR = jnp.einsum("baqkgh,barkh->bakgqr", q_BAQKGH, k_BAQKH.astype(jnp.float32))
    probs = jax.nn.softmax(jnp.concatenate([ctx_BAKGQS, own_BAKGQR], axis=-1), axis=-1)
    out_BAQKGH = (jnp.einsum("bakgqs,bskh->baqkgh", probs[..., :S], ctx_v_BSKH.astype(jnp.float32))
                  + jnp.einsum("bakgqr,barkh->baqkgh", probs[..., S:], v_BAQKH.astype(jnp.float32)))
    return out_BAQKGH.reshape(B, A, Q, N, H).astype(q_BAQNH.dtype)


# ----------------------------------------------------------------------------- attention over a cache
#
# Decoding attends to two spans: the committed cache slots [0, len) and the T
# new tokens (a prefill chunk, one AR token, a verified tree or a draft
# block), whose K/V the caller has just written into the cache in place.
# Both spans are reduced with an online softmax (running max m, normaliser l,
# unnormalised output o; DESIGN 11) and merged, so no [T, S] score tensor of
# the whole context and no concatenated copy of the cache ever exists. The
# committed span is walked in key blocks by a loop whose trip count is the
# longest sequence's length (not the capacity), which also skips the empty
# tail of the cache.
#
# Why a pure-JAX loop: it lowers to plain dots + a while loop on every
# backend (CPU, GPU, TPU), handles per-sequence lengths and any mask among
# the new tokens (causal chunk, tree ancestors, all-visible draft block), and
# is the one tested here. `jax.nn.dot_product_attention` would materialise
# the full [T, S] mask on CPU and takes no per-row length on TPU; a Pallas
# splash kernel could replace `_committed_span` on TPU without changing callers.

# Cache slots per step of the key loop. Measured on CPU (default model, 4k context): 512 beats 1k-4k
# for prefill chunks and single tokens alike (each block is copied out of the cache before its dots,
# and larger blocks read further past the valid length). A cache of at most 512 slots holds a short
# context, for which most of one 512 block would be masked slots: blocks of 128 there (AR step, short
# prompt: batch 1 at 512 slots 0.66 vs 0.75 ms; batch 8 at 256 slots 1.96 vs 2.08 ms). Not below 512
# slots in general: at batch 1 and a 900-token context, blocks of 128 cost 1.41 ms against 1.09.
KEY_BLOCK = 512
SMALL_CACHE_KEY_BLOCK = 128


def key_block(capacity: int) -> int:
    """Slots per step of the key loop over a cache of `capacity` slots."""
    return min(SMALL_CACHE_KEY_BLOCK if capacity <= KEY_BLOCK else KEY_BLOCK, capacity)


def _span(q_BKGTH, k_BKHS, v_BKSH, mask_BTS):
    """Online-softmax pieces of one key span: (m [B,K,G,T], l [B,K,G,T], o [B,K,G,T,H])."""
    s_BKGTS = jnp.einsum("bkgth,bkhs->bkgts", q_BKGTH, k_BKHS.astype(jnp.float32))
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, MASKED)
    m_BKGT = jnp.max(s_BKGTS, axis=-1)
    p_BKGTS = jnp.exp(s_BKGTS - m_BKGT[..., None])
    o_BKGTH = jnp.einsum("bkgts,bksh->bkgth", p_BKGTS, v_BKSH.astype(jnp.float32))
    return m_BKGT, jnp.sum(p_BKGTS, axis=-1), o_BKGTH


def _merge(a, b):
    """Combine the online-softmax pieces of two disjoint key spans."""
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = jnp.maximum(m_a, m_b)
    c_a, c_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    return m, l_a * c_a + l_b * c_b, o_a * c_a[..., None] + o_b * c_b[..., None]


def _committed_span(q_BKGTH, cache, layer: int, key_block: int):
    """Online-softmax pieces over slots [0, lengths[b]) of one layer's cache, key block by key block.

    Returns (pieces, cache): the cache rides through the loop's carry
    unchanged, so XLA aliases it instead of copying a loop operand that is
    still used after the loop (the next layer writes into it in place).
    """
    B, K, G, T, H = q_BKGTH.shape
    S = cache.capacity
    num_blocks = (jnp.max(cache.lengths_B) + key_block - 1) // key_block

    def block(j, carry):
        acc, cache = carry
        # The last block may be clamped to fit the capacity; slots before j * key_block were seen already.
        start = jnp.minimum(j * key_block, S - key_block)
        slot_S = start + jnp.arange(key_block)
        visible_BS = (slot_S[None, :] < cache.lengths_B[:, None]) & (slot_S[None, :] >= j * key_block)
        mask_BTS = jnp.broadcast_to(visible_BS[:, None, :], (B, T, key_block))
        span = _span(q_BKGTH, cache.keys(layer, start, key_block), cache.values(layer, start, key_block), mask_BTS)
        return _merge(acc, span), cache

    init = (jnp.full((B, K, G, T), MASKED, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))
    return jax.lax.fori_loop(0, num_blocks, block, (init, cache))


def attend_cached(q_BTNH, k_BTKH, v_BTKH, mask_BTT, cache, layer: int):
    """Attention of T new tokens over committed cache slots [0, lengths) plus the new tokens themselves.

    q_BTNH: the new tokens' rotated queries; k_BTKH, v_BTKH: their keys and
    values (also written into the cache by the caller); mask_BTT: which new
    tokens each new token sees. cache: a `KVCache` (every layer), read in
    key blocks at `layer`, never sliced whole. Scores and softmax in float32.

    Returns (output [B, T, N, H], the same cache: use it afterwards, see `_committed_span`).
    """
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    q_BKGTH = (q_BTNH.astype(jnp.float32) * H ** -0.5).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    committed, cache = _committed_span(q_BKGTH, cache, layer, key_block(cache.capacity))
    new = _span(q_BKGTH, k_BTKH.transpose(0, 2, 3, 1), v_BTKH.transpose(0, 2, 1, 3), mask_BTT)
    _, l_BKGT, o_BKGTH = _merge(committed, new)
    out_BKGTH = o_BKGTH / l_BKGT[..., None]
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q_BTNH.dtype), cache
