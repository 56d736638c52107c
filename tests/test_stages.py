"""Stage-by-stage execution equals the fused round; the round inspector."""

from __future__ import annotations

import jax
import numpy as np

from spec_helpers import tiny_pair
from taps_jax.decoder import SpeculativeDecoder
from taps_jax.engine.stages import Stages, first_round, format_tree

PROMPTS = [[3, 1, 4, 1, 5], [6, 2, 6]]


def test_stages_compose_to_the_generate_loop():
    """Running draft -> select -> verify by hand for a few rounds gives generate's tokens."""
    target, drafter = tiny_pair(8)
    dec = SpeculativeDecoder(target, drafter, "ddtree", 16)
    want = dec.generate(PROMPTS, 12)
    stages = Stages.after_prefill(dec, PROMPTS, 12)
    for _ in range(12):
        dcache, draft, hidden = stages.draft()
        tree = stages.select(draft, hidden)
        stages.state, _ = stages.verify(dcache, tree)
    state = jax.device_get(stages.state)
    for b, tokens in enumerate(want.tokens):
        n = int(state.generated_B[b])
        assert n == len(tokens) and state.out_BN[b, :n].tolist() == tokens
        assert state.accepted_BR[b, : state.rounds_B[b]].tolist() == want.stats["accepted_lengths"][b]


def test_first_round_view_is_a_prefix_closed_tree_with_an_accepted_path():
    target, drafter = tiny_pair(8)
    dec = SpeculativeDecoder(target, drafter, "ddtree", 16)
    view = first_round(dec, PROMPTS[0])
    parents, depths, accepted = view["parents"], view["depths"], view["accepted"]
    assert len(view["tokens"]) == 17 and parents[0] == -1 and depths[0] == 0
    assert all(parents[i] < i and depths[i] == depths[parents[i]] + 1 for i in range(1, len(parents)))
    assert accepted[0] == 0 and all(parents[accepted[k]] == accepted[k - 1] for k in range(1, len(accepted)))
    # The accepted path followed by the bonus is what generate emits first.
    res = dec.generate([PROMPTS[0]], 12)
    emitted = [int(view["tokens"][i]) for i in accepted[1:]] + [view["bonus"]]
    assert res.tokens[0][1: 1 + len(emitted)] == emitted
    text = format_tree(view)
    assert text.count("*") == len(accepted) and len(text.splitlines()) >= 2
    assert np.all(depths <= drafter.config.block_size - 1)
