"""Bad input fails fast: a ValueError with a clear sentence, raised before tracing."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import taps_jax
from taps_jax.engine.sampling import SamplingConfig, filtered_logits


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- checkpoints

def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        taps_jax.load_target(tmp_path / "nope")


def test_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        taps_jax.load_target(tmp_path)


def test_unsupported_architecture(tiny_target_dir, tmp_path):
    path = copy_checkpoint(tiny_target_dir, tmp_path / "ckpt")
    raw = json.loads((path / "config.json").read_text())
    raw.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        taps_jax.load_target(path)
    msg = str(e.value)
    assert "MistralForCausalLM" in msg
    assert all(a in msg for a in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"))


def _rewrite_weights(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_weight_name_mismatch(tiny_target_dir, tmp_path):
    path = copy_checkpoint(tiny_target_dir, tmp_path / "ckpt")
    old, new = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.upp_proj.weight"
    _rewrite_weights(path, lambda t: t.__setitem__(new, t.pop(old)))
    with pytest.raises(ValueError) as e:
        taps_jax.load_target(path)
    assert old in str(e.value)  # the tensor the model needs
    assert new in str(e.value)  # and the stray one the checkpoint has instead


def test_extra_tensor(tiny_target_dir, tmp_path):
    path = copy_checkpoint(tiny_target_dir, tmp_path / "ckpt")
    _rewrite_weights(path, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", np.zeros(64, np.float32)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        taps_jax.load_target(path)


def test_weight_shape_mismatch(tiny_target_dir, tmp_path):
    path = copy_checkpoint(tiny_target_dir, tmp_path / "ckpt")
    name = "model.layers.0.self_attn.k_proj.weight"  # HF [out, in] = (2 * 16, 32)
    _rewrite_weights(path, lambda t: t.__setitem__(name, np.zeros((24, 32), np.float32)))
    with pytest.raises(ValueError) as e:
        taps_jax.load_target(path)
    msg = str(e.value)
    assert name in msg and "(24, 32)" in msg and "(32, 32)" in msg


@pytest.mark.parametrize("keep", [0.5, 0.002])
def test_truncated_safetensors(tiny_target_dir, tmp_path, keep):
    path = copy_checkpoint(tiny_target_dir, tmp_path / "ckpt")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="cannot read safetensors file") as e:
        taps_jax.load_target(path)
    assert "model.safetensors" in str(e.value)


def test_missing_weights_file(tiny_target_dir, tmp_path):
    path = copy_checkpoint(tiny_target_dir, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights found"):
        taps_jax.load_target(path)


def test_bad_dtype(tiny_target_dir):
    with pytest.raises(ValueError, match="dtype must be"):
        taps_jax.load_target(tiny_target_dir, dtype="float16")


# ---------------------------------------------------------------- generate / logits

GOOD = [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        ([], {}, "no prompts given"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[]], {}, "prompt 0 is empty"),
        ("hello", {}, "need a tokenizer"),
        ([[1.5, 2.0]], {}, "1-D sequence of integers"),
        ([[1, 2, 100]], {}, "token id 100 is outside the vocabulary"),
        ([[3], [-1]], {}, "token id -1 is outside the vocabulary"),
        ([[1] * 20], dict(capacity=16), "prompt 0 has 20 tokens but the cache holds 16"),
        (GOOD, dict(capacity=0), "capacity must be a positive integer"),
        (GOOD, dict(capacity=8.5), "capacity must be a positive integer"),
        (GOOD, dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (GOOD, dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
        (GOOD, dict(max_new_tokens=2.0), "max_new_tokens must be a positive integer"),
        (GOOD, dict(temperature=-0.1), "temperature must be"),
        (GOOD, dict(temperature=float("nan")), "temperature must be"),
        (GOOD, dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (GOOD, dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (GOOD, dict(top_p=-0.2), r"top_p must be in \(0, 1\]"),
        (GOOD, dict(top_k=-1), "top_k must be"),
        (GOOD, dict(seed=1.5), "seed must be an integer"),
    ],
)
def test_generate_rejects(tiny_target, no_tracing, prompts, kwargs, message):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        tiny_target.generate(prompts, **kwargs)


@pytest.mark.parametrize(
    "ids,message",
    [
        (np.zeros((1, 0), np.int32), "non-empty"),
        (np.asarray([[0.5, 1.0]]), "integer"),
        (np.asarray([[1, 100]]), r"token ids must lie in \[0, 100\)"),
        (np.asarray([[-1, 3]]), r"token ids must lie in \[0, 100\)"),
    ],
)
def test_logits_rejects(tiny_target, no_tracing, ids, message):
    with pytest.raises(ValueError, match=message):
        tiny_target.logits(ids)


def test_top_k_larger_than_vocab_means_off():
    """top_k >= vocab keeps every token (as in transformers) instead of failing inside jit."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 100)), jnp.float32)
    big = filtered_logits(logits, SamplingConfig(temperature=0.5, top_k=1000))
    off = filtered_logits(logits, SamplingConfig(temperature=0.5))
    np.testing.assert_array_equal(np.asarray(big), np.asarray(off))
    assert np.isfinite(np.asarray(big)).all()


def test_text_that_is_not_utf8_is_refused_by_the_api(no_tracing):
    from taps_jax.decoder import DEFAULT_MODEL_DIR

    target = taps_jax.load_target(DEFAULT_MODEL_DIR / "target")
    with pytest.raises(ValueError, match=r"prompt 1 is not valid UTF-8 text \(unpaired surrogate \\ud800 at "
                                         r"character 5\); pass str text, or a list of token ids"):
        target.generate(["fine", "bad \ud800 text"], 4)
