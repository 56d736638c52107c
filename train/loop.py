"""A small, reusable training loop: AdamW + warmup/cosine, jitted step, eval, orbax.

Used by target pretraining (`train.target`) and meant to be reused by the
drafter-distillation and scorer-training loops. Everything model-specific
lives in a `loss_fn(params, batch) -> (loss, metrics)` closure; the loop only
knows pytrees:

    state = TrainState.create(params, optimizer)          # step, params, opt_state
    step_fn = make_train_step(loss_fn, optimizer)          # jitted, state donated
    result = run(LoopConfig(...), state, step_fn, batch_at, eval_fn, ...)

The batch is whatever `batch_at(step)` returns (arrays with a leading batch
axis); the step is written on whole arrays (no per-example Python).

Sharding (`mesh=`, a `taps_jax.sharding.make_mesh` ("data", "model") mesh):
`shard_state` places params AND optimizer state by the logical-axis rules
(attention heads / kv heads / MLP width / vocab over "model", the rest
replicated; Adam moments follow their parameter's path, so they land like
it), `run` splits every host (numpy) leaf of the batch over "data" on its
leading axis (device arrays in the batch, e.g. frozen target params, are
taken as already placed), and the jitted step pins the new state to the same
shardings, so it stays one GSPMD program with the gradient all-reduce
inserted by XLA. Orbax saves sharded arrays as they are and restores onto
whatever mesh the template state lives on: resuming on another mesh shape
is `Checkpointer.restore(shard_state(template, new_mesh))`.

Resumability: `batch_at` must be a pure function of the step (see
`train.packing.PackedBatches.batch_at`), the optimizer state and step live in
the checkpoint, and there is no RNG in the step; so restoring checkpoint k and
running step k gives bit-identical results to an uninterrupted run.

Outputs under `out_dir`:
    checkpoints/<step>/   orbax CheckpointManager, keeps the last `keep`
    best/<step>/          params of the best validation loss (keeps 1)
    metrics.csv           step,split,loss,lr,grad_norm,tokens_per_s,elapsed_s,cpu_s (wall and process CPU
                          seconds of training so far, all legs)
    loss.png              train/val loss curves (redrawn at each eval)

Faults (tests/test_train_faults.py): a run killed at any point (SIGKILL
included) resumes from the last complete checkpoint. Orbax writes each save
into `<step>.orbax-checkpoint-tmp` and renames it when complete, so a killed
save is never listed as a step; the next run removes the leftover. A latest
checkpoint that does not restore (damaged or missing files) is reported with
a warning and the previous one is used; it is kept, and moved aside to
`checkpoints/<step>.corrupt-<n>` when the resumed run saves again.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from taps_jax import sharding
from train.config import option

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, dict]]
# evaluate(params, step) -> {"loss": the selection metric (lower is better), ...anything else to report}
EvalFn = Callable[[PyTree, int], dict]


# --------------------------------------------------------------------------- optimizer


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay to `min_lr_ratio * lr`, global-norm clipping."""

    lr: float = option(1e-3, "peak learning rate")
    warmup_steps: int = option(100, "linear warmup steps")
    total_steps: int = 1000  # set from the run's steps, not a flag
    min_lr_ratio: float = option(0.1, "final learning rate / peak (cosine decay)")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)")
    b1: float = option(0.9, "Adam beta1")
    b2: float = option(0.95, "Adam beta2")
    eps: float = option(1e-8, "Adam epsilon")
    clip_norm: float = option(1.0, "global gradient-norm clip")

    def schedule(self) -> optax.Schedule:
        warmup = max(1, min(self.warmup_steps, self.total_steps - 1))
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=self.lr, warmup_steps=warmup,
            decay_steps=max(self.total_steps, warmup + 1), end_value=self.lr * self.min_lr_ratio,
        )


def decay_mask(params: PyTree) -> PyTree:
    """Weight decay on matrices only (not on norms' gains or biases)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(
            config.schedule(), b1=config.b1, b2=config.b2, eps=config.eps,
            weight_decay=config.weight_decay, mask=decay_mask,
        ),
    )


# --------------------------------------------------------------------------- state and step


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32: the number of optimizer updates applied
    params: PyTree
    opt_state: PyTree

    @classmethod
    def create(cls, params: PyTree, optimizer: optax.GradientTransformation) -> "TrainState":
        return cls(step=jnp.zeros([], jnp.int32), params=params, opt_state=optimizer.init(params))


def shard_state(state: PyTree, mesh) -> PyTree:
    """Place a TrainState (or params) on `mesh` by the logical-axis rules; None: unchanged."""
    return sharding.shard_params(state, mesh)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh=None):
    """jitted (state, batch) -> (state, metrics); the input state is donated.

    mesh: the new state is constrained to the rules' shardings (the same the
    input got from `shard_state`), so steps never drift to other layouts.
    """

    def train_step(state: TrainState, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        new = TrainState(state.step + 1, params, opt_state)
        if mesh is not None:
            new = jax.lax.with_sharding_constraint(new, sharding.param_shardings(new, mesh))
        return new, metrics

    step = jax.jit(train_step, donate_argnums=0)
    if mesh is None:
        return step

    def sharded_step(state: TrainState, batch):
        with sharding.use_mesh(mesh):
            return step(state, sharding.shard_batch(batch, mesh))

    sharded_step.jitted = step
    return sharded_step


def make_eval_fn(loss_fn: LossFn, batches: Sequence[PyTree], mesh=None) -> EvalFn:
    """evaluate(params, step) -> {"loss": mean loss over fixed batches} (all batches have the same shape)."""
    step = jax.jit(lambda params, batch: loss_fn(params, batch)[0])
    batches = [sharding.shard_batch(b, mesh) for b in batches]

    def evaluate(params, step_number: int) -> dict:
        losses = [step(params, b) for b in batches]  # dispatched asynchronously
        return {"loss": float(np.mean(jax.device_get(losses))) if losses else float("nan")}

    return evaluate


# --------------------------------------------------------------------------- checkpoints


def _key_name(entry) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten(tree: PyTree) -> dict[str, Any]:
    """{'a.b.0.c': leaf} — plain names, so any pytree (nnx.State, optax states) checkpoints the same way."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(_key_name(e) for e in path) or "_"
        if name in flat:
            raise ValueError(f"two leaves of the train state flatten to the same name {name!r}")
        flat[name] = leaf
    return flat


def unflatten(template: PyTree, flat: dict[str, Any]) -> PyTree:
    names = list(flatten(template))
    missing = [n for n in names if n not in flat]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} entries of the train state, e.g. {missing[:3]}; "
                         "was it written for another model or optimizer config?")
    return jax.tree.unflatten(jax.tree.structure(template), [flat[n] for n in names])


class Checkpointer:
    """Last-N train-state checkpoints plus the best-validation params, via orbax.

    writer=True (what `run` uses) also removes the `*.orbax-checkpoint-tmp`
    directories that a killed save leaves behind; readers (export, resume
    probes) leave them alone, since a training run may be writing one.
    """

    def __init__(self, out_dir: str | Path, keep: int = 3, writer: bool = False):
        out_dir = Path(out_dir).absolute()
        opts = dict(create=True, enable_async_checkpointing=False, cleanup_tmp_directories=writer)
        self.latest = ocp.CheckpointManager(
            out_dir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=keep, **opts)
        )
        self.best = ocp.CheckpointManager(
            out_dir / "best", options=ocp.CheckpointManagerOptions(max_to_keep=1, **opts)
        )
        self.good: set[int] = set()  # steps this object saved or restored
        self.bad: dict[int, str] = {}  # steps that failed to restore -> the error

    def save(self, state: TrainState, meta: dict) -> None:
        step = int(state.step)
        if step in self.good:  # e.g. the final checkpoint right after a periodic one
            return
        self._move_aside_bad()
        if step in self.latest.all_steps():
            warnings.warn(f"{self.latest.directory / str(step)} is from an earlier run and is not overwritten; "
                          "continue a run with --resume, or give a new run its own --out", RuntimeWarning)
            return
        # force: orbax otherwise skips, silently, a step below its latest one.
        saved = self.latest.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(flatten(state)), meta=ocp.args.JsonSave(meta)))
        self.latest.wait_until_finished()
        if not saved:
            raise RuntimeError(f"orbax did not save step {step} under {self.latest.directory}")
        self.good.add(step)

    def _move_aside_bad(self) -> None:
        """Rename the steps that failed to restore to `<step>.corrupt-<n>` (orbax ignores those names).

        They must leave the step namespace: the resumed run reaches their step
        numbers again, and orbax neither overwrites a step nor saves below its
        latest one. Renamed, not deleted, so nothing is lost if the failure was
        something else (a flaky disk, a wrong template).
        """
        if not self.bad:
            return
        for step in sorted(self.bad):
            path = Path(self.latest.directory) / str(step)
            if path.exists():
                n = 0
                while path.with_name(f"{step}.corrupt-{n}").exists():
                    n += 1
                path.rename(path.with_name(f"{step}.corrupt-{n}"))
                tqdm.write(f"moved the unrestorable checkpoint {path} aside to {path.name}.corrupt-{n}")
        self.bad.clear()
        self.latest.reload()  # orbax caches the step list

    def save_best(self, step: int, params: PyTree, meta: dict) -> None:
        # Atomic: orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete, and
        # max_to_keep=1 deletes the previous best only after that. A best at a step >= `step`
        # can only come from a leg after the checkpoint this run resumed from: that trajectory
        # is being recomputed, so it is deleted first (orbax neither overwrites a step nor saves
        # below its latest one); a kill right then leaves best/ empty until it is recomputed.
        for old in self.best.all_steps():
            if old >= step:
                self.best.delete(old)
        self.best.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(flatten(params)), meta=ocp.args.JsonSave(meta)))
        self.best.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def _restore(self, template: TrainState, step: int) -> tuple[TrainState, dict]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, flatten(template))
        got = self.latest.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return unflatten(template, got["state"]), dict(got["meta"])

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """The checkpoint at `step`, or else the newest one that restores.

        A step that fails (files damaged or missing, e.g. after a disk fault)
        gives a warning and the next older one is tried; it is left on disk
        (see `_move_aside_bad`). An explicit `step` is restored or raises.
        """
        if step is not None:
            return self._restore(template, step)
        steps = sorted(self.latest.all_steps(), reverse=True)
        if not steps:
            raise ValueError(f"no checkpoint to resume from under {self.latest.directory}")
        for step in steps:
            try:
                got = self._restore(template, step)
            except Exception as e:  # orbax / tensorstore raise many types (ValueError, KeyError, JSONDecodeError, ...)
                self.bad[step] = error = f"{type(e).__name__}: {_shorten(str(e))}"
                text = (f"checkpoint {self.latest.directory / str(step)} does not restore ({error}); "
                        f"trying the previous one. It is kept, and moved aside at the next save.")
                tqdm.write(f"warning: {text}")
                warnings.warn(text, RuntimeWarning, stacklevel=2)
                continue
            self.good.add(step)
            return got
        tried = "; ".join(f"step {s}: {e}" for s, e in self.bad.items())
        raise ValueError(f"none of the {len(steps)} checkpoints under {self.latest.directory} restores ({tried}). "
                         "If they were written for another model or optimizer config, use that config or "
                         "another --out; otherwise start over without --resume (or delete that directory).")

    def restore_best(self, template_params: PyTree) -> tuple[PyTree, dict] | None:
        """(params, meta) of the best validation; None if none was saved or it does not restore (warned)."""
        step = self.best.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, flatten(template_params))
        try:
            got = self.best.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # damaged like a latest checkpoint can be; callers fall back to the latest params
            text = (f"best checkpoint {self.best.directory / str(step)} does not restore "
                    f"({type(e).__name__}: {_shorten(str(e))}); using the latest params instead")
            tqdm.write(f"warning: {text}")
            warnings.warn(text, RuntimeWarning, stacklevel=2)
            return None
        return unflatten(template_params, got["params"]), dict(got["meta"])

    def close(self) -> None:
        self.latest.close()
        self.best.close()


def _shorten(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())  # tensorstore errors span lines and quote whole specs
    return text if len(text) <= limit else text[:limit] + " ..."


# --------------------------------------------------------------------------- metrics log


FIELDS = ("step", "split", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "cpu_s")


class MetricsLog:
    """Append-only CSV (kept consistent on resume) and a PNG of the loss curves."""

    def __init__(self, out_dir: Path, resume_step: int | None):
        self.csv_path = out_dir / "metrics.csv"
        self.png_path = out_dir / "loss.png"
        rows = []
        if resume_step is not None and self.csv_path.exists():
            text = self.csv_path.read_text()
            if not text.endswith("\n"):  # a kill mid-append tore the last row: drop it
                text = text[: text.rfind("\n") + 1]
            reader = csv.DictReader(io.StringIO(text, newline=""))
            old = {k: "" for k in FIELDS if k not in (reader.fieldnames or ())}  # cpu_s: logged since 2026-12-04
            rows = [{**r, **old} for r in reader]
            rows = [r for r in rows if _complete(r) and int(r["step"]) <= resume_step]
        self.rows = rows
        # Rewritten whole and renamed into place: a kill here leaves the old file, not half of it.
        tmp = self.csv_path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, self.csv_path)

    def add(self, **row) -> None:
        row = {k: row.get(k, "") for k in FIELDS}
        self.rows.append(row)
        with self.csv_path.open("a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow(row)

    def plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for split, style in (("train", "-"), ("val", "o-")):
            pts = [(int(r["step"]), float(r["loss"])) for r in self.rows if r["split"] == split]
            if pts:
                ax.plot(*zip(*pts), style, label=split, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = self.png_path.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, self.png_path)


def _complete(row: dict) -> bool:
    """False for a damaged row (fields missing or extra, no step): skipped on resume, not a crash."""
    return None not in row and all(row.get(k) is not None for k in FIELDS) and row["step"].isdigit()


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    total_steps: int
    tokens_per_step: int  # for tokens/s
    log_every: int = 10
    eval_every: int = 250  # 0: only at the end
    checkpoint_every_s: float = 600.0  # wall-clock; also saved at the end and on SIGTERM / Ctrl-C
    checkpoint_every: int = 0  # steps; 0: time-based only
    keep: int = 3


@dataclasses.dataclass
class LoopResult:
    state: TrainState
    best_params: PyTree | None  # None when no evaluation ran
    best_val: float
    best_step: int
    history: list[dict]


def _lr_at(optim: OptimConfig | None, step: int) -> float:
    return float(optim.schedule()(step)) if optim is not None else float("nan")


def run(
    config: LoopConfig,
    state: TrainState,
    train_step,
    batch_at: Callable[[int], PyTree],
    out_dir: str | Path,
    *,
    evaluate: EvalFn | None = None,
    frozen: dict[str, PyTree] | None = None,
    resume: bool = False,
    meta: dict | None = None,
    optim: OptimConfig | None = None,
    desc: str = "train",
    mesh=None,
    resume_must_match: tuple[str, ...] = (),
) -> LoopResult:
    """Train from `state` (or the latest checkpoint if resume) to config.total_steps.

    resume_must_match: keys of `meta` that the checkpoint resumed from must
    have the same value for (a ValueError otherwise, before any step).

    evaluate(params, step) -> {"loss": ..., ...}: called after step `step`
    (steps done); its "loss" selects the best checkpoint.
    frozen: {name: inputs every step reads but never trains} (e.g. the
    target's params, already placed): added to every batch under those
    names, never split over "data" or checkpointed.

    mesh: the state is placed on it (`shard_state`) before any restore, so a
    checkpoint written on any mesh shape resumes onto this one; pair it with
    `make_train_step(..., mesh=mesh)`, which splits each batch over "data".
    """
    out_dir = Path(out_dir)
    meta = dict(meta or {})
    state = shard_state(state, mesh)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(out_dir, config.keep, writer=True)
    best_val, best_step = math.inf, -1
    if resume and ckpt.latest_step() is not None:
        state, saved = ckpt.restore(state)
        for key in resume_must_match:
            if key in saved and saved[key] != meta.get(key):
                raise ValueError(f"{out_dir}: its checkpoints were trained with {key}={saved[key]!r}, this run asks "
                                 f"for {key}={meta.get(key)!r}; resume with the same setting or pick "
                                 f"another output directory")
        best_val, best_step = saved.get("best_val", math.inf), saved.get("best_step", -1)
        tqdm.write(f"resumed from step {int(state.step)} (best val {best_val:.4f} at step {best_step})")
    elif resume:
        tqdm.write(f"--resume: no checkpoint under {out_dir / 'checkpoints'}; starting from step 0")
    start = int(state.step)
    log = MetricsLog(out_dir, start if resume else None)
    elapsed0 = float(log.rows[-1]["elapsed_s"] or 0) if log.rows else 0.0  # wall time of earlier legs
    cpu0 = float(log.rows[-1]["cpu_s"] or 0) if log.rows else 0.0  # their process CPU time (all threads)

    def clocks() -> dict:
        return {"elapsed_s": f"{elapsed0 + time.perf_counter() - t0:.1f}",
                "cpu_s": f"{cpu0 + time.process_time() - c0:.1f}"}

    def checkpoint():
        ckpt.save(state, {**meta, "step": int(state.step), "best_val": best_val, "best_step": best_step})

    def do_eval(step: int):
        nonlocal best_val, best_step
        val = float(evaluate(state.params, step)["loss"])
        log.add(step=step, split="val", loss=f"{val:.5f}", lr=f"{_lr_at(optim, step):.3e}", **clocks())
        mark = ""
        if val < best_val:
            best_val, best_step = val, step
            ckpt.save_best(step, state.params, {**meta, "step": step, "val_loss": val})
            mark = " (best)"
        tqdm.write(f"step {step:6d}  val loss {val:.4f}{mark}")
        log.plot()

    # SIGTERM (`kill PID`) and Ctrl-C only set a flag; the loop checkpoints after the
    # current step and raises KeyboardInterrupt. (Raising from the handler could land
    # between the step call and the assignment, leaving only the donated, deleted state.)
    # A second Ctrl-C interrupts at once.
    stop: list[int] = []

    def _request_stop(signum, frame):
        if stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.append(signum)

    old_handlers = {}
    if _in_main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old_handlers[sig] = signal.signal(sig, _request_stop)
    t0 = t_log = t_ckpt = time.perf_counter()
    c0 = time.process_time()
    pending: list[dict] = []
    interactive = sys.stderr.isatty()
    bar = tqdm(total=config.total_steps, initial=start, desc=desc, unit="step", dynamic_ncols=True,
               mininterval=1.0 if interactive else 60.0, smoothing=0.05)
    try:
        for step in range(start, config.total_steps):
            batch = batch_at(step) if frozen is None else {**batch_at(step), **frozen}
            state, metrics = train_step(state, batch)
            pending.append(metrics)
            bar.update(1)
            done = step + 1
            if done % config.log_every == 0 or done == config.total_steps:
                got = jax.device_get(pending)  # the one host sync per log interval
                now = time.perf_counter()
                tok_s = len(got) * config.tokens_per_step / max(now - t_log, 1e-9)
                loss = float(np.mean([m["loss"] for m in got]))
                gnorm = float(np.mean([m["grad_norm"] for m in got]))
                lr = _lr_at(optim, step)
                log.add(step=done, split="train", loss=f"{loss:.5f}", lr=f"{lr:.3e}", grad_norm=f"{gnorm:.4f}",
                        tokens_per_s=f"{tok_s:.0f}", **clocks())
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}", refresh=False)
                if not interactive:
                    tqdm.write(f"step {done:6d}  loss {loss:.4f}  gnorm {gnorm:.3f}  lr {lr:.2e}  "
                               f"{tok_s:,.0f} tok/s  {_eta(bar)}")
                pending, t_log = [], now
            if evaluate is not None and config.eval_every and done % config.eval_every == 0 and done != config.total_steps:
                t_pause = time.perf_counter()
                do_eval(done)
                t_log += time.perf_counter() - t_pause  # keep eval time out of tokens/s
            now = time.perf_counter()
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or (
                config.checkpoint_every_s and now - t_ckpt >= config.checkpoint_every_s
            ):
                checkpoint()
                t_ckpt = time.perf_counter()
                t_log += t_ckpt - now
            if stop:
                bar.close()
                checkpoint()
                tqdm.write(f"stopped by signal {stop[0]} at step {done}: checkpoint saved; continue with --resume")
                raise KeyboardInterrupt
        if evaluate is not None and int(state.step) == config.total_steps and best_step != config.total_steps:
            do_eval(config.total_steps)
        checkpoint()
    finally:
        bar.close()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)

    best = ckpt.restore_best(state.params) if best_step >= 0 else None
    ckpt.close()
    if evaluate is not None:
        log.plot()
    return LoopResult(state, best[0] if best else None, best_val, best_step, log.rows)


def _eta(bar: tqdm) -> str:
    rate = bar.format_dict.get("rate")
    if not rate:
        return ""
    left = (bar.total - bar.n) / rate
    return f"ETA {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"


def _in_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
