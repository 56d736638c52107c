"""Checkpoint I/O: save/load round trips, sharded files, bfloat16, config layouts."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import taps_jax
from taps_jax.checkpoints.hf import _prefix, config_from_hf, config_to_hf
from taps_jax.checkpoints.tensors import INDEX_NAME, module_to_tensors, read_tensors, write_tensors

from conftest import LLAMA3_ROPE, hf_logits

IDS = np.asarray([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79],
                  [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 2, 87, 47, 13, 52]], np.int32)


def params_of(target):
    return {tuple(map(str, path)): np.asarray(var.get_value()) for path, var in nnx.to_flat_state(target.params)}


def assert_same_weights(a, b):
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied"])
def test_save_load_round_trip(name, hf_checkpoint, tmp_path):
    path, hf_model = hf_checkpoint(name)
    first = taps_jax.load_target(path)
    first.save(tmp_path / "saved")
    second = taps_jax.load_target(tmp_path / "saved")
    assert second.config == first.config
    assert second.eos_ids == first.eos_ids
    assert_same_weights(first, second)
    # Every tensor on disk is identical to the one transformers wrote (a tied
    # model writes no lm_head, like transformers).
    theirs, ours = read_tensors(path), read_tensors(tmp_path / "saved")
    assert ours.keys() == theirs.keys()
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    np.testing.assert_array_equal(np.asarray(second.logits(IDS)), np.asarray(first.logits(IDS)))
    # ...and transformers reads what we wrote back to the same model.
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
    np.testing.assert_allclose(hf_logits(reloaded.float(), IDS[0]), hf_logits(hf_model, IDS[0]), rtol=0, atol=1e-5)


def test_eos_ids_round_trip(tiny_target, tmp_path):
    target = taps_jax.Target(tiny_target.model, None, eos_ids=(7, 9))
    target.save(tmp_path)
    assert taps_jax.load_target(tmp_path).eos_ids == (7, 9)


def test_sharded_checkpoint_loads(tiny_target_dir, tiny_target, tmp_path):
    tensors = module_to_tensors(tiny_target.model, _prefix)
    write_tensors(tmp_path, tensors, max_shard_bytes=16 << 10)
    shutil.copy(tiny_target_dir / "config.json", tmp_path / "config.json")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(tensors)
    assert not list(tmp_path.glob("*.tmp"))
    loaded = taps_jax.load_target(tmp_path)
    assert_same_weights(tiny_target, loaded)
    np.testing.assert_array_equal(np.asarray(loaded.logits(IDS)), np.asarray(tiny_target.logits(IDS)))


def test_single_file_save_over_sharded_dir_replaces_it(tiny_target, hf_checkpoint, tmp_path):
    other = taps_jax.load_target(hf_checkpoint("qwen3_tied")[0])
    write_tensors(tmp_path, module_to_tensors(tiny_target.model, _prefix), max_shard_bytes=16 << 10)
    other.save(tmp_path)  # a small model: one file; the stale index must not win
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]
    loaded = taps_jax.load_target(tmp_path)
    assert_same_weights(other, loaded)


def test_bfloat16_loading(tiny_target_dir, tiny_target):
    bf = taps_jax.load_target(tiny_target_dir, dtype="bfloat16")
    assert bf.config.dtype == "bfloat16"
    assert all(v.dtype == jax.numpy.bfloat16 for v in params_of(bf).values())
    logits = np.asarray(bf.logits(IDS))
    ref = np.asarray(tiny_target.logits(IDS))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    assert np.abs(logits - ref).max() < 0.1 * np.abs(ref).max()
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() > 0.8


def test_both_rope_config_layouts():
    """transformers 5 `rope_parameters` and 4.x `rope_theta` + `rope_scaling` read the same."""
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    v5 = {**base, "dtype": "float32", "rope_parameters": dict(LLAMA3_ROPE)}
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    v4 = {**base, "torch_dtype": "float32", "rope_theta": LLAMA3_ROPE["rope_theta"], "rope_scaling": scaling}
    a, b = config_from_hf(v5), config_from_hf(v4)
    assert a == b and a.rope_scaling is not None and a.rope_theta == 10000.0
    assert config_from_hf(config_to_hf(a)) == a
    plain = config_from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 5e5
