"""The one-command recipe, end to end on the tiny presets (seconds-long stages)."""

from __future__ import annotations

import json

from taps_jax.decoder import SpeculativeDecoder, load_model_set
from train import recipe


def test_recipe_builds_a_working_set_and_skips_done_stages(tmp_path, capsys):
    work, assets = tmp_path / "work", tmp_path / "assets"
    argv = ["--work", str(work), "--assets", str(assets), "--preset", "tiny", "--vocab-size", "320",
            "--tokenizer-bytes", "60000", "--heldout-prompts", "4", "--trace-prompts", "4",
            "--trace-tokens", "8", "--scorer-steps", "6", "--report-prompts", "2",
            "--stages", "tokenizer,data,target,drafter,traces,scorer,assemble"]
    assert recipe.main(argv) == 0
    models = load_model_set(assets)
    assert models.drafter is not None and models.scorer is not None
    assert json.loads((assets / "target" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert models.target.params["embed_tokens"]["embedding"].get_value().dtype == "float32"
    ar = SpeculativeDecoder(models.target, None, "ar").generate(["def f(x):"], 8)
    for policy in ("ddtree", "taps"):
        extra = {"scorer": models.scorer} if policy == "taps" else {}
        dec = SpeculativeDecoder(models.target, models.drafter, policy, 4, **extra)
        assert dec.generate(["def f(x):"], 8).tokens == ar.tokens
    capsys.readouterr()
    assert recipe.main(argv) == 0  # everything done: every stage is skipped
    out = capsys.readouterr().out
    assert out.count("skipped") == 6
