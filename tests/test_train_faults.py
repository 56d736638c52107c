"""Training faults: SIGKILL between and during checkpoint saves, damaged checkpoints, torn CSV rows.

The kill tests run a toy regression through `train.loop.run` in a child
process (this file's `main`), cheap to start and compile; the
damaged-checkpoint test uses the tiny Transformer of test_train_target.py.
The child dies deterministically: in `batch_at` for "between saves", and
for "during" inside orbax's commit of a chosen save, with everything written
into `<step>.orbax-checkpoint-tmp` but not yet renamed into place (a patch of
orbax's private AtomicRenameTemporaryPath.finalize; if orbax renames it, the
child finishes instead of dying and the test says so).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import loop

REPO = Path(__file__).resolve().parents[1]
TOY_STEPS, TOY_EVERY = 12, 3  # checkpoints (and evaluations) at steps 3, 6, 9, 12


# --------------------------------------------------------------------------- the toy run (also the child's main)


def toy_batch(step: int) -> dict:
    rng = np.random.default_rng(step)  # a pure function of the step, as resuming requires
    x = rng.normal(size=(16, 8)).astype(np.float32)
    return {"x": x, "y": x @ np.arange(64, dtype=np.float32).reshape(8, 8) / 64}


def toy_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2), {}


def toy_run(out: Path, resume: bool = False, batch_at=toy_batch) -> loop.LoopResult:
    optim = loop.OptimConfig(lr=0.05, warmup_steps=2, total_steps=TOY_STEPS)
    optimizer = loop.make_optimizer(optim)
    state = loop.TrainState.create({"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}, optimizer)
    cfg = loop.LoopConfig(total_steps=TOY_STEPS, tokens_per_step=16, log_every=1, eval_every=TOY_EVERY,
                          checkpoint_every=TOY_EVERY, checkpoint_every_s=0, keep=3)
    evaluate = loop.make_eval_fn(toy_loss, [toy_batch(10_000)])
    return loop.run(cfg, state, loop.make_train_step(toy_loss, optimizer), batch_at, out,
                    evaluate=evaluate, resume=resume, optim=optim)


def main(argv: list[str]) -> None:
    """Child: toy_run(argv[0], resume=--resume), SIGKILLed where the environment asks.

    KILL_AT_STEP=k: when step k's batch is requested (between saves).
    KILL_IN_SAVE=checkpoints/6 or best/6: in that save, after orbax wrote the
    temporary directory and before it renames it into place.
    """
    kill_at = int(os.environ.get("KILL_AT_STEP", -1))
    kill_in = os.environ.get("KILL_IN_SAVE")
    if kill_in:
        from orbax.checkpoint._src.path import atomicity

        finalize = atomicity.AtomicRenameTemporaryPath.finalize

        async def finalize_or_die(self):
            final = self.get_final()
            if f"{final.parent.name}/{final.name}" == kill_in:
                os.kill(os.getpid(), signal.SIGKILL)
            return await finalize(self)

        atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die

    def batch_at(step):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return toy_batch(step)

    toy_run(Path(argv[0]), resume="--resume" in argv, batch_at=batch_at)


def child(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    code = f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import test_train_faults as t; t.main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, str(out), *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **env}, timeout=300)


def toy_template() -> loop.TrainState:
    return loop.TrainState.create({"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)},
                                  loop.make_optimizer(loop.OptimConfig(total_steps=TOY_STEPS)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return toy_run(tmp_path_factory.mktemp("uninterrupted"))


def check_finished(out: Path, reference: loop.LoopResult) -> None:
    """Only complete, restorable steps on disk; the CSV whole; the result equals an uninterrupted run."""
    for sub in ("checkpoints", "best"):
        names = sorted(p.name for p in (out / sub).iterdir())
        assert all(n.isdigit() for n in names), (sub, names)  # no *.orbax-checkpoint-tmp left over
    ckpt = loop.Checkpointer(out)
    assert ckpt.latest.all_steps() == [6, 9, 12]
    for step in ckpt.latest.all_steps():
        state, meta = ckpt.restore(toy_template(), step=step)
        assert int(state.step) == meta["step"] == step
    final, _ = ckpt.restore(toy_template())
    best, best_meta = ckpt.restore_best(toy_template().params)
    ckpt.close()
    assert best_meta["step"] == reference.best_step
    for got, want in ((final.params, reference.state.params), (best, reference.best_params)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    with (out / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["split"] == "train"] == list(range(1, TOY_STEPS + 1))
    assert [int(r["step"]) for r in rows if r["split"] == "val"] == list(range(TOY_EVERY, TOY_STEPS + 1, TOY_EVERY))
    want = [(str(r["step"]), r["split"], r["loss"]) for r in reference.history]
    assert [(r["step"], r["split"], r["loss"]) for r in rows] == want


# --------------------------------------------------------------------------- SIGKILL


def test_sigkill_between_saves_resumes_from_last_checkpoint(tmp_path, uninterrupted):
    killed = child(tmp_path, KILL_AT_STEP="8")  # steps 1..7 done, checkpoints at 3 and 6
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    rerun = child(tmp_path, "--resume")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resumed from step 6" in rerun.stdout + rerun.stderr
    check_finished(tmp_path, uninterrupted)


@pytest.mark.parametrize("save", ["checkpoints/6", "best/6"])
def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path, uninterrupted, save):
    killed = child(tmp_path, KILL_IN_SAVE=save)
    assert killed.returncode == -signal.SIGKILL, f"the child was not killed in its save:\n{killed.stderr[-2000:]}"
    sub, step = save.split("/")
    assert (tmp_path / sub / f"{step}.orbax-checkpoint-tmp").is_dir()  # the torn save, never renamed into place

    # Orbax does not list the temporary directory: a reader sees step 3 as the latest and restores it.
    ckpt = loop.Checkpointer(tmp_path)
    assert ckpt.latest.all_steps() == [3]
    state, _ = ckpt.restore(toy_template())
    assert int(state.step) == 3
    best = ckpt.restore_best(toy_template().params)  # best/ is saved before checkpoints/ at step 6
    assert best is not None and best[1]["step"] == (3 if sub == "best" else 6)
    ckpt.close()

    # The rerun resumes from 3, removes the leftover, saves step 6 again and finishes.
    rerun = child(tmp_path, "--resume")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resumed from step 3" in rerun.stdout + rerun.stderr
    check_finished(tmp_path, uninterrupted)


# --------------------------------------------------------------------------- damaged checkpoints


def damage(step_dir: Path) -> None:
    """Truncate the array data files (what a full disk or a torn copy leaves)."""
    files = list((step_dir / "state" / "d").iterdir())
    assert files
    for f in files:
        os.truncate(f, 10)


def test_damaged_latest_checkpoint_falls_back_to_previous(tmp_path):
    from test_train_target import setup, token_stream
    from train.packing import PackedBatches

    steps, stop = 8, 6
    tokens = token_stream()
    batches = PackedBatches(tokens, batch_size=4, seq_len=32, seed=1)
    cfg = lambda total: loop.LoopConfig(total_steps=total, tokens_per_step=128, log_every=1, checkpoint_every=2,
                                        checkpoint_every_s=0)
    # One jitted step for every leg (compiled once); each leg starts from a differently seeded state.
    _, _, optim, train_step, state = setup(steps)
    fresh = lambda seed: setup(steps, seed=seed)[4]
    loop.run(cfg(stop), state, train_step, batches.batch_at, tmp_path, optim=optim)  # checkpoints 2, 4, 6
    damage(tmp_path / "checkpoints" / "6")

    # What resuming from step 4 gives.
    ckpt = loop.Checkpointer(tmp_path)
    at4, _ = ckpt.restore(fresh(123), step=4)
    ref_loss = float(train_step(at4, batches.batch_at(4))[1]["loss"])

    # A plain restore warns about step 6 and gives step 4: the same next-step loss, bit for bit.
    with pytest.warns(RuntimeWarning, match=r"checkpoints/6 does not restore \(ValueError"):
        restored, meta = ckpt.restore(fresh(7))
    ckpt.close()
    assert int(restored.step) == meta["step"] == 4
    assert float(train_step(restored, batches.batch_at(4))[1]["loss"]) == ref_loss

    # The loop resumes the same way, moves step 6 aside (kept) when it saves it again, and finishes.
    with pytest.warns(RuntimeWarning, match="checkpoints/6 does not restore"):
        result = loop.run(cfg(steps), fresh(9), train_step, batches.batch_at, tmp_path, resume=True, optim=optim)
    assert int(result.state.step) == steps
    train = [r for r in result.history if r["split"] == "train"]
    assert [int(r["step"]) for r in train] == list(range(1, steps + 1))
    assert float(train[4]["loss"]) == pytest.approx(ref_loss, abs=1e-5)  # step 5 = the step after 4; 5 decimals

    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "6", "6.corrupt-0", "8"]
    ckpt = loop.Checkpointer(tmp_path)
    for step in (4, 6, 8):
        assert int(ckpt.restore(result.state, step=step)[0].step) == step
    ckpt.close()


def test_no_restorable_checkpoint_says_how_to_fix(tmp_path):
    ckpt = loop.Checkpointer(tmp_path)
    for step in (1, 2):
        ckpt.save(toy_template().replace(step=jnp.asarray(step, jnp.int32)), {"step": step})
    ckpt.close()
    damage(tmp_path / "checkpoints" / "2")
    (tmp_path / "checkpoints" / "1" / "meta" / "metadata").write_text("{torn")

    ckpt = loop.Checkpointer(tmp_path)
    with pytest.warns(RuntimeWarning) as warned, pytest.raises(ValueError, match="without --resume") as err:
        ckpt.restore(toy_template())
    ckpt.close()
    assert len([w for w in warned if "does not restore" in str(w.message)]) == 2
    assert "step 2: ValueError" in str(err.value) and "step 1: JSONDecodeError" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]  # nothing deleted


def test_metrics_from_before_cpu_time_resume_with_it_blank(tmp_path):
    """A metrics.csv written before the cpu_s column (2026-12-04) keeps its rows on resume; new rows log it."""
    old = ["step,split,loss,lr,grad_norm,tokens_per_s,elapsed_s", "1,train,4.1,1e-3,1.0,100,0.5",
           "1,val,3.9,1e-3,,,1.2"]
    (tmp_path / "metrics.csv").write_text("\n".join(old) + "\n")
    log = loop.MetricsLog(tmp_path, resume_step=1)
    assert [(r["step"], r["split"], r["elapsed_s"], r["cpu_s"]) for r in log.rows] == [
        ("1", "train", "0.5", ""), ("1", "val", "1.2", "")]
    log.add(step=2, split="train", loss="3.8", elapsed_s="2.0", cpu_s="3.5")
    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["cpu_s"]) for r in rows] == [("1", ""), ("1", ""), ("2", "3.5")]


def test_torn_metrics_row_is_dropped_on_resume(tmp_path):
    header = ",".join(loop.FIELDS)
    good = ["1,train,4.1,1e-3,1.0,100,0.5,0.9", "2,train,4.0,1e-3,1.0,100,1.0,1.8", "2,val,3.9,1e-3,,,1.2,2.1"]
    (tmp_path / "metrics.csv").write_text("\n".join([header, *good, "3,train,3.8,1e-3,1.0,100,1"]))  # killed mid-row

    log = loop.MetricsLog(tmp_path, resume_step=5)
    assert [(r["step"], r["split"]) for r in log.rows] == [("1", "train"), ("2", "train"), ("2", "val")]
    log.add(step=3, split="train", loss="3.70000")
    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["split"], r["loss"]) for r in rows][-2:] == [("2", "val", "3.9"), ("3", "train", "3.70000")]
    assert not list(tmp_path.glob("*.tmp"))
