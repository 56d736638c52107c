"""`SpeculativeDecoder`: target + drafter (+ policy) behind one `generate`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from taps_jax import sharding
from taps_jax.api import GenerateResult, Target, load_target
from taps_jax.calls import STREAM_CHUNK, GenerateCall, Programs
from taps_jax.checkpoints.dflash import _no_prefix, load_drafter_module, read_drafter_config, save_drafter
from taps_jax.checkpoints.scorer import ScorerModel, load_scorer
from taps_jax.config import DrafterConfig
from taps_jax.engine.adaptive import (AdaptiveConfig, AdaptiveTable, after_ar_steps, probe_due, start_clock,
                                     trees_never_pay)
from taps_jax.engine.ar import DecodeConfig
from taps_jax.engine.batching import check_call, check_lengths, pad_batch
from taps_jax.engine.prefill import FINISH_NAMES, PREFILL_CHUNK, RUNNING
from taps_jax.engine.sampling import SamplingConfig
from taps_jax.engine.sizing import check_memory, estimate_memory, params_bytes, plan_capacity
from taps_jax.engine.static import StaticGraph
from taps_jax.engine.speculative import (SpecConfig, spec_advance, spec_extend, spec_generate, spec_outputs,
                                         spec_refill, spec_start, spec_until)
from taps_jax.model_sets import NAMED_SETS, resolve_set, set_name, target_of
from taps_jax.models.drafter import Drafter
from taps_jax.session import SESSION_CHUNK, ChatSession, session_sizes
from taps_jax.tree.lookup import LookupTable
from taps_jax.tree.policies import TreeConfig

POLICIES = ("ar", "chain", "ddtree", "taps", "adaptive")
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


def load_drafter(path, dtype: str = "float32", mesh=None) -> DrafterModel:
    """Load a DFlash drafter checkpoint directory (published layout).

    mesh: load straight onto a device mesh (each host reads only its shards),
    as `load_target`. None (default): one device.
    """
    if mesh is None:
        module, _ = load_drafter_module(path, dtype)
        return DrafterModel(module)
    config = read_drafter_config(path, dtype)
    sharding.check_config(config, mesh, "drafter", replicate_kv=True)
    abstract = nnx.eval_shape(lambda: Drafter(config, nnx.Rngs(0)))
    module = sharding.load_module(abstract, Path(path), _no_prefix, str(path), mesh,
                                  ignore=lambda name: name.endswith("rotary_emb.inv_freq"))
    return DrafterModel(module)


def tree_config(policy: str, budget: int, vocab_size: int, lattice_k: int | None = None,
                beam_width: int | None = None) -> TreeConfig:
    """A TreeConfig for a policy; by default K and W are wide enough for exact DDTree.

    For "taps" the same default pool holds DDTree's top-M set, and the scorer
    re-ranks the H * W pool nodes.
    """
    if policy not in ("chain", "ddtree", "taps"):
        raise ValueError(f"unknown tree policy {policy!r}; choose one of chain, ddtree, taps")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive integer (non-root tree nodes per round), got {budget!r}")
    # `is None`, not `or`: an explicit 0 must reach validate() and fail there.
    k = min(budget, vocab_size) if lattice_k is None else lattice_k
    return TreeConfig(policy, budget, k, budget if beam_width is None else beam_width)


def check_scorer_target(scorer: ScorerModel, target: Target) -> None:
    """ValueError if the scorer recorded another target's embedding (it learned that target's acceptance).

    Skipped on multi-host meshes, where the table is not addressable here; the
    CLIs check from the checkpoint files there.
    """
    if jax.process_count() == 1:
        scorer.check_target_embedding(target.model.embed_tokens.embedding.get_value())


class SpeculativeDecoder:
    """Lossless speculative decoding with a block-diffusion drafter.

    policy: "ar" (plain autoregressive), "chain" (DFlash's argmax path),
    "ddtree" (top-`budget` prefixes by draft log-prob) or "taps" (top-`budget`
    prefixes by the reach of a learned scorer's q_cond; pass `scorer`, a
    `ScorerModel` from `load_scorer`), verified in one target forward per round;
    or "adaptive" (the default): each round picks one of a few budgets up to
    `budget`, down to a plain AR step, to maximise expected tokens per unit
    cost (TAPS trees when `scorer` is given, DDTree trees otherwise;
    `taps_jax.engine.adaptive`): never much slower than the best of AR and
    the fixed trees on the hardware it runs on.

    costs (adaptive): the cost of one round of each budget in
    `adaptive_budgets(budget)` order (any unit, e.g. ms). Default: measured
    once per device kind and shape and cached on disk
    (`taps_jax.engine.calibrate`). adaptive: an `AdaptiveConfig` to use
    instead of `AdaptiveConfig.for_budget(budget)` (other budgets, decay,
    probing share, signal buckets, or the `force_cycle` test hook). table
    (adaptive): an `AdaptiveTable` of accepted lengths per text signal and
    budget fitted on traces (a model set's adaptive.json, `ModelSet.table`),
    the first call's prior; without one the first round probes the largest
    tree.

    lookup: a `LookupTable` (a model set's lookup.json, `ModelSet.lookup`):
    every draft gets the committed text's own earlier continuation mixed in
    with the fitted weights (`taps_jax.tree.lookup`), so trees copy what the
    text repeats. Output is unchanged; only which nodes are verified.

    mesh: run on a ("data", "model") device mesh (`taps_jax.sharding.make_mesh`):
    target and drafter params are sharded by the logical-axis rules, the
    scorer is replicated, and each batch is split over "data" (padded to a
    multiple of it with inactive rows; results hold only your prompts).
    Default: the target's mesh (`load_target(path, mesh=...)`), i.e. one
    device for a target loaded without one. A model axis that divides the
    query heads but not the kv heads repeats each kv head of target and
    drafter (`sharding.replicate_kv_heads`). Tokens are the same as on one
    device.

    prefill_chunk: prompt tokens per prefill step (default 512): a prompt is
    run through the cache in chunks, so prefill memory is O(chunk x context).
    Prompt length, context and memory are checked before anything compiles.
    """

    def __init__(self, target: Target, drafter: DrafterModel | None, policy: str = "adaptive", budget: int = 32,
                 lattice_k: int | None = None, beam_width: int | None = None, scorer: ScorerModel | None = None,
                 mesh=None, prefill_chunk: int = PREFILL_CHUNK, costs=None, adaptive: AdaptiveConfig | None = None,
                 table: AdaptiveTable | None = None, lookup: LookupTable | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if not isinstance(target, Target):
            raise ValueError(f"target must be a Target (from load_target(path)), got {type(target).__name__}")
        if drafter is not None and not isinstance(drafter, DrafterModel):
            raise ValueError(f"drafter must be a DrafterModel (from load_drafter(path)) or None, "
                             f"got {type(drafter).__name__}")
        check_call(0, None, True, prefill_chunk)
        self.prefill_chunk = prefill_chunk
        if mesh is not None and mesh is not target.mesh:
            target = target.on_mesh(mesh)
        self.mesh = target.mesh
        self.scorer, self.lookup = None, None
        if drafter is None:
            if policy != "ar":
                raise ValueError(f"policy {policy!r} needs a drafter; load one with load_drafter(path) or use policy 'ar'")
            self.target, self.drafter, self.policy, self.tree = target, None, policy, None
            return
        drafter.config.check_target(target.config)
        if policy == "adaptive":
            adaptive = AdaptiveConfig.for_budget(budget) if adaptive is None else adaptive
            if not isinstance(adaptive, AdaptiveConfig):
                raise ValueError(f"adaptive must be an AdaptiveConfig, got {type(adaptive).__name__}")
            adaptive.validate()
            if costs is not None:
                costs = check_costs(costs, len(adaptive.budgets))
            if table is not None and not isinstance(table, AdaptiveTable):
                raise ValueError(f"table must be an AdaptiveTable (AdaptiveTable.load(path)), got {type(table).__name__}")
        elif costs is not None or adaptive is not None or table is not None:
            raise ValueError(f"costs, adaptive and table are for policy 'adaptive', not {policy!r}")
        if lookup is not None and not isinstance(lookup, LookupTable):
            raise ValueError(f"lookup must be a LookupTable (LookupTable.load(path)), got {type(lookup).__name__}")
        if lookup is not None:
            for greedy in (True, False):
                lookup.config(greedy).validate(drafter.config.block_size - 1)
        self.lookup = lookup
        self.adaptive, self.costs = (adaptive, costs) if policy == "adaptive" else (None, None)
        self.table = table if policy == "adaptive" else None
        # Each call's final statistics and probe clock start the next call with the same sampling settings and
        # costs; the first call starts from the fitted table (a model set's adaptive.json) when there is one.
        self._priors = {}
        self._measured, self._device_costs = {}, {}  # costs per call shape; costs placed on device
        self._never_pay = {}  # (prior, costs) -> `trees_never_pay`
        self._no_force, self._no_limit = (jnp.int32(-1), jnp.int32(2**30)) if self.adaptive else (None, None)
        if policy == "taps" or (policy == "adaptive" and scorer is not None):
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
            check_scorer_target(scorer, target)
            self.scorer = scorer
            self._scorer_graphdef, self._scorer_params = nnx.split(scorer.module)
            self._scorer_graphdef = StaticGraph(self._scorer_graphdef)
            self._scorer_params = sharding.replicate(self._scorer_params, self.mesh)
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.tree = None
        if policy != "ar":
            family = policy if policy != "adaptive" else ("taps" if scorer is not None else "ddtree")
            largest = budget if policy != "adaptive" else self.adaptive.budgets[-1]
            self.tree = tree_config(family, largest, target.config.vocab_size, lattice_k, beam_width)
            self.tree.validate(drafter.config.block_size - 1, target.config.vocab_size)
        module = drafter.module
        if self.mesh is not None:
            sharding.check_config(drafter.config, self.mesh, "drafter", replicate_kv=True)
            module = sharding.replicate_kv_heads(module, self.mesh)  # no-op once loaded onto this mesh
        self._drafter_config = module.config  # kv heads as the caches will hold them
        self._drafter_graphdef, self._drafter_params = nnx.split(module)
        self._drafter_graphdef = StaticGraph(self._drafter_graphdef)  # jit hashes it on every call
        self._drafter_params = sharding.shard_params(self._drafter_params, self.mesh)

    @property
    def horizon(self) -> int:
        return self.drafter.config.block_size - 1

    def prepare(self, prompts, max_new_tokens: int = 64, **options) -> GenerateCall:
        """`generate`'s checks and host work, without the decode: a `GenerateCall`
        to `.compile()` ahead of time, `.run()` or `.stream()` (taps_jax.calls).

        Every size is checked here, before anything is traced: the context
        (prompt + new tokens + tree headroom within max_position_embeddings)
        and the estimated memory (`taps_jax.engine.sizing`). options: as `generate`'s.
        """
        options = self._call_options(**options)
        if self.policy == "ar":
            return self.target.prepare(prompts, max_new_tokens, **options)
        return self._prepare(prompts, max_new_tokens, options)

    def session(self, max_new_tokens: int = 64, *, context: int | None = None, chunk: int = SESSION_CHUNK,
                **options) -> ChatSession:
        """A conversation that keeps its caches between turns (`taps_jax.session`): each turn prefills only what
        follows what the target's cache and the drafter's context hold. context: conversation tokens it may hold
        (default: 4096, or less on a shorter target); chunk: prefill tokens per step; options: as `generate`'s
        (capacity and prefill_chunk are the session's). An adaptive session runs the speculative program every
        turn (its loop takes AR steps where trees do not pay), its statistics going on from turn to turn."""
        if self.policy == "ar":
            return self.target.session(max_new_tokens, context=context, chunk=chunk, **options)
        headroom = self.tree.tree_size(self.horizon)
        context, capacity = session_sizes(self.target.config, context, max_new_tokens, headroom, chunk)
        options = self._call_options(capacity=capacity, prefill_chunk=chunk, **options)
        call = self._prepare([[0]], max_new_tokens, options, shortcut=False)
        before_turn = None
        if self.adaptive is not None:
            sampling = call.kwargs["config"].decode.sampling
            key = (sampling, self.branch_costs)

            def before_turn(kwargs):  # the last finished turn's statistics and probe clock
                prior, clock = self._start(key, sampling)
                kwargs.update(prior=prior, clock=clock)

        return ChatSession(self.target, call, context, headroom, before_turn)

    def _call_options(self, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                      capacity: int | None = None, stop_at_eos: bool = True, prefill_chunk: int | None = None) -> dict:
        """A call's options, defaults filled in (the prefill chunk: the decoder's)."""
        prefill_chunk = self.prefill_chunk if prefill_chunk is None else prefill_chunk
        return dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, capacity=capacity,
                    stop_at_eos=stop_at_eos, prefill_chunk=prefill_chunk)

    def warm_up(self, prompts, max_new_tokens: int = 64, **options) -> GenerateResult:
        """`generate`, and for the adaptive policy also one run of its speculative program (which that call
        skips where every round would be an AR step): a later call whose probe comes due then does not compile
        mid-run (say, in a benchmark's timed repeats). The extra run's statistics are dropped: the decoder's
        estimates and probe clock stay as `generate` left them."""
        result = self.generate(prompts, max_new_tokens, **options)
        if self.policy == "adaptive" and max_new_tokens > 2:
            kept = dict(self._priors)
            self._prepare(prompts, max_new_tokens, self._call_options(**options), shortcut=False).run()
            self._priors = kept
        return result

    def _prepare(self, prompts, max_new_tokens: int, options: dict, shortcut: bool = True) -> GenerateCall:
        """`prepare` for a speculative policy (options filled in); shortcut=False: the speculative program even
        where the adaptive policy would run AR's (`warm_up`)."""
        seed, capacity, prefill_chunk = options["seed"], options["capacity"], options["prefill_chunk"]
        check_lengths(max_new_tokens)
        check_call(seed, capacity, options["stop_at_eos"], prefill_chunk)
        sampling = SamplingConfig(options["temperature"], options["top_k"], options["top_p"])
        ids = self.target.encode(prompts)
        tree_size = self.tree.tree_size(self.horizon)
        capacity = plan_capacity(max(map(len, ids)), max_new_tokens, tree_size,
                                 self.target.config, capacity)
        mesh = self.mesh
        prompt, lens, active = pad_batch(ids, capacity, min_batch=sharding.data_size(mesh))
        estimate = estimate_memory(
            self.target.config, params_bytes(self.target.params, self._drafter_params), prompt.shape[0],
            prompt.shape[1], capacity, drafter=self._drafter_config, tree_size=tree_size, chunk=prefill_chunk)
        check_memory(estimate, mesh)
        eos_ids = self.target.eos_ids if options["stop_at_eos"] else ()
        decode = DecodeConfig(max_new_tokens, capacity, sampling, eos_ids, prefill_chunk)
        args = (self.target._static_graph, self.target.params, self._drafter_graphdef, self._drafter_params,
                sharding.put_batch(prompt, mesh), sharding.put_batch(lens, mesh), sharding.put_batch(active, mesh),
                jax.random.key(seed))
        lookup = None if self.lookup is None else self.lookup.config(sampling.greedy)
        kwargs = {"config": SpecConfig(decode, self.tree, self.adaptive, lookup)}
        if self.scorer is not None:
            kwargs.update(scorer_graphdef=self._scorer_graphdef, scorer_params=self._scorer_params)
        key = None  # adaptive: (sampling, costs), what the call's statistics and clock are kept under
        if self.adaptive is not None:
            from taps_jax.engine.calibrate import branch_costs

            if shortcut and max_new_tokens <= 2 and not self.adaptive.force_cycle:  # one round: an AR step is all
                return self._ar_call(prompts, max_new_tokens, options)
            costs = self.costs
            if costs is None:  # within a decoder the calibration's key only changes with these
                shape = (prompt.shape[0], capacity, sampling.greedy, sampling.top_k > 0, sampling.top_p < 1.0)
                costs = self._measured.get(shape)
                if costs is None:
                    with sharding.use_mesh(mesh):
                        costs, final = branch_costs(args, kwargs, max_new_tokens)
                    if final:  # else this batch stopped too soon to time a round: the figures are this call's only
                        self._measured[shape] = costs
            self.branch_costs = tuple(costs)  # the last call's, for reports
            if self.branch_costs not in self._device_costs:  # placed once: a host array is copied every call
                self._device_costs[self.branch_costs] = jnp.asarray(costs, jnp.float32)
            key = (sampling, self.branch_costs)
            prior, clock = self._start(key, sampling)
            if shortcut and not probe_due(clock, self.branch_costs, max_new_tokens) and self._trees_never_pay(prior):
                return self._ar_call(prompts, max_new_tokens, options, key)
            # No forced branch, no round limit (a round emits at least one token): device constants, of the
            # same kinds as the calibration passes (`calibrate.measure`), so one program serves both.
            kwargs.update(costs_K=self._device_costs[self.branch_costs], force=self._no_force,
                          max_rounds=self._no_limit, prior=prior, clock=clock)
        programs = Programs(spec_generate, spec_start, spec_advance, lambda c, kw: spec_outputs(c, kw["config"]),
                            ("target_graphdef", "drafter_graphdef", "config", "scorer_graphdef"), spec_until,
                            spec_refill, spec_extend)
        return GenerateCall(programs, args, kwargs, lambda out: self._result(out, len(ids), key), mesh, estimate)

    def _trees_never_pay(self, prior: np.ndarray) -> bool:
        """`adaptive.trees_never_pay` remembered per (prior, costs): its few small ops, once."""
        key = (np.asarray(prior).tobytes(), self.branch_costs)
        if key not in self._never_pay:
            self._never_pay[key] = trees_never_pay(prior, self.branch_costs, self.adaptive)
        return self._never_pay[key]

    def _ar_call(self, prompts, max_new_tokens: int, options: dict, key=None) -> GenerateCall:
        """The target's AR call for an adaptive call whose every round would be an AR step (no probe due, trees
        never pay; or one round at most): the same tokens (greedy) or law (sampled), the adaptive stats (every
        round budget 0), estimates unchanged, the probe clock of `key` advanced by the AR steps' cost."""
        call = self.target.prepare(prompts, max_new_tokens, **options)

        def finish(outputs):
            result = call.finish(outputs)
            rounds = [max(len(t) - 1, 0) for t in result.tokens]  # the first token comes with the prefill
            result.stats.update(rounds=rounds, accepted_lengths=[[1] * r for r in rounds],
                                tau=1.0, budgets=[0] * max(rounds, default=0))
            if key is not None and self.adaptive.carry_clock and FINISH_NAMES[RUNNING] not in result.finish_reasons:
                prior, clock = self._priors[key]
                self._priors[key] = prior, after_ar_steps(clock, self.branch_costs, max(rounds, default=0))
            return result

        return dataclasses.replace(call, finish=finish)

    def _start(self, key, sampling: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        """([2, Q, K] statistics, [3] probe clock) a call starts from: the last finished call's (same sampling and
        costs; its clock with `carry_clock`, else a first call's), else the fitted table's (or none) and a first
        call's clock (`adaptive.start_clock`)."""
        if key not in self._priors:
            prior = self.adaptive.empty_prior() if self.table is None else self.table.prior(self.adaptive,
                                                                                            sampling.greedy)
            self._priors[key] = prior, self._first_clock(prior)
        return self._priors[key]

    def _first_clock(self, prior) -> np.ndarray:
        """[3] the clock of a call that does not resume the last one's (`adaptive.start_clock`)."""
        return np.asarray(start_clock(self.adaptive, prior, jnp.asarray(self.branch_costs, jnp.float32)), np.float32)

    def _result(self, outputs, count: int, key=None) -> GenerateResult:
        out, n, finish, rounds, accepted, branch, est, clock = outputs
        rounds, accepted = rounds[:count], accepted[:count]
        per_round = [accepted[b, : rounds[b]].tolist() for b in range(count)]
        total_rounds = int(rounds.sum())
        stats = {
            "rounds": rounds.tolist(),
            "accepted_lengths": per_round,
            "tau": float(sum(map(sum, per_round)) / max(total_rounds, 1)),
        }
        if self.adaptive is not None:
            # One branch per round for the whole batch: the budget each round verified (0 = an AR step).
            stats["budgets"] = [self.adaptive.budgets[k] for k in branch.tolist() if k >= 0]
            if (finish[:count] != RUNNING).all():  # a finished call's statistics (and clock) start the next call
                est = np.asarray(est, np.float32)
                self._priors[key] = est, np.asarray(clock if self.adaptive.carry_clock else self._first_clock(est),
                                                    np.float32)
        return self.target._result(out, n, finish, count, stats)

    def generate(self, prompts, max_new_tokens: int = 64, **options) -> GenerateResult:
        """Decode a batch of prompts; `stats` holds rounds and accepted lengths (tau).

        options: temperature=0.0, top_k=0, top_p=1.0, seed=0, capacity=None,
        stop_at_eos=True, prefill_chunk=None (see `prepare`).
        capacity: KV-cache slots per sequence (default: prompt + new tokens +
        tree headroom, bucketed). prefill_chunk: prompt tokens per prefill
        step (default: the decoder's).
        """
        return self.prepare(prompts, max_new_tokens, **options).run()

    def stream(self, prompts, max_new_tokens: int = 64, *, chunk: int = STREAM_CHUNK, **options):
        """Like `generate`, yielding the result so far every `chunk` rounds (the last yield == generate's)."""
        return self.prepare(prompts, max_new_tokens, **options).stream(chunk)


def check_costs(costs, count: int) -> tuple[float, ...]:
    """Per-branch round costs as a tuple of `count` positive finite floats (ValueError otherwise)."""
    try:
        values = tuple(float(c) for c in costs)
    except (TypeError, ValueError):
        raise ValueError(f"costs must be {count} positive numbers (one per adaptive budget), got {costs!r}") from None
    if len(values) != count or not all(np.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"costs must be {count} positive numbers (one per adaptive budget), got {costs!r}")
    return values


@dataclasses.dataclass
class ModelSet:
    """What one model directory bundles: target/, drafter/ and optionally scorer/ and scorer_greedy/.

    scorer: TAPS scorer fitted to the target's temperature-1 probabilities
    (what sampled verification accepts); greedy_scorer: one fitted to whether
    a token is the target's argmax (what greedy verification accepts).
    """

    target: Target
    drafter: DrafterModel | None = None
    scorer: ScorerModel | None = None
    greedy_scorer: ScorerModel | None = None
    name: str | None = None  # the set the parts came from (a shipped name or a path), for messages
    table: AdaptiveTable | None = None  # adaptive.json: the adaptive policy's fitted prior
    lookup: LookupTable | None = None  # lookup.json: the weights of the text's continuation in every draft

    def missing_drafter(self) -> str:
        """Why a speculative policy cannot run here, and what to do instead."""
        where = f"the {self.name} model set has no drafter/" if self.name else "no drafter was given"
        return (f"speculative policies need a drafter and {where}: pass --drafter DIR (or a --model set with "
                f"drafter/; train one with python -m train.distill), or use --policy ar")

    def options(self, policy: str, temperature: float = 0.0) -> dict:
        """The `SpeculativeDecoder` keywords this set gives `policy` at `temperature`: its scorer (taps, adaptive)
        and its fitted table (adaptive), the lookup weights (every speculative policy)."""
        extra = {"scorer": self.scorer_for(temperature)} if policy in ("taps", "adaptive") else {}
        if policy == "adaptive" and self.table is not None:
            extra["table"] = self.table
        if policy != "ar" and self.lookup is not None:
            extra["lookup"] = self.lookup
        return extra

    def decoder(self, policy: str = "adaptive", budget: int = 32, temperature: float = 0.0,
                **kwargs) -> "SpeculativeDecoder":
        """A `SpeculativeDecoder` of this set's parts for `policy` (what the CLIs build; kwargs go to it)."""
        drafter = None if policy == "ar" else self.drafter
        if policy != "ar" and drafter is None:
            raise ValueError(self.missing_drafter())
        return SpeculativeDecoder(self.target, drafter, policy, budget, **self.options(policy, temperature), **kwargs)

    def scorer_for(self, temperature: float) -> ScorerModel | None:
        """The scorer fitted to this temperature's acceptance rule (scorer_greedy/ at 0 when present)."""
        if temperature == 0 and self.greedy_scorer is not None:
            return self.greedy_scorer
        return self.scorer


def load_model_set(path, dtype: str = "float32", mesh=None) -> ModelSet:
    """Load a model set: a directory bundling target/ (or a target.json pointer), drafter/ (and scorer/,
    scorer_greedy/ when present), or a shipped set by name ("default", "smollm2"; `taps_jax.model_sets`).

    mesh: load target and drafter sharded onto it (see `load_target`).
    """
    path = resolve_set(path)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist; pass a directory holding target/ and "
                         f"drafter/, or one of {', '.join(NAMED_SETS)}")
    target_path = target_of(path)
    if target_path is None:
        raise ValueError(f"{path}: no target/ subdirectory; a model set holds target/ and drafter/")
    target = load_target(target_path, dtype, mesh)
    drafter = load_drafter(path / "drafter", dtype, mesh) if (path / "drafter").is_dir() else None
    scorers = [load_scorer(path / name) if (path / name).is_dir() else None for name in ("scorer", "scorer_greedy")]
    # The parts ship together, so a mismatch is a broken set: say so at load, not at decode.
    try:
        if drafter is not None:
            drafter.config.check_target(target.config)
            for scorer in scorers:
                if scorer is not None:
                    scorer.check_models(target.config, drafter.config)
                    check_scorer_target(scorer, target)
    except ValueError as e:
        raise ValueError(f"{path}: the model set's parts do not fit together: {e}") from None
    table = AdaptiveTable.of_set(path) if drafter is not None else None  # the prior of the set's own drafter
    return ModelSet(target, drafter, *scorers, set_name(path), table, LookupTable.of_set(path))
