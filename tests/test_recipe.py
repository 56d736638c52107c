"""The one-command recipe, end to end on the tiny presets (seconds-long stages)."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest

from taps_jax.decoder import SpeculativeDecoder, load_model_set
from train import corpus, recipe


# A 2.3 MB slice of the stdlib (145 files: 138 train, 5 validation, 2 held-out)
# keeps the data stage at seconds instead of tokenising all 30 MB.
SMALL_CORPUS = ("email", "json", "asyncio", "concurrent", "importlib", "logging", "xml", "urllib", "http", "unittest")


def small_corpus(root: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in SMALL_CORPUS:
        shutil.copytree(stdlib / package, root / package, ignore=shutil.ignore_patterns("test", "tests", "__pycache__"))
    return root


def test_recipe_builds_a_working_set_and_skips_done_stages(tmp_path, capsys):
    work, assets = tmp_path / "work", tmp_path / "assets"
    argv = ["--work", str(work), "--assets", str(assets), "--corpus", str(small_corpus(tmp_path / "corpus")),
            "--preset", "tiny", "--vocab-size", "320",
            "--tokenizer-bytes", "60000", "--heldout-prompts", "4", "--trace-prompts", "4",
            "--trace-tokens", "8", "--scorer-steps", "6", "--adaptive-prompts", "2", "--adaptive-tokens", "8", "--report-prompts", "2", "--report-budgets", "4",
            "--report-tokens", "8"]
    assert recipe.main(argv) == 0
    assert corpus.CORPUS_ROOT_ENV not in os.environ  # the recipe restores the environment
    small = "".join(f.read_text(errors="replace") for f in (tmp_path / "corpus").rglob("*.py"))
    traced = [json.loads(line)["prompt"] for line in (work / "prompts_traces.jsonl").open()]
    defs = [p.splitlines()[0].strip() for p in traced]
    assert defs and all(d in small for d in defs)  # the prompts come from --corpus, not the whole stdlib
    # The scorer's traces come from prompts the drafter was not distilled on.
    distilled = {p["prompt"] for p in corpus.build_prompts("train", n=16, seed=0)}  # train/presets/drafter_tiny.json
    assert distilled and not distilled & set(traced)
    models = load_model_set(assets)
    assert models.drafter is not None and models.scorer is not None and models.greedy_scorer is not None
    assert models.table is not None and sum(map(sum, models.table.counts["greedy"])) > 0  # the adaptive prior
    assert models.scorer.training["labels"] == "sampled" and models.greedy_scorer.training["labels"] == "greedy"
    assert json.loads((assets / "target" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert models.target.params["embed_tokens"]["embedding"].get_value().dtype == "float32"
    ar = SpeculativeDecoder(models.target, None, "ar").generate(["def f(x):"], 8)
    for policy in ("ddtree", "taps"):
        extra = {"scorer": models.scorer} if policy == "taps" else {}
        dec = SpeculativeDecoder(models.target, models.drafter, policy, 4, **extra)
        assert dec.generate(["def f(x):"], 8).tokens == ar.tokens
    report = json.loads((assets / "report.json").read_text())
    assert report["losses"]["target"]["val_loss"] > 0 and report["losses"]["scorer"]["val_loss"] > 0
    assert report["losses"]["scorer_greedy"]["val_loss"] > 0
    assert report["losses"]["drafter_val_agreement"]["acc_1"] >= 0
    assert [r["policy"] for r in report["greedy"]["results"]] == ["chain", "ddtree", "taps"]
    assert all(r["lossless"] for r in report["greedy"]["results"])
    assert report["sampled"]["config"]["temperature"] == 1.0
    assert (assets / "report.png").exists() and (assets / "report_t1.png").exists()
    capsys.readouterr()
    assert recipe.main(argv) == 0  # everything done: every stage is skipped
    out = capsys.readouterr().out
    assert out.count("skipped") == 10  # 9 stages, 2 scorers
    assert (assets / "report.png").exists() and (assets / "report.json").exists()
    target_loss = report["losses"]["target"]
    (work / "target_train" / "metrics.csv").unlink()  # say the target was restored, not retrained
    assert recipe.main(argv + ["--stages", "report"]) == 0
    assert json.loads((assets / "report.json").read_text())["losses"]["target"] == target_loss


def test_recipe_refuses_a_missing_corpus_before_any_stage(tmp_path, capsys):
    assert recipe.main(["--work", str(tmp_path / "work"), "--corpus", str(tmp_path / "nowhere")]) == 2
    assert "--corpus" in capsys.readouterr().err and not (tmp_path / "work").exists()


def test_corpus_root_from_the_environment(tmp_path, monkeypatch):
    root = small_corpus(tmp_path / "corpus")
    monkeypatch.setenv(corpus.CORPUS_ROOT_ENV, str(root))
    counts = {s: len(corpus.files_of(s)) for s in corpus.SPLITS}
    assert counts == {"train": 138, "validation": 5, "heldout": 2}, counts
    monkeypatch.setenv(corpus.CORPUS_ROOT_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="is not a directory"):
        corpus.stdlib_root()
