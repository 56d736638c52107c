"""Float32 precision at long positions, against a float64 transformers run (issue 35).

For each family a random tiny model (2 layers, hidden 64, vocab 256; Qwen3 with head_dim 64 = twice
hidden/heads and q/k norms, Llama with Llama 3 rope scaling) runs a 1,500-token prompt three ways:
transformers in float64 (the reference), transformers in float32, and ours in float32. Our error from
the reference must stay within 2x of transformers' own float32 error, over positions 1,000-1,499:
through `Target.logits` (dense attention) and through the cached path decoding uses (chunked prefill,
then one AR step, both `attend_cached`).

The reference is transformers' float64 run as users run it (`model.double()`): its rotary buffer is
still built in float32 and its angles are taken in float32, so a model whose inverse frequencies differ
by one ulp is p x ulp off in its angles at position p (24 of Qwen3-4B's 64 frequencies were, until
issue 35: 4-8x transformers' float32 error past position 1,000 here). q and k are scaled up so the
attention is sharp, as in trained heads, and angle errors show in the logits.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import build_hf_model

import taps_jax
from taps_jax.engine.prefill import prefill

T = 1500  # prompt tokens
LATE = slice(1000, T)  # the positions compared
PREFILL_LENS = tuple(range(1000, T, 63))  # cached path: prompts of these lengths, then one AR step each
QK_SHARPEN = 2.0
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=2048, initializer_range=0.1)
FAMILIES = {
    "llama": dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=256, rope_theta=10000.0)),
    "qwen2": dict(),
    "qwen3": dict(head_dim=64),  # twice hidden / heads, like Qwen3-4B's 128 = 2 x 2560 / 32
}


def _torch_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids[None], dtype=torch.long)).logits[0].double().numpy()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def run(request, tmp_path_factory):
    """(family, ids, float64 reference logits [T, V], transformers float32 logits, loaded Target)."""
    import torch

    family = request.param
    model = build_hf_model(family, False, seed=7, **{**TINY, **FAMILIES[family]})
    with torch.no_grad():  # sharper attention: Qwen3 through its q/k norms, the others through q/k themselves
        for name, p in model.named_parameters():
            if (family == "qwen3" and ("q_norm" in name or "k_norm" in name)) or (
                    family != "qwen3" and ("q_proj" in name or "k_proj" in name)):
                p.mul_(QK_SHARPEN)
    path = tmp_path_factory.mktemp(f"precision_{family}")
    model.save_pretrained(path)
    ids = np.random.default_rng(7).integers(0, TINY["vocab_size"], T)
    reference = _torch_logits(copy.deepcopy(model).double(), ids)
    return family, ids, reference, _torch_logits(model, ids), taps_jax.load_target(path)


def _error(logits, reference):
    """Max |logit difference| per position."""
    return np.abs(np.asarray(logits, np.float64) - reference).max(axis=-1)


def test_logits_within_2x_of_transformers_float32(run):
    family, ids, reference, hf32, target = run
    ours = np.asarray(target.logits(ids[None]))[0]
    ours_err, hf_err = _error(ours, reference)[LATE].max(), _error(hf32, reference)[LATE].max()
    assert ours_err <= 2 * hf_err, (
        f"{family}: logits at positions 1000-{T - 1} are {ours_err:.2e} from transformers float64, "
        f"transformers float32 {hf_err:.2e}")


def test_prefill_and_decode_within_2x_of_transformers_float32(run):
    family, ids, reference, hf32, target = run
    lens = np.asarray(PREFILL_LENS, np.int32)
    B = len(lens)

    @jax.jit
    def cached(params, prompt_BT, lens_B, next_B):
        model = nnx.merge(target.graphdef, params)
        last_BV, _, cache = prefill(model, prompt_BT, lens_B, T + 8)
        step_B1V, _, _ = model(next_B[:, None], lens_B[:, None], jnp.ones((B, 1, 1), bool), cache)
        return last_BV, step_B1V[:, 0]

    prompt = jnp.asarray(np.broadcast_to(ids, (B, T)), jnp.int32)
    last, step = cached(target.params, prompt, jnp.asarray(lens), jnp.asarray(ids[lens], jnp.int32))
    prefill_err = _error(last, reference[lens - 1]).max()
    step_err = _error(step, reference[lens]).max()
    hf_err = _error(hf32, reference)[LATE].max()
    assert max(prefill_err, step_err) <= 2 * hf_err, (
        f"{family}: from transformers float64, prefill's last-token logits {prefill_err:.2e}, the AR step's "
        f"{step_err:.2e} (positions {lens[0]}-{lens[-1]}); transformers float32 {hf_err:.2e}")
