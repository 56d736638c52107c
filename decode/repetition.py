"""How much of tau comes from repeated text.

Greedy continuations of small models loop, and a loop is easy to draft. A
generated token is a *repeat* when the n-gram it completes (its n - 1
predecessors and itself, prompt included) already occurred earlier in the
sequence; a round is a *copy round* when every token it emitted is a repeat.
tau over the other rounds ("novel" rounds) is the acceptance a drafter earns
on text it cannot copy.
"""

from __future__ import annotations

from collections.abc import Sequence

REPEAT_NGRAM = 4


def repeat_mask(prompt: Sequence[int], generated: Sequence[int], n: int = REPEAT_NGRAM) -> list[bool]:
    """mask[i]: generated[i] completes an n-gram seen earlier in prompt + generated."""
    seq = list(prompt) + list(generated)
    seen: set[tuple[int, ...]] = set()
    mask = []
    for i in range(len(seq)):
        gram = tuple(seq[i - n + 1: i + 1]) if i >= n - 1 else None
        if i >= len(prompt):
            mask.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return mask


def split_rounds(accepted_lengths: Sequence[int], mask: Sequence[bool]) -> list[tuple[int, bool]]:
    """(accepted length, is copy round) per round.

    Token 0 comes from prefill; round r emitted the next accepted_lengths[r]
    tokens (the last round may be trimmed by EOS or max_new_tokens).
    """
    rounds, start = [], 1
    for a in accepted_lengths:
        span = mask[start: start + a]
        rounds.append((a, bool(span) and all(span)))
        start += a
    return rounds


def repetition_stats(prompts_ids, tokens, accepted_lengths, n: int = REPEAT_NGRAM) -> dict[str, float]:
    """Repeat share of the text and tau split into copy / novel rounds, over a whole prompt set."""
    n_tok = n_rep = 0
    rounds = []
    for prompt, gen, acc in zip(prompts_ids, tokens, accepted_lengths):
        mask = repeat_mask(prompt, gen, n)
        n_tok, n_rep = n_tok + len(mask), n_rep + sum(mask)
        rounds += split_rounds(acc, mask)
    copy = [a for a, is_copy in rounds if is_copy]
    novel = [a for a, is_copy in rounds if not is_copy]
    accepted = sum(a for a, _ in rounds)
    return {
        "repeat_ngram": n,
        "repeat_token_fraction": n_rep / max(n_tok, 1),
        "copy_round_fraction": len(copy) / max(len(rounds), 1),
        "copy_accepted_fraction": sum(copy) / max(accepted, 1),
        "tau_copy_rounds": sum(copy) / len(copy) if copy else float("nan"),
        "tau_novel_rounds": sum(novel) / len(novel) if novel else float("nan"),
    }
