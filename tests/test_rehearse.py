"""`python -m decode.rehearse` on the embedded default's shapes: it compiles, it counts, and its memory is real.

The rehearsal compiles generate for abstract parameters; here its per-device
bytes are compared with what a real run of the same model and shapes holds
in JAX buffers (parameters, inputs and the decode-loop state after prefill),
and its per-round FLOPs must be positive and grow with the tree.
"""

from __future__ import annotations

import gc
import json

import jax
import pytest

from decode import rehearse, roofline
from taps_jax import sharding
from taps_jax.decoder import DEFAULT_MODEL_DIR, SpeculativeDecoder, load_model_set
from taps_jax.engine import stages

TARGET, DRAFTER = str(DEFAULT_MODEL_DIR / "target"), str(DEFAULT_MODEL_DIR / "drafter")
BATCH, PROMPT, NEW, BUDGET = 2, 200, 16, 16


@pytest.fixture(scope="module")
def report():
    tcfg, dcfg = rehearse.read_configs(TARGET, DRAFTER, "float32")
    return rehearse.rehearse(tcfg, dcfg, sharding.make_mesh(1, 1), batch=BATCH, prompt_tokens=PROMPT,
                             max_new_tokens=NEW, policy="taps", budget=BUDGET)


def test_rehearsal_compiles_and_reports_positive_costs(report):
    assert report["per_device_bytes"] > 0 and report["memory"]["temp_bytes"] > 0
    assert report["flops_per_round"] > 0 and report["bytes_per_round"] > 0
    assert set(report["stage_costs"]) == {"draft", "select", "verify"}
    assert all(c["flops"] > 0 for c in report["stage_costs"].values())
    assert report["ar_step_cost"]["flops"] > 0
    # Verifying a 17-node tree reads the same weights and cache as one AR step but computes more.
    assert report["stage_costs"]["verify"]["flops"] > report["ar_step_cost"]["flops"]
    assert report["tau"] == rehearse.default_tau("taps", BUDGET) > 1
    for name, p in report["predicted"].items():
        assert p["round_ms"] > 0 and p["ar_ms_per_token"] > 0 and p["fits"]
        assert p["speedup"] == pytest.approx(report["tau"] * p["ar_ms_per_token"] / p["round_ms"])
    assert "NOT A MEASUREMENT" in report["note"]


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def test_rehearsal_memory_is_within_2x_of_a_real_run(report):
    """Rehearsed bytes vs JAX's live buffer bytes of a real run: parameters, inputs, the loop state after prefill."""
    before = _live_bytes()
    models = load_model_set(DEFAULT_MODEL_DIR)
    decoder = SpeculativeDecoder(models.target, models.drafter, "taps", BUDGET, scorer=models.scorer_for(0))
    prompts = [[5 + i] * PROMPT for i in range(BATCH)]
    call = decoder.prepare(prompts, NEW)
    args, kwargs = call.args, call.kwargs
    tg, tp, dg, dp, prompt, lens, active, key = args
    static = dict(target_graphdef=tg, drafter_graphdef=dg, scorer_graphdef=kwargs["scorer_graphdef"],
                  config=kwargs["config"])
    state = stages.init_jit((tp, dp, kwargs["scorer_params"]), prompt, lens, active, key, **static)
    jax.block_until_ready(state)
    live = _live_bytes() - before
    assert prompt.shape == (report["padded_batch"], report["prompt_buffer"])
    assert state.cache.capacity == report["cache_slots"]
    ratio = report["per_device_bytes"] / live
    assert 0.5 <= ratio <= 2.0, (report["memory"], live)
    del state, args, call


def test_kv_replication_is_rehearsed_on_a_wide_model_axis():
    """2 kv heads on a model axis of 4: the rehearsal compiles the repeated heads (4 per layer, one per device)."""
    tcfg, dcfg = rehearse.read_configs(TARGET, DRAFTER, "float32")
    r = rehearse.rehearse(tcfg, dcfg, sharding.make_mesh(2, 4), batch=2, prompt_tokens=32, max_new_tokens=8,
                          policy="chain", budget=8)
    assert r["kv_heads_per_model_axis"] == {"target": 4, "drafter": 4}
    assert r["per_device_bytes"] > 0 and r["flops_per_round"] > 0


def test_cli_json_and_errors(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert rehearse.main(["--target-config", TARGET, "--drafter-config", DRAFTER, "--mesh", "1,2", "--batch", "1",
                          "--prompt-tokens", "16", "--max-new-tokens", "4", "--policy", "ar", "--dtype", "float32",
                          "--parts", "tpu-v5e,h100-sxm", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "NOT A MEASUREMENT" in text and "tpu-v5e" in text and "h200" not in text
    data = json.loads(out.read_text())
    for field in ("per_device_bytes", "flops_per_round", "bytes_per_round", "predicted"):
        assert field in data
    assert set(data["predicted"]) == {"tpu-v5e", "h100-sxm"}
    assert set(data["predicted"]["h100-sxm"]) >= {"ar_ms_per_token", "round_ms", "speedup"}
    bad = [(["--target-config", "qwen9"], "neither a known name"),
           (["--target-config", TARGET, "--drafter-config", DRAFTER, "--mesh", "1,8"],
            r"attention heads \(4\) are not divisible by the model axis \(8\).*--mesh 2,4"),
           (["--parts", "tpu-v9"], "unknown part"),
           (["--tau", "0.5"], "--tau must be"),
           (["--target-config", "qwen3-4b", "--drafter-config", DRAFTER], "hidden_size")]
    for argv, message in bad:
        with pytest.raises(SystemExit) as e:
            rehearse.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m decode.rehearse: error:") and len(err.strip().splitlines()) == 1
        import re
        assert re.search(message, err), err


def test_published_configs_parse():
    for name in rehearse.TARGETS:
        tcfg, _ = rehearse.read_configs(name, None, "bfloat16")
        assert tcfg.num_kv_heads == 8 and tcfg.num_heads == 32
    tcfg, dcfg = rehearse.read_configs("qwen3-4b", "dflash-b16", "bfloat16")
    assert (tcfg.hidden_size, tcfg.num_layers, tcfg.vocab_size, tcfg.tie_embeddings) == (2560, 36, 151936, True)
    assert dcfg.block_size == 16 and dcfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert roofline.seconds(roofline.PARTS["tpu-v5e"], 197e12, 0) == pytest.approx(1.0)
