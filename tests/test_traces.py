"""TAPS traces and scorer training: labels, loss, resume, bad input."""

from __future__ import annotations

import csv
import json
import os
import signal

import numpy as np
import pytest

from spec_helpers import tiny_pair
from taps_helpers import path_tokens, random_scorer, sharp_pair
from taps_jax import load_scorer
from taps_jax.checkpoints.scorer import ScorerModel
from taps_jax.decoder import SpeculativeDecoder
from taps_jax.tree.scorer import ScorerConfig
from train import scorer as train_scorer_mod
from train import traces as traces_mod

PROMPTS = [[1, 2, 3], [4, 5], [6, 0, 1, 2, 5], [3, 3], [2, 4, 6, 1], [5, 1, 0]]
CONFIG = traces_mod.TraceConfig(pool_width=4, pool_k=4, budget=4, max_new_tokens=10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A sharp tiny target + drafter saved to disk, and traces collected through the CLI."""
    root = tmp_path_factory.mktemp("traces")
    target, drafter = sharp_pair(vocab=8, block_size=4, seed=0, head_scale=20.0)
    target.save(root / "target")
    drafter.save(root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"ids": p}) + "\n" for p in PROMPTS))
    rc = traces_mod.main([
        "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts", str(prompts),
        "--out", str(root / "tr"), "--pool-width", "4", "--pool-k", "4", "--budget", "4",
        "--max-new-tokens", "10", "--batch-size", "4", "--shard-rows", "8",
    ])
    assert rc == 0
    return root, target, drafter


def test_trace_labels_match_a_plain_causal_forward(setup):
    root, target, _ = setup
    meta, tr = traces_mod.load_traces(root / "tr")
    assert meta["pool"] == {"horizon": 3, "beam_width": 4, "lattice_k": 4, "nodes": 12}
    assert len(meta["shards"]) >= 2 and meta["rows"] == len(tr["token"])
    assert tr["hidden"].dtype == np.float16 and tr["p_star"].dtype == np.float32
    greedy = target.generate(PROMPTS, 16).tokens

    seqs, where = [], []
    for r in range(len(tr["token"])):
        prompt = PROMPTS[tr["prompt_id"][r]]
        done = tr["length"][r] - len(prompt)
        assert tr["root_token"][r] == greedy[tr["prompt_id"][r]][done], "decoding was not greedy"
        context = prompt + greedy[tr["prompt_id"][r]][:done] + [int(tr["root_token"][r])]
        for slot in range(13):  # root, then the 12 pool nodes as parents
            path = [] if slot == 0 else path_tokens(tr["parent"][r], tr["token"][r], slot - 1)
            seqs.append(context + path)
            where.append((r, slot))
    width = max(map(len, seqs))
    padded = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    logits = np.asarray(target.logits(padded), np.float64)[np.arange(len(seqs)), [len(s) - 1 for s in seqs]]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    at = {rs: probs[i] for i, rs in enumerate(where)}

    for r in range(len(tr["token"])):
        parent, token, valid = tr["parent"][r], tr["token"][r], tr["valid"][r]
        assert valid.all()
        want_p = np.array([at[(r, parent[n] + 1)][token[n]] for n in range(12)])
        np.testing.assert_allclose(tr["p_star"][r], want_p, atol=2e-5)
        want_reach = np.array([np.prod([want_p[m] for m in _ancestry(parent, n)]) for n in range(12)])
        np.testing.assert_allclose(tr["reach_star"][r], want_reach, rtol=1e-4, atol=1e-7)
        for slot in range(13):
            kids = [n for n in range(12) if parent[n] + 1 == slot]
            np.testing.assert_allclose(tr["p_other"][r, slot], max(0.0, 1 - want_p[kids].sum()), atol=2e-5)
            assert tr["target_argmax"][r, slot] == np.argmax(at[(r, slot)])


def _ancestry(parent, n):
    out = []
    while n >= 0:
        out.append(n)
        n = parent[n]
    return out


def _train_losses(out_dir):
    with open(out_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"}


def test_training_lowers_the_loss_and_exports_a_scorer(setup, capsys):
    root, target, drafter = setup
    out = root / "train"
    rc = train_scorer_mod.main(["--traces", str(root / "tr"), "--target", str(root / "target"), "--out", str(out),
                                "--steps", "40", "--batch-size", "8", "--eval-every", "20", "--val-fraction", "0.34"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "final train loss" in printed and "val top-1 child = target argmax" in printed
    losses = _train_losses(out)
    assert losses[max(losses)] < 0.7 * losses[min(losses)], losses
    summary = json.loads((out / "summary.json").read_text())
    assert np.isfinite(summary["val_loss"]) and 0 <= summary["val_top1_accuracy"] <= 1
    assert "val greedy tau of the top-12 tree" in printed
    # The drafter's greedy tau on the validation rows, by hand: 1 + accepted nodes among its top 12 (= all).
    _, tr = traces_mod.load_traces(root / "tr")
    _, val = train_scorer_mod.split_by_prompt(tr["prompt_id"], 0.34, seed=0)
    accepted = train_scorer_mod.greedy_labels(tr, CONFIG.pool_width)["reach_star"][val].sum(axis=1)
    assert summary["val_tau_budget"] == 12
    assert abs(summary["val_greedy_tau_drafter"] - (1 + accepted).mean()) < 1e-5
    assert abs(summary["val_greedy_tau_scorer"] - (1 + accepted).mean()) < 1e-5  # budget = whole pool
    scorer = load_scorer(out / "scorer")
    assert scorer.config.horizon == 3 and scorer.training["pool"]["nodes"] == 12
    # The trained scorer decodes losslessly.
    dec = SpeculativeDecoder(target, drafter, "taps", 4, scorer=scorer)
    assert dec.generate(PROMPTS[:2], 8).tokens == target.generate(PROMPTS[:2], 8).tokens


def test_greedy_labels_mark_the_paths_greedy_verification_accepts(setup):
    root, _, _ = setup
    _, tr = traces_mod.load_traces(root / "tr")
    got = train_scorer_mod.greedy_labels(tr, CONFIG.pool_width)
    for r in range(len(tr["token"])):
        parent, token = tr["parent"][r], tr["token"][r]
        hit = np.array([token[n] == tr["target_argmax"][r, parent[n] + 1] for n in range(12)], np.float32)
        np.testing.assert_array_equal(got["p_star"][r], hit)
        reach = [np.prod([hit[m] for m in _ancestry(parent, n)]) for n in range(12)]
        np.testing.assert_array_equal(got["reach_star"][r], reach)
        for slot in range(13):
            kids = [n for n in range(12) if parent[n] + 1 == slot]
            assert got["p_other"][r, slot] == 1 - hit[kids].sum()
    # A child holding more than half of the target's mass is its argmax.
    sure = tr["p_star"] > 0.5
    assert sure.any() and (got["p_star"][sure] == 1).all()


def test_greedy_label_training_lowers_the_loss_and_is_recorded(setup, monkeypatch):
    root, target, drafter = setup
    out = root / "train_greedy"
    monkeypatch.setattr(train_scorer_mod, "VAL_TAU_BUDGET", 4)
    rc = train_scorer_mod.main(["--traces", str(root / "tr"), "--target", str(root / "target"), "--out", str(out),
                                "--steps", "40", "--batch-size", "8", "--eval-every", "20", "--val-fraction", "0.34",
                                "--labels", "greedy"])
    assert rc == 0
    losses = _train_losses(out)
    assert losses[max(losses)] < 0.7 * losses[min(losses)], losses
    scorer = load_scorer(out / "scorer")
    assert scorer.training["labels"] == "greedy"
    # Validation tau of DDTree's top-4 trees, by hand.
    summary = json.loads((out / "summary.json").read_text())
    _, tr = traces_mod.load_traces(root / "tr")
    _, val = train_scorer_mod.split_by_prompt(tr["prompt_id"], 0.34, seed=0)
    top4 = np.argsort(-tr["cum_logprob"][val], axis=1, kind="stable")[:, :4]
    accepted = np.take_along_axis(train_scorer_mod.greedy_labels(tr, CONFIG.pool_width)["reach_star"][val], top4, axis=1).sum(1)
    assert summary["val_tau_budget"] == 4
    assert abs(summary["val_greedy_tau_drafter"] - (1 + accepted).mean()) < 1e-5
    assert 1 <= summary["val_greedy_tau_scorer"] <= 5
    dec = SpeculativeDecoder(target, drafter, "taps", 4, scorer=scorer)
    assert dec.generate(PROMPTS[:2], 8).tokens == target.generate(PROMPTS[:2], 8).tokens
    # Resuming these checkpoints with the other labels would mix two objectives.
    with pytest.raises(ValueError, match="labels"):
        train_scorer_mod.train_scorer(root / "tr", root / "target", out,
                                      train_scorer_mod.ScorerTrainConfig(steps=50, batch_size=8), resume=True,
                                      progress=False)


def test_validation_split_is_by_prompt():
    prompt_id = np.repeat(np.arange(10), 3)
    train, val = train_scorer_mod.split_by_prompt(prompt_id, 0.2, seed=0)
    assert len(val) == 6 and not set(prompt_id[train]) & set(prompt_id[val])
    with pytest.raises(ValueError, match="at least 2"):
        train_scorer_mod.split_by_prompt(np.zeros(5, int), 0.1, seed=0)


def test_resume_continues_from_the_saved_step(setup, monkeypatch):
    root, _, _ = setup
    config = train_scorer_mod.ScorerTrainConfig(steps=10, batch_size=4, log_every=1, checkpoint_every=100,
                                                val_fraction=0.0)
    args = (root / "tr", root / "target")
    train_scorer_mod.train_scorer(*args, root / "straight", config, progress=False)

    original = train_scorer_mod.TraceBatches.batch_at
    sent = []

    def interrupted(self, step):
        if step == 5 and not sent:  # `kill PID` mid-run: the loop checkpoints and stops
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, step)

    monkeypatch.setattr(train_scorer_mod.TraceBatches, "batch_at", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_scorer_mod.train_scorer(*args, root / "resumed", config, progress=False)
    monkeypatch.setattr(train_scorer_mod.TraceBatches, "batch_at", original)
    stopped_at = max(_train_losses(root / "resumed"))
    assert stopped_at in (5, 6) and sorted(_train_losses(root / "resumed")) == list(range(1, stopped_at + 1))
    summary = train_scorer_mod.train_scorer(*args, root / "resumed", config, resume=True, progress=False)
    assert summary["steps"] == 10
    straight, resumed = _train_losses(root / "straight"), _train_losses(root / "resumed")
    assert sorted(resumed) == list(range(1, 11))
    np.testing.assert_allclose([resumed[s] for s in range(1, 11)], [straight[s] for s in range(1, 11)], rtol=1e-6)


# ------------------------------------------------------------------ bad input


def test_traces_of_another_configuration_are_refused(setup):
    root, target, drafter = setup
    # Same configuration: a finished collection resumes as a no-op.
    meta = traces_mod.collect(target, drafter, PROMPTS, root / "tr", CONFIG, batch_size=4, progress=False)
    assert meta["complete"]
    with pytest.raises(ValueError, match=r"another configuration \(pool.beam_width: 4 vs 8\)"):
        traces_mod.collect(target, drafter, PROMPTS, root / "tr",
                           traces_mod.TraceConfig(pool_width=8, pool_k=4, budget=4, max_new_tokens=10))
    other = traces_mod.describe(target, drafter, traces_mod.TraceConfig(pool_width=8, pool_k=4, budget=4,
                                                                        max_new_tokens=10))
    with pytest.raises(ValueError, match="traces of another configuration"):
        traces_mod.load_traces(root / "tr", expect={"pool": other["pool"]})
    with pytest.raises(ValueError, match="no meta.json"):
        traces_mod.load_traces(root)


def test_training_with_another_target_is_refused(setup, tmp_path):
    root, _, _ = setup
    wide, _ = tiny_pair(16)
    wide.save(tmp_path / "wide")
    with pytest.raises(ValueError, match="vocab_size=8.*vocab_size=16"):
        train_scorer_mod.train_scorer(root / "tr", tmp_path / "wide", tmp_path / "out")
    twin, _ = sharp_pair(vocab=8, block_size=4, seed=1, head_scale=20.0)  # same shapes, other weights
    twin.save(tmp_path / "twin")
    with pytest.raises(ValueError, match="other embedding weights"):
        train_scorer_mod.train_scorer(root / "tr", tmp_path / "twin", tmp_path / "out")


def test_scorer_for_another_target_is_refused(setup, tmp_path):
    _, target, drafter = setup
    wide_target, wide_drafter = tiny_pair(16)
    scorer = random_scorer(target, drafter)
    with pytest.raises(ValueError, match="vocab_size=8 differs from the target's vocab_size=16"):
        SpeculativeDecoder(wide_target, wide_drafter, "taps", 4, scorer=scorer)
    c = scorer.config
    for field, value, want in [("embed_dim", 64, "embed_dim=64 .* hidden_size=32"),
                               ("drafter_hidden_size", 48, "drafter_hidden_size=48 .* hidden_size=32"),
                               ("horizon", 7, "horizon=7 .* block_size - 1=3")]:
        bad = ScorerModel.init(ScorerConfig(**{**c.__dict__, field: value}))
        with pytest.raises(ValueError, match=want):
            SpeculativeDecoder(target, drafter, "taps", 4, scorer=bad)
    target.save(tmp_path / "t")
    with pytest.raises(ValueError, match="not a TAPS scorer checkpoint"):
        load_scorer(tmp_path / "t")
