"""Drafter distillation: the anchor-keyed mask, learning, exact resume, export, lossless decoding.

Everything runs on a tiny random target (vocab 64, 2 layers x 32) whose
greedy continuations fall into short cycles: learnable in a few dozen steps.
Its lm_head is scaled up so the frozen head can express confident drafts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from taps_jax.api import Target
from taps_jax.checkpoints.dflash import load_drafter_module, save_drafter
from taps_jax.config import ModelConfig
from taps_jax.decoder import SpeculativeDecoder, load_drafter
from taps_jax.models.drafter import Drafter
from taps_jax.models.transformer import Transformer
from train import distill as D

VOCAB, KB, MASK = 64, 6, 2
STEPS = 100


def tiny_target() -> Target:
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    model = Transformer(cfg, nnx.Rngs(0))
    model.lm_head.kernel.set_value(model.lm_head.kernel.get_value() * 8.0)
    return Target(model, None, ())


def tiny_drafter(target: Target, seed: int = 1, draft_vocab_size: int | None = None) -> Drafter:
    cfg = D.make_drafter_config(target.config, num_layers=1, block_size=KB, target_layer_ids=(0, 1),
                                mask_token_id=MASK, draft_vocab_size=draft_vocab_size)
    return Drafter(cfg, nnx.Rngs(seed))


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, rng.integers(3, 9)).tolist() for _ in range(n)]


def config(steps: int, **kw) -> D.DistillConfig:
    return D.DistillConfig(**{"steps": steps, "batch_size": 4, "anchors_per_seq": 8, "log_every": 1,
                              "eval_every": 0, "checkpoint_every_s": 0, **kw})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_target()
    seqs = D.generate_sequences(target, prompts(), 40, batch_size=16, greedy_fraction=1.0,
                                cache_dir=tmp_path_factory.mktemp("gen"))
    return target, seqs


DRAFT_VOCAB = 16  # the trained drafter's logits cover the 16 ids its answers use most (of 64)


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    target, seqs = setup
    out = tmp_path_factory.mktemp("distill")
    drafter = tiny_drafter(target, draft_vocab_size=DRAFT_VOCAB)
    drafter.set_draft_vocab(D.draft_vocab(out, seqs, seqs, drafter.config, "continuation"))
    graphdef, _, buffers = nnx.split(drafter, nnx.Param, ...)
    result = D.distill(target, drafter, seqs, seqs, out, config(STEPS), D.distill_optim(STEPS, lr=1e-2))
    D.export(out / "export", graphdef, result.best_params, buffers)
    return out, (graphdef, buffers), result


# --------------------------------------------------------------------------- the mask


def test_mask_is_keyed_on_anchor_positions():
    anchors = np.array([[5, 2, 9], [0, 7, 3]])
    C, T = 12, 3 * KB
    mask = np.asarray(D.anchor_block_mask(jnp.asarray(anchors), C, KB))
    assert mask.shape == (2, T, C + T)
    for b in range(2):
        for t in range(T):
            j = t // KB
            want_ctx = np.arange(C) < anchors[b, j]  # strictly before the anchor
            want_blk = np.arange(T) // KB == j  # its own block, every slot, nothing else
            np.testing.assert_array_equal(mask[b, t, :C], want_ctx)
            np.testing.assert_array_equal(mask[b, t, C:], want_blk)
    assert not mask[1, :KB, :C].any()  # anchor 0 sees no context, only its block


def test_blocks_see_only_earlier_context_and_their_own_block():
    target = tiny_target()
    drafter = tiny_drafter(target, seed=3)
    # O(1) random weights so every input visibly moves the logits.
    graphdef, params = nnx.split(drafter)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    drafter = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    fwd = nnx.jit(lambda d, t, *a: D.block_forward(d, t, *a))

    B, S, F = 1, 24, 2 * 32
    rng = np.random.default_rng(0)
    taps = jnp.asarray(rng.standard_normal((B, S, F)), jnp.float32)
    anchors = jnp.asarray([[12, 4, 17]], jnp.int32)  # not sorted: the mask must not rely on order
    tokens = jnp.asarray(rng.integers(3, VOCAB, (B, S)), jnp.int32)
    blocks = D.block_tokens(tokens, anchors, KB, MASK)
    base = np.asarray(fwd(drafter, target.model, blocks, anchors, taps))
    changed = lambda new: ~np.isclose(np.asarray(new), base, rtol=0, atol=1e-6).reshape(3, -1).all(-1)

    # Context at and after block 0's anchor (12): block 0 unchanged, block 2 (anchor 17) sees it.
    at_after = taps.at[:, 12:].add(1.0)
    np.testing.assert_array_equal(changed(fwd(drafter, target.model, blocks, anchors, at_after)), [0, 0, 1])
    # Exactly at the anchor position: still invisible to block 0 (strictly before).
    at = taps.at[:, 12].add(1.0)
    np.testing.assert_array_equal(changed(fwd(drafter, target.model, blocks, anchors, at)), [0, 0, 1])
    # Just before it: visible to block 0 (and to block 2), not to block 1 (anchor 4).
    before = taps.at[:, 11].add(1.0)
    np.testing.assert_array_equal(changed(fwd(drafter, target.model, blocks, anchors, before)), [1, 0, 1])

    # Another block's tokens (its anchor and mask slots): only that block moves.
    other = blocks.at[:, 1].set(jnp.asarray(rng.integers(3, VOCAB, (B, KB)), jnp.int32))
    np.testing.assert_array_equal(changed(fwd(drafter, target.model, other, anchors, taps)), [0, 1, 0])


def test_anchor_sampling_and_labels():
    lo, hi = D.anchor_range(prompt_len=5, length=30, block_size=KB, region="continuation")
    assert (lo, hi) == (5, 30 - KB)
    assert D.anchor_range(0, 30, KB, "all") == (0, 30 - KB)
    assert D.anchor_range(5, 8, KB, "continuation") == (5, 6)  # cut short by EOS: labels masked
    rng = np.random.default_rng(0)
    a, v = D.sample_anchors(rng, 5, 7, 5)
    assert sorted(a[v].tolist()) == [5, 6, 7] and v.sum() == 3

    tokens = jnp.arange(20, dtype=jnp.int32)[None]
    w = D.position_weights(KB)
    np.testing.assert_allclose(w, np.exp(-np.arange(KB - 1) / (7 * (KB - 1) / 15)), rtol=1e-6)
    assert D.default_gamma(16) == 7.0
    labels, weights, valid = D.labels_and_weights(
        tokens, jnp.asarray([[3, 14]]), jnp.asarray([[True, True]]), jnp.asarray([17]), jnp.asarray(w))
    np.testing.assert_array_equal(labels[0, 0], np.arange(4, 4 + KB - 1))
    np.testing.assert_array_equal(valid[0, 1], np.arange(15, 15 + KB - 1) < 17)
    assert float(weights[0, 1, 2]) == 0.0 and float(weights[0, 1, 1]) == pytest.approx(w[1])


# --------------------------------------------------------------------------- data


def test_generation_mixes_modes_and_is_cached(tmp_path, monkeypatch):
    target = tiny_target()
    ps = prompts(4, seed=1)
    seqs = D.generate_sequences(target, ps, 8, batch_size=2, greedy_fraction=0.5, temperature=1.0,
                                cache_dir=tmp_path)
    assert seqs.tokens.shape[0] == 4 and seqs.seq_len % 16 == 0
    want_greedy = target.generate(ps[:2], 8).tokens
    for i, p in enumerate(ps):
        assert seqs.prompt_lens[i] == len(p) and seqs.lengths[i] == len(p) + 8
        assert seqs.tokens[i, : len(p)].tolist() == p
    for i in range(2):
        assert seqs.tokens[i, len(ps[i]): seqs.lengths[i]].tolist() == want_greedy[i]
    # A rerun loads the .npy cache without generating.
    monkeypatch.setattr("taps_jax.calls.refilled", lambda *a, **k: pytest.fail("regenerated despite the cache"))
    again = D.generate_sequences(target, ps, 8, batch_size=2, greedy_fraction=0.5, temperature=1.0,
                                 cache_dir=tmp_path)
    np.testing.assert_array_equal(again.tokens, seqs.tokens)
    assert len(list(tmp_path.glob("train-*/tokens.npy"))) == 1


def test_static_batches_answer_as_refilled_rows_do(tmp_path, monkeypatch):
    """`static_batches` (the comparison mode) gives the refilled run's greedy answers, some of them cut at EOS."""
    base = tiny_target()
    target = Target(base.model, None, (5, 6, 7, 8))
    ps = prompts(12, seed=2)
    refilled = D.generate_sequences(target, ps, 24, batch_size=4, greedy_fraction=1.0, cache_dir=tmp_path / "r")
    assert (refilled.lengths - refilled.prompt_lens < 24).any(), "no answer stopped early: the test proves nothing"
    monkeypatch.setattr("taps_jax.calls.refilled", lambda *a, **k: pytest.fail("static batches refilled rows"))
    static = D.generate_sequences(target, ps, 24, batch_size=4, greedy_fraction=1.0, static_batches=True,
                                  cache_dir=tmp_path / "s")
    np.testing.assert_array_equal(static.lengths, refilled.lengths)
    np.testing.assert_array_equal(static.tokens, refilled.tokens)
    meta = json.loads(next((tmp_path / "s").glob("train-*/meta.json")).read_text())
    assert meta["refill_rows"] == 0 and meta["tokens_per_s"] > 0


def test_packed_answers_spare_a_new_machine_the_generation(tmp_path, monkeypatch):
    """pack_answers -> unpack_answers on another cache dir: generate_sequences then finds the same answers by
    their key and generates nothing; answers to other prompts are not picked up."""
    from train import distill_data

    target = tiny_target()
    ps = prompts(6, seed=3)
    made = D.generate_sequences(target, ps, 16, batch_size=4, greedy_fraction=0.5, temperature=1.0,
                                cache_dir=tmp_path / "a")
    packed = distill_data.pack_answers(tmp_path / "a", tmp_path / "committed")
    assert [p.name for p in packed] == [f"{d.name}.npz" for d in (tmp_path / "a").glob("train-*")]
    assert distill_data.pack_answers(tmp_path / "a", tmp_path / "committed") == []  # kept, not rewritten
    assert [p.name for p in distill_data.unpack_answers(tmp_path / "committed", tmp_path / "b")] == \
        [p.stem for p in packed]
    monkeypatch.setattr("taps_jax.calls.refilled", lambda *a, **k: pytest.fail("the packed answers were not used"))
    again = D.generate_sequences(target, ps, 16, batch_size=4, greedy_fraction=0.5, temperature=1.0,
                                 cache_dir=tmp_path / "b")
    for name in ("tokens", "prompt_lens", "lengths"):
        np.testing.assert_array_equal(getattr(again, name), getattr(made, name))
    assert json.loads(next((tmp_path / "b").glob("train-*/meta.json")).read_text())["sequences"] == 6
    with pytest.raises(BaseException, match="packed answers were not used"):  # other prompts: other key
        D.generate_sequences(target, ps[:5], 16, batch_size=4, greedy_fraction=0.5, temperature=1.0,
                             cache_dir=tmp_path / "b")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train-0123456789ab.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a packed answer set"):
        distill_data.unpack_answers(tmp_path / "bad", tmp_path / "c")


def test_an_interrupted_generation_continues_with_the_unanswered_prompts(tmp_path, monkeypatch):
    """Answers are saved as rows finish (continuous batching); a rerun decodes only the prompts left, and every
    greedy answer is the batch-1 AR one, whichever row it ran in."""
    import taps_jax.calls as calls

    target = tiny_target()
    ps = prompts(10, seed=2)
    real, asked = calls.refilled, []

    class Interrupted:  # the first rows to finish are handed out, then the run is killed
        def __init__(self, *args, **kwargs):
            asked.append(len(args[1]))
            self.run = real(*args, **kwargs)
            self.utilisation = 0.0

        def __iter__(self):
            yield next(iter(self.run))
            raise KeyboardInterrupt

    monkeypatch.setattr(calls, "refilled", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        D.generate_sequences(target, ps, 12, batch_size=4, greedy_fraction=1.0, cache_dir=tmp_path, save_every_s=0)
    monkeypatch.setattr(calls, "refilled", lambda *a, **k: (asked.append(len(a[1])), real(*a, **k))[1])
    seqs = D.generate_sequences(target, ps, 12, batch_size=4, greedy_fraction=1.0, cache_dir=tmp_path)
    assert asked[0] == 10 and 0 < asked[1] < 10, asked  # the second run decoded only what was left
    want = [target.generate([p], 12).tokens[0] for p in ps]
    assert [seqs.tokens[i, len(p): seqs.lengths[i]].tolist() for i, p in enumerate(ps)] == want


# --------------------------------------------------------------------------- training


def test_loss_decreases_and_validation_is_reported(trained):
    out, _, result = trained
    train = [float(r["loss"]) for r in result.history if r["split"] == "train"]
    assert len(train) == STEPS
    assert np.mean(train[-5:]) < train[0] - 0.8, train
    rows = (out / "val_agreement.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert header[:5] == ["step", "loss", "acc_mean", "tau_cumprod", "tau_chain"]
    assert header[5:] == [f"acc_{k}" for k in range(1, KB)]
    last = dict(zip(header, rows[-1].split(",")))
    assert int(last["step"]) == STEPS
    acc = [float(last[f"acc_{k}"]) for k in range(1, KB)]
    assert float(last["tau_cumprod"]) == pytest.approx(1 + np.cumprod(acc).sum(), abs=1e-3)
    assert float(last["tau_chain"]) > 1.8  # it learned the cycles (an untrained drafter: ~1.0)
    assert (out / "agreement.png").stat().st_size > 0 and (out / "loss.png").stat().st_size > 0


def test_resume_gives_identical_next_step_loss(setup, tmp_path):
    target, seqs = setup
    steps, stop = 6, 3
    optim = D.distill_optim(steps, lr=1e-2)
    ref = D.distill(target, tiny_drafter(target), seqs, None, tmp_path / "ref", config(steps), optim)
    D.distill(target, tiny_drafter(target), seqs, None, tmp_path / "cut", config(steps), optim, stop_after=stop)
    # A fresh process would start from other weights: the checkpoint must overwrite them.
    resumed = D.distill(target, tiny_drafter(target, seed=99), seqs, None, tmp_path / "cut", config(steps), optim,
                        resume=True)
    loss = lambda r: [float(x["loss"]) for x in r.history if x["split"] == "train"]
    assert len(loss(resumed)) == steps
    assert loss(resumed)[stop] == loss(ref)[stop]  # the next step after the resume
    assert loss(resumed) == loss(ref)
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(ref.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_data_seed_draws_other_rows_and_anchors_alone(setup):
    """A leg's own data seed reorders its batches; the weights' initialisation and the answers keep the seed."""
    target, seqs = setup
    drafter = tiny_drafter(target)
    base = D.setup(target, drafter, seqs, config(4), D.distill_optim(4)).batches
    own = D.setup(target, drafter, seqs, config(4, data_seed=7), D.distill_optim(4)).batches
    same = D.setup(target, drafter, seqs, config(4, data_seed=0), D.distill_optim(4)).batches
    assert (own.seed, base.seed, same.seed) == (7, 0, 0)
    rows = lambda b: np.concatenate([b.rows_at(s) for s in range(len(seqs) // b.B)])
    assert sorted(rows(own)) == sorted(rows(base)) and rows(own).tolist() != rows(base).tolist()  # one epoch each
    assert rows(same).tolist() == rows(base).tolist()
    with pytest.raises(ValueError, match="data_seed must be a non-negative integer"):
        config(4, data_seed=-1)


def test_tap_cache_trains_as_the_step_forward_does(setup, tmp_path):
    """Precomputed tap features give the losses and params of the in-step forward; a rerun reuses the file."""
    target, seqs = setup
    steps = 4
    optim = D.distill_optim(steps, lr=1e-2)
    ref = D.distill(target, tiny_drafter(target), seqs, seqs, tmp_path / "ref", config(steps), optim)
    got = D.distill(target, tiny_drafter(target), seqs, seqs, tmp_path / "cached", config(steps, tap_cache=True),
                    optim)
    files = sorted(p.name for p in (tmp_path / "cached" / "data").glob("*.npy") if "tmp" not in p.name)
    assert len(files) == 2 and files[0].startswith("rows-train-") and files[1].startswith("rows-validation-")
    flat = np.load(tmp_path / "cached" / "data" / files[0])  # each row's real positions, back to back
    assert flat.shape == (seqs.lengths.sum(), 2 * target.config.hidden_size)
    want = np.asarray(D.target_taps(target.model, jnp.asarray(seqs.tokens), (0, 1)))
    np.testing.assert_allclose(flat, np.concatenate([w[:n] for w, n in zip(want, seqs.lengths)]), rtol=1e-5,
                               atol=1e-5)
    feats = np.asarray(D.tap_features(target, seqs, (0, 1), tmp_path / "cached" / "data", "train"))
    for i, n in enumerate(seqs.lengths):  # read back padded with zeros
        np.testing.assert_allclose(feats[i, :n], want[i, :n], rtol=1e-5, atol=1e-5)
        assert not feats[i, n:].any()
    loss = lambda r: np.array([float(x["loss"]) for x in r.history])
    np.testing.assert_allclose(loss(got), loss(ref), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got.state.params), jax.tree.leaves(ref.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # A rerun on the same weights and tokens loads the features instead of running the target.
    path = tmp_path / "cached" / "data" / files[0]
    stamp = path.stat().st_mtime_ns
    again = D.tap_features(target, seqs, (0, 1), tmp_path / "cached" / "data", "train")
    np.testing.assert_array_equal(np.asarray(again), feats)
    np.testing.assert_array_equal(again[[2, 0]], feats[[2, 0]])
    assert path.stat().st_mtime_ns == stamp and not list(path.parent.glob("*.tmp*"))


def test_tap_features_of_the_drawn_rows_only_and_resumed(tmp_path):
    """A run that draws some rows computes their features only (a done mask beside the cache says which); a later
    call fills in what it lacks, an interrupted pass resumes with the rows it saved, and a complete cache has no
    mask and equals one computed at once."""
    from train import distill_data

    target = tiny_target()
    rng = np.random.default_rng(6)
    lengths = np.array([40, 90, 12, 70, 33, 61, 25, 80], np.int32)
    tokens = np.zeros((len(lengths), 96), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(3, VOCAB, n)
    seqs = D.Sequences(tokens, np.full(len(lengths), 4, np.int32), lengths)
    batches = D.AnchorBatches(seqs, 2, 4, KB, seed=3)
    drawn = batches.rows_drawn(2)
    assert len(drawn) == 4 and set(drawn) == set(batches.rows_at(0)) | set(batches.rows_at(1))
    assert batches.rows_drawn(4).tolist() == list(range(8))  # a whole epoch: every row
    want = D.target_feature_cache(target, seqs, (0, 1), tmp_path / "whole", "train", soft_k=2, batch_size=2)
    rows_run, real, clock = [], jax.jit, iter(range(0, 10**6, 1000))

    def counting(fn, fail_after=None):
        def run(params, tokens_BS):
            if fail_after is not None and len(rows_run) == fail_after:
                raise KeyboardInterrupt
            rows_run.append(len(tokens_BS))
            return real(fn)(params, tokens_BS)
        return run

    cache = tmp_path / "drawn"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_data.jax, "jit", counting)
        got = D.target_feature_cache(target, seqs, (0, 1), cache, "train", soft_k=2, batch_size=2, rows=drawn)
        assert sum(rows_run) == 4
        for r in drawn:
            np.testing.assert_allclose(got["taps"][r, :lengths[r]], want["taps"][r, :lengths[r]], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got["soft_ids"][r, :lengths[r]], want["soft_ids"][r, :lengths[r]])
        (mask,) = cache.glob("done-train-*.npy")
        assert np.flatnonzero(np.load(mask)).tolist() == sorted(drawn)
        rows_run.clear()
        D.target_feature_cache(target, seqs, (0, 1), cache, "train", soft_k=2, batch_size=2, rows=drawn[:2])
        assert rows_run == []  # what it has is reused
        # All rows now, interrupted after one batch (the mask is saved after every batch here): the rerun
        # computes only what the interrupted pass did not save.
        mp.setattr(distill_data.time, "monotonic", lambda: next(clock))
        mp.setattr(distill_data.jax, "jit", lambda fn: counting(fn, fail_after=1))
        with pytest.raises(KeyboardInterrupt):
            D.target_feature_cache(target, seqs, (0, 1), cache, "train", soft_k=2, batch_size=2)
        assert np.load(mask).sum() == 6
        rows_run.clear()
        mp.setattr(distill_data.jax, "jit", counting)
        got = D.target_feature_cache(target, seqs, (0, 1), cache, "train", soft_k=2, batch_size=2)
    assert sum(rows_run) == 2 and not mask.exists()
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got["taps"][i, :n], want["taps"][i, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["soft_p"][i, :n], want["soft_p"][i, :n], rtol=1e-5, atol=1e-6)
    assert not list(cache.glob("*.tmp*"))


_CACHE_PROCESS = """
import json, sys, time
from pathlib import Path
import jax, numpy as np
from tests.test_distill import VOCAB, prompts, tiny_target
from train import distill as D, distill_data
cache, gate, who, what = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
work = []
def held(fn, count):  # fn, held inside the first call until the test opens the gate, counting what it does
    def run(*args):
        (cache / f"started-{who}").touch()
        while gate.name != "-" and not gate.exists():
            time.sleep(0.05)
        work.append(count(*args))
        return fn(*args)
    return run
if what == "features":
    real_jit = jax.jit
    jax.jit = lambda fn: held(real_jit(fn), lambda params, tokens_BS: len(tokens_BS))
    rng = np.random.default_rng(6)
    lengths = np.array([40, 90, 12, 70, 33, 61, 25, 80], np.int32)
    tokens = np.zeros((len(lengths), 96), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(3, VOCAB, n)
    seqs = D.Sequences(tokens, np.full(8, 4, np.int32), lengths)
    got = D.target_feature_cache(tiny_target(), seqs, (0, 1), cache, "train", batch_size=2)
    print(json.dumps({"work": sum(work), "sum": float(np.abs(got["taps"][:]).sum())}))
else:
    distill_data._refilled_answers = held(distill_data._refilled_answers, lambda target, prompts, todo, *a: len(todo))
    got = D.generate_sequences(tiny_target(), prompts(8), 12, batch_size=4, cache_dir=cache, save_every_s=0)
    print(json.dumps({"work": sum(work), "sum": float(got.tokens.sum() + got.lengths.sum())}))
"""


@pytest.mark.parametrize("what", ["features", "answers"])
def test_a_cache_filled_by_one_of_two_processes_at_once(tmp_path, what):
    """Two runs fill one tap-feature (or answer) cache at once: the second waits for the first (it says so), then
    finds every row and runs the target over none. Without the lock the second would compute every row again, and
    truncate the first's feature file or delete the answer parts it is still writing."""
    import os
    import subprocess
    import sys
    import time

    from tests.process_helpers import REPO

    cache, gate, err = tmp_path / "cache", tmp_path / "gate", tmp_path / "second.err"
    cache.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}

    def start(who, gate_path, stderr):
        return subprocess.Popen([sys.executable, "-c", _CACHE_PROCESS, str(cache), str(gate_path), who, what],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)

    deadline = time.monotonic() + 300  # a bound on a hang, not a timing: two JAX start-ups on busy cores
    procs = [start("first", gate, subprocess.DEVNULL)]
    try:
        while not (cache / "started-first").exists():  # the first is inside its pass, held at the gate
            assert procs[0].poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        with open(err, "w") as stderr:
            procs.append(start("second", "-", stderr))
        while "waiting for it" not in err.read_text():
            assert procs[1].poll() is None, f"the second process did not wait: {err.read_text()}"
            assert time.monotonic() < deadline
            time.sleep(0.1)
        gate.touch()
        outs = [json.loads(p.communicate(timeout=300)[0].splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [o["work"] for o in outs] == [8, 0]
    assert outs[0]["sum"] == outs[1]["sum"] > 0
    assert not (cache / "started-second").exists() and not list(cache.glob("done-*"))


def test_a_multi_host_job_takes_no_cache_lock(tmp_path, monkeypatch):
    """The processes of one multi-host job fill a shared cache together (each batch is a collective): a lock would
    have one wait on the other forever, so they take none."""
    import fcntl
    import threading

    from train import distill_data

    lock = tmp_path / "lock-train-key"
    entered = threading.Event()

    def fill():
        with distill_data._exclusive(lock, "target features (train)"):
            entered.set()

    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another run's process would hold it
        monkeypatch.setattr(distill_data.jax, "process_count", lambda: 2)
        threading.Thread(target=fill, daemon=True).start()
        assert entered.wait(10)
        monkeypatch.setattr(distill_data.jax, "process_count", lambda: 1)
        entered.clear()
        threading.Thread(target=fill, daemon=True).start()
        assert not entered.wait(0.5)  # a single-process run waits for the holder
    assert entered.wait(10)


def test_tap_features_run_each_batch_at_its_own_width(tmp_path):
    """Rows of very different lengths: the cache runs batches of similar lengths at their own width, and gives
    every position inside a row the full-width forward's features, so training reads what the step computes."""
    from train import distill_data

    target = tiny_target()
    rng = np.random.default_rng(4)
    lengths = np.array([150, 12, 70, 9, 140, 33, 100, 20, 64], np.int32)  # widths 64 to 192 (WIDTH_STEP 64)
    tokens = np.full((len(lengths), 160), 0, np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(3, VOCAB, n)
    seqs = D.Sequences(tokens, np.full(len(lengths), 4, np.int32), lengths)
    widths = []
    real = jax.jit  # the cache's one jitted forward, wrapped to see the widths it runs at
    jitted = lambda fn: (lambda params, tokens_BS: (widths.append(tokens_BS.shape[1]), real(fn)(params, tokens_BS))[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_data.jax, "jit", jitted)
        feats = D.tap_features(target, seqs, (0, 1), tmp_path, "train", batch_size=2)
    assert sorted(set(widths)) == [64, 128, 160] and len(widths) == 5  # sorted by length: 9, 12 | 20, 33 | ...
    want = np.asarray(D.target_taps(target.model, jnp.asarray(tokens), (0, 1)))
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(feats[i, :n], want[i, :n], rtol=1e-5, atol=1e-5)
    steps, optim = 2, D.distill_optim(2, lr=1e-2)
    ref = D.distill(target, tiny_drafter(target), seqs, seqs, tmp_path / "ref", config(steps), optim)
    got = D.distill(target, tiny_drafter(target), seqs, seqs, tmp_path / "cached", config(steps, tap_cache=True),
                    optim)
    np.testing.assert_allclose([float(x["loss"]) for x in got.history], [float(x["loss"]) for x in ref.history],
                               rtol=1e-5)


def test_tap_features_of_grown_data_run_only_the_added_rows(tmp_path):
    """A leg that adds answers: the features of [earlier rows; new rows] copy an earlier cache of the same weights
    whose rows are the first ones (even at a narrower width), run the target over the new rows only, and equal
    the features computed from scratch; a cache of other tap ids or other first rows is not reused."""
    from train import distill_data

    target = tiny_target()
    rng = np.random.default_rng(5)

    def part(lengths, width):
        tokens = np.zeros((len(lengths), width), np.int32)
        for i, n in enumerate(lengths):
            tokens[i, :n] = rng.integers(3, VOCAB, n)
        return D.Sequences(tokens, np.full(len(lengths), 4, np.int32), np.array(lengths, np.int32))

    first, added = part([40, 90, 12, 70], 96), part([150, 30, 120], 160)
    grown = D.Sequences.concat([first, added])
    rows_run = []
    real = jax.jit
    counting = lambda fn: (lambda params, tokens_BS: (rows_run.append(len(tokens_BS)), real(fn)(params, tokens_BS))[1])
    D.target_feature_cache(target, first, (0, 1), tmp_path / "grow", "train", soft_k=3, batch_size=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_data.jax, "jit", counting)
        got = D.target_feature_cache(target, grown, (0, 1), tmp_path / "grow", "train", soft_k=3, batch_size=2)
    assert sum(rows_run) == 4  # the 3 added rows in batches of 2 (the last one wraps), not the 7
    want = D.target_feature_cache(target, grown, (0, 1), tmp_path / "scratch", "train", soft_k=3, batch_size=2)
    for i, n in enumerate(grown.lengths):  # past a row's end each batch leaves what its width gave
        np.testing.assert_allclose(got["taps"][i, :n], want["taps"][i, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got["soft_ids"][i, :n], want["soft_ids"][i, :n])
        np.testing.assert_allclose(got["soft_p"][i, :n], want["soft_p"][i, :n], rtol=1e-5, atol=1e-6)
    rows_run.clear()
    other_first = D.Sequences.concat([part([40, 90, 12, 70], 96), added])  # other tokens in the first rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_data.jax, "jit", counting)
        D.target_feature_cache(target, other_first, (0, 1), tmp_path / "grow", "train", batch_size=2)
        D.target_feature_cache(target, grown, (1, 0), tmp_path / "grow", "train", batch_size=2)  # other taps
    assert sum(rows_run) == 16
    # A padded cache of before (taps-<name>-<key>.npy, [n, S, F], keyed by the padded tokens) is read the same way.
    weights = hashlib.sha1(D.params_fingerprint(target.params).encode())
    weights.update(repr((0, 1)).encode())
    padded = np.asarray(D.target_taps(target.model, jnp.asarray(first.tokens), (0, 1)))
    (tmp_path / "old").mkdir()
    np.save(tmp_path / "old" / f"taps-train-{distill_data._padded_key(weights, first.tokens)}.npy", padded)
    rows_run.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_data.jax, "jit", counting)
        got = D.target_feature_cache(target, grown, (0, 1), tmp_path / "old", "train", batch_size=2)
    assert sum(rows_run) == 4
    for i, n in enumerate(grown.lengths):
        np.testing.assert_allclose(got["taps"][i, :n], want["taps"][i, :n], rtol=1e-5, atol=1e-5)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "old").glob("*.npy")) == ["rows", "taps"]
    rows_run.clear()  # the same rows as the padded cache: converted, the target runs over none
    (tmp_path / "same").mkdir()
    shutil.copy(next((tmp_path / "old").glob("taps-*.npy")), tmp_path / "same")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_data.jax, "jit", counting)
        got = D.tap_features(target, first, (0, 1), tmp_path / "same", "train", batch_size=2)
    assert sum(rows_run) == 0
    for i, n in enumerate(first.lengths):
        np.testing.assert_array_equal(got[i, :n], padded[i, :n])


def test_grown_data_takes_over_the_earlier_cache_in_place(tmp_path, capsys):
    """Without soft targets the earlier rows cache becomes the grown data's (renamed, its header given the new
    shape, its end extended: the same file, no second copy on disk), keeping the earlier mask's rows; the target
    runs over the rows neither has, and the features equal those computed from scratch."""
    from train import distill_data

    target = tiny_target()
    rng = np.random.default_rng(8)

    def part(lengths):
        tokens = np.zeros((len(lengths), 160), np.int32)
        for i, n in enumerate(lengths):
            tokens[i, :n] = rng.integers(3, VOCAB, n)
        return D.Sequences(tokens, np.full(len(lengths), 4, np.int32), np.array(lengths, np.int32))

    first = part([40, 90, 12, 70, 33, 61])
    grown = D.Sequences.concat([first, part([150, 30, 120])])
    cache = tmp_path / "grow"
    D.target_feature_cache(target, first, (0, 1), cache, "train", batch_size=2, rows=np.array([0, 1, 3, 4]))
    (earlier,) = cache.glob("rows-train-*.npy")
    inode = earlier.stat().st_ino
    rows_run, real = [], jax.jit
    counting = lambda fn: (lambda params, tokens_BS: (rows_run.append(len(tokens_BS)), real(fn)(params, tokens_BS))[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distill_data.jax, "jit", counting)
        got = D.target_feature_cache(target, grown, (0, 1), cache, "train", batch_size=2, rows=np.arange(9))
    assert sum(rows_run) == 6  # the earlier's two missing rows and the 3 added, in batches of 2 (the last wraps)
    assert "4 rows from the earlier cache" in capsys.readouterr().err
    (now,) = cache.glob("rows-train-*.npy")
    assert now != earlier and now.stat().st_ino == inode and not list(cache.glob("done-*"))
    want = D.target_feature_cache(target, grown, (0, 1), tmp_path / "scratch", "train", batch_size=2)
    for i, n in enumerate(grown.lengths):
        np.testing.assert_allclose(got["taps"][i, :n], want["taps"][i, :n], rtol=1e-5, atol=1e-5)
    assert got["taps"].flat.shape == want["taps"].flat.shape


@pytest.mark.parametrize("tap_cache", [False, True])
def test_bench_times_the_step_training_runs(tap_cache, capsys):
    """--bench: with tap_cache the timed steps read features computed beforehand (as training then does)."""
    target = tiny_target()
    assert D.bench(target, tiny_drafter(target), config(2, tap_cache=tap_cache), D.distill_optim(2), 16, 2,
                   prompt_len=8) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("BENCH"))
    assert "B4 S32 A8 Kb6" in line and "draft tok/CPU-s" in line
    assert ("computed once beforehand" in line) == tap_cache


def test_soft_targets_are_the_targets_top_k_in_the_loss_cached_or_not(setup, tmp_path):
    """--soft-top-k k: each slot's loss mixes in the target's own top-k next-token probabilities (from the tap
    forward, or cached beside the taps: the same losses); checked against numpy at the first step."""
    target, seqs = setup
    k, w, steps = 5, 0.25, 3

    def fresh():  # a train step donates its params: one drafter per run
        drafter = tiny_drafter(target, draft_vocab_size=DRAFT_VOCAB)
        drafter.set_draft_vocab(D.fit_draft_vocab(seqs, DRAFT_VOCAB, VOCAB))
        return drafter

    drafter = fresh()
    cfg = config(steps, soft_top_k=k, soft_weight=w)
    run = D.setup(target, drafter, seqs, cfg, D.distill_optim(steps, lr=1e-2))
    batch = {**run.batches.batch_at(0), "target": target.params}
    logits, labels, weights, _, soft = run.forward(run.state.params, batch)
    loss, _ = run.loss_fn(run.state.params, batch)
    # numpy: the target's distribution after position anchor + slot - 1, its top k kept in the draft vocabulary
    probs = np.asarray(jax.nn.softmax(target.model.logits(jnp.asarray(batch["tokens"])), axis=-1))
    vocab = np.asarray(drafter.draft_vocab[...])
    logq = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    want_num = want_den = 0.0
    for b, a, h in np.ndindex(*labels.shape):
        if weights[b, a, h] == 0:
            continue
        p = probs[b, batch["anchors"][b, a] + h]
        top = np.argsort(-p, kind="stable")[:k]
        keep = [t for t in top if t in vocab]
        q = p[keep] / p[keep].sum()
        soft_ce = -sum(qi * logq[b, a, h, np.searchsorted(vocab, t)] for qi, t in zip(q, keep))
        hard_ce = -logq[b, a, h, labels[b, a, h]]
        want_num += weights[b, a, h] * ((1 - w) * hard_ce + w * soft_ce)
        want_den += weights[b, a, h]
    assert float(loss) == pytest.approx(want_num / want_den, rel=1e-4)
    ref = D.distill(target, fresh(), seqs, None, tmp_path / "ref", cfg, D.distill_optim(steps, lr=1e-2))
    got = D.distill(target, fresh(), seqs, None, tmp_path / "cached",
                    config(steps, soft_top_k=k, soft_weight=w, tap_cache=True), D.distill_optim(steps, lr=1e-2))
    assert len(seqs) > steps * cfg.batch_size  # so the cache holds the drawn rows only, a mask says which
    assert sorted(f.name.split("-")[0] for f in (tmp_path / "cached" / "data").glob("*.npy")) == \
        ["done", "rows", "soft5", "soft5"]
    loss_of = lambda r: np.array([float(x["loss"]) for x in r.history])
    np.testing.assert_allclose(loss_of(got), loss_of(ref), rtol=1e-5)


def test_init_from_target_copies_its_last_layers():
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=10000.0)  # qwen3: q/k norms too
    target = Transformer(cfg, nnx.Rngs(0))
    target.layers[2].self_attn.k_norm.weight.set_value(jnp.full((8,), 3.0))
    drafter = Drafter(D.make_drafter_config(cfg, num_layers=2, block_size=KB, mask_token_id=MASK), nnx.Rngs(1))
    D.init_from_target(drafter, target)
    mine, theirs = nnx.to_flat_state(nnx.state(drafter.layers)), dict(nnx.to_flat_state(nnx.state(target.layers)))
    for path, var in mine:
        np.testing.assert_array_equal(var.get_value(), theirs[(path[0] + 1, *path[1:])].get_value(), str(path))
    np.testing.assert_array_equal(drafter.norm.weight[...], target.norm.weight[...])
    with pytest.raises(ValueError, match="MLP width"):
        D.init_from_target(Drafter(D.make_drafter_config(cfg, num_layers=1, block_size=KB, mask_token_id=MASK,
                                                         intermediate_size=32), nnx.Rngs(1)), target)


def test_a_new_leg_starts_from_an_exported_drafter(setup, trained, tmp_path, capsys):
    target, seqs = setup
    out, (graphdef, buffers), result = trained
    drafter = tiny_drafter(target, seed=7, draft_vocab_size=DRAFT_VOCAB)
    ids = D.init_from_drafter(drafter, out / "export")
    got, want = nnx.to_flat_state(nnx.state(drafter, nnx.Param)), dict(nnx.to_flat_state(result.best_params))
    assert len(got) == len(want)
    for path, var in got:
        np.testing.assert_array_equal(var.get_value(), want[path].get_value(), str(path))
    np.testing.assert_array_equal(ids, json.loads((out / D.DRAFT_VOCAB).read_text())["ids"])
    # The leg keeps the ids it was given (not refitted on its own data), and saves them for resume and export.
    given = np.arange(3, 3 + DRAFT_VOCAB, dtype=np.int32)
    assert D.draft_vocab(tmp_path, seqs, seqs, drafter.config, "continuation", given).tolist() == given.tolist()
    assert "the starting drafter's" in capsys.readouterr().out
    assert json.loads((tmp_path / D.DRAFT_VOCAB).read_text())["ids"] == given.tolist()
    with pytest.raises(ValueError, match="give one"):  # refused as the settings are read, before any model loads
        D.DrafterSpec(init_drafter=str(out / "export"), init_from_target=True)
    with pytest.raises(ValueError, match=r"draft_vocab_size 16 \(this run: None\)"):
        D.init_from_drafter(tiny_drafter(target), out / "export")


def test_a_leg_with_more_layers_grows_the_drafter_it_starts_from(setup, trained, tmp_path, capsys):
    target, seqs = setup
    out, _, _ = trained
    source, _ = load_drafter_module(out / "export")
    deeper = lambda n, seed: Drafter(dataclasses.replace(source.config, num_layers=n), nnx.Rngs(seed))
    grown = deeper(3, 5)
    ids = D.init_from_drafter(grown, out / "export")
    assert "grown from 1 to 3 layers" in capsys.readouterr().out
    np.testing.assert_array_equal(ids, np.asarray(source.draft_vocab[...]))
    np.testing.assert_array_equal(grown.draft_vocab[...], source.draft_vocab[...])
    rng = np.random.default_rng(0)
    C, A = 12, 2
    F = len(source.config.target_layer_ids) * source.config.hidden_size
    taps = jnp.asarray(rng.normal(size=(2, C, F)), jnp.float32)
    embeds = jnp.asarray(rng.normal(size=(2, A * KB, source.config.hidden_size)), jnp.float32)
    anchors = jnp.asarray([[4, 9], [2, 11]])
    positions = (anchors[:, :, None] + jnp.arange(KB)).reshape(2, A * KB)
    ctx_pos = jnp.broadcast_to(jnp.arange(C), (2, C))
    visible = jnp.arange(C)[None, None, :] < anchors[:, :, None]

    def hidden(d):
        return d.forward_blocks(embeds, positions, taps, ctx_pos, visible)

    # The grown drafter computes what its source does (the new layers write nothing yet) ...
    np.testing.assert_allclose(np.asarray(hidden(grown)), np.asarray(hidden(source)), rtol=1e-5, atol=1e-5)
    # ... its new layers read like the source's last one, and the loss reaches their zero writes at once.
    np.testing.assert_array_equal(grown.layers[2].self_attn.q_proj.kernel[...], source.layers[0].self_attn.q_proj.kernel[...])
    grads = nnx.grad(lambda d: jnp.sum(jnp.sin(hidden(d))))(grown)
    assert float(jnp.abs(grads.layers[2].self_attn.o_proj.kernel[...]).max()) > 0
    assert float(jnp.abs(grads.layers[1].mlp.down_proj.kernel[...]).max()) > 0
    # Fewer layers than the source is not a growth: refused, naming the field.
    save_drafter(grown, tmp_path / "deep")
    with pytest.raises(ValueError, match=r"num_layers 3 \(this run: 2\)"):
        D.init_from_drafter(deeper(2, 0), tmp_path / "deep")
    # It trains (its layers hold their own buffers, which the step donates).
    result = D.distill(target, grown, seqs, None, tmp_path / "run", config(2), D.distill_optim(2, lr=1e-2))
    assert np.isfinite(float(result.history[-1]["loss"]))


# --------------------------------------------------------------------------- export and decoding


def test_export_reloads_identically_and_decodes_losslessly(setup, trained):
    target, seqs = setup
    out, graphdef, result = trained
    raw = json.loads((out / "export" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == KB
    assert raw["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 1]}

    assert raw["draft_vocab_size"] == DRAFT_VOCAB
    loaded = load_drafter(out / "export")
    trained_module = nnx.merge(graphdef[0], result.best_params, graphdef[1])
    np.testing.assert_array_equal(np.asarray(loaded.module.draft_vocab[...]),
                                  json.loads((out / D.DRAFT_VOCAB).read_text())["ids"])
    fwd = nnx.jit(lambda d, t, *a: D.block_forward(d, t, *a))
    tokens = jnp.asarray(seqs.tokens[:2])
    anchors = jnp.asarray([[8, 20], [9, 30]], jnp.int32)
    taps = D.target_taps(target.model, tokens, (0, 1))
    blocks = D.block_tokens(tokens, anchors, KB, MASK)
    np.testing.assert_array_equal(np.asarray(fwd(loaded.module, target.model, blocks, anchors, taps)),
                                  np.asarray(fwd(trained_module, target.model, blocks, anchors, taps)))

    ps = prompts()[:4]
    want = target.generate(ps, 24).tokens
    got = SpeculativeDecoder(target, loaded, "chain", KB - 1).generate(ps, 24)
    assert got.tokens == want
    assert got.stats["tau"] > 1.3, got.stats  # the trained drafter is accepted, not just lossless


def test_the_draft_vocabulary_is_the_most_used_ids_and_kept_on_resume(setup, tmp_path, capsys):
    target, seqs = setup
    K = 12
    labels = D.label_tokens(seqs)
    counts = np.bincount(labels, minlength=VOCAB)
    dcfg = tiny_drafter(target, draft_vocab_size=K).config
    ids = D.draft_vocab(tmp_path, seqs, seqs, dcfg, "continuation")
    assert len(ids) == K and list(ids) == sorted(ids)
    assert counts[ids].min() >= np.delete(counts, ids).max()
    coverage, distinct = D.vocab_coverage(seqs, ids)
    assert coverage == pytest.approx(np.isin(labels, ids).mean()) and distinct == len(np.unique(labels))
    assert f"coverage: train {coverage:.2%}" in capsys.readouterr().out
    saved = json.loads((tmp_path / D.DRAFT_VOCAB).read_text())
    assert saved["ids"] == ids.tolist() and saved["size"] == K
    # A resumed run reads its ids back instead of refitting; another K is refused.
    saved["ids"] = list(range(K))
    (tmp_path / D.DRAFT_VOCAB).write_text(json.dumps(saved))
    assert D.draft_vocab(tmp_path, seqs, seqs, dcfg, "continuation").tolist() == list(range(K))
    with pytest.raises(ValueError, match="--draft-vocab"):
        D.read_draft_vocab(tmp_path, K + 1)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert D.main(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert D.main(["--target", str(tmp_path), "--out", str(tmp_path / "o"), "--preset", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
