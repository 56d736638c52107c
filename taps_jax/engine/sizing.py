"""Sizes checked on the host before anything compiles: positions, capacity and memory.

A prompt past the model's context, or a batch whose caches cannot fit, must
fail in milliseconds with the numbers and the fix, not after minutes of
compiling with an allocator error (DESIGN 11: budget memory before compiling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import numpy as np

from taps_jax.config import DrafterConfig, ModelConfig
from taps_jax.engine.batching import bucket
from taps_jax.engine.prefill import PREFILL_CHUNK, cache_slots
from taps_jax.models.layers import key_block

GiB = 1 << 30
USABLE_FRACTION = 0.9  # leave room for the runtime, compiled code and fragmentation


def capacity_bucket(n: int) -> int:
    """Cache slots for n tokens: a power of two up to 4096, then steps of 1/8 of the next power
    of two (at most 25% unused), so long prompts do not double the cache of a 16k-token job."""
    size = bucket(n)
    if size <= 4096:
        return size
    step = size // 8
    return -(-n // step) * step


def plan_capacity(longest_prompt: int, max_new_tokens: int, headroom: int, config: ModelConfig,
                  capacity: int | None = None) -> int:
    """The KV-cache capacity for a call, checked against the target's context.

    headroom: slots a decoding step needs beyond the tokens kept: the
    largest tree's T nodes for speculative decoding, 0 for AR. (A running
    sequence keeps at most prompt + max_new_tokens - 2 tokens in its cache,
    so a round's tree always fits; a round that accepts past the last new
    token finishes the sequence.)
    The target's positions never exceed capacity - 1, so a capacity within
    `max_position_embeddings` keeps every one inside the trained range. (With
    a tree of fewer nodes than the drafter's block, the block's last positions
    may run up to block - T past it: RoPE is computed, not looked up, and a
    draft is only a proposal that the target verifies.)
    """
    limit = config.max_position_embeddings
    if max_new_tokens > limit:
        raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the target's context of {limit} positions "
                         f"(max_position_embeddings); ask for at most {limit - longest_prompt - headroom}")
    needed = longest_prompt + max_new_tokens + headroom
    if needed > limit:
        room = limit - max_new_tokens - headroom
        raise ValueError(
            f"a prompt of {longest_prompt} tokens + max_new_tokens {max_new_tokens}"
            + (f" + {headroom} slots of tree headroom" if headroom else "")
            + f" needs {needed} positions, but the target has max_position_embeddings={limit}; "
            + (f"shorten the prompt to at most {room} tokens or lower max_new_tokens" if room > 0
               else f"lower max_new_tokens to at most {limit - longest_prompt - headroom}")
        )
    if capacity is not None:
        if capacity > limit:
            raise ValueError(f"capacity={capacity} exceeds the target's max_position_embeddings={limit}; "
                             f"pass capacity <= {limit} (or leave it out)")
        return int(capacity)
    return min(capacity_bucket(needed), limit)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one generate call needs (whole batch, before sharding)."""

    params: int
    caches: int  # target KV cache + drafter context cache
    largest_step: int  # activations of the largest step: a prefill chunk, a draft or a verify
    batch: int
    slots: int

    @property
    def total(self) -> int:
        return self.params + self.caches + self.largest_step

    def describe(self) -> str:
        return (f"{self.total / GiB:.2f} GiB: KV caches {self.caches / GiB:.2f} GiB for {self.batch} sequences x "
                f"{self.slots} slots, largest step {self.largest_step / GiB:.2f} GiB, "
                f"parameters {self.params / GiB:.2f} GiB")


def _cache_bytes(num_layers, batch, slots, kv_heads, head_dim, dtype) -> int:
    return 2 * num_layers * batch * slots * kv_heads * head_dim * np.dtype(dtype).itemsize


def estimate_memory(target: ModelConfig, params_bytes: int, batch: int, prompt_buffer: int, capacity: int, *,
                    drafter: DrafterConfig | None = None, tree_size: int = 1,
                    chunk: int = PREFILL_CHUNK) -> MemoryEstimate:
    """A model of the memory a generate call needs; an estimate, not a measurement.

    Counts the caches (the dominant term at long contexts), the parameters
    and the largest activations alive in one step: a prefill chunk (its MLP
    activations, one key block of float32 scores per head, tap features) or
    a round (draft logits [B, H, V] and tree logits [B, T, V] in float32).
    """
    f32 = 4
    slots = cache_slots(capacity, prompt_buffer, chunk)
    C = min(chunk, prompt_buffer)
    caches = _cache_bytes(target.num_layers, batch, slots, target.num_kv_heads, target.head_dim, target.dtype)
    scores = 3 * batch * target.num_heads * C * (key_block(slots) + C) * f32  # scores, probabilities, mask
    mlp = 3 * batch * C * target.intermediate_size * f32
    step = scores + mlp + 4 * batch * C * target.hidden_size * f32
    if drafter is not None:
        caches += _cache_bytes(drafter.num_layers, batch, slots, drafter.num_kv_heads, drafter.head_dim,
                               drafter.dtype)
        step += batch * C * len(drafter.target_layer_ids) * target.hidden_size * f32
        draft_logits = 3 * batch * drafter.num_drafted * target.vocab_size * f32  # logits, log-probs, top-k work
        tree_logits = 3 * batch * tree_size * target.vocab_size * f32  # logits, sampling, argmax
        step = max(step, draft_logits + tree_logits)
    else:
        step = max(step, 3 * batch * target.vocab_size * f32)
    return MemoryEstimate(params=params_bytes, caches=caches, largest_step=step, batch=batch, slots=slots)


def available_memory(mesh=None) -> tuple[int, str]:
    """(bytes a call may use, where): free RAM on CPU; the devices' free memory on an accelerator."""
    devices = list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]
    if devices[0].platform == "cpu":
        return _host_available(), "this machine's free RAM"
    stats = [d.memory_stats() or {} for d in devices]
    if not all("bytes_limit" in s for s in stats):
        return _host_available(), "this machine's free RAM (the device reports no memory limit)"
    free = sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    return free, f"the free memory of {len(devices)} {devices[0].device_kind} device(s)"


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_memory(estimate: MemoryEstimate, mesh=None) -> None:
    """Refuse, before compiling, a call whose estimated memory exceeds what is free."""
    free, where = available_memory(mesh)
    if estimate.total > USABLE_FRACTION * free:
        raise ValueError(
            f"this call needs about {estimate.describe()}, more than {where} "
            f"({free / GiB:.2f} GiB); decode fewer prompts at once (a smaller batch) or shorter prompts"
        )


def params_bytes(*trees) -> int:
    """Bytes held by the arrays of some parameter pytrees."""
    return sum(int(x.size) * x.dtype.itemsize for tree in trees if tree is not None
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


@contextlib.contextmanager
def raise_out_of_memory(estimate: MemoryEstimate):
    """Turn an allocator failure that escaped the estimate into a one-line MemoryError with the sizes."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
            raise
        first = next((line.strip() for line in text.splitlines() if line.strip()), text)
        raise MemoryError(f"out of memory while decoding (estimated need {estimate.describe()}): {first[:300]}; "
                          "decode fewer prompts at once (a smaller batch) or shorter prompts") from None
