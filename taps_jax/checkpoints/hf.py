"""Hugging Face checkpoints of target models (Qwen3, Llama 3, Qwen2)."""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx

from taps_jax.checkpoints.tensors import load_module, module_to_tensors, read_tensors, write_tensors
from taps_jax.config import FAMILIES, ModelConfig, RopeScaling
from taps_jax.models.transformer import Transformer

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}


def check_dir(path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; expected a Hugging Face model directory")
    return path


def read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read JSON ({e})") from e


def _field(raw: dict, key: str, kind, source: str, default=None):
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{source}: config field {key!r} is missing")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{source}: config field {key!r} must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{source}: config field {key!r} must be a number, got {value!r}")
    return kind(value)


def _rope(raw: dict, source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either the v4 (`rope_scaling`) or v5 (`rope_parameters`) layout."""
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"{source}: rope type {kind!r} is not supported (supported: default, llama3)")
    return float(theta), RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def config_from_hf(raw: dict, source: str = "config.json", dtype: str = "float32") -> ModelConfig:
    arch = (raw.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch) or (raw.get("model_type") if raw.get("model_type") in FAMILIES else None)
    if family is None:
        raise ValueError(
            f"{source}: unsupported architecture {arch or raw.get('model_type')!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source}: sliding-window attention is not supported; set use_sliding_window false")
    if family == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ValueError(f"{source}: Llama with attention_bias/mlp_bias is not supported")
    theta, scaling = _rope(raw, source)
    hidden = _field(raw, "hidden_size", int, source)
    heads = _field(raw, "num_attention_heads", int, source)
    head_dim = raw.get("head_dim") or hidden // heads
    return ModelConfig(
        vocab_size=_field(raw, "vocab_size", int, source),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, source),
        num_layers=_field(raw, "num_hidden_layers", int, source),
        num_heads=heads,
        num_kv_heads=_field(raw, "num_key_value_heads", int, source, default=heads),
        head_dim=int(head_dim),
        family=family,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_field(raw, "rms_norm_eps", float, source, default=1e-6),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=_field(raw, "max_position_embeddings", int, source, default=32768),
        dtype=dtype,
    )


def config_to_hf(config: ModelConfig, extra: dict | None = None) -> dict:
    raw = {
        "architectures": [FAMILY_ARCH[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.qkv_bias,
        "torch_dtype": config.dtype,
    }
    if config.rope_scaling is not None:
        s = config.rope_scaling
        raw["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    raw.update(extra or {})
    return raw


def _prefix(path: tuple) -> str:
    return "" if path[0] == "lm_head" else "model."


def ignored_tensors(config: ModelConfig):
    """Checkpoint tensors that map to no parameter and are fine to skip."""

    def ignore(name: str) -> bool:
        # Tied checkpoints may still carry a copy of lm_head; rotary buffers are derived.
        return name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")

    return ignore


def load_transformer(path, dtype: str = "float32") -> tuple[Transformer, dict]:
    """Transformer + its raw config dict from a HF checkpoint dir."""
    path = check_dir(path)
    raw = read_json(path / "config.json")
    config = config_from_hf(raw, str(path / "config.json"), dtype)
    abstract = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))
    tensors = read_tensors(path)
    model = load_module(abstract, tensors, _prefix, str(path), ignored_tensors(config))
    return model, raw


def save_transformer(model: Transformer, path, extra_config: dict | None = None) -> None:
    """Write config.json + model.safetensors in the HF layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_tensors(path, module_to_tensors(model, _prefix))
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config, extra_config), indent=2))
