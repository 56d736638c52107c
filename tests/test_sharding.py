"""Meshes, sharding rules, sharded decoding and sharded training on 8 CPU devices (conftest).

The decoding tests compare every policy on meshes (8,1), (4,2), (2,4) with
the single-device greedy run (greedy speculative decoding is lossless, so one
single-device AR run is the reference for ar, ddtree and taps alike), through
the Python API and through `taps-decode --mesh`. The API and CLI tests decode
the same prompts with the same model set, so the CLI reuses the API's
compiled programs (the jit cache is keyed on structure, shapes and
shardings, not on objects).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from decode import cli
from taps_helpers import random_scorer
from taps_jax import sharding
from taps_jax.api import Target, load_target
from taps_jax.checkpoints.tokenizer import Tokenizer
from taps_jax.config import DrafterConfig, ModelConfig
from taps_jax.decoder import DrafterModel, SpeculativeDecoder, load_drafter, load_model_set
from taps_jax.models.drafter import Drafter
from taps_jax.models.transformer import Transformer
from train import loop
from train.target import lm_loss_fn
from train.tokenizer import train_tokenizer

VOCAB = 300
MESHES = [(8, 1), (4, 2), (2, 4)]
POLICIES = ["ar", "ddtree", "taps"]
PROMPTS = ["def f(x):", "import os\n", "class A:"]
NEW = 12
BUDGET = 4

# 4 heads over 4 kv heads, MLP 64, vocab 300: all divisible by a model axis of 1, 2 and 4.
TARGET_CFG = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=4, head_dim=8, rope_theta=10000.0, tie_embeddings=True)
DRAFTER_CFG = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                            head_dim=8, block_size=4, mask_token_id=2, target_layer_ids=(0, 1),
                            num_target_layers=2, vocab_size=VOCAB, rope_theta=10000.0)


def mesh_of(shape):
    return sharding.make_mesh(*shape)


def save_model_set(root, target_config, drafter_config):
    """A random target (with a tokenizer), drafter and scorer saved under root as a model set."""
    tok_file = train_tokenizer(root / "tok", vocab_size=VOCAB, max_bytes=40_000, show_progress=False)
    target = Target(Transformer(target_config, nnx.Rngs(0)), Tokenizer.from_file(tok_file), (0,))
    target.save(root / "target")
    drafter = DrafterModel(Drafter(drafter_config, nnx.Rngs(1)))
    drafter.save(root / "drafter")
    random_scorer(target, drafter).save(root / "scorer")
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = save_model_set(tmp_path_factory.mktemp("shard_models"), TARGET_CFG, DRAFTER_CFG)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                                                for i, p in enumerate(PROMPTS)))
    return root


@pytest.fixture(scope="module")
def reference(model_dir):
    """Single-device greedy AR: tokens and texts of PROMPTS."""
    models = load_model_set(model_dir)
    return models.target.generate(PROMPTS, NEW)


# --------------------------------------------------------------------------- meshes and rules


def test_mesh_axes_are_auto_and_named():
    mesh = mesh_of((4, 2))
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert sharding.data_size(sharding.make_mesh(None, 2)) == 4  # data=None: the devices left over
    assert sharding.parse_mesh("2,4") == (2, 4) and sharding.parse_mesh("auto") == "auto"
    assert sharding.parse_mesh(None) is None and sharding.mesh_from_flag(None) is None
    assert dict(sharding.mesh_from_flag("auto").shape) == {"data": 8, "model": 1}
    for bad in ("4", "a,b", "0,2", "2,2,2"):
        with pytest.raises(ValueError, match="--mesh"):
            sharding.parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 16 devices but only 8.*xla_force_host_platform_device_count"):
        sharding.make_mesh(4, 4)


def test_param_rules_by_path():
    mesh = mesh_of((2, 4))
    target = Target(Transformer(TARGET_CFG.replace(tie_embeddings=False), nnx.Rngs(0)))
    specs = {sharding._path_name(p): s.spec
             for p, s in jax.tree_util.tree_flatten_with_path(sharding.param_shardings(target.params, mesh))[0]}
    assert specs["embed_tokens.embedding"] == P("model")  # vocab-parallel
    assert specs["lm_head.kernel"] == P(None, "model")
    assert specs["layers.0.self_attn.q_proj.kernel"] == P(None, "model")
    assert specs["layers.1.self_attn.k_proj.kernel"] == P(None, "model")
    assert specs["layers.1.self_attn.o_proj.kernel"] == P("model")
    assert specs["layers.0.mlp.gate_proj.kernel"] == P(None, "model")
    assert specs["layers.0.mlp.down_proj.kernel"] == P("model")
    assert specs["layers.0.self_attn.q_norm.weight"] == P() and specs["norm.weight"] == P()
    # The drafter follows the same rules; its fc and norms are replicated.
    _, dparams = nnx.split(Drafter(DRAFTER_CFG, nnx.Rngs(1)))
    dspecs = {sharding._path_name(p): s.spec
              for p, s in jax.tree_util.tree_flatten_with_path(sharding.param_shardings(dparams, mesh))[0]}
    assert dspecs["layers.0.self_attn.v_proj.kernel"] == P(None, "model") and dspecs["fc.kernel"] == P()
    # Optimizer moments follow their parameter's path; counts are replicated.
    state = loop.TrainState.create(target.params, optax.adam(1e-3))
    flat = {name: s.spec for name, s in loop.flatten(sharding.param_shardings(state, mesh)).items()}
    assert flat["opt_state.0.mu.layers.0.mlp.up_proj.kernel.value"] == P(None, "model")
    assert flat["opt_state.0.count"] == P() and flat["step"] == P()
    # A vocabulary the model axis does not divide is replicated (the one soft axis).
    assert sharding.param_spec("embed_tokens.embedding", (301, 32), mesh) == P()


def test_divisibility_errors_are_clear():
    two_kv = TARGET_CFG.replace(num_kv_heads=2)
    # Training keeps the strict rule; decoding repeats the kv heads instead (test_kv_head_replication_*).
    with pytest.raises(ValueError, match=r"kv heads \(2\) are not divisible by the model axis \(4\).*--mesh 4,2"):
        sharding.check_config(two_kv, mesh_of((2, 4)))
    sharding.check_config(two_kv, mesh_of((4, 2)))  # fine
    sharding.check_config(two_kv, mesh_of((2, 4)), replicate_kv=True)  # fine: 2 kv heads -> 4 copies
    assert Target(Transformer(two_kv, nnx.Rngs(0)), mesh=mesh_of((2, 4))).config.num_kv_heads == 4
    # Query heads must still divide the model axis; the error names a mesh that works.
    with pytest.raises(ValueError, match=r"attention heads \(4\) are not divisible by the model axis \(8\); "
                                         r"use a model axis that divides the heads and MLP width, e.g. --mesh 2,4"):
        Target(Transformer(two_kv, nnx.Rngs(0)), mesh=mesh_of((1, 8)))
    with pytest.raises(ValueError, match=r"dimension 6 \(mlp\) is not divisible by the 'model' mesh axis \(4\)"):
        sharding.param_spec("layers.0.mlp.up_proj.kernel", (32, 6), mesh_of((2, 4)))
    with pytest.raises(ValueError, match="batch of 3 rows is not divisible by the data axis"):
        sharding.put_batch(np.zeros((3, 4)), mesh_of((2, 4)))
    assert sharding.padded_batch(1, mesh_of((8, 1))) == 8 and sharding.padded_batch(5, mesh_of((4, 2))) == 8


def test_sharded_load_reads_shards_and_matches(model_dir):
    mesh = mesh_of((2, 4))
    plain = load_target(model_dir / "target")
    sharded = load_target(model_dir / "target", mesh=mesh)
    q = sharded.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding == NamedSharding(mesh, P(None, "model"))
    assert {s.data.shape for s in q.addressable_shards} == {(32, 8)}  # each device holds a quarter
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    d_plain, d_sharded = load_drafter(model_dir / "drafter"), load_drafter(model_dir / "drafter", mesh=mesh)
    for a, b in zip(jax.tree.leaves(nnx.state(d_plain.module)), jax.tree.leaves(nnx.state(d_sharded.module))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_distributed_settings_from_flags_then_env():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert sharding.distributed_settings(env=env) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert sharding.distributed_settings("h:1", 2, 0, env=env) == {
        "coordinator_address": "h:1", "num_processes": 2, "process_id": 0}
    assert sharding.distributed_settings(env={}) == {}  # left to JAX's cluster detection (TPU pods)
    with pytest.raises(ValueError, match="outside"):
        sharding.distributed_settings("h:1", 2, 2, env={})


def test_engine_hooks_pin_caches_under_a_mesh_and_are_no_ops_without():
    from taps_jax.models.cache import KVCache

    x = jnp.ones((4, 3))
    assert sharding.constrain_batch(x) is x and sharding.constrain(x, ("batch", None)) is x

    @jax.jit
    def make(n):
        cache = KVCache.zeros(TARGET_CFG, 4, 16)
        return sharding.constrain_kv_cache(cache.replace(lengths_B=cache.lengths_B + n))

    mesh = mesh_of((2, 4))
    with sharding.use_mesh(mesh):
        cache = make(1)
    assert cache.k_LBKHS.sharding == NamedSharding(mesh, P(None, "data", "model"))
    assert cache.lengths_B.sharding == NamedSharding(mesh, P("data"))
    assert len(make(1).k_LBKHS.sharding.device_set) == 1  # no mesh: one device (a separate compile)


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_generate_on_mesh_matches_one_device(model_dir, reference, shape):
    mesh = mesh_of(shape)
    models = load_model_set(model_dir, mesh=mesh)
    assert models.target.mesh is mesh
    for policy in POLICIES:
        decoder = SpeculativeDecoder(models.target, models.drafter if policy != "ar" else None, policy, BUDGET,
                                     scorer=models.scorer if policy == "taps" else None)
        got = decoder.generate(PROMPTS, NEW)
        assert got.tokens == reference.tokens, f"{policy} on mesh {shape}"
        assert got.finish_reasons == reference.finish_reasons
        if policy != "ar":
            assert len(got.stats["rounds"]) == len(PROMPTS) and got.stats["tau"] >= 1
    if shape == (8, 1):  # one prompt on 8 data shards: padded with 7 inactive rows
        one = decoder.generate(PROMPTS[:1], NEW)
        assert one.tokens == reference.tokens[:1] and len(one.finish_reasons) == 1


def test_adaptive_on_mesh_matches_one_device(model_dir, reference):
    """Every adaptive branch in turn, AR rounds included."""
    from taps_jax.engine.adaptive import AdaptiveConfig

    models = load_model_set(model_dir, mesh=mesh_of((4, 2)))
    cycle = AdaptiveConfig((0, 1, 2, 4), force_cycle=True)
    decoder = SpeculativeDecoder(models.target, models.drafter, "adaptive", BUDGET, adaptive=cycle, costs=(1, 1, 1, 1))
    got = decoder.generate(PROMPTS, NEW)
    assert got.tokens == reference.tokens and set(got.stats["budgets"]) == {0, 1, 2, 4}


def test_decoder_mesh_argument_reshards_a_one_device_target(model_dir, reference):
    models = load_model_set(model_dir)
    mesh = mesh_of((4, 2))
    decoder = SpeculativeDecoder(models.target, models.drafter, "ddtree", BUDGET, mesh=mesh)
    assert decoder.mesh is mesh and decoder.target.mesh is mesh and models.target.mesh is None
    k = decoder.target.params["layers"][0]["self_attn"]["k_proj"]["kernel"].get_value()
    assert k.sharding == NamedSharding(mesh, P(None, "model"))
    assert decoder.generate(PROMPTS, NEW).tokens == reference.tokens


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_taps_decode_mesh_matches_one_device(model_dir, reference, shape, tmp_path, capsys):
    """`taps-decode --mesh D,M` in job mode: same tokens as the single-device API run, every policy."""
    want = dict(zip(("p0", "p1", "p2"), reference.texts))
    for policy in POLICIES:
        out = tmp_path / f"{policy}.jsonl"
        assert cli.main(["--model", str(model_dir), "--prompts", str(model_dir / "prompts.jsonl"), "--out", str(out),
                         "--mesh", f"{shape[0]},{shape[1]}", "--policy", policy, "--budget", str(BUDGET),
                         "--max-new-tokens", str(NEW), "--batch-size", "4"]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert {r["id"]: r["text"] for r in rows} == want, f"{policy} on mesh {shape}"
        assert all(r["num_tokens"] == NEW and r["finish_reason"] == "length" and r["tau"] >= 1 for r in rows)
    if shape == (8, 1):  # the single-prompt mode: one prompt padded to the 8 data shards
        capsys.readouterr()
        assert cli.main(["--model", str(model_dir), "--prompt", PROMPTS[0], "--mesh", "8,1", "--policy", "taps",
                         "--budget", str(BUDGET), "--max-new-tokens", str(NEW)]) == 0
        assert capsys.readouterr().out == PROMPTS[0] + reference.texts[0] + "\n"


def test_cli_mesh_errors_are_one_line(model_dir):
    with pytest.raises(ValueError, match="needs 16 devices"):
        cli.main(["--model", str(model_dir), "--prompt", "x", "--mesh", "4,4", "--policy", "ar"])
    with pytest.raises(ValueError, match="--mesh expects DATA,MODEL"):
        cli.main(["--model", str(model_dir), "--prompt", "x", "--mesh", "four", "--policy", "ar"])
    with pytest.raises(ValueError, match="only apply with --distributed"):
        cli.main(["--model", str(model_dir), "--prompt", "x", "--process-id", "0", "--policy", "ar"])


# --------------------------------------------------------------------------- kv-head replication

# 8 query heads over 2 kv heads: model axes 4 and 8 need each kv head repeated 2 and 4 times.
GQA_TARGET = TARGET_CFG.replace(num_heads=8, num_kv_heads=2, head_dim=4)
GQA_DRAFTER = DRAFTER_CFG.replace(num_heads=8, num_kv_heads=2, head_dim=4)


def test_kv_replicas_and_repeated_weights():
    assert sharding.kv_replicas(GQA_TARGET, mesh_of((4, 2))) == 1
    assert sharding.kv_replicas(GQA_TARGET, mesh_of((2, 4))) == 2
    assert sharding.kv_replicas(GQA_TARGET, mesh_of((1, 8))) == 4
    assert sharding.kv_replicas(TARGET_CFG.replace(num_kv_heads=4, num_heads=12), None) == 1
    model = Transformer(GQA_TARGET.replace(family="qwen2"), nnx.Rngs(0))  # qwen2: k/v biases too
    mesh = mesh_of((1, 8))
    wide = sharding.replicate_kv_heads(model, mesh)
    assert wide.config.num_kv_heads == 8 and wide.layers[0].self_attn.num_kv_heads == 8
    for name in ("k_proj", "v_proj"):
        for leaf in ("kernel", "bias"):
            old = np.asarray(getattr(getattr(model.layers[1].self_attn, name), leaf).get_value())
            new = getattr(getattr(wide.layers[1].self_attn, name), leaf).get_value()
            assert new.sharding.spec[-1] == "model"
            new = np.asarray(new).reshape(*old.shape[:-1], 2, 4, 4)  # [.., K, r, H]
            for copy in range(4):
                np.testing.assert_array_equal(new[..., copy, :].reshape(old.shape), old)
    # Query head h reads kv head h // 4 (of 2) before and copy h // 1 (of 8) after: the same head.
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(wide.logits(tokens)), np.asarray(model.logits(tokens)), atol=1e-5)


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    return save_model_set(tmp_path_factory.mktemp("gqa_models"), GQA_TARGET, GQA_DRAFTER)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_kv_head_replication_matches_one_device(gqa_dir, shape):
    """2 kv heads on a model axis of 4 and 8: every policy gives the single-device greedy tokens."""
    reference = load_model_set(gqa_dir).target.generate(PROMPTS, NEW)
    mesh = mesh_of(shape)
    models = load_model_set(gqa_dir, mesh=mesh)  # sharded load, then kv heads repeated on the mesh
    assert models.target.config.num_kv_heads == shape[1] and models.drafter.config.num_kv_heads == shape[1]
    k = models.target.params["layers"][0]["self_attn"]["k_proj"]["kernel"].get_value()
    assert k.sharding == NamedSharding(mesh, P(None, "model"))
    for policy in ["ar", "chain", "ddtree", "taps"]:
        decoder = SpeculativeDecoder(models.target, models.drafter if policy != "ar" else None, policy, BUDGET,
                                     scorer=models.scorer if policy == "taps" else None)
        assert decoder.generate(PROMPTS, NEW).tokens == reference.tokens, f"{policy} on mesh {shape}"
    # A drafter loaded on one device is repeated by the decoder for its mesh.
    plain = load_model_set(gqa_dir)
    decoder = SpeculativeDecoder(plain.target, plain.drafter, "ddtree", BUDGET, mesh=mesh)
    assert decoder._drafter_config.num_kv_heads == shape[1]
    assert decoder.generate(PROMPTS, NEW).tokens == reference.tokens


# --------------------------------------------------------------------------- training


def _lm_setup():
    model = Transformer(TARGET_CFG, nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, VOCAB, (4, 17)).astype(np.int32) for _ in range(2)]
    return lm_loss_fn(graphdef), optimizer, params, batches


def _assert_close(a, b, atol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def test_train_step_on_mesh_matches_one_device_and_restores_on_another_mesh(tmp_path):
    loss_fn, optimizer, params, batches = _lm_setup()
    fresh = lambda: loop.TrainState.create(jax.tree.map(jnp.copy, params), optimizer)  # steps donate their input
    single_step = loop.make_train_step(loss_fn, optimizer)
    ref, m_ref = single_step(fresh(), batches[0])

    mesh24 = mesh_of((2, 4))
    state = loop.shard_state(fresh(), mesh24)
    state, m = loop.make_train_step(loss_fn, optimizer, mesh24)(state, batches[0])
    np.testing.assert_allclose(float(m["loss"]), float(m_ref["loss"]), rtol=1e-6)
    _assert_close(state.params, ref.params)
    q = state.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding == NamedSharding(mesh24, P(None, "model"))  # the step kept the rules' layout
    mu = state.opt_state[1][0].mu["layers"][0]["mlp"]["down_proj"]["kernel"].get_value()
    assert mu.sharding.spec == P("model")

    # Save on (2,4), restore onto (4,2), continue: same as continuing on one device.
    ckpt = loop.Checkpointer(tmp_path)
    ckpt.save(state, {"note": "2x4"})
    mesh42 = mesh_of((4, 2))
    template = loop.shard_state(fresh(), mesh42)
    restored, meta = ckpt.restore(template)
    ckpt.close()
    assert meta["note"] == "2x4" and int(restored.step) == 1
    q = restored.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
    assert q.sharding == NamedSharding(mesh42, P(None, "model"))
    _assert_close(restored, state, atol=0)
    cont, m2 = loop.make_train_step(loss_fn, optimizer, mesh42)(restored, batches[1])
    ref2, m2_ref = single_step(ref, batches[1])
    np.testing.assert_allclose(float(m2["loss"]), float(m2_ref["loss"]), rtol=1e-6)
    _assert_close(cont.params, ref2.params)
    assert int(cont.step) == 2


def test_drafter_distill_step_on_mesh_matches_one_device():
    from train import distill

    target = Target(Transformer(TARGET_CFG, nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    seqs = distill.Sequences(rng.integers(3, VOCAB, (8, 32)).astype(np.int32), np.full(8, 8, np.int32),
                             np.full(8, 32, np.int32))
    config = distill.DistillConfig(steps=4, batch_size=4, anchors_per_seq=2)
    optim = loop.OptimConfig(lr=1e-3, warmup_steps=1, total_steps=4)
    mesh = mesh_of((2, 4))
    run = distill.setup(target, Drafter(DRAFTER_CFG, nnx.Rngs(1)), seqs, config, optim, mesh)
    batch = run.batches.batch_at(0)
    params = nnx.split(Drafter(DRAFTER_CFG, nnx.Rngs(1)))[1]
    want = float(jax.jit(run.loss_fn)(params, {**batch, "target": target.params})[0])
    state, m = run.train_step(run.state, {**batch, "target": sharding.shard_params(target.params, mesh)})
    np.testing.assert_allclose(float(m["loss"]), want, rtol=1e-5)  # vs the loss on one device
    fc = state.params["layers"][0]["mlp"]["gate_proj"]["kernel"].get_value()
    assert fc.sharding == NamedSharding(mesh, P(None, "model")) and int(state.step) == 1
