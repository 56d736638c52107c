"""Issue 8, item 2: edge cases of the speculative engine, token-identical to AR greedy (float32).

EOS ids are picked from the models' own greedy output, so the cases hold for
whatever the random weights produce. Shapes repeat across tests (batch
bucket 4, prompt bucket 16, capacity 64, N = 24) so compiles are shared.
"""

from __future__ import annotations

import pytest

from spec_helpers import tiny_pair
from taps_helpers import random_scorer
from taps_jax.api import Target
from taps_jax.decoder import SpeculativeDecoder

VOCAB = 8  # small, so random drafts are often accepted and rounds are long
N, CAP = 24, 64
LONG, SHORT = [5, 3, 5, 0, 1, 7, 2, 3, 2, 4, 6, 1], [2, 7]
PROMPTS = [LONG, SHORT, [3, 1, 4, 1, 5], [6, 2, 6]]


@pytest.fixture(scope="module")
def models():
    return tiny_pair(VOCAB)


@pytest.fixture(scope="module")
def ar(models):
    """AR greedy without EOS: the reference every case is cut from."""
    result = models[0].generate(PROMPTS, N, capacity=CAP)
    assert all(len(t) == N for t in result.tokens)
    return result.tokens


@pytest.fixture(scope="module")
def ddtree(models):
    return SpeculativeDecoder(*models, "ddtree", 16)


def with_eos(target: Target, eos: tuple[int, ...]) -> Target:
    """The same weights with other stop ids (a new wrapper: the shared target stays EOS-free)."""
    return Target(target.model, None, eos)


def ar_until_eos(tokens: list[int], eos) -> tuple[list[int], str]:
    """What AR greedy emits with these stop ids: up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], "eos"
    return tokens, "length"


def round_spans(accepted: list[int]) -> list[tuple[int, int]]:
    """Output positions [start, end) each round emitted (token 0 comes from the prefill)."""
    spans, start = [], 1
    for a in accepted:
        spans.append((start, start + a))
        start += a
    return spans


def pick_eos(tokens, accepted):
    """(eos_first, eos_inside, row_first, row_inside, position of eos_inside) from an EOS-free run.

    eos_first: the first generated token of some row. eos_inside: a token some
    other row emits for the first time in the middle of a round (an accepted
    node with accepted nodes below it), and before which eos_first never occurs.
    """
    for q, (toks, acc) in enumerate(zip(tokens, accepted)):
        for start, end in round_spans(acc):
            for pos in range(start, min(end - 1, len(toks))):  # end - 1: not the round's last token
                t = toks[pos]
                if t in toks[:pos]:
                    continue
                for p, other in enumerate(tokens):
                    if p != q and other[0] not in toks[:pos]:
                        return other[0], t, p, q, pos
    return None


def test_eos_first_token_and_inside_an_accepted_path(models, ar, ddtree):
    target, drafter = models
    free = ddtree.generate(PROMPTS, N, capacity=CAP)
    assert free.tokens == ar
    picked = pick_eos(free.tokens, free.stats["accepted_lengths"])
    assert picked, f"no round accepted a new token before its last one: {free.stats['accepted_lengths']}"
    eos_first, eos_inside, p, q, pos = picked
    eos = (eos_first, eos_inside)

    spec = SpeculativeDecoder(with_eos(target, eos), drafter, "ddtree", 16).generate(PROMPTS, N, capacity=CAP)
    want = [ar_until_eos(t, eos) for t in ar]
    assert spec.tokens == [w[0] for w in want]
    assert spec.finish_reasons == [w[1] for w in want]

    # Row p: EOS is the very first generated token; no round runs.
    assert spec.tokens[p] == [eos_first] and spec.finish_reasons[p] == "eos"
    assert spec.stats["rounds"][p] == 0
    # Row q: its last round accepted nodes past the EOS, and none of them was emitted.
    assert spec.tokens[q] == ar[q][: pos + 1] and spec.finish_reasons[q] == "eos"
    accepted = spec.stats["accepted_lengths"][q]
    assert 1 + sum(accepted) > len(spec.tokens[q]), (accepted, spec.tokens[q])


def test_padded_slot_and_batch_of_one(models, ar, ddtree):
    # 3 prompts ride in a batch of 4: the padded slot must not leak into the results.
    three = ddtree.generate(PROMPTS[:3], N, capacity=CAP)
    assert three.tokens == ar[:3]
    assert three.finish_reasons == ["length"] * 3
    assert len(three.stats["rounds"]) == len(three.stats["accepted_lengths"]) == 3
    # A batch of one (no padding at all), on the cheaper chain policy.
    one = SpeculativeDecoder(*models, "chain", 16).generate(PROMPTS[2:3], N, capacity=CAP)
    assert one.tokens == ar[2:3] and one.finish_reasons == ["length"]


@pytest.mark.parametrize("policy", ["chain", "taps"])
def test_max_new_tokens_smaller_than_a_round(models, ar, policy):
    """N = 2 while the first round alone accepts more: the output is cut exactly.

    (ddtree with N = 1, 2, 3 is in test_speculative.py.)
    """
    target, drafter = models
    scorer = random_scorer(target, drafter) if policy == "taps" else None
    n = 2
    # Three prompts: the batch of 4 has a padded slot, which must not leak either.
    res = SpeculativeDecoder(target, drafter, policy, 16, scorer=scorer).generate(PROMPTS[:3], n, capacity=CAP)
    assert res.tokens == [t[:n] for t in ar[:3]]
    assert res.finish_reasons == ["length"] * 3
    # The prefill token plus the first round's accepted nodes overshoot N somewhere.
    assert any(1 + acc[0] > n for acc in res.stats["accepted_lengths"]), res.stats["accepted_lengths"]


def test_the_tree_is_all_the_headroom_a_call_needs(models, ar):
    """A running sequence keeps at most prompt + N - 2 tokens in its cache (the
    last token emitted is pending), so a cache of the longest prompt + N + T - 2
    slots lets every sequence reach N: the decoder's default capacity (prompt +
    N + T, bucketed) has room to spare."""
    for policy, T in (("chain", 8), ("ddtree", 17)):
        dec = SpeculativeDecoder(*models, policy, 16)
        assert dec.tree.tree_size(dec.horizon) == T
        res = dec.generate(PROMPTS, N, capacity=len(LONG) + N + T - 2)
        assert res.tokens == ar and res.finish_reasons == ["length"] * 4, policy


def test_capacity_stops_one_sequence_while_the_other_goes_on(models, ar):
    """With a 32-slot cache the 12-token prompt runs out of room; the 2-token one does not.

    A round needs room for its whole tree (T = 8 slots for chain with H = 7),
    so a sequence stops with `capacity` once committed + T > capacity; what it
    emitted up to then is AR's greedy output.
    """
    target, drafter = models
    cap, T = 32, 8
    dec = SpeculativeDecoder(target, drafter, "chain", 16)
    assert dec.tree.tree_size(dec.horizon) == T
    res = dec.generate([LONG, SHORT], N, capacity=cap)
    assert res.finish_reasons == ["capacity", "length"]
    assert res.tokens[1] == ar[1]
    long = res.tokens[0]
    assert long == ar[0][: len(long)]
    # Committed = prompt + emitted - 1 (the last token is pending). It stopped
    # because one more tree would not fit, and it never overflowed the cache.
    committed = len(LONG) + len(long) - 1
    assert committed + T > cap
    assert committed <= cap
    assert len(long) < N
