"""DFlash drafter: golden parity, an independent numpy reference, the context cache, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import taps_jax
from taps_jax.checkpoints.dflash import config_from_dflash, load_drafter_module, save_drafter
from taps_jax.checkpoints.tensors import load_module, module_to_tensors, param_shapes
from taps_jax.config import DrafterConfig, ModelConfig
from taps_jax.models.drafter import Drafter, DrafterCache, draft_logits

GOLDEN = Path(__file__).resolve().parent / "golden" / "ddtree-tiny"  # tests/golden/README.md

# One compiled program per call site instead of op-by-op eager dispatch (much faster on CPU).
uncached = nnx.jit(lambda m, *args: m.forward_uncached(*args))
masked = nnx.jit(lambda m, *args: m.forward_masked(*args))
cached = nnx.jit(lambda m, *args: m(*args))
append = nnx.jit(lambda m, *args: m.append_context(*args))
drafted = nnx.jit(lambda d, t, *args: draft_logits(d, t, *args))

TINY = DrafterConfig(
    hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    block_size=4, mask_token_id=49, target_layer_ids=(0, 1, 3), num_target_layers=4, vocab_size=50,
    rope_theta=10_000.0,
)


def random_drafter(config: DrafterConfig, seed: int) -> tuple[Drafter, dict[str, np.ndarray]]:
    """A drafter with O(1)-scale random weights (norm weights too), and those weights by HF name."""
    rng = np.random.default_rng(seed)
    abstract = nnx.eval_shape(lambda: Drafter(config, nnx.Rngs(0)))
    tensors = {}
    for name, shape in param_shapes(abstract, lambda p: "").items():
        if len(shape) == 1:  # norm weights: around 1 so the norms matter
            tensors[name] = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        else:  # [out, in]
            tensors[name] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return load_module(abstract, tensors, lambda p: "", "random"), tensors


# --- an independent, unbatched float64 reference ---------------------------

def np_rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def np_rope(x_TNH, pos_T, theta):
    half = x_TNH.shape[-1] // 2
    inv = theta ** (-np.arange(half) * 2.0 / x_TNH.shape[-1])
    ang = pos_T[:, None, None].astype(np.float64) * inv  # [T, 1, half]
    x1, x2 = x_TNH[..., :half], x_TNH[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def np_drafter(W, cfg: DrafterConfig, emb_KD, pos_K, feats_CF, ctx_pos_C):
    """Final-normed hidden [K, D] of one block given its valid context (no padding)."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    eps, Nh, Nkv, Hd = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ctx = np_rms(feats_CF.astype(np.float64) @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x = emb_KD.astype(np.float64)
    K, C = x.shape[0], ctx.shape[0]
    key_pos = np.concatenate([ctx_pos_C, pos_K])
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = np_rms(x, W[p + "input_layernorm.weight"], eps)
        q = np_rms((h @ W[p + "self_attn.q_proj.weight"].T).reshape(K, Nh, Hd), W[p + "self_attn.q_norm.weight"], eps)
        q = np_rope(q, pos_K, cfg.rope_theta)
        src = np.concatenate([ctx, h])  # context skips the input norm
        k = (src @ W[p + "self_attn.k_proj.weight"].T).reshape(C + K, Nkv, Hd)
        k = np_rope(np_rms(k, W[p + "self_attn.k_norm.weight"], eps), key_pos, cfg.rope_theta)
        v = (src @ W[p + "self_attn.v_proj.weight"].T).reshape(C + K, Nkv, Hd)
        out = np.zeros((K, Nh, Hd))
        for n in range(Nh):
            g = n // (Nh // Nkv)
            s = q[:, n] @ k[:, g].T / np.sqrt(Hd)  # no mask: the block is non-causal
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, n] = (s / s.sum(-1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(K, -1) @ W[p + "self_attn.o_proj.weight"].T
        h = np_rms(x, W[p + "post_attention_layernorm.weight"], eps)
        gate = h @ W[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    return np_rms(x, W["norm.weight"], eps)


# --- golden parity with the reference DFlashDraftModel ----------------------

@pytest.fixture(scope="module")
def golden():
    g = np.load(GOLDEN / "golden.npz")
    target = taps_jax.load_target(GOLDEN / "target").model
    drafter, config = load_drafter_module(GOLDEN / "drafter")
    return g, target, drafter, config


def test_golden_target_tap_features(golden):
    g, target, _, config = golden
    ids = jnp.asarray(g["drafter_prompt_ids"])
    T, D = ids.shape[1], target.config.hidden_size
    forward = nnx.jit(lambda m, *args: m(*args, taps=config.target_layer_ids)[1])
    taps = forward(target, ids, jnp.arange(T)[None], jnp.tril(jnp.ones((T, T), bool))[None])
    want = g["drafter_context_features"]
    assert taps.shape == want.shape
    np.testing.assert_allclose(np.asarray(taps)[..., :D], want[..., :D], atol=1e-4, err_msg="tap of layer 0")
    # Tap 2 is the target's LAST layer: Hugging Face's hidden_states[L] (what DFlash reads)
    # is the final-normed output there, not the raw layer output.
    np.testing.assert_allclose(
        np.asarray(taps)[..., D:], want[..., D:], atol=1e-4,
        err_msg="tap of the last target layer must be final-normed (HF hidden_states[-1])",
    )


def test_golden_drafter_logits(golden):
    g, target, drafter, config = golden
    config.check_target(target.config)
    feats = jnp.asarray(g["drafter_context_features"])
    block = jnp.asarray(g["drafter_block_ids"])
    block_pos = jnp.arange(5, 21)[None]
    want = g["drafter_logits"]

    hidden = uncached(drafter, target.embed(block), block_pos, feats, jnp.arange(5)[None], jnp.ones((1, 5), bool))
    np.testing.assert_allclose(np.asarray(target.unembed(hidden[:, 1:])), want, atol=1e-4)

    # Cached: context arrives padded to 8 with garbage in the padding.
    padded = jnp.concatenate([feats, 100.0 * jnp.ones((1, 3, feats.shape[-1]))], axis=1)
    cache = append(drafter, padded, jnp.array([5]), DrafterCache.zeros(config, 1, 32))
    assert int(cache.lengths_B[0]) == 5
    logits, hidden_BHD = drafted(drafter, target, block, block_pos, cache)
    assert logits.dtype == jnp.float32 and logits.shape == (1, 15, 256) and hidden_BHD.shape == (1, 15, 96)
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4)


# --- independent reimplementation -------------------------------------------

def test_matches_numpy_reference():
    drafter, W = random_drafter(TINY, seed=0)
    rng = np.random.default_rng(1)
    B, C, K, F = 2, 7, TINY.block_size, len(TINY.target_layer_ids) * TINY.hidden_size
    n_ctx = np.array([7, 4])
    feats = rng.standard_normal((B, C, F)).astype(np.float32)
    emb = rng.standard_normal((B, K, TINY.hidden_size)).astype(np.float32)
    ctx_pos = np.broadcast_to(np.arange(C), (B, C))
    block_pos = n_ctx[:, None] + np.arange(K)
    valid = np.arange(C)[None] < n_ctx[:, None]
    got = uncached(drafter, jnp.asarray(emb), jnp.asarray(block_pos), jnp.asarray(feats),
                                   jnp.asarray(ctx_pos), jnp.asarray(valid))
    for b in range(B):
        n = n_ctx[b]
        want = np_drafter(W, TINY, emb[b], block_pos[b], feats[b, :n], np.arange(n))
        np.testing.assert_allclose(np.asarray(got[b]), want, atol=1e-5, rtol=1e-5)


def test_training_mask_matches_separate_blocks():
    """forward_masked with two anchor blocks side by side = each block on its own context."""
    drafter, _ = random_drafter(TINY, seed=2)
    rng = np.random.default_rng(3)
    S, K, F = 9, TINY.block_size, len(TINY.target_layer_ids) * TINY.hidden_size
    feats = jnp.asarray(rng.standard_normal((1, S, F)), jnp.float32)
    anchors = [3, 6]
    emb = jnp.asarray(rng.standard_normal((1, 2 * K, TINY.hidden_size)), jnp.float32)
    pos = jnp.asarray(np.concatenate([a + np.arange(K) for a in anchors]))[None]
    blk_of = np.repeat(np.arange(2), K)
    ctx_vis = np.arange(S)[None, :] < np.repeat(anchors, K)[:, None]  # strictly before the anchor
    own_block = blk_of[:, None] == blk_of[None, :]
    mask = jnp.asarray(np.concatenate([ctx_vis, own_block], axis=1))[None]
    got = masked(drafter, emb, pos, feats, jnp.arange(S)[None], mask)
    for j, a in enumerate(anchors):
        # Same static shapes for both blocks: context padded to S, hidden beyond the anchor.
        one = uncached(drafter, emb[:, j * K:(j + 1) * K], pos[:, j * K:(j + 1) * K], feats,
                       jnp.arange(S)[None], jnp.arange(S)[None] < a)
        np.testing.assert_allclose(np.asarray(got[:, j * K:(j + 1) * K]), np.asarray(one), atol=1e-5)


def test_blockwise_training_forward_equals_the_dense_mask():
    """forward_blocks (training: blocks never score each other's keys) = forward_masked under anchor_block_mask,
    including an anchor at 0 that sees no context, and its gradients too."""
    from train.distill_objective import anchor_block_mask, anchor_context_visibility

    drafter, _ = random_drafter(TINY, seed=6)
    rng = np.random.default_rng(7)
    B, S, A, K = 2, 11, 3, TINY.block_size
    F = len(TINY.target_layer_ids) * TINY.hidden_size
    feats = jnp.asarray(rng.standard_normal((B, S, F)), jnp.float32)
    anchors = jnp.asarray([[0, 4, 9], [7, 2, 5]], jnp.int32)
    emb = jnp.asarray(rng.standard_normal((B, A * K, TINY.hidden_size)), jnp.float32)
    pos = (anchors[..., None] + jnp.arange(K)).reshape(B, A * K)
    ctx_pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    dense = lambda m: m.forward_masked(emb, pos, feats, ctx_pos, anchor_block_mask(anchors, S, K))
    blocks = lambda m: m.forward_blocks(emb, pos, feats, ctx_pos, anchor_context_visibility(anchors, S))
    np.testing.assert_allclose(np.asarray(nnx.jit(blocks)(drafter)), np.asarray(nnx.jit(dense)(drafter)),
                               atol=1e-5, rtol=1e-5)
    grads = [nnx.grad(lambda m, f=f: jnp.sum(jnp.sin(f(m))))(drafter) for f in (blocks, dense)]
    for got, want in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="visibility"):
        drafter.forward_blocks(emb, pos, feats, ctx_pos, anchor_context_visibility(anchors, S - 1))


# --- context cache ----------------------------------------------------------

def test_cache_matches_recompute():
    drafter, _ = random_drafter(TINY, seed=4)
    rng = np.random.default_rng(5)
    B, C, K, F, D = 2, 5, TINY.block_size, len(TINY.target_layer_ids) * TINY.hidden_size, TINY.hidden_size
    # Sequence 0 ends exactly at capacity 12; its last padded write runs past it (dropped).
    rounds = [(5, 3), (2, 4), (1, 1), (4, 2)]
    cache = DrafterCache.zeros(TINY, B, capacity=12)
    seen = [[], []]
    for counts in rounds:
        new = rng.standard_normal((B, C, F)).astype(np.float32)
        for b in range(B):
            new[b, counts[b]:] = 1e3  # garbage padding must stay invisible
            seen[b].extend(new[b, :counts[b]])
        cache = append(drafter, jnp.asarray(new), jnp.asarray(counts, jnp.int32), cache)
        lengths = np.array([len(s) for s in seen])
        np.testing.assert_array_equal(np.asarray(cache.lengths_B), lengths)
        emb = jnp.asarray(rng.standard_normal((B, K, D)), jnp.float32)
        block_pos = jnp.asarray(lengths[:, None] + np.arange(K))
        got = cached(drafter, emb, block_pos, cache)

        L = cache.capacity  # one static shape for every round
        all_feats = np.zeros((B, L, F), np.float32)
        for b in range(B):
            all_feats[b, :lengths[b]] = np.stack(seen[b])
        want = uncached(drafter, emb, block_pos, jnp.asarray(all_feats), jnp.broadcast_to(jnp.arange(L), (B, L)),
                                        jnp.arange(L)[None] < jnp.asarray(lengths)[:, None])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert cache.lengths_B.tolist() == [12, 10]


# --- checkpoints and configs ------------------------------------------------

def test_save_load_round_trip(tmp_path):
    drafter, W = random_drafter(TINY, seed=6)
    save_drafter(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"mask_token_id": 49, "target_layer_ids": [0, 1, 3]}
    loaded, config = load_drafter_module(tmp_path / "d")
    assert config == TINY
    again = module_to_tensors(loaded, lambda p: "")
    assert sorted(again) == sorted(W)
    assert not any(name.startswith("model.") for name in again)
    for name in W:
        np.testing.assert_array_equal(again[name], W[name], err_msg=name)
    rng = np.random.default_rng(7)
    args = (jnp.asarray(rng.standard_normal((1, 4, 32)), jnp.float32), jnp.arange(3, 7)[None],
            jnp.asarray(rng.standard_normal((1, 3, 96)), jnp.float32), jnp.arange(3)[None], jnp.ones((1, 3), bool))
    np.testing.assert_array_equal(np.asarray(uncached(loaded, *args)), np.asarray(uncached(drafter, *args)))


def qwen3_4b_dflash_raw() -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "block_size": 16, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
        "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "num_attention_heads": 32,
        "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936, "dtype": "bfloat16",
    }


def test_qwen3_4b_dflash_config():
    config = config_from_dflash(qwen3_4b_dflash_raw())
    assert config == DrafterConfig(
        hidden_size=2560, intermediate_size=9728, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128,
        block_size=16, mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33), num_target_layers=36,
        vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
    )
    shapes = param_shapes(nnx.eval_shape(lambda: Drafter(config, nnx.Rngs(0))), lambda p: "")
    assert shapes["fc.weight"] == (2560, 5 * 2560)
    assert shapes["layers.4.self_attn.q_proj.weight"] == (4096, 2560)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, 2560)
    assert shapes["layers.0.self_attn.k_norm.weight"] == (128,)
    assert shapes["layers.0.mlp.down_proj.weight"] == (2560, 9728)
    assert len(shapes) == 2 + 5 * 11 + 1
    # Taps omitted: DFlash's default spread gives the same ids for this geometry.
    raw = qwen3_4b_dflash_raw()
    del raw["dflash_config"]["target_layer_ids"]
    assert config_from_dflash(raw).target_layer_ids == (1, 9, 17, 25, 33)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(architectures=["Qwen3ForCausalLM"]), "DFlashDraftModel"),
    (lambda r: r.pop("dflash_config"), "dflash_config"),
    (lambda r: r["dflash_config"].update(mask_token_id="151669"), "mask_token_id"),
    (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda r: r["dflash_config"].update(target_layer_ids=1), "target_layer_ids"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[]), "target_layer_ids"),
    (lambda r: r.update(block_size=16.0), "block_size"),
    (lambda r: r.update(block_size=1), "block_size"),
    (lambda r: r.pop("num_target_layers"), "num_target_layers"),
    (lambda r: r.update(num_key_value_heads=7), "num_kv_heads"),
])
def test_config_errors(edit, message):
    raw = qwen3_4b_dflash_raw()
    edit(raw)
    with pytest.raises(ValueError, match=message):
        config_from_dflash(raw, "drafter/config.json")


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_drafter_module(tmp_path / "missing")
    drafter, _ = random_drafter(TINY, seed=8)
    save_drafter(drafter, tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({**json.loads((tmp_path / "d" / "config.json").read_text()),
                                                            "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing tensor 'layers.2"):
        load_drafter_module(tmp_path / "d")


def test_check_target_names_both_values():
    base = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=8)
    TINY.check_target(base)
    cases = [
        (TINY, base.replace(hidden_size=64), ["32", "64", "hidden_size"]),
        (TINY, base.replace(vocab_size=60), ["50", "60", "vocab_size"]),
        (TINY.replace(target_layer_ids=(0, 5)), base, ["[5]", "4 layers"]),
        (TINY.replace(num_target_layers=36), base, ["36", "4 layers"]),
        (TINY.replace(mask_token_id=50), base, ["mask_token_id=50", "vocab_size=50"]),
    ]
    for drafter_config, target_config, parts in cases:
        with pytest.raises(ValueError) as e:
            drafter_config.check_target(target_config)
        for part in parts:
            assert part in str(e.value), (part, str(e.value))
