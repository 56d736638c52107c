"""taps-jax: tree-verified speculative decoding for JAX.

The public API is this one namespace (docs/api.md):

    import taps_jax
    models = taps_jax.load_model_set("default")             # the embedded set: target/, drafter/, scorers
    decoder = taps_jax.SpeculativeDecoder(models.target, models.drafter, scorer=models.scorer_for(0.0))
    result = decoder.generate(["def fibonacci(n):"], max_new_tokens=32)   # a taps_jax.GenerateResult

The modules these come from (`taps_jax.api`, `taps_jax.decoder`, ...) keep
them too, so older imports still work. Submodules for more: `sharding`
(meshes), `compile_cache` (compiled programs cached on disk), `engine`.
"""

# Order matters only in that taps_jax.decoder imports taps_jax.api: both are imported as modules here, and
# neither reads a name from this package, so there is no cycle.
from taps_jax.api import Target, load_target
from taps_jax.calls import GenerateCall, GenerateResult
from taps_jax.checkpoints.scorer import ScorerModel, load_scorer
from taps_jax.config import DrafterConfig, ModelConfig, RopeFactors, RopeScaling
from taps_jax.decoder import (POLICIES, DrafterModel, ModelSet, SpeculativeDecoder, load_drafter,
                              load_model_set)
from taps_jax.engine.adaptive import AdaptiveConfig
from taps_jax.engine.sampling import SamplingConfig
from taps_jax.tree.lookup import LookupTable

__all__ = [
    "AdaptiveConfig", "DrafterConfig", "DrafterModel", "GenerateCall", "GenerateResult", "LookupTable", "ModelConfig", "ModelSet",
    "POLICIES", "RopeFactors", "RopeScaling", "SamplingConfig", "ScorerModel", "SpeculativeDecoder", "Target", "load_drafter",
    "load_model_set", "load_scorer", "load_target",
]
