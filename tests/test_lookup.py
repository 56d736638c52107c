"""Prompt lookup in the draft: the match, the continuation, the mix, the fitted weights, and exactness."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from spec_helpers import assert_follows, tiny_pair, two_token_law
from taps_jax.decoder import SpeculativeDecoder
from taps_jax.engine.adaptive import AdaptiveConfig
from taps_jax.tree.lookup import (LookupConfig, LookupTable, continuation, lookup_draft, match_lengths,
                                  mix)
from train.lookup_table import count_texts


def _runs_reference(text, n, longest):
    """{end j: m} for every earlier end j < n - 1: how many of text[:n]'s last tokens (<= longest) also end at j."""
    runs = {}
    for j in range(n - 1):
        m = 0
        while m < longest and j - m >= 0 and text[j - m] == text[n - 1 - m]:
            m += 1
        runs[j] = m
    return runs


def _random_text(seed=0, rows=16, length=40):
    rng = np.random.default_rng(seed)
    text = rng.integers(0, 3, size=(rows, length))
    text[3, :20] = text[3, 20:]  # a long repeat
    lengths = rng.integers(0, length + 1, size=rows)
    lengths[3] = length
    return text, lengths


def test_match_lengths_against_a_reference():
    text, lengths = _random_text()
    got = np.asarray(match_lengths(jnp.asarray(text, jnp.int32), jnp.asarray(lengths, jnp.int32), 8))
    want = [max(_runs_reference(text[b].tolist(), int(lengths[b]), 8).values(), default=0) for b in range(16)]
    np.testing.assert_array_equal(got, want)
    assert got[3] == 8


def test_continuation_is_what_followed_the_latest_longest_match():
    text, lengths = _random_text(seed=1)
    H = 6
    q, cont, valid = (np.asarray(x) for x in continuation(jnp.asarray(text, jnp.int32),
                                                          jnp.asarray(lengths, jnp.int32), 8, H))
    for b in range(len(text)):
        n = int(lengths[b])
        runs = _runs_reference(text[b].tolist(), n, 8)
        best = max(runs.values(), default=0)
        assert q[b] == best
        if best == 0:
            assert not valid[b].any()
            continue
        end = max(j for j, m in runs.items() if m == best)  # the latest of the longest
        for h in range(H):
            src = end + 1 + h
            assert valid[b, h] == (src < n)
            if src < n:
                assert cont[b, h] == text[b, src]


def test_mix_is_a_distribution_that_keeps_the_draft_where_the_weight_is_zero():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
    cont = jnp.asarray([[4, 0, 6], [1, 1, 2]], jnp.int32)
    w = jnp.asarray([[0.0, 0.9, 0.3], [0.5, 0.0, 0.999]], jnp.float32)
    out = np.asarray(mix(logits, cont, w))
    p = np.exp(np.asarray(logits) - np.asarray(logits).max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (1 - np.asarray(w))[..., None] * p + np.asarray(w)[..., None] * np.eye(7)[np.asarray(cont)]
    np.testing.assert_allclose(np.exp(out), want, rtol=1e-5, atol=1e-7)
    assert np.asarray(out).argmax(-1)[0, 1] == 0 and np.asarray(out).argmax(-1)[1, 2] == 2


def test_lookup_draft_boosts_the_repeat_and_leaves_novel_text_alone():
    # Row 0's prompt repeats "1 2 3"; its output ends "1 2": the continuation is 3, 9 (what followed).
    prompt = jnp.asarray([[1, 2, 3, 9, 5, 0], [4, 5, 6, 0, 0, 0]], jnp.int32)
    lens = jnp.asarray([5, 3], jnp.int32)
    out = jnp.asarray([[1, 2, 0, 0], [7, 0, 0, 0]], jnp.int32)
    weights = tuple((0.0,) * 3 if q == 0 else (0.8,) * 3 for q in range(4))
    logits = jnp.zeros((2, 3, 10), jnp.float32)
    got = np.asarray(lookup_draft(LookupConfig(weights), logits, prompt, lens, out, jnp.asarray([2, 1])))
    assert got[0].argmax(-1).tolist() == [3, 9, 5]
    np.testing.assert_allclose(got[1], np.log(np.full((3, 10), 0.1)), rtol=1e-6)  # no match: the draft as is


def test_count_agreement_against_a_reference():
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 4, size=n).tolist() for n in (5, 9, 3)]
    outputs = [rng.integers(0, 4, size=n).tolist() for n in (12, 7, 15)]
    outputs[0][6:12] = outputs[0][0:6]  # a repeat inside the answer
    H, longest = 5, 3
    agreed, tried = count_texts(prompts, outputs, longest=longest, horizon=H)
    want_a, want_t = np.zeros((longest + 1, H)), np.zeros((longest + 1, H))
    for p, o in zip(prompts, outputs):
        text = p + o
        for L in range(len(p) + 1, len(text)):
            runs = _runs_reference(text, L, longest)
            q = max(runs.values(), default=0)
            if q == 0:
                continue
            end = max(j for j, m in runs.items() if m == q)
            for h in range(H):
                src, truth = end + 1 + h, L + h
                if src >= L or truth >= len(text):
                    break
                want_t[q, h] += 1
                if text[src] != text[truth]:
                    break
                want_a[q, h] += 1
    np.testing.assert_array_equal(tried, want_t)
    np.testing.assert_array_equal(agreed, want_a)
    assert agreed.sum() > 0


def test_table_round_trip_and_refusals(tmp_path):
    agreed = {"greedy": [[0, 0], [3, 1]], "sampled": [[0, 0], [1, 0]]}
    tried = {"greedy": [[5, 5], [3, 3]], "sampled": [[5, 5], [3, 1]]}
    LookupTable(agreed, tried, {"prompts": 2}).save(tmp_path / "lookup.json")
    table = LookupTable.load(tmp_path / "lookup.json")
    np.testing.assert_allclose(table.weights(True), [[0, 0], [0.75, 0.25]])  # agreed / (tried + 1); no match: 0
    assert table.config(False).weights == ((0.0, 0.0), (0.25, 0.0))
    (tmp_path / "bad.json").write_text('{"agreed": {}}')
    with pytest.raises(ValueError, match="not a lookup table"):
        LookupTable.load(tmp_path / "bad.json")
    target, drafter = tiny_pair(8, block_size=4)
    with pytest.raises(ValueError, match=r"lookup weights must be \[Q >= 2\]\[H >= 3\]"):
        SpeculativeDecoder(target, drafter, "ddtree", 4, lookup=table)  # H = 2 < the drafter's 3
    with pytest.raises(ValueError, match="lookup must be a LookupTable"):
        SpeculativeDecoder(target, drafter, "ddtree", 4, lookup={"greedy": 1})


PROMPTS = [[3, 1, 4, 1, 5, 3, 1, 4], [6, 2, 6, 2, 6], [5, 3, 5, 0, 1, 7, 2, 3, 2], [2, 7]]


def _strong_table(horizon):
    """Weights that make the continuation every position's top token wherever the text has a match."""
    agreed = [[0.0] * horizon] + [[9.0] * horizon] * 8
    tried = [[0.0] * horizon] + [[9.0] * horizon] * 8
    return LookupTable({"greedy": agreed, "sampled": agreed}, {"greedy": tried, "sampled": tried})


@pytest.mark.parametrize("policy,budget", [("chain", 8), ("ddtree", 8), ("ddtree", 32), ("adaptive", 16)])
def test_greedy_with_lookup_is_lossless(policy, budget):
    target, drafter = tiny_pair(8, eos=(6,))
    want = target.generate(PROMPTS, 40)
    extra = dict(adaptive=AdaptiveConfig((0, 2, 4, 8, 16), force_cycle=True), costs=(1,) * 5) \
        if policy == "adaptive" else {}
    plain = SpeculativeDecoder(target, drafter, policy, budget, **extra).generate(PROMPTS, 40)
    got = SpeculativeDecoder(target, drafter, policy, budget, lookup=_strong_table(15), **extra).generate(PROMPTS, 40)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    assert got.stats["accepted_lengths"] != plain.stats["accepted_lengths"], "the lookup changed no tree"


def test_sampling_with_lookup_follows_the_target_distribution():
    """Chi-square on the first two tokens at T=1 with the continuation dominating every draft."""
    target, drafter = tiny_pair(vocab=6, block_size=4, seed=3)
    prompt = [1, 2, 1, 2, 1]
    dec = SpeculativeDecoder(target, drafter, "ddtree", 4, lookup=_strong_table(3))
    counts = np.zeros((6, 6))
    for seed in range(500):
        for toks in dec.generate([prompt] * 8, 2, temperature=1.0, seed=seed, stop_at_eos=False).tokens:
            counts[toks[0], toks[1]] += 1
    assert_follows(counts, two_token_law(target, prompt, 6))


def test_cli_fits_a_table_the_decoder_takes(tmp_path, capsys):
    from train import lookup_table

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n    return a + b\\n\\n\\ndef add3(a, b, c):\\n"}\n'
                       '{"prompt": "class Point:\\n    def __init__(self, x, y):\\n"}\n')
    out = tmp_path / "lookup.json"
    argv = ["--model", "default", "--prompts", str(prompts), "--max-new-tokens", "24", "--out", str(out)]
    assert lookup_table.main(argv) == 0
    table = LookupTable.load(out)
    assert np.asarray(table.tried["greedy"]).shape == (9, 15) and np.asarray(table.tried["greedy"]).sum() > 0
    assert table.meta["prompts"] == 2
    assert lookup_table.main(["--model", "default", "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
