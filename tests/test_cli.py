"""taps-decode and taps-bench end to end on a tiny random model set."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from flax import nnx

from decode import bench, cli
from taps_jax.api import Target
from taps_jax.checkpoints.tokenizer import Tokenizer
from taps_jax.config import DrafterConfig, ModelConfig
from taps_jax.decoder import DrafterModel
from taps_jax.models.drafter import Drafter
from taps_jax.models.transformer import Transformer
from train.tokenizer import train_tokenizer

VOCAB = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelset")
    tok_file = train_tokenizer(root / "tok", vocab_size=VOCAB, max_bytes=40_000, show_progress=False)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=10000.0, tie_embeddings=True)
    Target(Transformer(cfg, nnx.Rngs(0)), Tokenizer.from_file(tok_file), (0,)).save(root / "target")
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, block_size=4, mask_token_id=2, target_layer_ids=(0, 1),
                         num_target_layers=2, vocab_size=VOCAB, rope_theta=10000.0)
    DrafterModel(Drafter(dcfg, nnx.Rngs(1))).save(root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def f(x):", "import os\n", "class A:"]))
    return root


def test_decode_prints_continuation_and_stats(model_dir, capsys):
    assert cli.main(["--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "8",
                     "--policy", "ddtree", "--budget", "4", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def add(a, b):")
    assert "tau=" in err and "tokens/s=" in err and "rounds=" in err


def test_decode_ar_and_chain_agree(model_dir, capsys):
    texts = []
    for policy in ("ar", "chain", "adaptive"):
        costs = ["--adaptive-costs", "1,2,3,4"] if policy == "adaptive" else []
        cli.main(["--model", str(model_dir), "--prompt", "x = ", "--max-new-tokens", "6", "--policy", policy,
                  "--budget", "4", *costs])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2]


def test_bench_sampled_rows_say_lossless_na(model_dir, capsys):
    assert bench.main(["--model", str(model_dir), "--prompts", str(model_dir / "prompts.jsonl"),
                       "--policies", "ar,chain", "--budgets", "4", "--max-new-tokens", "4", "--repeats", "1",
                       "--temperature", "1", "--no-stages"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("chain")]
    assert " n/a " in row and "False" not in row


@pytest.fixture
def _private_cost_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_JAX_CACHE_DIR", str(tmp_path / "cost-cache"))


def test_bench_writes_json_and_plot(model_dir, tmp_path, capsys, _private_cost_cache):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert bench.main(["--model", str(model_dir), "--prompts", str(model_dir / "prompts.jsonl"),
                       "--policies", "ar,chain,ddtree,adaptive", "--budgets", "4", "--max-new-tokens", "6",
                       "--batch-size", "2", "--repeats", "2", "--cost-curve", "--json", str(out_json),
                       "--plot", str(out_png)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "compile s" in printed and "rounds per budget" in printed
    assert "compiling the adaptive decoder for batch 2, prompts up to " in captured.err
    assert "timing its branches" in captured.err
    report = json.loads(out_json.read_text())
    assert set(report) >= {"config", "ar", "results", "ar_spread", "busy"}
    assert report["config"]["repeats"] == 2
    ar = report["ar"]
    assert ar["tokens"] == 18 and ar["tokens_per_s_min"] <= ar["tokens_per_s"] <= ar["tokens_per_s_max"]
    assert report["ar_spread"] == pytest.approx(ar["tokens_per_s_max"] / ar["tokens_per_s_min"])
    assert 0 <= report["ar"]["repeat_token_fraction"] <= 1
    assert [(r["policy"], r["budget"]) for r in report["results"]] == [("chain", 4), ("ddtree", 4), ("adaptive", 4)]
    keys = {"policy", "budget", "tau", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "speedup_vs_ar",
            "speedup_min", "speedup_max", "lossless", "rounds", "compile_s", "draft_ms_per_round",
            "select_ms_per_round", "verify_ms_per_round", "compiles", "tau_novel_rounds", "copy_accepted_fraction"}
    for row in report["results"]:
        assert keys <= set(row)
        assert row["lossless"] is True
        assert row["tau"] >= 1 and row["rounds"] > 0
        assert row["speedup_min"] <= row["speedup_vs_ar"] <= row["speedup_max"]
        assert row["tau_for_2x"] == pytest.approx(2 * row["tau"] / row["speedup_vs_ar"])
        if row["policy"] == "adaptive":
            # One branch per loop round for the whole batch; every loop round has a running sequence.
            assert 1 <= sum(row["branch_rounds"].values()) <= row["rounds"]
            assert list(row["branch_costs"]) == ["0", "1", "2", "4"]
        else:
            assert all(row[f"{s}_ms_per_round"] > 0 for s in ("draft", "select", "verify"))
    cost = report["verify_cost"]  # T = 1, powers of two, and every policy's tree size (1 + budget 4)
    assert cost["tree_tokens"] == [1, 2, 4, 5] and all(ms > 0 for ms in cost["ms"])
    assert cost["ratio_to_one_token"][0] == 1.0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("script", ["taps-decode", "taps-bench"])
def test_help_of_installed_console_scripts(script):
    """The README's commands exist once the package is installed."""
    path = shutil.which(script)
    assert path, f"{script} is not installed; pip install -e . registers it"
    res = subprocess.run([path, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and f"usage: {script}" in res.stdout


def _run(tool, *args):
    return subprocess.run([sys.executable, "-m", tool, *args], capture_output=True, text=True)


@pytest.mark.parametrize("args, message", [
    (["--policy", "nope"], "invalid choice"),
    (["--budget", "0"], "positive integer"),
    (["--max-new-tokens", "-3"], "positive integer"),
    (["--policy", "ddtree", "--adaptive-costs", "1,2"], "--adaptive-costs is for --policy adaptive"),
    (["--policy", "adaptive", "--budget", "32", "--adaptive-costs", "1,2"], "needs 5 values, one per budget 0,4,8,16,32"),
    (["--policy", "adaptive", "--adaptive-costs", "1,-2"], "positive numbers"),
])
def test_decode_bad_flags(model_dir, args, message):
    res = _run("decode.cli", "--model", str(model_dir), "--prompt", "x", *args)
    assert res.returncode == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_decode_missing_model_dir(tmp_path):
    res = _run("decode.cli", "--model", str(tmp_path / "nowhere"), "--prompt", "x")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "does not exist" in res.stderr


def test_bench_bad_input(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    cases = [
        (["--policies", "ar,bogus"], "unknown policy"),
        (["--budgets", "0"], "positive"),
        (["--prompts", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--prompts", str(bad)], f"{bad}:2"),
    ]
    for args, message in cases:
        res = _run("decode.bench", "--model", str(model_dir), *args)
        assert res.returncode == 2, (args, res.stderr)
        assert message in res.stderr, (args, res.stderr)
        assert res.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("module", ["train.recipe", "train.target", "train.distill", "train.traces",
                                    "train.scorer", "train.tokenizer", "train.packing", "train.corpus"])
def test_help_of_training_commands(module):
    res = _run(module, "--help")
    assert res.returncode == 0 and "usage:" in res.stdout, res.stderr


def test_longrun_reports_no_growth_no_recompile_and_lossless(model_dir, tmp_path):
    """The long-run script's checks, on a short run (the figures in the README come from the full one)."""
    from decode import longrun

    out = tmp_path / "longrun.json"
    assert longrun.main(["--model", str(model_dir), "--prompts", str(model_dir / "prompts.jsonl"),
                         "--num-prompts", "3", "--max-new-tokens", "40", "--policies", "ar,chain,ddtree",
                         "--budget", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and set(report["results"]) == {"ar", "chain", "ddtree"}
    for row in report["results"].values():
        assert row["identical_to_ar"] and row["compiles_after_warmup"] == 0
        assert row["tokens_per_s"] > 0
