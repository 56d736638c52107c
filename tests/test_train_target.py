"""Target pretraining: the loss falls, resume is exact, the export matches transformers."""

from __future__ import annotations

import csv
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from taps_jax.api import load_target
from taps_jax.config import ModelConfig
from taps_jax.models.transformer import Transformer
from train import loop
from train.packing import PackedBatches, eval_batches
from train.target import export, lm_loss_fn

VOCAB = 64


def tiny_config(tie: bool = True) -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=16, family="qwen3", rope_theta=10000.0, tie_embeddings=tie,
    )


def token_stream(n: int = 6000, seed: int = 0) -> np.ndarray:
    """A learnable stream: documents that walk a fixed random cycle over the vocab, EOS-separated."""
    rng = np.random.default_rng(seed)
    cycle = rng.permutation(np.arange(3, VOCAB))
    out = []
    while sum(map(len, out)) < n:
        start, length = rng.integers(len(cycle)), rng.integers(10, 60)
        out.append(np.append(cycle[(start + np.arange(length)) % len(cycle)], 0))
    return np.concatenate(out)[:n].astype(np.uint16)


def setup(steps: int, seed: int = 0, lr: float = 1e-2):
    model = Transformer(tiny_config(), nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    optim = loop.OptimConfig(lr=lr, warmup_steps=2, total_steps=steps)
    optimizer = loop.make_optimizer(optim)
    loss_fn = lm_loss_fn(graphdef)
    return graphdef, loss_fn, optim, loop.make_train_step(loss_fn, optimizer), loop.TrainState.create(params, optimizer)


def test_loss_decreases_and_logs(tmp_path):
    steps = 20
    graphdef, loss_fn, optim, train_step, state = setup(steps)
    tokens = token_stream()
    batches = PackedBatches(tokens, batch_size=8, seq_len=32, seed=0)
    evaluate = loop.make_eval_fn(loss_fn, [jnp.asarray(b) for b in eval_batches(tokens[:2000], 8, 32, 2)])
    cfg = loop.LoopConfig(total_steps=steps, tokens_per_step=8 * 32, log_every=1, eval_every=10, checkpoint_every_s=0)
    result = loop.run(cfg, state, train_step, batches.batch_at, tmp_path, evaluate=evaluate, optim=optim)

    train = [float(r["loss"]) for r in result.history if r["split"] == "train"]
    val = [float(r["loss"]) for r in result.history if r["split"] == "val"]
    assert len(train) == steps and len(val) == 2
    assert train[0] > np.log(VOCAB) - 0.3  # starts near uniform
    assert np.mean(train[-3:]) < train[0] - 1.0, train
    assert val[-1] < val[0]
    assert result.best_params is not None and result.best_step == steps
    assert int(result.state.step) == steps
    assert (tmp_path / "loss.png").stat().st_size > 0
    with (tmp_path / "metrics.csv").open() as f:
        assert [r["split"] for r in csv.DictReader(f)].count("train") == steps


def test_resume_gives_identical_next_step_loss(tmp_path):
    steps, stop = 8, 5
    tokens = token_stream()
    batches = PackedBatches(tokens, batch_size=4, seq_len=32, seed=1)
    cfg = lambda total: loop.LoopConfig(total_steps=total, tokens_per_step=128, log_every=1, checkpoint_every_s=0)

    # Uninterrupted: train `stop` steps (checkpointed at the end), then keep going in memory.
    _, _, optim, train_step, state = setup(steps)
    first = loop.run(cfg(stop), state, train_step, batches.batch_at, tmp_path, optim=optim)
    ref_state, ref_metrics = train_step(first.state, batches.batch_at(stop))
    ref_loss = float(ref_metrics["loss"])

    # Resumed: a fresh process would build a differently initialised state; restore overwrites it.
    _, _, optim, train_step2, fresh = setup(steps, seed=123)
    ckpt = loop.Checkpointer(tmp_path)
    restored, meta = ckpt.restore(fresh)
    ckpt.close()
    assert int(restored.step) == stop and meta["step"] == stop
    _, metrics = train_step2(restored, batches.batch_at(stop))
    assert float(metrics["loss"]) == ref_loss  # bit-identical

    # Through the loop: resuming continues at `stop` and keeps the earlier CSV rows.
    _, _, optim, train_step3, fresh = setup(steps, seed=7)
    resumed = loop.run(cfg(steps), fresh, train_step3, batches.batch_at, tmp_path, resume=True, optim=optim)
    rows = [r for r in resumed.history if r["split"] == "train"]
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    assert float(rows[stop]["loss"]) == pytest.approx(ref_loss, abs=1e-5)  # CSV keeps 5 decimals
    for step in range(stop + 1, steps):
        ref_state, _ = train_step(ref_state, batches.batch_at(step))
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def write_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, "<|mask|>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.parametrize("tie", [True, False])
def test_export_matches_transformers(tmp_path, tie):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    model = Transformer(tiny_config(tie), nnx.Rngs(3))
    # Perturb the norms so their weights are exercised (they initialise to ones).
    graphdef, params = nnx.split(model)
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.key(0)
    leaves = [x + 0.1 * jax.random.normal(jax.random.fold_in(key, i), x.shape) for i, x in enumerate(leaves)]
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    out = export(tmp_path / "export", model, write_tokenizer(tmp_path / "tokenizer.json"))
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert (out / "tokenizer.json").is_file()

    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
    ours = np.asarray(model.logits(jnp.asarray(tokens, jnp.int32)))

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert hf.config.model_type == "qwen3" and hf.config.tie_word_embeddings == tie
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    target = load_target(out)
    assert target.eos_ids == (0,)
    np.testing.assert_allclose(np.asarray(target.logits(tokens)), ours, atol=1e-5, rtol=0)
