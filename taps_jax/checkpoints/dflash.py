"""DFlash drafter checkpoints (the published `DFlashDraftModel` layout).

config.json: Qwen3 fields + `block_size`, `num_target_layers` and
`dflash_config: {mask_token_id, target_layer_ids}`. Weights carry no
`model.` prefix: fc.weight, hidden_norm.weight, layers.{i}...., norm.weight.
Ours may add `draft_vocab_size: K` and the int32 tensor `draft_vocab` [K]
(the target ids of the drafter's K logits); a file without them drafts over
the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
from flax import nnx

from taps_jax.checkpoints.hf import _field, _rope, check_dir, read_json, rope_scaling_to_hf
from taps_jax.checkpoints.tensors import load_weights, module_to_tensors, write_tensors
from taps_jax.config import DrafterConfig
from taps_jax.models.drafter import Drafter

ARCHITECTURES = ("DFlashDraftModel",)


def _no_prefix(path: tuple) -> str:
    return ""


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """DFlash's default taps when a config omits them: spread evenly over [1, L-3]."""
    if num_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_layers - 1))) for i in range(num_layers)]


def config_from_dflash(raw: dict, source: str = "config.json", dtype: str = "float32") -> DrafterConfig:
    """DrafterConfig from a DFlash config.json dict (errors name the field and the fix)."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
        raise ValueError(
            f"{source}: not a DFlash drafter checkpoint (architectures {archs!r}); supported drafter "
            f"architectures: {', '.join(ARCHITECTURES)}. A target model is loaded with load_target instead"
        )
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(
            f"{source}: missing or malformed 'dflash_config' (got {dflash!r}); a DFlash drafter config "
            f"needs dflash_config = {{'mask_token_id': int, 'target_layer_ids': [int, ...]}}"
        )
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError(f"{source}: sliding-window attention is not supported; set use_sliding_window false")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{source}: attention_bias/mlp_bias drafters are not supported")
    if (raw.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")

    mask = dflash.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise ValueError(
            f"{source}: dflash_config.mask_token_id must be an integer token id (a row of the target's "
            f"embedding table), got {mask!r}"
        )
    num_layers = _field(raw, "num_hidden_layers", int, source)
    num_target_layers = _field(raw, "num_target_layers", int, source)
    taps = dflash.get("target_layer_ids")
    if taps is None:
        taps = default_target_layer_ids(num_target_layers, num_layers)
    if not isinstance(taps, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in taps):
        raise ValueError(f"{source}: dflash_config.target_layer_ids must be a list of integers, got {taps!r}")

    theta, scaling = _rope(raw, source)
    hidden = _field(raw, "hidden_size", int, source)
    heads = _field(raw, "num_attention_heads", int, source)
    head_dim = _field(raw, "head_dim", int, source, default=hidden // heads)
    try:
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=_field(raw, "intermediate_size", int, source),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=_field(raw, "num_key_value_heads", int, source, default=heads),
            head_dim=head_dim,
            block_size=_field(raw, "block_size", int, source),
            mask_token_id=mask,
            target_layer_ids=tuple(taps),
            num_target_layers=num_target_layers,
            vocab_size=_field(raw, "vocab_size", int, source),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=_field(raw, "rms_norm_eps", float, source, default=1e-6),
            dtype=dtype,
            draft_vocab_size=(None if raw.get("draft_vocab_size") is None
                              else _field(raw, "draft_vocab_size", int, source)),
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


def config_to_dflash(config: DrafterConfig) -> dict:
    """The DFlash config.json dict (loadable by the reference DFlashDraftModel too)."""
    c = config
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * c.num_layers,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "torch_dtype": c.dtype,
    }
    if c.rope_scaling is not None:
        raw["rope_scaling"] = rope_scaling_to_hf(c.rope_scaling)
    if c.draft_vocab_size is not None:
        raw["draft_vocab_size"] = c.draft_vocab_size  # its ids are the `draft_vocab` tensor
    return raw


def read_drafter_config(path, dtype: str = "float32") -> DrafterConfig:
    path = check_dir(path)
    return config_from_dflash(read_json(path / "config.json"), str(path / "config.json"), dtype)


def load_drafter_module(path, dtype: str = "float32") -> tuple[Drafter, DrafterConfig]:
    """Drafter + its config from a DFlash checkpoint dir."""
    config = read_drafter_config(path, dtype)
    path = Path(path)
    abstract = nnx.eval_shape(lambda: Drafter(config, nnx.Rngs(0)))

    def ignore(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")  # derived from the config

    drafter = load_weights(abstract, path, _no_prefix, str(path), ignore)
    if config.draft_vocab_size is not None:
        try:
            drafter.set_draft_vocab(jax.device_get(drafter.draft_vocab[...]))
        except ValueError as e:
            raise ValueError(f"{path}: tensor 'draft_vocab': {e}; re-export the drafter") from e
    return drafter, config


def save_drafter(drafter: Drafter, path) -> None:
    """Write config.json + model.safetensors in the DFlash layout."""
    path = Path(path)
    config = config_to_dflash(drafter.config)  # a config it cannot write fails before anything is written
    path.mkdir(parents=True, exist_ok=True)
    write_tensors(path, module_to_tensors(drafter, _no_prefix))
    (path / "config.json").write_text(json.dumps(config, indent=2))
