"""The embedded default model set that ships in the package."""

from __future__ import annotations

import pytest

from taps_jax.decoder import DEFAULT_MODEL_DIR, load_model_set
from taps_jax.prompt_file import read_prompt_file

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "target").is_dir(), reason="no embedded set in this build")


def test_embedded_target_loads_and_continues_code():
    models = load_model_set(DEFAULT_MODEL_DIR)
    target = models.target
    assert target.config.family == "qwen3" and target.tokenizer is not None and target.eos_ids == (0,)
    assert target.tokenizer.token_to_id("<|mask|>") == 2
    out = target.generate(["def fibonacci(n):\n"], 24)
    assert len(out.tokens[0]) >= 1 and out.finish_reasons[0] in ("eos", "length")
    assert out.texts[0].strip(), "the default target should continue code with some text"


def test_embedded_prompt_set_parses():
    records = read_prompt_file(DEFAULT_MODEL_DIR / "prompts_heldout.jsonl")
    assert len(records) >= 100 and all(r.prompt.lstrip().startswith("def ") for r in records)
