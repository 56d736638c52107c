"""The repeated-text split of tau used by taps-bench."""

import math

from decode.repetition import repeat_mask, repetition_stats, split_rounds


def test_repeat_mask_marks_ngrams_seen_before():
    # prompt 1 2 3 4; generated 1 2 3 4 5: only the second 4 completes an earlier 4-gram (1 2 3 4).
    assert repeat_mask([1, 2, 3, 4], [1, 2, 3, 4, 5], n=4) == [False, False, False, True, False]
    # A period-2 loop repeats 3-grams once one full period follows the prompt.
    assert repeat_mask([7, 8], [7, 8, 7, 8], n=3) == [False, False, True, True]
    assert repeat_mask([], [5, 5, 5], n=2) == [False, False, True]


def test_split_rounds_follows_emitted_spans():
    # Token 0 is the prefill token; rounds then emit 2 and 3 tokens.
    mask = [False, True, True, True, False, True]
    assert split_rounds([2, 3], mask) == [(2, True), (3, False)]
    # A round trimmed by max_new_tokens only sees the tokens that were emitted.
    assert split_rounds([2, 4], mask[:4]) == [(2, True), (4, True)]


def test_repetition_stats_split_tau():
    prompts = [[1, 2]]
    gen = [[1, 2, 1, 2, 1, 2, 9]]  # n=2: the loop tokens repeat, 9 is new
    stats = repetition_stats(prompts, gen, [[3, 3]], n=2)
    # mask F T T T T T F; rounds: tokens 1..3 all repeat (copy), tokens 4..6 end in the new 9 (novel).
    assert stats["copy_round_fraction"] == 0.5
    assert stats["tau_copy_rounds"] == 3 and stats["tau_novel_rounds"] == 3
    assert stats["copy_accepted_fraction"] == 0.5
    assert math.isclose(stats["repeat_token_fraction"], 5 / 7)
    empty = repetition_stats([[1]], [[2]], [[]], n=2)
    assert math.isnan(empty["tau_copy_rounds"]) and empty["copy_round_fraction"] == 0
