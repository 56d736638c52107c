"""Continuous batching (`taps_jax.engine.refill`, `calls.Refilled`): a finished row takes the next prompt.

Every prompt's tokens must be its batch-1 decode, whichever row it ran in
and whatever ran beside it (rows refilled while neighbours are mid-way
through their rounds, with pending drafter context), with one compile per
program; a refilled row samples from the target's law.
"""

from __future__ import annotations

import numpy as np
import pytest

from spec_helpers import assert_follows, tiny_pair, two_token_law
from taps_helpers import random_scorer
from taps_jax.calls import refilled
from taps_jax.decoder import SpeculativeDecoder
from taps_jax.engine import calibrate
from taps_jax.engine.adaptive import AdaptiveConfig
from taps_jax.engine.ar import ar_refill, ar_start, ar_until
from taps_jax.engine.speculative import spec_refill, spec_until

VOCAB = 16
EOS = (6,)
# Mixed prompt lengths (1 to 19 tokens); with EOS 6 their answers stop at mixed lengths.
PROMPTS = [[(3 * i + j) % (VOCAB - 1) for j in range(1 + (7 * i) % 19)] for i in range(14)]


@pytest.fixture(autouse=True)
def _private_cost_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "_memory", {})


_ALONE = {}


def alone(target, prompts, n):
    """Each prompt's greedy AR decode in a batch of one (kept: every test compares against the same)."""
    for p in prompts:
        if (id(target), tuple(p), n) not in _ALONE:
            r = target.generate([p], n)
            _ALONE[id(target), tuple(p), n] = r.tokens[0], r.finish_reasons[0]
    return [_ALONE[id(target), tuple(p), n] for p in prompts]


def decode_all(decoder, prompts, n, rows, refill_rows, **options):
    run = refilled(decoder, prompts, n, rows=rows, refill_rows=refill_rows, **options)
    done = [f for chunk in run for f in chunk]
    assert sorted(f.index for f in done) == list(range(len(prompts)))  # every prompt exactly once
    by_index = {f.index: f for f in done}
    return [(by_index[i].tokens, by_index[i].finish_reason) for i in range(len(prompts))], run, done


@pytest.mark.parametrize("rows, refill_rows", [(4, 1), (4, 2), (8, 3)])
def test_ar_rows_refilled_decode_as_alone(rows, refill_rows):
    target, _ = tiny_pair(VOCAB, eos=EOS)
    want = alone(target, PROMPTS, 24)
    got, run, done = decode_all(target, PROMPTS, 24, rows, refill_rows)
    assert got == want
    reasons = {r for _, r in want}
    assert reasons == {"eos", "length"}  # mixed answer lengths
    assert run.refills >= -(-(len(PROMPTS) - rows) // refill_rows)
    assert 0 < run.utilisation <= 1 and run.row_steps == sum(len(t) - 1 for t, _ in want)
    # Completion order is not input order: rows that stop early hand out first.
    assert [f.index for f in done] != sorted(f.index for f in done)


def test_ar_refill_never_retraces():
    target, _ = tiny_pair(VOCAB, eos=EOS)
    programs = (ar_start, ar_until, ar_refill)
    before = [f._cache_size() for f in programs]
    run = decode_all(target, PROMPTS, 20, 4, 2)[1]
    sizes = [f._cache_size() for f in programs]
    # One compile each; the refill once per refill prompt bucket (16 and 32 here: short prompts prefill short).
    assert run.refills >= 5 and all(after - was <= most for was, after, most in zip(before, sizes, (1, 1, 2)))
    # Other prompts of the same buckets, in another order: the same three programs, however many refills.
    decode_all(target, PROMPTS[::-1][:11], 20, 4, 2)
    assert [f._cache_size() for f in programs] == sizes


def watch_refills(run):
    """Record, at each refill, how many running rows not refilled hold pending drafter context (mid-rounds)."""
    seen, call = [], run.call
    inner = call._call

    def spy(name, *args):
        if name == "refill":
            state, rows = args[-4], np.asarray(args[-1])
            running = np.asarray(state.finish_B) == 0
            pending = np.asarray(state.ctx_count_B) > 0
            seen.append(int((running & pending & ~np.isin(np.arange(len(running)), rows)).sum()))
        return inner(name, *args)

    call._call = spy
    return seen


@pytest.mark.parametrize("policy, budget", [("chain", 8), ("ddtree", 12)])
def test_speculative_rows_refilled_decode_as_alone(policy, budget):
    target, drafter = tiny_pair(VOCAB, eos=EOS)
    want = alone(target, PROMPTS, 24)
    dec = SpeculativeDecoder(target, drafter, policy, budget)
    run = refilled(dec, PROMPTS, 24, rows=4, refill_rows=1)
    seen = watch_refills(run)
    done = [f for chunk in run for f in chunk]
    assert [(f.tokens, f.finish_reason) for f in sorted(done, key=lambda f: f.index)] == want
    assert len(seen) >= len(PROMPTS) - 4 and min(seen) >= 1  # every refill landed beside rows mid-way
    assert max(x for f in done for x in f.accepted_lengths) >= 2  # tree rounds accepted drafts
    before = (spec_until._cache_size(), spec_refill._cache_size())
    decode_all(dec, PROMPTS[3:], 24, 4, 1)
    assert (spec_until._cache_size(), spec_refill._cache_size()) == before


def test_adaptive_and_taps_rows_refilled_decode_as_alone():
    """Adaptive switches budget (AR runs and trees) every round for the whole batch, across refills; TAPS trees."""
    target, drafter = tiny_pair(VOCAB, eos=EOS)
    want = alone(target, PROMPTS, 24)
    cycle = AdaptiveConfig((0, 8), force_cycle=True)
    dec = SpeculativeDecoder(target, drafter, "adaptive", 8, adaptive=cycle, costs=(1, 1))
    got, _, done = decode_all(dec, PROMPTS, 24, 4, 2)
    assert got == want and max(x for f in done for x in f.accepted_lengths) >= 2
    taps = SpeculativeDecoder(target, drafter, "taps", 4, scorer=random_scorer(target, drafter, seed=1))
    assert decode_all(taps, PROMPTS[:9], 24, 4, 1)[0] == want[:9]


def test_refilled_rows_follow_the_target_law():
    """Temperature 1, two tokens per prompt: every row is refilled every other step; (first, second) token
    counts of many copies of one prompt match the target's exact two-token law."""
    target, drafter = tiny_pair(8)
    prompt = [1, 2, 3]
    law = two_token_law(target, prompt, 8)
    for decoder in (target, SpeculativeDecoder(target, drafter, "ddtree", 6)):
        run = refilled(decoder, [prompt] * 600, 2, rows=8, refill_rows=4, temperature=1.0, seed=3)
        counts = np.zeros((8, 8))
        for f in (f for chunk in run for f in chunk):
            counts[f.tokens[0], f.tokens[1]] += 1
        assert counts.sum() == 600 and run.refills >= (600 - 8) // 4
        assert_follows(counts.ravel(), law.ravel())


def test_fewer_prompts_than_rows_and_one_prompt():
    target, _ = tiny_pair(VOCAB, eos=EOS)
    for prompts in (PROMPTS[:3], PROMPTS[5:6]):
        assert decode_all(target, prompts, 24, 4, 2)[0] == alone(target, prompts, 24)


def test_refilled_rows_on_a_model_sharded_mesh():
    """A (1, 2) mesh: params over "model", the batch whole on "data"; refills place their rows the same way.
    (A data axis > 1 keeps jobs on static batches.)"""
    from taps_jax import sharding

    target, _ = tiny_pair(VOCAB, eos=EOS)
    dec = SpeculativeDecoder(target, None, "ar", mesh=sharding.make_mesh(1, 2))
    assert decode_all(dec, PROMPTS[:9], 24, 4, 2)[0] == alone(target, PROMPTS[:9], 24)


def test_bad_refill_settings_are_one_line_errors():
    from decode import cli

    target, _ = tiny_pair(VOCAB, eos=EOS)
    for kwargs, message in [(dict(rows=4, refill_rows=5), r"refill_rows must be an integer in \[1, 4\]"),
                            (dict(rows=4, refill_rows=0), r"refill_rows must be an integer in \[1, 4\]"),
                            (dict(rows=0, refill_rows=1), "rows must be a positive integer")]:
        with pytest.raises(ValueError, match=message):
            refilled(target, PROMPTS, 8, **kwargs)
    for argv, message in [(["--prompt", "x", "--static-batches"], "--static-batches is for job mode"),
                          (["--prompts", "in.jsonl", "--out", "o.jsonl", "--refill-rows", "9"],
                           "--refill-rows 9 is more than --batch-size 8"),
                          (["--prompts", "in.jsonl", "--out", "o.jsonl", "--refill-rows", "2", "--static-batches"],
                           "--refill-rows is for continuous batching")]:
        with pytest.raises(ValueError, match=message):
            cli.check_args(cli.build_parser().parse_args(argv))
