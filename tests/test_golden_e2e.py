"""Greedy chain / ddtree generation reproduces the published references exactly.

The golden pair and outputs come from the public DFlash drafter and DDTree
code (tests/golden/README.md). The references loop while the committed
length is below prompt + 48, so their last round may start with 47 tokens
committed; our loop counts the pending bonus as generated, so we ask for 49
tokens to run the same rounds, then compare the first 48.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from taps_jax import load_target
from taps_jax.decoder import SpeculativeDecoder, load_drafter

GOLDEN = Path(__file__).resolve().parent / "golden" / "ddtree-tiny"  # in the repository: the tests never skip


@pytest.fixture(scope="module")
def pair():
    return load_target(GOLDEN / "target"), load_drafter(GOLDEN / "drafter"), np.load(GOLDEN / "golden.npz")


def _check(decoder, prompt, want_ids, want_lengths):
    res = decoder.generate([prompt.tolist()], 49, stop_at_eos=False)
    new = len(want_ids) - len(prompt)
    assert res.tokens[0][:new] == want_ids[len(prompt):].tolist()
    assert res.stats["accepted_lengths"][0] == want_lengths.tolist()


@pytest.mark.parametrize("j", [0, 1, 2])
def test_ddtree_matches_reference(pair, j):
    target, drafter, g = pair
    budget = int(g[f"e2e{j}_budget"])
    dec = SpeculativeDecoder(target, drafter, "ddtree", budget)
    _check(dec, g[f"e2e{j}_prompt"][0], g[f"e2e{j}_output_ids"][0], g[f"e2e{j}_acceptance_lengths"])


def test_chain_matches_reference(pair):
    target, drafter, g = pair
    dec = SpeculativeDecoder(target, drafter, "chain", drafter.config.block_size - 1)
    _check(dec, g["chain_prompt"][0], g["chain_output_ids"][0], g["chain_acceptance_lengths"])
