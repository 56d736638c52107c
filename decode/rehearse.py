"""`python -m decode.rehearse`: compile the whole generate at real model sizes, on CPU, with nothing allocated.

A scale rehearsal before renting accelerators: the target and drafter exist
only as abstract parameters (`jax.eval_shape`, sharded by our rules), the
whole generate (chunked prefill + the while loop of rounds) is lowered and
compiled ahead of time for a ("data", "model") mesh of CPU devices, and the
compiled program reports, per device, its argument / output / temporary
bytes (`memory_analysis`). Each stage of one round (draft, select, verify)
and one AR step are compiled alone for their FLOPs and bytes accessed
(`cost_analysis`, attention over the whole cache), which a roofline model
(`decode.roofline`) turns into predicted ms per AR token and per round on
named parts. Predictions are a model, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from decode.common import Parser, positive_int
from decode import roofline
from taps_jax import compile_cache
from taps_jax.config import CONFIGS_DIR

CONFIG_DIR = CONFIGS_DIR / "published"  # shipped with the package (taps_jax.config)
TARGETS = {"qwen3-4b": "qwen3-4b.json", "qwen3-8b": "qwen3-8b.json", "llama3-8b": "llama3-8b.json"}
DRAFTERS = {"dflash-b16": "dflash-b16.json"}
DEFAULT_SET = Path(__file__).resolve().parent.parent / "taps_jax" / "assets" / "default"


def _config_file(text: str, names: dict, what: str) -> Path:
    if text in names:
        return CONFIG_DIR / names[text]
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--{what}-config {text!r} is neither a known name ({', '.join(names)}) nor a config.json "
                         "file or a directory holding one")
    return path


def read_configs(target: str, drafter: str | None, dtype: str):
    """(ModelConfig, DrafterConfig or None) from names or config.json paths (HF / DFlash layouts)."""
    from taps_jax.checkpoints.dflash import config_from_dflash
    from taps_jax.checkpoints.hf import config_from_hf, read_json

    tfile = _config_file(target, TARGETS, "target")
    tcfg = config_from_hf(read_json(tfile), str(tfile), dtype)
    dcfg = None
    if drafter is not None:
        dfile = _config_file(drafter, DRAFTERS, "drafter")
        dcfg = config_from_dflash(read_json(dfile), str(dfile), dtype)
        dcfg.check_target(tcfg)
    return tcfg, dcfg


def default_tau(policy: str, budget: int) -> float:
    """The greedy tau the embedded default set measured for this policy (nearest budget), from its report."""
    if policy == "ar":
        return 1.0
    try:
        rows = json.loads((DEFAULT_SET / "report.json").read_text())["greedy"]["results"]
    except (OSError, KeyError, ValueError):
        return 1.0
    rows = [r for r in rows if r["policy"] == policy]
    if not rows:
        return 1.0
    return float(min(rows, key=lambda r: abs(r["budget"] - budget))["tau"])


# --------------------------------------------------------------------------- abstract inputs


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_module(cls, config, mesh):
    """(graphdef, sharded ShapeDtypeStruct params) of a module; nothing is allocated."""
    from taps_jax import sharding

    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(config, nnx.Rngs(0))))
    return graphdef, _abstract(state, sharding.param_shardings(state, mesh))


def state_shardings(tree, mesh):
    """Shardings of engine values by the engine's rules: caches (-, data, model, -, -), rows on data, keys replicated."""
    from taps_jax import sharding

    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) or x.ndim == 0:
            return NamedSharding(mesh, P())
        if x.ndim == 5:
            return NamedSharding(mesh, _soft_spec(sharding.KV_CACHE_AXES, x.shape, mesh))
        return NamedSharding(mesh, _soft_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh))

    return jax.tree.map(one, tree)


def _soft_spec(logical, shape, mesh):
    from taps_jax import sharding

    axes = []
    for dim, axis in zip(shape, logical):
        mesh_axis = sharding.LOGICAL_AXES.get(axis) if axis else None
        size = int(mesh.shape[mesh_axis]) if mesh_axis else 1
        axes.append(mesh_axis if size > 1 and dim % size == 0 else None)
    return P(*axes)


def _sharded_shapes(fn, mesh, *args):
    shapes = jax.eval_shape(fn, *args)
    return _abstract(shapes, state_shardings(shapes, mesh))


@contextlib.contextmanager
def whole_cache_attention():
    """Attend over the cache in ONE key block: XLA's cost analysis counts a loop body once, so the
    per-round figures then include reading every cache slot (an upper bound at full context)."""
    from taps_jax.models import layers

    saved = layers.KEY_BLOCK, layers.SMALL_CACHE_KEY_BLOCK
    layers.KEY_BLOCK = layers.SMALL_CACHE_KEY_BLOCK = 1 << 30
    try:
        yield
    finally:
        layers.KEY_BLOCK, layers.SMALL_CACHE_KEY_BLOCK = saved


COST_NOTE = (
    "flops: XLA cost_analysis() of each stage's lowered (unpartitioned) program with attention over the whole "
    "cache in one key block, divided by the device count (even partitioning assumed). bytes: HBM traffic "
    "model per device from the sharded shapes: every parameter the stage uses read once, every cache slot "
    "read once, float32 logits written and read once (XLA's own 'bytes accessed' counts each in-place cache "
    "update as a copy of the whole cache, and the CPU-optimised program's counts reflect CPU fusion, so "
    "neither is used)")


CPU_NOTE = (
    "per_device_bytes is what XLA:CPU's buffer assignment needs; for bfloat16 it overstates an accelerator: "
    "XLA:CPU has no bfloat16 scatter, so it converts whole bf16 caches to float32 around each in-place cache "
    "update (temporaries TPU and GPU do not need). params_bytes + cache_bytes (from the sharded shapes) is the "
    "floor any device needs before activations")


def _fresh(jitted):
    """A new jit of the same function, so tracing sees the current KEY_BLOCK (not a cached trace)."""
    static = ("target_graphdef", "drafter_graphdef", "scorer_graphdef", "config", "graphdef")
    fn = getattr(jitted, "__wrapped__", jitted)
    import inspect

    names = tuple(n for n in static if n in inspect.signature(fn).parameters or "static" in
                  inspect.signature(fn).parameters)
    return jax.jit(fn, static_argnames=names)


def _flops(lowered, devices: int) -> float:
    cost = lowered.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0)) / devices


def _device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "sharding") and x.sharding is not None:
            total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def _logits_bytes(like_B, rows: int, vocab: int) -> int:
    """float32 logits [b, rows, V / M] of one device, written once and read once."""
    mesh = like_B.sharding.mesh
    b = like_B.sharding.shard_shape(like_B.shape)[0]
    m = int(mesh.shape["model"])
    return 2 * b * rows * (vocab // m if vocab % m == 0 else vocab) * 4


def _head_bytes(tparams) -> int:
    """The target's embedding table and lm_head (the drafter reads both)."""
    names = {"embed_tokens", "lm_head"}
    return _device_bytes({k: v for k, v in tparams.items() if k in names})


def round_traffic(tparams, dparams, sparams, state, draft_BHV, tree_size: int, vocab: int) -> dict:
    H = draft_BHV.shape[1]
    caches = lambda c: _device_bytes((c.k_LBKHS, c.v_LBKSH))
    draft_logits = _logits_bytes(state.bonus_B, H, vocab)
    return {
        "draft": _device_bytes(dparams) + caches(state.dcache) + _head_bytes(tparams) + draft_logits,
        "select": draft_logits + _device_bytes(sparams) if sparams is not None else draft_logits,
        "verify": _device_bytes(tparams) + caches(state.cache) + _logits_bytes(state.bonus_B, tree_size, vocab),
    }


def ar_traffic(tparams, cache, vocab: int) -> int:
    return (_device_bytes(tparams) + _device_bytes((cache.k_LBKHS, cache.v_LBKSH))
            + _logits_bytes(cache.lengths_B, 1, vocab))


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    out = {f.replace("_size_in_bytes", "_bytes"): int(getattr(m, f, 0) or 0) for f in fields}
    out["per_device_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
    return out


# --------------------------------------------------------------------------- the rehearsal


def rehearse(target_config, drafter_config, mesh, *, batch: int, prompt_tokens: int, max_new_tokens: int,
             policy: str = "taps", budget: int = 64, prefill_chunk: int = 512, tau: float | None = None,
             parts=None, progress=lambda msg: None) -> dict:
    """Compile generate + one round's stages + one AR step for these shapes; returns the report dict.

    Everything is abstract: parameters, prompts and states are ShapeDtypeStructs carrying
    their shardings, so a 4B-parameter target costs no memory, only compile time.
    """
    from taps_jax import sharding
    from taps_jax.decoder import POLICIES, tree_config
    from taps_jax.engine import speculative as spec
    from taps_jax.engine import stages
    from taps_jax.engine.ar import DecodeConfig, ar_generate
    from taps_jax.engine.batching import bucket
    from taps_jax.engine.prefill import cache_slots
    from taps_jax.engine.sampling import SamplingConfig
    from taps_jax.engine.sizing import estimate_memory, plan_capacity
    from taps_jax.models.cache import KVCache
    from taps_jax.models.drafter import Drafter
    from taps_jax.models.transformer import Transformer
    from taps_jax.tree.scorer import Scorer, ScorerConfig

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy != "ar" and drafter_config is None:
        raise ValueError(f"policy {policy!r} needs a drafter config (--drafter-config)")
    sharding.check_config(target_config, mesh, "target", replicate_kv=True)
    # The engine's view: kv heads repeated for a model axis wider than them (as Target does on a mesh).
    tcfg = target_config.replace(num_kv_heads=target_config.num_kv_heads * sharding.kv_replicas(target_config, mesh))
    dcfg = None
    if policy != "ar":
        sharding.check_config(drafter_config, mesh, "drafter", replicate_kv=True)
        dcfg = drafter_config.replace(
            num_kv_heads=drafter_config.num_kv_heads * sharding.kv_replicas(drafter_config, mesh))
        tree = tree_config(policy, budget, tcfg.vocab_size)
        H = dcfg.block_size - 1
        tree.validate(H, tcfg.vocab_size)
        tree_size = tree.tree_size(H)
        headroom = tree_size  # as SpeculativeDecoder sizes it
    else:
        tree, tree_size, headroom = None, 1, 0
    capacity = plan_capacity(prompt_tokens, max_new_tokens, headroom, tcfg)
    B = bucket(batch, minimum=sharding.data_size(mesh))
    if B % sharding.data_size(mesh):
        B = sharding.padded_batch(B, mesh)
    T = bucket(prompt_tokens)
    decode = DecodeConfig(max_new_tokens, capacity, SamplingConfig(), (), prefill_chunk)

    tg, tparams = abstract_module(Transformer, tcfg, mesh)
    rows = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, sharding.batch_spec(len(shape))))
    prompt, lens, active = rows((B, T), jnp.int32), rows((B,), jnp.int32), rows((B,), jnp.bool_)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
    params_total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tparams))
    report = {
        "note": roofline.MODEL_NOTE,
        "target": dataclass_dict(target_config), "drafter": dataclass_dict(drafter_config) if dcfg else None,
        "mesh": [sharding.data_size(mesh), sharding.model_size(mesh)], "devices": int(mesh.devices.size),
        "kv_heads_per_model_axis": {"target": tcfg.num_kv_heads, "drafter": dcfg.num_kv_heads if dcfg else None},
        "batch": batch, "padded_batch": B, "prompt_tokens": prompt_tokens, "prompt_buffer": T,
        "max_new_tokens": max_new_tokens, "capacity": capacity, "cache_slots": cache_slots(capacity, T, prefill_chunk),
        "policy": policy, "budget": budget if policy != "ar" else None, "tree_size": tree_size,
        "dtype": tcfg.dtype, "prefill_chunk": prefill_chunk,
    }

    with sharding.use_mesh(mesh):
        # 1. The whole generate, as generate runs it.
        start = time.perf_counter()
        if policy == "ar":
            lowered = ar_generate.lower(tg, tparams, prompt, lens, active, key, config=decode)
            extra_params = 0
        else:
            dg, dparams = abstract_module(Drafter, dcfg, mesh)
            extra_params = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(dparams))
            config = spec.SpecConfig(decode, tree)
            scorer_kwargs = {}
            if policy == "taps":
                scfg = ScorerConfig(vocab_size=tcfg.vocab_size, embed_dim=tcfg.hidden_size,
                                    drafter_hidden_size=dcfg.hidden_size, horizon=H, residual=True)
                sg, sp = nnx.split(nnx.eval_shape(lambda: Scorer(scfg, nnx.Rngs(0))))
                sp = _abstract(sp, jax.tree.map(lambda _: NamedSharding(mesh, P()), sp))
                scorer_kwargs = dict(scorer_graphdef=sg, scorer_params=sp)
            lowered = spec.spec_generate.lower(tg, tparams, dg, dparams, prompt, lens, active, key, config=config,
                                               **scorer_kwargs)
        progress("compiling generate (prefill + decode loop)")
        compiled = lowered.compile()
        report["compile_s"] = time.perf_counter() - start
        report["memory"] = _memory(compiled)
        report["per_device_bytes"] = report["memory"]["per_device_bytes"]
        report["params_bytes_total"] = params_total + extra_params
        estimate = estimate_memory(tcfg, params_total + extra_params, B, T, capacity, drafter=dcfg,
                                   tree_size=tree_size, chunk=prefill_chunk)
        report["host_estimate_bytes_total"] = estimate.total

        # 2. One round's stages and one AR step, attention over the whole cache.
        progress("lowering one round's stages and one AR step for their costs")
        start = time.perf_counter()
        devices = int(mesh.devices.size)
        with whole_cache_attention():
            stage_costs = {}
            if policy != "ar":
                static = dict(target_graphdef=tg, drafter_graphdef=dg,
                              scorer_graphdef=scorer_kwargs.get("scorer_graphdef"), config=config)
                params = (tparams, dparams, scorer_kwargs.get("scorer_params"))
                init, draft, select, verify = (_fresh(f) for f in (stages.init_jit, stages.draft_jit,
                                                                   stages.select_jit, stages.verify_jit))
                state = _sharded_shapes(lambda p, a, b, c, k: init(p, a, b, c, k, **static), mesh,
                                        params, prompt, lens, active, key)
                dcache, draft_BHV, hidden_BHD = _sharded_shapes(lambda p, s: draft(p, s, **static), mesh, params, state)
                tree_out = _sharded_shapes(lambda p, d, h, b: select(p, d, h, b, **static), mesh, params, draft_BHV,
                                           hidden_BHD, state.bonus_B)
                flops = {
                    "draft": _flops(draft.lower(params, state, **static), devices),
                    "select": _flops(select.lower(params, draft_BHV, hidden_BHD, state.bonus_B, **static), devices),
                    "verify": _flops(verify.lower(params, state, dcache, tree_out, **static), devices),
                }
                traffic = round_traffic(tparams, dparams, scorer_kwargs.get("scorer_params"), state, draft_BHV,
                                        tree_size, tcfg.vocab_size)
                stage_costs = {k: {"flops": flops[k], "bytes": traffic[k]} for k in flops}
            cache = _sharded_shapes(lambda: KVCache.zeros(tcfg, B, report["cache_slots"]), mesh)
            tokens = rows((B,), jnp.int32)
            ar_cost = {"flops": _flops(_fresh(_ar_step).lower(tg, tparams, cache, tokens), devices),
                       "bytes": ar_traffic(tparams, cache, tcfg.vocab_size)}
        report["cost_lower_s"] = time.perf_counter() - start
        kv = lambda c: _device_bytes((c.k_LBKHS, c.v_LBKSH))
        report["per_device_floor"] = {
            "params_bytes": _device_bytes(params if policy != "ar" else tparams),
            "cache_bytes": kv(state.cache) + kv(state.dcache) if policy != "ar" else kv(cache),
            "note": CPU_NOTE,
        }
    report["cost_model"] = COST_NOTE
    report["stage_costs"] = stage_costs
    report["ar_step_cost"] = ar_cost
    report["flops_per_round"] = sum(c["flops"] for c in stage_costs.values()) if stage_costs else ar_cost["flops"]
    report["bytes_per_round"] = sum(c["bytes"] for c in stage_costs.values()) if stage_costs else ar_cost["bytes"]
    report["tau"] = default_tau(policy, budget) if tau is None else float(tau)
    report["tau_source"] = ("--tau" if tau is not None else
                            "greedy tau of the embedded default set (report.json), nearest budget")
    costs = stage_costs or {"ar_step": ar_cost}
    report["predicted"] = roofline.predict(costs, ar_cost, report["tau"] if stage_costs else 1.0,
                                           report["per_device_bytes"], parts)
    report["parts"] = {name: {"bf16_tflops": p.bf16_flops / 1e12, "hbm_gb_per_s": p.hbm_bytes_per_s / 1e9,
                              "memory_gib": p.memory_bytes / roofline.GiB, "source": p.source}
                       for name, p in roofline.PARTS.items() if parts is None or name in parts}
    return report


def _ar_step_fn(graphdef, params, cache, tokens_B):
    """One AR step of a batch: a one-token forward over the cache + greedy sample (what ar_generate's loop runs)."""
    from taps_jax.engine.sampling import SamplingConfig, sample
    from taps_jax.engine.static import merge

    model = merge(graphdef, params)
    B = tokens_B.shape[0]
    logits_B1V, _, cache = model(tokens_B[:, None], cache.lengths_B[:, None], jnp.ones((B, 1, 1), bool), cache)
    return sample(logits_B1V[:, 0], jax.random.key(0), SamplingConfig()), cache


_ar_step = jax.jit(_ar_step_fn, static_argnames=("graphdef",))


def dataclass_dict(config) -> dict | None:
    import dataclasses

    if config is None:
        return None
    return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v)
            for k, v in ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))}


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m decode.rehearse", description=__doc__.split("\n\n")[0])
    p.add_argument("--target-config", default="qwen3-4b", metavar="NAME|PATH",
                   help=f"target: {'|'.join(TARGETS)} or a Hugging Face config.json (file or directory); default qwen3-4b")
    p.add_argument("--drafter-config", default="dflash-b16", metavar="NAME|PATH",
                   help=f"drafter: {'|'.join(DRAFTERS)} or a DFlash config.json (file or directory); default dflash-b16")
    p.add_argument("--mesh", default="1,1", metavar="DATA,MODEL",
                   help="mesh to compile for (CPU devices; set to DATA*MODEL automatically unless XLA_FLAGS "
                        "already sets --xla_force_host_platform_device_count); default 1,1")
    p.add_argument("--batch", type=positive_int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--prompt-tokens", type=positive_int, default=8192, help="prompt length (default 8192)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens to generate (default 256)")
    p.add_argument("--policy", choices=("ar", "chain", "ddtree", "taps"), default="taps", help="default taps")
    p.add_argument("--budget", type=positive_int, default=64, help="tree budget (default 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="default bfloat16")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, help="prompt tokens per prefill step (default 512)")
    p.add_argument("--tau", type=float, default=None,
                   help="accepted tokens per round for the speedup (default: the greedy tau the embedded default "
                        "set measured for this policy and budget)")
    p.add_argument("--parts", default=None, metavar="A,B",
                   help=f"roofline parts (default all: {','.join(roofline.PARTS)})")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report as JSON")
    compile_cache.add_flag(p)
    return p


def _use_cpu_devices(n: int) -> None:
    """Ask for n CPU devices unless XLA_FLAGS already chose (must run before JAX starts its backends)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    with contextlib.suppress(Exception):  # backends already up (e.g. inside a test): keep what exists
        jax.config.update("jax_num_cpu_devices", max(n, int(jax.config.jax_num_cpu_devices)))


def format_report(r: dict) -> str:
    gib = lambda b: f"{b / roofline.GiB:.2f} GiB"
    m = r["memory"]
    lines = [
        f"target {r['target']['num_layers']} layers x {r['target']['hidden_size']}, vocab {r['target']['vocab_size']}, "
        f"{r['dtype']}; policy {r['policy']}" + (f" budget {r['budget']} (tree {r['tree_size']})" if r['budget'] else "")
        + f"; batch {r['batch']} (padded {r['padded_batch']}) x {r['prompt_tokens']} prompt tokens + "
        f"{r['max_new_tokens']} new; cache {r['cache_slots']} slots; mesh {r['mesh'][0]},{r['mesh'][1]}",
        f"compiled for {r['devices']} CPU devices in {r['compile_s']:.1f} s (stage costs lowered in {r['cost_lower_s']:.1f} s)",
        f"per device: {gib(r['per_device_bytes'])} = arguments {gib(m['argument_bytes'])} + outputs "
        f"{gib(m['output_bytes'])} + temporaries {gib(m['temp_bytes'])} (parameters {gib(r['params_bytes_total'])} "
        f"in all, before sharding)",
        f"floor per device: parameters {gib(r['per_device_floor']['params_bytes'])} + KV caches "
        f"{gib(r['per_device_floor']['cache_bytes'])} (XLA:CPU adds float32 copies of bfloat16 caches; see JSON)",
        f"per round per device: {r['flops_per_round'] / 1e9:.1f} GFLOP, {r['bytes_per_round'] / 1e9:.2f} GB accessed"
        + "".join(f"; {k} {c['flops'] / 1e9:.1f} GFLOP {c['bytes'] / 1e9:.2f} GB" for k, c in r["stage_costs"].items()),
        f"per AR step per device: {r['ar_step_cost']['flops'] / 1e9:.1f} GFLOP, {r['ar_step_cost']['bytes'] / 1e9:.2f} GB",
        f"tau {r['tau']:.2f} ({r['tau_source']})",
        "cost model: " + r["cost_model"],
        "",
        r["note"] + ":",
        f"{'part':10} {'AR ms/token':>12} {'round ms':>9} {'speedup':>8}  fits",
    ]
    for name, p in r["predicted"].items():
        lines.append(f"{name:10} {p['ar_ms_per_token']:12.2f} {p['round_ms']:9.2f} {p['speedup']:8.2f}  "
                     f"{'yes' if p.get('fits') else 'NO'} ({r['parts'][name]['memory_gib']:.0f} GiB)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from taps_jax import sharding

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        compile_cache.setup(args)
        shape = sharding.parse_mesh(args.mesh)
        if not isinstance(shape, tuple):
            raise ValueError(f"--mesh needs DATA,MODEL for a rehearsal, got {args.mesh!r}")
        parts = None
        if args.parts:
            parts = [p.strip() for p in args.parts.split(",") if p.strip()]
            bad = [p for p in parts if p not in roofline.PARTS]
            if bad:
                raise ValueError(f"--parts: unknown part {bad[0]!r}; choose from {', '.join(roofline.PARTS)}")
        if args.tau is not None and not args.tau >= 1:
            raise ValueError(f"--tau must be >= 1 (accepted tokens per round), got {args.tau}")
        tcfg, dcfg = read_configs(args.target_config, None if args.policy == "ar" else args.drafter_config, args.dtype)
        _use_cpu_devices(shape[0] * shape[1])
        mesh = sharding.make_mesh(*shape, devices=jax.devices("cpu"))
        sharding.check_config(tcfg, mesh, "target", replicate_kv=True)
        if dcfg is not None:
            sharding.check_config(dcfg, mesh, "drafter", replicate_kv=True)
        print(f"rehearsal on {sharding.describe(mesh)}: nothing is allocated; compiling (this can take minutes)",
              file=sys.stderr)
        report = rehearse(tcfg, dcfg, mesh, batch=args.batch, prompt_tokens=args.prompt_tokens,
                          max_new_tokens=args.max_new_tokens, policy=args.policy, budget=args.budget,
                          prefill_chunk=args.prefill_chunk, tau=args.tau, parts=parts,
                          progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    report["command"] = "python -m decode.rehearse " + " ".join(sys.argv[1:] if argv is None else argv)
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
