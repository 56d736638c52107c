"""Per-stage timing placeholder (replaced once the round is split into stages)."""

from __future__ import annotations


def stage_times_ms(decoder, prompts, max_new_tokens) -> dict:
    return {}
