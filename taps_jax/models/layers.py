"""Building blocks shared by the target transformer and the drafter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from taps_jax.config import RopeScaling


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


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with optional Llama 3 scaling (host-side)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x_BTNH, positions_BT, inv_freq_F):
    """Rotate-half RoPE (the Hugging Face convention) at explicit per-token positions."""
    angles_BTF = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq_F)
    angles_BTH = jnp.concatenate([angles_BTF, angles_BTF], axis=-1)
    cos, sin = jnp.cos(angles_BTH)[:, :, None, :], jnp.sin(angles_BTH)[:, :, None, :]
    x32 = x_BTNH.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_BTNH.dtype)


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS):
    """Grouped-query attention; scores and softmax in float32.

    N query heads share K kv heads (N = K * G). Masked-out keys get a large
    negative score (not -inf) so a fully masked padding row stays finite.
    """
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum(
        "btkgh,bskh->bkgts", q_BTKGH.astype(jnp.float32), k_BSKH.astype(jnp.float32)
    ) * (H ** -0.5)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], scores_BKGTS, -1e30)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH.astype(jnp.float32))
    return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)
