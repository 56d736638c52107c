"""TAPS scorer checkpoints: a small config.json + model.safetensors.

config.json: {"architectures": ["TapsScorer"], "scorer_config": {ScorerConfig
fields}, "training": {...optional provenance...}}. Tensors use the same
naming as the other checkpoints (dotted module paths, Linear kernels stored
[out, in] as `.weight`), e.g. `token_proj.weight`, `edge_head.fc1.weight`,
`edge_head.norm.scale`, `depth_embed.weight`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flax import nnx

from taps_jax.checkpoints.hf import check_dir, read_json
from taps_jax.checkpoints.tensors import load_module, module_to_tensors, read_tensors, write_tensors
from taps_jax.tree.scorer import Scorer, ScorerConfig

ARCHITECTURE = "TapsScorer"


def _no_prefix(path: tuple) -> str:
    return ""


@dataclasses.dataclass
class ScorerModel:
    """A TAPS scorer (module + config) and what it was trained on."""

    module: Scorer
    training: dict = dataclasses.field(default_factory=dict)

    @property
    def config(self) -> ScorerConfig:
        return self.module.config

    @classmethod
    def init(cls, config: ScorerConfig, seed: int = 0) -> "ScorerModel":
        """A freshly initialised (random) scorer."""
        return cls(Scorer(config, nnx.Rngs(seed)))

    @classmethod
    def for_models(cls, target_config, drafter_config, seed: int = 0, **sizes) -> "ScorerModel":
        """A random scorer shaped for a target/drafter pair (sizes: token_dim, mlp_dim, ...)."""
        config = ScorerConfig(
            vocab_size=target_config.vocab_size, embed_dim=target_config.hidden_size,
            drafter_hidden_size=drafter_config.hidden_size, horizon=drafter_config.block_size - 1, **sizes,
        )
        return cls.init(config, seed)

    def check_models(self, target_config, drafter_config) -> None:
        self.config.check_models(target_config, drafter_config)

    def save(self, path) -> None:
        save_scorer(self.module, path, self.training)


def config_to_json(config: ScorerConfig, training: dict | None = None) -> dict:
    raw = {"architectures": [ARCHITECTURE], "scorer_config": dataclasses.asdict(config)}
    if training:
        raw["training"] = training
    return raw


def config_from_json(raw: dict, source: str) -> ScorerConfig:
    archs = raw.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ValueError(f"{source}: not a TAPS scorer checkpoint (architectures {archs!r}); expected "
                         f"[{ARCHITECTURE!r}] as written by `python -m train.scorer`")
    fields = raw.get("scorer_config")
    if not isinstance(fields, dict):
        raise ValueError(f"{source}: missing or malformed 'scorer_config' object")
    known = {f.name for f in dataclasses.fields(ScorerConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{source}: unknown scorer_config fields {unknown}; remove them (known: {sorted(known)})")
    try:
        return ScorerConfig(**fields)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{source}: incomplete scorer_config ({e})") from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def save_scorer(scorer: Scorer, path, training: dict | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_tensors(path, module_to_tensors(scorer, _no_prefix))
    (path / "config.json").write_text(json.dumps(config_to_json(scorer.config, training), indent=2))


def load_scorer(path) -> ScorerModel:
    """Load a TAPS scorer directory (config.json + model.safetensors), float32."""
    path = check_dir(path)
    raw = read_json(path / "config.json")
    config = config_from_json(raw, str(path / "config.json"))
    abstract = nnx.eval_shape(lambda: Scorer(config, nnx.Rngs(0)))
    module = load_module(abstract, read_tensors(path), _no_prefix, str(path))
    return ScorerModel(module, dict(raw.get("training") or {}))
