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

import jax
import numpy as np
from flax import nnx

from taps_jax.checkpoints.hf import check_dir, check_target, read_json
from taps_jax.checkpoints.tensors import load_weights, module_to_tensors, open_tensors, write_tensors
from taps_jax.tree.scorer import Scorer, ScorerConfig

ARCHITECTURE = "TapsScorer"
EMBED_NAME = "model.embed_tokens.weight"
# A probe of 12 fixed embedding entries, not a hash of the table: a target loaded in bfloat16 (or
# re-exported in another dtype) still matches within these tolerances, while another target of the
# same shape (other weights) misses by far more.
PROBE_RTOL, PROBE_ATOL = 2e-2, 1e-4


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

    @property
    def target_probe(self) -> list[float] | None:
        """The embedding probe of the target it was fitted on (`train.scorer` records it); None if unknown."""
        return (self.training.get("target") or {}).get("embed_probe")

    def check_target_embedding(self, embed_VD) -> None:
        """ValueError (with the fix) if this scorer was fitted on a target with other embedding weights."""
        check_probe(self.target_probe, embed_probe(embed_VD), "this scorer")

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
    module = load_weights(abstract, path, _no_prefix, str(path))
    return ScorerModel(module, dict(raw.get("training") or {}))


def probe_index(vocab_size: int, width: int) -> tuple[list[int], list[int]]:
    """Rows and columns of the embedding probe (first, thirds and last row; first, middle and last column)."""
    rows = sorted({0, vocab_size // 3, (2 * vocab_size) // 3, vocab_size - 1})
    cols = sorted({0, width // 2, width - 1})
    return rows, cols


def embed_probe(embed_VD) -> list[float]:
    """The probe of a [V, D] embedding table (numpy or jax; only the 12 entries leave the device)."""
    rows, cols = probe_index(*embed_VD.shape)
    picked = embed_VD[np.asarray(rows)[:, None], np.asarray(cols)[None, :]]
    return [float(x) for x in np.asarray(jax.device_get(picked), np.float32).ravel()]


def checkpoint_embed_probe(target_dir) -> list[float]:
    """The probe of a target checkpoint, read from its safetensors (or GGUF) file: 4 rows, no model loading."""
    target_dir = check_target(target_dir)
    with open_tensors(target_dir) as where:
        if EMBED_NAME not in where:
            raise ValueError(f"{target_dir}: no tensor {EMBED_NAME!r}; expected a Hugging Face target checkpoint")
        table = where[EMBED_NAME].get_slice(EMBED_NAME)
        rows, cols = probe_index(*table.get_shape())
        picked = [np.asarray(table[r:r + 1], np.float32)[0, cols] for r in rows]
    return [float(x) for x in np.concatenate(picked)]


def check_probe(recorded, probe: list[float], scorer: str) -> None:
    """ValueError if a scorer's recorded target probe is not this target's; nothing recorded: nothing to check."""
    if recorded is None:
        return
    if len(recorded) != len(probe) or not np.allclose(recorded, probe, rtol=PROBE_RTOL, atol=PROBE_ATOL):
        raise ValueError(f"{scorer} was fitted on another target (the embedding entries it recorded, "
                         f"{[round(x, 4) for x in recorded[:3]]}..., are not this target's, "
                         f"{[round(x, 4) for x in probe[:3]]}...); "
                         "train a scorer for this target (python -m train.traces, then python -m train.scorer "
                         "--target THIS_TARGET) or use policy 'ddtree'")


def check_scorer_dir_for_target(scorer_dir, target_dir) -> None:
    """The same check from the checkpoint dirs, before either model is loaded."""
    scorer_dir = check_dir(scorer_dir)
    training = read_json(scorer_dir / "config.json").get("training") or {}
    recorded = (training.get("target") or {}).get("embed_probe") if isinstance(training, dict) else None
    if recorded is not None:
        check_probe(recorded, checkpoint_embed_probe(target_dir), f"the scorer {scorer_dir}")
