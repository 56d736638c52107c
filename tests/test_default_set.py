"""The embedded default model set that ships in the package."""

from __future__ import annotations

import json

import numpy as np
import pytest

from taps_jax.decoder import DEFAULT_MODEL_DIR, SpeculativeDecoder, load_model_set
from taps_jax.prompt_file import read_prompt_file


@pytest.fixture(scope="module")
def models():
    return load_model_set(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts():
    return [r.prompt for r in read_prompt_file(DEFAULT_MODEL_DIR / "prompts_heldout.jsonl")]


def test_embedded_set_is_complete_and_float32_by_default(models):
    target = models.target
    assert models.drafter is not None and models.scorer is not None and models.greedy_scorer is not None
    assert models.scorer.training["labels"] == "sampled" and models.greedy_scorer.training["labels"] == "greedy"
    assert target.config.family == "qwen3" and target.tokenizer is not None and target.eos_ids == (0,)
    assert target.tokenizer.token_to_id("<|mask|>") == models.drafter.config.mask_token_id == 2
    assert target.params["embed_tokens"]["embedding"].get_value().dtype == np.float32  # stored bf16, run f32
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.rglob("*") if f.is_file())
    assert size <= 40 * 2**20, f"the embedded set is {size / 2**20:.1f} MiB; it must stay <= 40 MiB"
    report = json.loads((DEFAULT_MODEL_DIR / "report.json").read_text())
    assert {"losses", "greedy", "sampled"} <= set(report)


def test_embedded_target_continues_code(models):
    out = models.target.generate(["def fibonacci(n):\n"], 24)
    assert len(out.tokens[0]) >= 1 and out.finish_reasons[0] in ("eos", "length")
    assert out.texts[0].strip(), "the default target should continue code with some text"


def test_embedded_prompt_set_parses(prompts):
    assert len(prompts) >= 100 and all(p.lstrip().startswith("def ") for p in prompts)


def test_embedded_drafter_beats_one_token_per_round_losslessly(models, prompts):
    batch = prompts[:4]
    ar = SpeculativeDecoder(models.target, None, "ar").generate(batch, 48)
    taps = SpeculativeDecoder(models.target, models.drafter, "taps", 16, scorer=models.scorer_for(0.0)).generate(batch, 48)
    assert taps.tokens == ar.tokens
    assert taps.stats["tau"] > 2.0, "the trained drafter should accept well over one token per round"


def test_bfloat16_is_finite_and_keeps_tau_within_10_percent(models, prompts):
    """Issue 8: bf16 runs are finite and accept about as much as float32 (ddtree, budget 16).

    Measured pairwise on the same text: greedy trajectories of a bf16 target
    drift from float32 ones (different loops), so an unpaired tau on a few
    prompts is noise (8 prompts: f32 3.68 vs bf16 4.11; 32 prompts: 3.52 vs
    3.28). The bf16 run is split into its two parts instead: the bf16 drafter
    drafting for the float32 target (same tokens, so tau is paired) and the
    bf16 target's greedy choice on float32 text.
    """
    bf16 = load_model_set(DEFAULT_MODEL_DIR, dtype="bfloat16")
    batch = prompts[:8]
    ids = bf16.target.encode(batch[:1])
    assert np.isfinite(np.asarray(bf16.target.logits(np.asarray(ids)), np.float32)).all()
    run = SpeculativeDecoder(bf16.target, bf16.drafter, "ddtree", 16).generate(batch[:4], 32)
    assert all(len(t) > 0 for t in run.tokens) and run.stats["tau"] > 2.0  # the whole bf16 set decodes

    f32 = SpeculativeDecoder(models.target, models.drafter, "ddtree", 16).generate(batch, 64)
    mixed = SpeculativeDecoder(models.target, bf16.drafter, "ddtree", 16).generate(batch, 64)
    assert mixed.tokens == f32.tokens  # lossless: the float32 target decides every token
    taus = {"float32": f32.stats["tau"], "bfloat16 drafter": mixed.stats["tau"]}
    assert abs(taus["bfloat16 drafter"] - taus["float32"]) <= 0.1 * taus["float32"], taus

    agree = total = 0
    for prompt_ids, new in zip(models.target.encode(batch), f32.tokens):
        seq = np.asarray([list(prompt_ids) + list(new)])
        want = np.asarray(models.target.logits(seq), np.float32).argmax(-1)
        got = np.asarray(bf16.target.logits(seq), np.float32).argmax(-1)
        agree, total = agree + int((want == got).sum()), total + want.size
    assert agree / total >= 0.97, f"bf16 target picks the float32 argmax at only {agree / total:.1%} of positions"
