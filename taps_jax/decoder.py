"""`SpeculativeDecoder`: target + drafter (+ policy) behind one `generate`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from taps_jax.api import GenerateResult, Target, load_target
from taps_jax.checkpoints.dflash import load_drafter_module, save_drafter
from taps_jax.checkpoints.scorer import ScorerModel, load_scorer
from taps_jax.config import DrafterConfig
from taps_jax.engine.ar import DecodeConfig
from taps_jax.engine.batching import bucket, check_lengths, pad_batch
from taps_jax.engine.sampling import SamplingConfig
from taps_jax.engine.speculative import SpecConfig, spec_generate
from taps_jax.models.drafter import Drafter
from taps_jax.tree.policies import TreeConfig

POLICIES = ("ar", "chain", "ddtree", "taps")
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "default"


@dataclasses.dataclass
class DrafterModel:
    """A loaded DFlash drafter (module + config)."""

    module: Drafter

    @property
    def config(self) -> DrafterConfig:
        return self.module.config

    def save(self, path) -> None:
        save_drafter(self.module, path)


def load_drafter(path, dtype: str = "float32") -> DrafterModel:
    """Load a DFlash drafter checkpoint directory (published layout)."""
    module, _ = load_drafter_module(path, dtype)
    return DrafterModel(module)


def tree_config(policy: str, budget: int, vocab_size: int, lattice_k: int | None = None,
                beam_width: int | None = None) -> TreeConfig:
    """A TreeConfig for a policy; by default K and W are wide enough for exact DDTree.

    For "taps" the same default pool holds DDTree's top-M set, and the scorer
    re-ranks the H * W pool nodes.
    """
    if policy not in POLICIES or policy == "ar":
        raise ValueError(f"unknown tree policy {policy!r}; choose one of {', '.join(p for p in POLICIES if p != 'ar')}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive integer (non-root tree nodes per round), got {budget!r}")
    k = lattice_k or min(budget, vocab_size)
    return TreeConfig(policy, budget, k, beam_width or budget)


class SpeculativeDecoder:
    """Lossless speculative decoding with a block-diffusion drafter.

    policy: "ar" (plain autoregressive), "chain" (DFlash's argmax path),
    "ddtree" (top-`budget` prefixes by draft log-prob) or "taps" (top-`budget`
    prefixes by the reach of a learned scorer's q_cond; pass `scorer`, a
    `ScorerModel` from `load_scorer`), verified in one target forward per round.
    """

    def __init__(self, target: Target, drafter: DrafterModel | None, policy: str = "ddtree", budget: int = 32,
                 lattice_k: int | None = None, beam_width: int | None = None, scorer: ScorerModel | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.scorer = None
        if drafter is None:
            if policy != "ar":
                raise ValueError(f"policy {policy!r} needs a drafter; load one with load_drafter(path) or use policy 'ar'")
            self.target, self.drafter, self.policy, self.tree = target, None, policy, None
            return
        drafter.config.check_target(target.config)
        if policy == "taps":
            if scorer is None:
                raise ValueError(
                    "policy 'taps' needs a trained scorer: collect traces with `python -m train.traces --target DIR "
                    "--drafter DIR --prompts FILE --out TRACES`, train one with `python -m train.scorer --traces "
                    "TRACES --target DIR --out OUT` and pass scorer=load_scorer('OUT/scorer') (or a model set with "
                    "scorer/); or use policy 'ddtree'"
                )
            if not isinstance(scorer, ScorerModel):
                raise ValueError(f"scorer must be a ScorerModel (from load_scorer(path)), got {type(scorer).__name__}")
            scorer.check_models(target.config, drafter.config)
            self.scorer = scorer
            self._scorer_graphdef, self._scorer_params = nnx.split(scorer.module)
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.tree = None
        if policy != "ar":
            self.tree = tree_config(policy, budget, target.config.vocab_size, lattice_k, beam_width)
            self.tree.validate(drafter.config.block_size - 1, target.config.vocab_size)
        self._drafter_graphdef, self._drafter_params = nnx.split(drafter.module)

    @property
    def horizon(self) -> int:
        return self.drafter.config.block_size - 1

    def prepare(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0, capacity: int | None = None, stop_at_eos: bool = True):
        """Checked, padded inputs of `spec_generate`: (prompt ids, positional args, keyword args)."""
        check_lengths(max_new_tokens)
        sampling = SamplingConfig(temperature, top_k, top_p)
        ids = self.target.encode(prompts)
        tree_size = self.tree.tree_size(self.horizon)
        capacity = capacity or bucket(max(map(len, ids)) + max_new_tokens + tree_size + self.horizon + 1)
        prompt, lens, active = pad_batch(ids, capacity)
        decode = DecodeConfig(max_new_tokens, capacity, sampling, self.target.eos_ids if stop_at_eos else ())
        args = (self.target.graphdef, self.target.params, self._drafter_graphdef, self._drafter_params,
                jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(active), jax.random.key(seed))
        kwargs = {"config": SpecConfig(decode, self.tree)}
        if self.scorer is not None:
            kwargs.update(scorer_graphdef=self._scorer_graphdef, scorer_params=self._scorer_params)
        return ids, args, kwargs

    def generate(
        self,
        prompts,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        capacity: int | None = None,
        stop_at_eos: bool = True,
    ) -> GenerateResult:
        """Decode a batch of prompts; `stats` holds rounds and accepted lengths (tau)."""
        if self.policy == "ar":
            return self.target.generate(prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                                        top_p=top_p, seed=seed, capacity=capacity, stop_at_eos=stop_at_eos)
        ids, args, kwargs = self.prepare(prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, seed=seed, capacity=capacity, stop_at_eos=stop_at_eos)
        out, n, finish, rounds, accepted = spec_generate(*args, **kwargs)
        rounds, accepted = np.asarray(rounds)[: len(ids)], np.asarray(accepted)[: len(ids)]
        per_round = [accepted[b, : rounds[b]].tolist() for b in range(len(ids))]
        total_rounds = int(rounds.sum())
        stats = {
            "rounds": rounds.tolist(),
            "accepted_lengths": per_round,
            "tau": float(sum(map(sum, per_round)) / max(total_rounds, 1)),
        }
        return self.target._result(np.asarray(out), np.asarray(n), np.asarray(finish), len(ids), stats)


@dataclasses.dataclass
class ModelSet:
    """What one model directory bundles: target/, drafter/ and optionally scorer/."""

    target: Target
    drafter: DrafterModel | None = None
    scorer: ScorerModel | None = None


def load_model_set(path, dtype: str = "float32") -> ModelSet:
    """Load a model directory bundling target/, drafter/ (and scorer/ when present)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    if not (path / "target").is_dir():
        raise ValueError(f"{path}: no target/ subdirectory; a model set holds target/ and drafter/")
    target = load_target(path / "target", dtype)
    drafter = load_drafter(path / "drafter", dtype) if (path / "drafter").is_dir() else None
    scorer = load_scorer(path / "scorer") if (path / "scorer").is_dir() else None
    return ModelSet(target, drafter, scorer)
