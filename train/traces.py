"""Trace collection for the TAPS scorer: target labels on large draft pools.

Decoding runs the speculative engine's round (greedy, with a normal policy
such as ddtree, so rounds start where real decoding rounds would). In every
round the drafter's lattice also feeds a LARGE candidate pool (beam width W,
lattice width K, N = H * W nodes), and the target runs ONCE over the whole
pool as a tree (ancestor mask from the pool's parent links, positions
len + depth). Recorded per pool node v with parent u (root = the bonus token):

  p_star(v)      = softmax(target logits at u)[x_v]       (temperature 1)
  p_other(u)     = 1 - sum of p_star over u's pool children (per parent slot)
  reach_star(v)  = product of p_star along the path to v
  target_argmax(u) = the target's greedy token at u

together with everything the scorer reads (pool tokens/parents/depths/
ranks/step and cumulative log-probs/validity, lattice entropy/margin/top-K
mass, the drafter hidden states, the root token). Parent slots are numbered
like the scorer's: 0 = root, 1 + n = pool node n.

On disk (OUT/): shard-00000.npz, ... (rows = one sequence in one round; the
hidden states in float16, labels in float32, ids in the smallest int type)
and meta.json describing the configuration (target, drafter, pool, decode
policy) and the shards with the prompt range each covers. Re-running into
the same OUT with the same configuration resumes after the last shard;
another configuration is refused with a clear error, and so is loading the
traces for a target they were not collected with.

CLI: python -m train.traces --target DIR --drafter DIR --prompts FILE --out DIR [--pool-width W] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from train import data
from train.config import add_flags, build, option

from decode.common import check_output_path
from taps_jax import compile_cache
from taps_jax.api import Target, load_target
from taps_jax.engine.ar import DecodeConfig
from taps_jax.engine.batching import bucket, encode_prompts, pad_batch
from taps_jax.engine.prefill import RUNNING
from taps_jax.engine.sampling import SamplingConfig
from taps_jax.prompt_file import read_prompt_file
from taps_jax.engine.speculative import SpecConfig, SpecState, draft_stage, init_state, select_stage, verify_stage
from taps_jax.tree.lattice import build_lattice
from taps_jax.tree.policies import TreeConfig
from taps_jax.tree.pool import Pool, build_pool
from taps_jax.tree.scorer import ScorerInputs
from taps_jax.tree.select import Tree, ancestor_mask, reach

FORMAT = "taps-traces"
VERSION = 1
META_NAME = "meta.json"

# The trace schema. What the scorer reads is the `ScorerInputs` pytree, flattened by path: each leaf is
# named by its field without the pool prefix and the shape suffix (pool.token_BN -> "token",
# hidden_BHD -> "hidden"), and the suffix after B gives its per-row axes (N nodes, S = N + 1 parent
# slots, H depths, D drafter width). The labels and the row's bookkeeping are the other fields.
# Only the on-disk storage dtypes are chosen here (ids in the smallest int type, hidden states in float16).
STORAGE = {"parent": np.int16, "token": np.int32, "depth": np.int8, "rank": np.int16, "step_logprob": np.float32,
           "cum_logprob": np.float32, "valid": np.bool_, "entropy": np.float32, "margin": np.float32,
           "topk_mass": np.float32, "hidden": np.float16, "root_token": np.int32}
LABELS = {"p_star": (np.float32, ("N",)), "p_other": (np.float32, ("S",)), "reach_star": (np.float32, ("N",)),
          "target_argmax": (np.int32, ("S",))}
BOOKKEEPING = {"prompt_id": (np.int32, ()), "round": (np.int32, ()), "length": (np.int32, ())}


def _leaf_name(field: str) -> tuple[str, tuple[str, ...]]:
    """("token", ("N",)) of "token_BN": the trace name and the per-row axes of a ScorerInputs leaf."""
    name, _, axes = field.rpartition("_")
    return name, tuple(axes[1:])  # drop the batch axis B


def _input_fields(cls=ScorerInputs) -> list[tuple[str, str, tuple[str, ...]]]:
    """[(trace name, attribute path, axes)] of the ScorerInputs pytree (static fields such as width skipped)."""
    out = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("pytree_node", True):
            continue
        if f.name == "pool":
            out += [(n, f"pool.{attr}", axes) for n, attr, axes in _input_fields(Pool)]
        else:
            out.append((*_leaf_name(f.name)[:1], f.name, _leaf_name(f.name)[1]))
    return out


INPUT_FIELDS = _input_fields()
assert {n for n, _, _ in INPUT_FIELDS} == set(STORAGE), "STORAGE must name every ScorerInputs leaf"
# name -> (on-disk dtype, per-row axes): the inputs, then the labels and bookkeeping.
FIELDS = {name: (STORAGE[name], axes) for name, _, axes in INPUT_FIELDS}
FIELDS.update(LABELS)
FIELDS.update(BOOKKEEPING)


def flatten_inputs(inputs: ScorerInputs) -> dict:
    """{trace name: [B, ...] array} of a round's ScorerInputs."""
    return {name: functools.reduce(getattr, attr.split("."), inputs) for name, attr, _ in INPUT_FIELDS}


def unflatten_inputs(rows: dict, width: int) -> ScorerInputs:
    """The ScorerInputs of a batch of trace rows (ids as int32, the rest float32, `valid` as bool)."""
    def cast(name):
        dtype = np.dtype(FIELDS[name][0])
        x = jnp.asarray(rows[name])
        return x.astype(bool if dtype == np.bool_ else jnp.int32 if dtype.kind in "iu" else jnp.float32)

    pool = {attr.removeprefix("pool."): cast(n) for n, attr, _ in INPUT_FIELDS if attr.startswith("pool.")}
    rest = {attr: cast(n) for n, attr, _ in INPUT_FIELDS if not attr.startswith("pool.")}
    return ScorerInputs(pool=Pool(**pool, width=width), **rest)


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """What a trace set is collected with (static; part of meta.json)."""

    pool_width: int = option(32, "beam width W of the large pool (N = H * W nodes)")
    pool_k: int = option(32, "lattice width K of the large pool")
    policy: str = option("ddtree", "the policy that advances decoding", choices=("ddtree", "chain"))
    budget: int = option(32, "that policy's verification budget")
    max_new_tokens: int = option(128, "tokens decoded per prompt")
    max_prompt_len: int = option(512, "longer prompts keep their last tokens")

    def __post_init__(self):
        for name in ("pool_width", "pool_k", "budget", "max_new_tokens", "max_prompt_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in ("chain", "ddtree"):
            raise ValueError(f"trace decoding policy must be 'chain' or 'ddtree', got {self.policy!r}")

    def decode_tree(self, vocab_size: int) -> TreeConfig:
        return TreeConfig(self.policy, self.budget, min(self.budget, vocab_size), self.budget)

    def spec_config(self, vocab_size: int, capacity: int, eos_ids: tuple[int, ...]) -> SpecConfig:
        """The engine's greedy round that advances the sequences between trace records."""
        return SpecConfig(DecodeConfig(self.max_new_tokens, capacity, SamplingConfig(), eos_ids),
                          self.decode_tree(vocab_size))


# --------------------------------------------------------------------------- the jitted round


def pool_tree(pool: Pool, root_token_B) -> Tree:
    """The whole pool as a tree: slot 0 = root, slot 1 + n = pool node n."""
    B, N = pool.token_BN.shape
    ones = jnp.ones((B, 1), bool)
    return Tree(
        tokens_BT=jnp.concatenate([root_token_B[:, None].astype(jnp.int32), pool.token_BN], axis=1),
        parents_BT=jnp.concatenate([-ones.astype(jnp.int32), jnp.maximum(pool.parent_BN + 1, 0)], axis=1),
        depths_BT=jnp.concatenate([jnp.zeros((B, 1), jnp.int32), pool.depth_BN], axis=1),
        valid_BT=jnp.concatenate([ones, pool.valid_BN], axis=1),
        pool_index_BT=jnp.concatenate([-ones.astype(jnp.int32), jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))], axis=1),
        max_depth=pool.horizon,
    )


def pool_labels(pool: Pool, logits_BSV) -> dict:
    """Target labels of a pool from the target's logits at its N + 1 parent slots."""
    B, N = pool.token_BN.shape
    S = N + 1
    slot_BN = jnp.maximum(pool.parent_BN + 1, 0)
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    # logits at the parent slot, at the node's token: one [B, N] gather.
    flat_BX = logits_BSV.reshape(B, S * logits_BSV.shape[-1])
    idx_BN = slot_BN * logits_BSV.shape[-1] + pool.token_BN
    logp_BN = jnp.take_along_axis(flat_BX, idx_BN, axis=1) - jnp.take_along_axis(lse_BS, slot_BN, axis=1)
    logp_BN = jnp.where(pool.valid_BN, logp_BN, -jnp.inf)
    p_BN = jnp.exp(logp_BN)
    child_sum_BS = jax.vmap(lambda p, s: jax.ops.segment_sum(p, s, num_segments=S))(p_BN, slot_BN)
    return {
        "p_star": p_BN,
        "p_other": jnp.clip(1.0 - child_sum_BS, 0.0, 1.0),
        "reach_star": jnp.exp(reach(pool, logp_BN)),
        "target_argmax": jnp.argmax(logits_BSV, axis=-1).astype(jnp.int32),
    }


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter_graphdef", "spec"))
def trace_prefill(target_graphdef, target_params, drafter_graphdef, drafter_params,
                  prompt_BT, prompt_len_B, active_B, *, spec: SpecConfig) -> SpecState:
    target = nnx.merge(target_graphdef, target_params)
    drafter = nnx.merge(drafter_graphdef, drafter_params)
    return init_state(target, drafter, prompt_BT, prompt_len_B, active_B, jax.random.key(0), spec)


@functools.partial(jax.jit, static_argnames=("target_graphdef", "drafter_graphdef", "config", "spec"))
def trace_round(target_graphdef, target_params, drafter_graphdef, drafter_params, state: SpecState, *,
                config: TraceConfig, spec: SpecConfig):
    """One greedy speculative round (the engine's stages) plus the large-pool labels. Returns (state, record)."""
    target = nnx.merge(target_graphdef, target_params)
    drafter = nnx.merge(drafter_graphdef, drafter_params)
    s = state
    running_B = s.finish_B == RUNNING
    dcache, draft_BHV, hidden_BHD = draft_stage(target, drafter, s)

    # Large pool, verified by the target in one forward; its cache writes are discarded.
    lattice = build_lattice(draft_BHV, config.pool_k)
    pool = build_pool(lattice, config.pool_width)
    ptree = pool_tree(pool, s.bonus_B)
    length_B = s.cache.lengths_B
    plogits_BSV, _, _ = target(ptree.tokens_BT, length_B[:, None] + ptree.depths_BT, ancestor_mask(ptree), s.cache)
    labels = pool_labels(pool, plogits_BSV)

    # The normal round advances decoding greedily.
    tree = select_stage(spec.tree, target, None, draft_BHV, hidden_BHD, s.bonus_B)
    new, acc = verify_stage(target, drafter, s, dcache, tree, spec)
    a_B = acc.num_accepted_B
    record = {
        "running": running_B, "accepted": a_B, "round": s.rounds_B, "length": length_B,
        **flatten_inputs(ScorerInputs.from_round(lattice, pool, hidden_BHD.astype(jnp.float16), s.bonus_B)),
        **labels,
    }
    return new, record


# --------------------------------------------------------------------------- meta and I/O


def embed_probe(embed_VD) -> list[float]:
    """A few fixed entries of the embedding table: tells targets of equal shape apart."""
    e = np.asarray(jax.device_get(embed_VD), np.float32)
    V, D = e.shape
    rows = sorted({0, V // 3, (2 * V) // 3, V - 1})
    cols = sorted({0, D // 2, D - 1})
    return [float(e[r, c]) for r in rows for c in cols]


def target_embedding(target: Target) -> jax.Array:
    return target.model.embed_tokens.embedding.get_value()


def describe(target: Target, drafter, config: TraceConfig) -> dict:
    """The configuration part of meta.json (what must match to mix or reuse traces)."""
    tc, dc = target.config, drafter.config
    H = dc.block_size - 1
    return {
        "target": {"vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size, "num_layers": tc.num_layers,
                   "embed_probe": embed_probe(target_embedding(target))},
        "drafter": {"hidden_size": dc.hidden_size, "block_size": dc.block_size, "num_layers": dc.num_layers,
                    "target_layer_ids": list(dc.target_layer_ids), "mask_token_id": dc.mask_token_id},
        "pool": {"horizon": H, "beam_width": config.pool_width, "lattice_k": config.pool_k,
                 "nodes": H * config.pool_width},
        "decode": {"policy": config.policy, "budget": config.budget, "max_new_tokens": config.max_new_tokens,
                   "max_prompt_len": config.max_prompt_len, "greedy": True},
    }


def _diff(a, b, prefix=""):
    """First differing key path between two JSON-like values, as 'path: a vs b'."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _diff(a.get(k), b.get(k), f"{prefix}{'.' if prefix else ''}{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(isinstance(x, float) for x in a + b):
        return None if np.allclose(a, b, rtol=2e-2, atol=1e-4) else f"{prefix}: {a} vs {b}"
    return None if a == b else f"{prefix}: {a!r} vs {b!r}"


def read_meta(trace_dir) -> dict:
    trace_dir = Path(trace_dir)
    file = trace_dir / META_NAME
    if not trace_dir.is_dir():
        raise ValueError(f"trace directory {str(trace_dir)!r} does not exist; collect traces with `python -m train.traces`")
    if not file.is_file():
        raise ValueError(f"{trace_dir}: no {META_NAME}; not a trace directory written by `python -m train.traces`")
    try:
        meta = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read JSON ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{file}: not a {FORMAT} v{VERSION} meta file (format {meta.get('format')!r}, "
                         f"version {meta.get('version')!r}); re-collect the traces with this version")
    return meta


def check_traces_for_embedding(meta: dict, target_config, embed_VD, source: str = "traces") -> None:
    """ValueError naming both values if the traces were collected with another target."""
    want = meta["target"]
    for key in ("vocab_size", "hidden_size"):
        value = getattr(target_config, key)
        if want[key] != value:
            raise ValueError(f"{source} were collected with a target of {key}={want[key]}, but the given target has "
                             f"{key}={value}; pass the target the traces were collected with, or re-collect them")
    probe = embed_probe(embed_VD)
    if not np.allclose(want["embed_probe"], probe, rtol=2e-2, atol=1e-4):
        raise ValueError(f"{source} were collected with a target of the same shape but other embedding weights "
                         f"(embedding probe {want['embed_probe'][:2]}... vs {probe[:2]}...); pass the target the "
                         f"traces were collected with")


def check_traces_for_target(meta: dict, target: Target, source: str = "traces") -> None:
    check_traces_for_embedding(meta, target.config, target_embedding(target), source)


def load_traces(trace_dir, expect: dict | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, {field: array [rows, ...]}) of a trace directory.

    expect: an optional `describe(...)` dict (or part of one) the traces must
    match; a mismatch raises ValueError naming the first differing setting.
    """
    trace_dir = Path(trace_dir)
    meta = read_meta(trace_dir)
    if expect is not None:
        d = _diff({k: meta.get(k) for k in expect}, expect)
        if d:
            raise ValueError(f"{trace_dir}: traces of another configuration ({d}); collect traces with this "
                             f"configuration or point at the matching trace directory")
    shards = meta.get("shards") or []
    if not shards:
        raise ValueError(f"{trace_dir}: no trace shards yet; run `python -m train.traces` to collect some")
    N, H = meta["pool"]["nodes"], meta["pool"]["horizon"]
    parts: dict[str, list[np.ndarray]] = {k: [] for k in FIELDS}
    for shard in shards:
        file = trace_dir / shard["file"]
        try:
            with np.load(file) as z:
                for k in FIELDS:
                    parts[k].append(z[k])
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{file}: unreadable or incomplete trace shard ({e}); delete it from meta.json's "
                             f"shards and re-collect") from None
        if parts["token"][-1].shape[1:] != (N,) or parts["entropy"][-1].shape[1:] != (H,):
            raise ValueError(f"{file}: pool shape {parts['token'][-1].shape[1:]} / horizon "
                             f"{parts['entropy'][-1].shape[1:]} differs from meta.json's N={N}, H={H}; "
                             f"this shard belongs to another configuration")
    return meta, {k: np.concatenate(v) for k, v in parts.items()}


def _write_shard(out: Path, index: int, rows: list[dict]) -> dict:
    arrays = {k: np.stack([r[k] for r in rows]).astype(dt) for k, (dt, _) in FIELDS.items()}
    name = f"shard-{index:05d}.npz"
    tmp = out / (name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(out / name)
    return {"file": name, "rows": len(rows)}


def _write_meta(out: Path, meta: dict) -> None:
    tmp = out / (META_NAME + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(out / META_NAME)


# --------------------------------------------------------------------------- collection


def collect(target: Target, drafter, prompts, out, config: TraceConfig = TraceConfig(), *,
            batch_size: int = 8, shard_rows: int = 4096, stop_at_eos: bool = True, progress: bool = True,
            source: str | None = None) -> dict:
    """Decode `prompts` and write trace shards + meta.json under `out`. Returns the meta.

    Resumes after the last written shard when `out` already holds traces of
    the same configuration; refuses traces of another configuration.
    """
    drafter.config.check_target(target.config)
    H = drafter.config.block_size - 1
    vocab = target.config.vocab_size
    if config.pool_k > vocab:
        raise ValueError(f"pool lattice K={config.pool_k} exceeds the vocabulary size {vocab}; lower --pool-k")
    config.decode_tree(vocab).validate(H, vocab)
    ids = [p[-config.max_prompt_len:] for p in encode_prompts(prompts, target.tokenizer, vocab)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    desc = describe(target, drafter, config)
    digest = hashlib.sha1(json.dumps(ids).encode()).hexdigest()
    meta = {"format": FORMAT, "version": VERSION, **desc,
            "prompts": {"count": len(ids), "digest": digest, "source": source},
            "fields": {k: [np.dtype(dt).name, list(shape)] for k, (dt, shape) in FIELDS.items()},
            "shards": [], "rows": 0, "rounds_accepted": 0, "complete": False}
    done = 0
    if (out / META_NAME).is_file():
        old = read_meta(out)
        d = _diff({k: old.get(k) for k in desc}, desc)
        if d:
            raise ValueError(f"{out} already holds traces of another configuration ({d}); use another --out "
                             f"or delete that directory")
        if old["prompts"].get("digest") != digest:
            raise ValueError(f"{out} holds traces of another prompt set ({old['prompts']['count']} prompts from "
                             f"{old['prompts'].get('source')}); use another --out or delete that directory")
        meta = old
        done = meta["shards"][-1]["prompt_end"] if meta["shards"] else 0
    _write_meta(out, meta)
    if done >= len(ids):
        return meta

    tg, tp = target.graphdef, target.params
    dg, dp = nnx.split(drafter.module)
    eos = target.eos_ids if stop_at_eos else ()
    T = config.decode_tree(vocab).tree_size(H)
    buffer: list[dict] = []
    shard_start = done
    bar = tqdm(total=len(ids), initial=done, desc="traces", unit="prompt", disable=not progress, dynamic_ncols=True)
    accepted = meta.get("rounds_accepted", 0)

    def flush(end: int):
        nonlocal buffer, shard_start
        if not buffer:
            return
        info = _write_shard(out, len(meta["shards"]), buffer)
        meta["shards"].append({**info, "prompt_start": shard_start, "prompt_end": end})
        meta["rows"] += len(buffer)
        meta["rounds_accepted"] = accepted
        _write_meta(out, meta)
        buffer, shard_start = [], end

    for start in range(done, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        capacity = bucket(max(map(len, chunk)) + config.max_new_tokens + T + H + 1)
        prompt, lens, active = pad_batch(chunk, capacity, min_batch=batch_size)
        spec = config.spec_config(vocab, capacity, eos)
        state = trace_prefill(tg, tp, dg, dp, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(active),
                              spec=spec)
        for _ in range(config.max_new_tokens):
            state, rec = trace_round(tg, tp, dg, dp, state, config=config, spec=spec)
            rec = jax.device_get(rec)
            for b in np.flatnonzero(rec["running"]):
                row = {k: rec[k][b] for k in FIELDS if k != "prompt_id"}
                row["prompt_id"] = start + int(b)
                buffer.append(row)
                accepted += int(rec["accepted"][b])
            if not np.any(np.asarray(jax.device_get(state.finish_B)) == RUNNING):
                break
        bar.update(len(chunk))
        rows = meta["rows"] + len(buffer)
        bar.set_postfix(rows=rows, tau=f"{accepted / max(rows, 1):.2f}", refresh=False)
        if len(buffer) >= shard_rows:
            flush(start + len(chunk))
    flush(len(ids))
    bar.close()
    meta["complete"] = True
    meta["rounds_accepted"] = accepted
    _write_meta(out, meta)
    return meta


@dataclasses.dataclass(frozen=True)
class TracesRun:
    """One trace collection: the models, the prompts (a file, or a corpus), where to write, and the settings."""

    target: Path
    drafter: Path
    out: Path
    prompts: Path | None = None
    corpus: Path | None = None
    num_prompts: int = 256  # with corpus: how many; with a prompts file: its first N
    distill_prompts: tuple[Path, ...] = ()  # prompt files the drafter was distilled on (refused)
    trace: TraceConfig = TraceConfig()
    batch_size: int = 8
    shard_rows: int = 4096
    dtype: str = "float32"
    stop_at_eos: bool = True


def run(config: TracesRun, progress: bool = True) -> dict:
    """Collect the traces of `config` (see `collect`); refusals come before any model loads where they can."""
    from taps_jax.decoder import load_drafter

    check_output_path(config.out, directory=True)  # before any work
    if (config.prompts is None) == (config.corpus is None):
        raise ValueError("give the trace prompts with --prompts FILE.jsonl or --corpus DIR (one of them)")
    if config.corpus is not None and not Path(config.corpus).is_dir():
        raise ValueError(f"--corpus {config.corpus} is not a directory; give a tree of .py files")
    prompts = [r.prompt for r in read_prompt_file(config.prompts)][: config.num_prompts] if config.prompts else None
    distill_files = [[e.prompt for e in data.read_examples(f)] for f in config.distill_prompts]
    target = load_target(config.target, config.dtype)
    drafter = load_drafter(config.drafter, config.dtype)
    vocab = target.config.vocab_size
    distilled = data.read_prompt_digests(config.drafter)
    for f, texts in zip(config.distill_prompts, distill_files):
        distilled |= {data.prompt_digest(data.encode(t, target.tokenizer, vocab, str(f))) for t in texts}
    if prompts is not None:
        data.check_disjoint(encode_prompts(prompts, target.tokenizer, vocab), distilled, str(config.prompts))
        source = str(config.prompts)
    else:
        from train.corpus import build_prompts

        texts = [p["prompt"] for p in build_prompts("train", n=None, root=config.corpus)]
        prompts = [t for t, ids in zip(texts, target.encode(texts))
                   if data.prompt_digest(ids) not in distilled][: config.num_prompts]
        if len(prompts) < config.num_prompts:
            raise ValueError(f"--corpus {config.corpus} has only {len(prompts)} train-split prompts the drafter was "
                             f"not distilled on; lower --num-prompts")
        source = f"{config.corpus} (train split, {len(prompts)} prompts)"
    return collect(target, drafter, prompts, config.out, config.trace, batch_size=config.batch_size,
                   shard_rows=config.shard_rows, stop_at_eos=config.stop_at_eos, progress=progress, source=source)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.traces",
                                description="Collect TAPS scorer traces: target labels on large draft pools.")
    p.add_argument("--target", type=Path, required=True, help="target checkpoint dir (Hugging Face layout)")
    p.add_argument("--drafter", type=Path, required=True, help="DFlash drafter checkpoint dir")
    data.add_data_flags(
        p, prompts='JSONL: {"prompt": "..."} or {"ids": [...]} per line; must not hold the prompts the drafter was '
                   'distilled on (checked against DRAFTER/distill_prompts.json and --distill-prompts)',
        corpus="instead of --prompts: function-signature prompts of the train split of this tree of .py files, "
               "skipping the drafter's distillation prompts", val_prompts=False)
    p.add_argument("--num-prompts", type=int, default=256, help="how many prompts (--prompts: the file's first N)")
    p.add_argument("--distill-prompts", type=Path, action="append", default=[],
                   help="a prompts file the drafter was distilled on (repeatable); an overlap is refused")
    p.add_argument("--out", type=Path, required=True, help="output dir (shards + meta.json); resumes if it exists")
    add_flags(p, TraceConfig)  # every setting, with its help and default, from the dataclass
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--shard-rows", type=int, default=4096, help="trace rows per shard file")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights dtype")
    p.add_argument("--no-eos", action="store_true", help="do not stop sequences at EOS")
    compile_cache.add_flag(p)
    args = p.parse_args(argv)
    try:
        compile_cache.setup(args)
        meta = run(TracesRun(
            target=args.target, drafter=args.drafter, out=args.out, prompts=args.prompts, corpus=args.corpus,
            num_prompts=args.num_prompts, distill_prompts=tuple(args.distill_prompts),
            trace=build(TraceConfig, None, args), batch_size=args.batch_size, shard_rows=args.shard_rows,
            dtype=args.dtype, stop_at_eos=not args.no_eos))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the shards written so far are kept; run the same command again to resume after "
              "the last one", file=sys.stderr)
        return 130
    print(f"{meta['rows']} rows ({meta['pool']['nodes']} pool nodes each) from {meta['prompts']['count']} prompts "
          f"in {len(meta['shards'])} shards under {args.out}; decoding tau "
          f"{meta['rounds_accepted'] / max(meta['rows'], 1):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
