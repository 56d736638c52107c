"""Hugging Face checkpoints of target models (Qwen3, Llama 3, Qwen2)."""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx

from taps_jax.checkpoints.tensors import load_weights, module_to_tensors, write_tensors
from taps_jax.config import FAMILIES, ModelConfig, RopeFactors, RopeScaling, llama3_rope
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
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist or is not a directory; check the path")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; expected a Hugging Face model directory")
    return path


def check_target(path) -> Path:
    """A target checkpoint path: a GGUF file, or a checked Hugging Face dir."""
    from taps_jax.checkpoints.gguf import is_gguf

    return Path(path) if is_gguf(path) else check_dir(path)


def read_target_config(path, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a target checkpoint (HF dir or GGUF file), no weights read."""
    from taps_jax.checkpoints import gguf

    path = check_target(path)
    if gguf.is_gguf(path):
        return gguf.config_from_gguf(gguf.GGUFFile(path), dtype)
    return config_from_hf(read_json(path / "config.json"), str(path / "config.json"), dtype)


def read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read JSON ({e}); fix or re-export the file") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: must hold a JSON object of config fields, got a {type(raw).__name__}; "
                         f"re-export the checkpoint")
    return raw


def _field(raw: dict, key: str, kind, source: str, default=None):
    """raw[key] as `kind` (int, float or bool); a wrong JSON type is named, never coerced."""
    value = raw.get(key)
    if value is None:  # absent or null (HF writes null for "use the default")
        value = default
    if value is None:
        raise ValueError(f"{source}: config field {key!r} is missing; add it to the config")
    # bool is an int in Python; "256" or 2.5 for a size must not be coerced silently.
    ok = {
        int: not isinstance(value, bool) and isinstance(value, int),
        float: not isinstance(value, bool) and isinstance(value, (int, float)),
        bool: isinstance(value, bool),
    }[kind]
    if not ok:
        want = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise ValueError(f"{source}: config field {key!r} must be {want}, got {type(value).__name__} {value!r}; "
                         f"fix it in the config")
    return kind(value)


def _rope(raw: dict, source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from either the v4 (`rope_scaling`) or v5 (`rope_parameters`) layout."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: config field 'rope_parameters' must be an object, got {params!r}")
    theta = _field(raw if "rope_theta" in raw else params, "rope_theta", float, source, default=10000.0)
    scaling = raw.get("rope_scaling") or params
    if not isinstance(scaling, dict):
        raise ValueError(f"{source}: config field 'rope_scaling' must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"{source}: rope type {kind!r} is not supported (supported: default, llama3)")
    where = f"{source} (rope scaling)"
    return float(theta), RopeScaling(
        factor=_field(scaling, "factor", float, where),
        low_freq_factor=_field(scaling, "low_freq_factor", float, where),
        high_freq_factor=_field(scaling, "high_freq_factor", float, where),
        original_max_position_embeddings=_field(scaling, "original_max_position_embeddings", int, where),
    )


def config_from_hf(raw: dict, source: str = "config.json", dtype: str = "float32") -> ModelConfig:
    arch = (raw.get("architectures") or [None])[0]
    family = ARCHITECTURES.get(arch) or (raw.get("model_type") if raw.get("model_type") in FAMILIES else None)
    if family is None:
        raise ValueError(
            f"{source}: unsupported architecture {arch or raw.get('model_type')!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    model_type = raw.get("model_type")
    if arch in ARCHITECTURES and model_type is not None and model_type != family:
        # Two fields naming two models: whichever is wrong, loading one of them would be a guess.
        raise ValueError(f"{source}: model_type {model_type!r} does not match architectures [{arch!r}] "
                         f"(model_type {family!r}); fix the config so both name the same model")
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source}: sliding-window attention is not supported; set use_sliding_window false")
    if family == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ValueError(f"{source}: Llama with attention_bias/mlp_bias is not supported")
    theta, scaling = _rope(raw, source)
    hidden = _field(raw, "hidden_size", int, source)
    heads = _field(raw, "num_attention_heads", int, source)
    head_dim = _field(raw, "head_dim", int, source, default=hidden // heads if heads > 0 else 0)
    try:
        return _model_config(raw, source, dtype, family, theta, scaling, hidden, heads, head_dim)
    except ValueError as e:
        raise ValueError(e if str(e).startswith(source) else f"{source}: {e}") from None


def _model_config(raw, source, dtype, family, theta, scaling, hidden, heads, head_dim) -> ModelConfig:
    return ModelConfig(
        vocab_size=_field(raw, "vocab_size", int, source),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, source),
        num_layers=_field(raw, "num_hidden_layers", int, source),
        num_heads=heads,
        num_kv_heads=_field(raw, "num_key_value_heads", int, source, default=heads),
        head_dim=head_dim,
        family=family,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=_field(raw, "rms_norm_eps", float, source, default=1e-6),
        tie_embeddings=_field(raw, "tie_word_embeddings", bool, source, default=False),
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
        raw["rope_scaling"] = rope_scaling_to_hf(config.rope_scaling)
    raw.update(extra or {})
    return raw


def rope_scaling_to_hf(scaling: RopeScaling | RopeFactors) -> dict:
    """The config.json `rope_scaling` object (Llama 3's). Per-frequency factors (a GGUF's rope_freqs) are
    written as the Llama-3 scaling that gives them; ValueError when none does (writing any other rope would run
    a different model)."""
    scaling = llama3_rope(scaling, "the model's", "use the GGUF file itself")
    return {
        "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


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
    model = load_weights(abstract, path, _prefix, str(path), ignored_tensors(config))
    return model, raw


def save_transformer(model: Transformer, path, extra_config: dict | None = None) -> None:
    """Write config.json + model.safetensors in the HF layout."""
    path = Path(path)
    config = config_to_hf(model.config, extra_config)  # a config it cannot write fails before anything is written
    path.mkdir(parents=True, exist_ok=True)
    write_tensors(path, module_to_tensors(model, _prefix))
    (path / "config.json").write_text(json.dumps(config, indent=2))
