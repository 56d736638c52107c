"""Train the TAPS scorer on traces (see train/traces.py).

Loss per batch = mean over parent groups of KL(p* || q) over {pool children,
other} + 0.5 * mean over pool nodes of BCE(q_reach, reach*), where q is the
scorer's grouped softmax and q_reach its product along the path. AdamW
(lr 3e-3, weight decay 1e-4) with a cosine schedule; the validation split is
by PROMPT (no prompt contributes rows to both sides); the checkpoint with the
best validation loss is exported. Runs on `train.loop` (orbax checkpoints,
resumable with --resume, progress bar, metrics.csv + loss.png).

Outputs under --out: checkpoints/, best/, metrics.csv, loss.png (the loop's)
and scorer/ (config.json + model.safetensors, loadable with
`taps_jax.load_scorer`).

CLI: python -m train.scorer --traces DIR --target DIR --out DIR [--steps N] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from decode.common import check_output_path
from taps_jax import compile_cache, sharding
from taps_jax.checkpoints.hf import check_target, read_target_config
from taps_jax.checkpoints.scorer import EMBED_NAME, ScorerModel, save_scorer
from taps_jax.checkpoints.tensors import read_tensor
from taps_jax.config import ModelConfig
from taps_jax.tree.pool import Pool
from taps_jax.tree.scorer import Scorer, ScorerConfig, ScorerInputs, scorer_log_qcond
from taps_jax.tree.select import reach
from train import loop
from train.config import add_flags, build, option
from train.traces import check_traces_for_embedding, load_traces, unflatten_inputs

LABELS = ("sampled", "greedy")
VAL_TAU_BUDGET = 64


@dataclasses.dataclass(frozen=True)
class ScorerTrainConfig:
    steps: int = option(2000, "optimizer steps")
    batch_size: int = option(32, "trace rows (one sequence-round each) per step")
    lr: float = option(3e-3, "peak learning rate (AdamW, cosine)")
    weight_decay: float = option(1e-4, "AdamW weight decay")
    warmup_steps: int | None = option(None, "linear warmup steps (default: 2% of the steps)")
    min_lr_ratio: float = option(0.0, "final learning rate / peak")
    val_fraction: float = option(0.1, "fraction of the PROMPTS held out for validation")
    eval_every: int = option(200, "validate every N steps (0: only at the end)")
    log_every: int = option(10, "log every N steps")
    checkpoint_every_s: float = option(600.0, "seconds between checkpoints")
    checkpoint_every: int = option(0, "also checkpoint every N steps (0: by time only)")
    seed: int = option(0, "initialisation, split and data-order seed")
    token_dim: int = option(32, "width of the token-embedding projection")
    hidden_dim: int = option(32, "width of the drafter-hidden-state projection")
    depth_dim: int = option(16, "width of the depth embedding")
    mlp_dim: int = option(64, "width of the scorer's MLP heads")
    labels: str = option("sampled", "what q_cond estimates: 'sampled' = the target's temperature-1 probability of "
                         "each child (for sampled decoding), 'greedy' = whether it is the target's argmax (for "
                         "temperature 0)", choices=LABELS)
    residual: bool = option(False, "learn a correction to the drafter's own conditional (starts at DDTree's "
                                   "ranking; ScorerConfig.residual)")

    def __post_init__(self):
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {self.labels!r}")
        for name in ("steps", "batch_size", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")

    def optim(self) -> loop.OptimConfig:
        warmup = self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 50)
        return loop.OptimConfig(lr=self.lr, warmup_steps=warmup, total_steps=self.steps,
                                min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay)


# --------------------------------------------------------------------------- target embedding


def load_target_embedding(path) -> tuple[ModelConfig, np.ndarray]:
    """The target's config and its [V, D] token embedding table (float32), nothing else (HF dir or GGUF)."""
    path = check_target(path)
    config = read_target_config(path)
    table = read_tensor(path, EMBED_NAME)  # the shared reader: this one tensor only
    if table is None:
        raise ValueError(f"{path}: no tensor {EMBED_NAME!r}; expected a Hugging Face target checkpoint")
    table = np.asarray(table, np.float32)
    if table.shape != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{path}: {EMBED_NAME} has shape {table.shape}, the config expects "
                         f"{(config.vocab_size, config.hidden_size)}")
    return config, table


# --------------------------------------------------------------------------- loss


def inputs_from_batch(batch: dict, width: int) -> ScorerInputs:
    """ScorerInputs of a batch of trace rows (the scorer's own view of a round; the schema is train.traces')."""
    return unflatten_inputs(batch, width)


def scorer_loss(pool: Pool, log_q_BN, log_qo_BS, p_BN, po_BS, reach_BN, row_w_B):
    """(KL + 0.5 * BCE, {"kl", "bce"}), weighted by row (padding rows weigh 0).

    KL(p* || q) per parent group over {pool children, other}, averaged over the
    groups that have at least one pool child; BCE(q_reach, reach*) averaged
    over valid pool nodes.
    """
    B, N = p_BN.shape
    S = N + 1
    valid = pool.valid_BN
    seg_BN = jnp.maximum(pool.parent_BN + 1, 0)
    segsum = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=S))
    p_BN = jnp.where(valid, p_BN.astype(jnp.float32), 0.0)
    po_BS = po_BS.astype(jnp.float32)
    lq_BN = jnp.where(valid, log_q_BN, 0.0)
    kl_child_BN = jnp.where(valid, jax.scipy.special.xlogy(p_BN, p_BN) - p_BN * lq_BN, 0.0)
    kl_BS = segsum(kl_child_BN, seg_BN) + jax.scipy.special.xlogy(po_BS, po_BS) - po_BS * log_qo_BS
    group_w_BS = (segsum(valid.astype(jnp.float32), seg_BN) > 0) * row_w_B[:, None]
    kl = jnp.sum(jnp.where(group_w_BS > 0, kl_BS, 0.0) * group_w_BS) / jnp.maximum(jnp.sum(group_w_BS), 1.0)

    log_r_BN = jnp.where(valid, reach(pool, lq_BN), -1.0)
    log_r_BN = jnp.minimum(log_r_BN, -1e-6)  # keeps log(1 - q_reach) finite
    log_1mr_BN = jnp.log(-jnp.expm1(log_r_BN))
    r_BN = reach_BN.astype(jnp.float32)
    bce_BN = -(r_BN * log_r_BN + (1.0 - r_BN) * log_1mr_BN)
    node_w_BN = valid * row_w_B[:, None]
    bce = jnp.sum(jnp.where(valid, bce_BN, 0.0) * node_w_BN) / jnp.maximum(jnp.sum(node_w_BN), 1.0)
    return kl + 0.5 * bce, {"kl": kl, "bce": bce}


def make_loss_fn(graphdef, width: int):
    def loss_fn(params, batch):
        scorer = nnx.merge(graphdef, params)
        inputs = inputs_from_batch(batch, width)
        log_q, log_qo = scorer_log_qcond(scorer, inputs, batch["embed"])
        return scorer_loss(inputs.pool, log_q, log_qo, batch["p_star"], batch["p_other"], batch["reach_star"],
                           batch["row_weight"])

    return loss_fn


@functools.partial(jax.jit, static_argnames=("graphdef", "width", "budget"))
def _val_counts(graphdef, params, batch, *, width: int, budget: int):
    """Validation counts of one batch, from one scorer forward.

    (scorer correct, drafter correct, groups whose target argmax is a pool
    child, groups with children, greedy tau of the scorer's top-`budget` tree
    and of the drafter's, summed over rows). Under greedy verification a tree
    accepts exactly its nodes on the target's argmax path, so tau = 1 + sum of
    the selected nodes' greedy reach (0/1).
    """
    scorer = nnx.merge(graphdef, params)
    inputs = inputs_from_batch(batch, width)
    log_q, _ = scorer_log_qcond(scorer, inputs, batch["embed"])
    pool = inputs.pool
    N = log_q.shape[1]
    S = N + 1
    seg = jnp.maximum(pool.parent_BN + 1, 0)
    segmax = jax.vmap(lambda x, s: jax.ops.segment_max(x, s, num_segments=S))
    segany = jax.vmap(lambda x, s: jax.ops.segment_max(x.astype(jnp.int32), s, num_segments=S) > 0)
    want_BN = jnp.take_along_axis(batch["target_argmax"].astype(jnp.int32), seg, axis=1)
    hit_BN = pool.valid_BN & (pool.token_BN == want_BN)
    row = batch["row_weight"][:, None] > 0

    def correct(score_BN):
        score_BN = jnp.where(pool.valid_BN, score_BN, -jnp.inf)
        best_BN = score_BN == jnp.take_along_axis(segmax(score_BN, seg), seg, axis=1)
        return jnp.sum(segany(hit_BN & best_BN, seg) & row)

    def tau(score_BN):
        _, idx_BM = jax.lax.top_k(jnp.where(pool.valid_BN, score_BN, -jnp.inf), budget)
        accepted_B = jnp.take_along_axis(batch["greedy_reach"], idx_BM, axis=1).sum(axis=1)
        return jnp.sum((1.0 + accepted_B) * batch["row_weight"])

    eligible = jnp.sum(segany(hit_BN, seg) & row)
    groups = jnp.sum(segany(pool.valid_BN, seg) & row)
    return (correct(log_q), correct(pool.step_logprob_BN), eligible, groups,
            tau(reach(pool, log_q)), tau(pool.cum_logprob_BN))


# --------------------------------------------------------------------------- data


def greedy_labels(arrays: dict[str, np.ndarray], width: int) -> dict[str, np.ndarray]:
    """Trace labels for greedy verification, from the target's argmax per parent slot.

    p_star(v) = 1 if x_v is the target's greedy token at v's parent else 0,
    p_other(u) = 1 - sum of its children's p_star (the argmax is not a pool
    child), reach_star(v) = 1 iff every edge on the path is the argmax, i.e.
    exactly whether greedy verification would accept v.
    """
    parent = arrays["parent"].astype(np.int64)
    slot = np.maximum(parent + 1, 0)
    want = np.take_along_axis(arrays["target_argmax"], slot, axis=1)
    hit = arrays["valid"] & (arrays["token"] == want)
    rows, n = hit.shape
    p_other = np.ones((rows, n + 1), np.float32)
    np.subtract.at(p_other, (np.repeat(np.arange(rows), n), slot.ravel()), hit.ravel().astype(np.float32))
    pool = inputs_from_batch(arrays, width).pool
    reach_star = np.exp(np.asarray(reach(pool, jnp.where(hit, 0.0, -jnp.inf))))  # log 1 / log 0 along the path
    return {"p_star": hit.astype(np.float32), "p_other": np.clip(p_other, 0.0, 1.0),
            "reach_star": reach_star.astype(np.float32)}


class TraceBatches:
    """Fixed-size batches of trace rows; `batch_at(step)` is a pure function of the step."""

    def __init__(self, arrays: dict[str, np.ndarray], rows: np.ndarray, batch_size: int, seed: int, embed):
        self.arrays, self.rows, self.batch_size, self.seed, self.embed = arrays, rows, batch_size, seed, embed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
        return self._perms[epoch]

    def take(self, idx: np.ndarray, weight: np.ndarray | None = None) -> dict:
        batch = {k: v[idx] for k, v in self.arrays.items() if k not in ("prompt_id", "round", "length")}
        batch["row_weight"] = np.ones(len(idx), np.float32) if weight is None else weight
        batch["embed"] = self.embed
        return batch

    def batch_at(self, step: int) -> dict:
        n = len(self.rows)
        pos = step * self.batch_size + np.arange(self.batch_size)
        idx = np.array([self._perm(int(p // n))[p % n] for p in pos])
        return self.take(idx)

    def fixed(self) -> list[dict]:
        """All rows once, in order, the last batch padded with weight-0 rows."""
        out = []
        for start in range(0, len(self.rows), self.batch_size):
            idx = self.rows[start:start + self.batch_size]
            weight = np.zeros(self.batch_size, np.float32)
            weight[: len(idx)] = 1.0
            idx = np.concatenate([idx, np.full(self.batch_size - len(idx), idx[0])])
            out.append(self.take(idx, weight))
        return out


def split_by_prompt(prompt_id: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, val rows): whole prompts go to one side."""
    prompts = np.unique(prompt_id)
    if val_fraction == 0:
        return np.arange(len(prompt_id)), np.zeros(0, np.int64)
    if len(prompts) < 2:
        raise ValueError(f"the traces cover {len(prompts)} prompt(s); a validation split by prompt needs at least 2 "
                         f"(collect traces on more prompts, or pass --val-fraction 0)")
    n_val = min(len(prompts) - 1, max(1, int(round(val_fraction * len(prompts)))))
    val_prompts = np.random.default_rng(seed).permutation(prompts)[:n_val]
    is_val = np.isin(prompt_id, val_prompts)
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)


# --------------------------------------------------------------------------- training


def train_scorer(traces, target, out, config: ScorerTrainConfig = ScorerTrainConfig(), *, resume: bool = False,
                 progress: bool = True, mesh=None) -> dict:
    """Train on a trace dir; export the best scorer to out/scorer. Returns a summary dict.

    target: a target checkpoint dir, or a (ModelConfig, embedding [V, D]) pair.
    mesh: split each batch of trace rows over "data" (batch_size must divide
    it); the scorer (~1e5 params) is replicated, the embedding table is
    vocab-sharded over "model" like the target's.
    """
    out = Path(out)
    if isinstance(target, (str, Path)):
        target_config, embed = load_target_embedding(target)
    else:
        target_config, embed = target
    meta, arrays = load_traces(traces)
    check_traces_for_embedding(meta, target_config, embed, source=f"the traces in {traces}")
    width, horizon = meta["pool"]["beam_width"], meta["pool"]["horizon"]
    greedy = greedy_labels(arrays, width)
    arrays["greedy_reach"] = greedy["reach_star"]  # for the validation tau below
    if config.labels == "greedy":
        arrays.update(greedy)
    scorer_config = ScorerConfig(
        vocab_size=target_config.vocab_size, embed_dim=target_config.hidden_size,
        drafter_hidden_size=meta["drafter"]["hidden_size"], horizon=horizon, token_dim=config.token_dim,
        hidden_dim=config.hidden_dim, depth_dim=config.depth_dim, mlp_dim=config.mlp_dim,
        residual=config.residual,
    )
    train_rows, val_rows = split_by_prompt(arrays["prompt_id"], config.val_fraction, config.seed)
    if config.batch_size % sharding.data_size(mesh):
        raise ValueError(f"batch size {config.batch_size} is not divisible by the mesh's data axis "
                         f"({sharding.data_size(mesh)})")
    embed_dev = jnp.asarray(embed, jnp.float32)
    if mesh is not None:
        embed_dev = jax.device_put(embed_dev, sharding.NamedSharding(
            mesh, sharding.param_spec("embed_tokens.embedding", embed_dev.shape, mesh)))
    train_data = TraceBatches(arrays, train_rows, config.batch_size, config.seed, embed_dev)
    val_data = TraceBatches(arrays, val_rows, config.batch_size, config.seed, embed_dev)

    graphdef, params = nnx.split(Scorer(scorer_config, nnx.Rngs(config.seed)))
    loss_fn = make_loss_fn(graphdef, width)
    optim = config.optim()
    optimizer = loop.make_optimizer(optim)
    state = loop.shard_state(loop.TrainState.create(params, optimizer), mesh)
    val_batches = val_data.fixed() if len(val_rows) else []
    evaluate = loop.make_eval_fn(loss_fn, val_batches, mesh) if val_batches else None
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    if progress:
        tqdm.write(f"scorer: {n_params:,} params; {len(train_rows)} train rows / {len(val_rows)} val rows "
                   f"({len(np.unique(arrays['prompt_id'][val_rows]))} val prompts); pool N={meta['pool']['nodes']}")
    loop_config = loop.LoopConfig(
        total_steps=config.steps, tokens_per_step=config.batch_size * meta["pool"]["nodes"],
        log_every=min(config.log_every, config.steps), eval_every=config.eval_every,
        checkpoint_every_s=config.checkpoint_every_s, checkpoint_every=config.checkpoint_every,
    )
    run_meta = {"scorer_config": dataclasses.asdict(scorer_config), "traces": str(traces), "labels": config.labels}
    result = loop.run(loop_config, state, loop.make_train_step(loss_fn, optimizer, mesh), train_data.batch_at, out,
                      evaluate=evaluate, resume=resume, meta=run_meta, optim=optim, desc="scorer", mesh=mesh,
                      resume_must_match=("labels",))

    best = result.best_params if result.best_params is not None else result.state.params
    train_losses = [float(r["loss"]) for r in result.history if r["split"] == "train"]
    summary = {
        "steps": int(result.state.step),
        "train_loss": train_losses[-1] if train_losses else float("nan"),
        "val_loss": result.best_val if val_batches else float("nan"),
        "best_step": result.best_step,
        "params": n_params,
    }
    if val_batches:
        # Greedy tau of the trace pools' top-64 trees: what selection buys (an
        # offline estimate; the pools are the traces', not the decoder's).
        budget = min(VAL_TAU_BUDGET, meta["pool"]["nodes"])
        counts = np.sum([jax.device_get(_val_counts(graphdef, best, b, width=width, budget=budget))
                         for b in val_batches], axis=0)
        sc, dr, eligible, groups = (int(c) for c in counts[:4])
        summary.update(val_top1_accuracy=sc / max(eligible, 1), val_top1_drafter=dr / max(eligible, 1),
                       val_argmax_in_pool=eligible / max(groups, 1), val_tau_budget=budget,
                       val_greedy_tau_scorer=float(counts[4] / len(val_rows)),
                       val_greedy_tau_drafter=float(counts[5] / len(val_rows)))
    training = {
        "labels": config.labels, "traces": str(traces), "pool": meta["pool"], "decode": meta["decode"], "target": meta["target"],
        "steps": summary["steps"], "best_step": summary["best_step"], "val_loss": summary["val_loss"],
    }
    model = ScorerModel(nnx.merge(graphdef, best), training)
    save_scorer(model.module, out / "scorer", training)
    summary["scorer_dir"] = str(out / "scorer")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@dataclasses.dataclass(frozen=True)
class ScorerRun:
    """One scorer training: the traces, the target they were collected with, where to write, the settings."""

    traces: Path
    target: Path
    out: Path
    train: ScorerTrainConfig = ScorerTrainConfig()
    resume: bool = False


def run(config: ScorerRun, mesh=None, progress: bool = True) -> dict:
    """Train and export the scorer of `config` (see `train_scorer`). Returns the summary."""
    check_output_path(config.out, directory=True)  # before any work
    return train_scorer(config.traces, config.target, config.out, config.train, resume=config.resume,
                        progress=progress, mesh=mesh)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.scorer", description="Train the TAPS scorer on traces from `python -m train.traces`.")
    p.add_argument("--traces", type=Path, required=True, help="trace dir (meta.json + shards)")
    p.add_argument("--target", type=Path, required=True, help="the target checkpoint the traces were collected with")
    p.add_argument("--out", type=Path, required=True, help="training dir; the scorer is exported to OUT/scorer")
    add_flags(p, ScorerTrainConfig)  # every setting, with its help and default, from the dataclass
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
    sharding.add_mesh_args(p)
    compile_cache.add_flag(p)
    args = p.parse_args(argv)
    try:
        compile_cache.setup(args)
        check_output_path(args.out, directory=True)  # before any work
        mesh = sharding.setup_mesh(args)
        s = run(ScorerRun(args.traces, args.target, args.out, build(ScorerTrainConfig, None, args), args.resume),
                mesh=mesh)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the last checkpoint is under {args.out}; continue with the same command plus --resume",
              file=sys.stderr)
        return 130
    line = f"final train loss {s['train_loss']:.4f}  val loss {s['val_loss']:.4f} (best step {s['best_step']})"
    if "val_top1_accuracy" in s:
        line += (f"  val top-1 child = target argmax: {s['val_top1_accuracy']:.3f} (drafter's own ranking "
                 f"{s['val_top1_drafter']:.3f}; argmax in pool for {s['val_argmax_in_pool']:.1%} of groups)\n"
                 f"val greedy tau of the top-{s['val_tau_budget']} tree: {s['val_greedy_tau_scorer']:.3f} by the "
                 f"scorer's reach, {s['val_greedy_tau_drafter']:.3f} by the drafter's (DDTree's) ranking")
    print(line, flush=True)
    print(f"scorer written to {s['scorer_dir']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
