"""The target's KV cache: a plain pytree carried through jitted loops."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp



@flax.struct.dataclass
class KVCache:
    """Keys/values for every layer; slot s of sequence b holds position s.

    Slots [0, lengths[b]) are committed and visible. A forward writes the K/V
    of its new tokens in place at [lengths, lengths + T) (or, for a prefill
    chunk, at one slot shared by the batch) without advancing `lengths`: the
    caller decides what to commit (all of it for prefill and AR decoding, the
    accepted tree path after verification).
    """

    k_LBSKH: jax.Array  # [layers, batch, capacity, kv_heads, head_dim]
    v_LBSKH: jax.Array  # [layers, batch, capacity, kv_heads, head_dim]
    lengths_B: jax.Array  # [batch] int32, committed tokens per sequence

    @classmethod
    def zeros(cls, config, batch: int, capacity: int):
        """An empty cache; `config` is a ModelConfig (target) or a DrafterConfig (drafter context)."""
        shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
        return cls(
            k_LBSKH=jnp.zeros(shape, config.jnp_dtype),
            v_LBSKH=jnp.zeros(shape, config.jnp_dtype),
            lengths_B=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def capacity(self) -> int:
        return self.k_LBSKH.shape[2]

    def write_layer(self, layer: int, k_BTKH, v_BTKH, start=None) -> "KVCache":
        """Write one layer's new K/V in place at slots [start, start + T) of each sequence.

        start: None writes at each sequence's `lengths` (a scatter; slots past
        the capacity are dropped, never clamped onto committed slots, so a
        finished sequence at capacity can ride along in a batch). A scalar
        writes every sequence at that slot (a dynamic_update_slice, as prefill
        chunks do); the caller guarantees start + T <= capacity.
        """
        k_BTKH, v_BTKH = k_BTKH.astype(self.k_LBSKH.dtype), v_BTKH.astype(self.v_LBSKH.dtype)
        if start is not None:
            at = (layer, 0, start, 0, 0)
            return self.replace(k_LBSKH=jax.lax.dynamic_update_slice(self.k_LBSKH, k_BTKH[None], at),
                                v_LBSKH=jax.lax.dynamic_update_slice(self.v_LBSKH, v_BTKH[None], at))
        B, T = k_BTKH.shape[:2]
        batch_B1 = jnp.arange(B)[:, None]
        slots_BT = self.lengths_B[:, None] + jnp.arange(T)[None, :]
        return self.replace(k_LBSKH=self.k_LBSKH.at[layer, batch_B1, slots_BT].set(k_BTKH, mode="drop"),
                            v_LBSKH=self.v_LBSKH.at[layer, batch_B1, slots_BT].set(v_BTKH, mode="drop"))

    def write(self, k_LBTKH, v_LBTKH, start=None) -> "KVCache":
        """`write_layer` for every layer at once (new K/V of all layers stacked)."""
        cache = self
        for layer in range(k_LBTKH.shape[0]):
            cache = cache.write_layer(layer, k_LBTKH[layer], v_LBTKH[layer], start)
        return cache

    def gather_commit(self, index_BA, count_B) -> "KVCache":
        """Commit `count_B` of the slots written by the last forward.

        index_BA[b, a] (a < count_B[b]) is the offset, relative to `lengths`, of
        the slot that becomes committed slot lengths + a: for a verified tree,
        the accepted nodes in root-to-leaf order. Entries a >= count_B are
        ignored. Reads happen before writes (functional update), so any order
        of offsets is safe.
        """
        A = index_BA.shape[1]
        slot_A = jnp.arange(A)

        def one(cache_LSKH, idx_A, start, count):
            window_LAKH = jnp.take(cache_LSKH, start + idx_A, axis=1, mode="clip")
            dest_A = jnp.where(slot_A < count, start + slot_A, cache_LSKH.shape[1])
            return cache_LSKH.at[:, dest_A].set(window_LAKH, mode="drop")

        move_B = jax.vmap(one, in_axes=(1, 0, 0, 0), out_axes=1)
        return self.replace(
            k_LBSKH=move_B(self.k_LBSKH, index_BA, self.lengths_B, count_B),
            v_LBSKH=move_B(self.v_LBSKH, index_BA, self.lengths_B, count_B),
            lengths_B=self.lengths_B + count_B,
        )
