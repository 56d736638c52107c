"""Chat sessions keep their caches between turns: each turn prefills only its new tokens, compiles nothing after
the session opens, and decodes exactly what a fresh call on the whole conversation decodes."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest

from spec_helpers import assert_follows, tiny_pair, two_token_law
from taps_jax import compile_cache
from taps_jax.decoder import SpeculativeDecoder
from taps_jax.engine.adaptive import AdaptiveConfig

VOCAB = 8  # small, so random drafts often match and rounds accept several tokens
USER_TURNS = [[3, 1, 4, 1, 5, 2, 6], [6, 2, 6], [5, 3, 5, 0, 1, 7, 2, 3, 2, 4, 4, 1, 0, 2, 6, 5, 3, 1, 7, 7], [2]]


def _decoder(policy: str):
    target, drafter = tiny_pair(VOCAB)
    if policy == "ar":
        return target
    if policy == "adaptive":  # rounds cheap enough that trees are chosen, and the probe schedule moves
        budgets = AdaptiveConfig.for_budget(8).budgets
        return SpeculativeDecoder(target, drafter, "adaptive", 8, costs=[1.0 + 0.1 * b for b in budgets])
    return SpeculativeDecoder(target, drafter, policy, 8)


@pytest.mark.parametrize("policy", ["ar", "ddtree", "adaptive"])
def test_turns_equal_fresh_calls_and_prefill_only_new_tokens(policy, monkeypatch):
    """Four turns, each the conversation so far + the answer + a new user message (a turn's answer of 20 tokens
    ends by length, so the cache holds tokens past what the history keeps too): every turn's greedy tokens are a
    fresh greedy AR call's on the whole conversation, and its prefill covers only what the cache did not hold."""
    target = tiny_pair(VOCAB)[0]
    session = _decoder(policy).session(20, context=200, chunk=16)
    session.compile()
    compiles = []
    monkeypatch.setattr(compile_cache, "announce", lambda *a: compiles.append(a))
    conversation, held = [], 0
    for i, user in enumerate(USER_TURNS):
        conversation = conversation + user
        result = session.send(conversation)
        assert result.tokens == target.generate([conversation], 20).tokens, i
        assert result.stats["cached_tokens"] == held, i
        assert result.stats["prefill_tokens"] == len(conversation) - held, i
        if policy != "ar":
            assert result.stats["tau"] > 1.0, i  # trees ran and accepted: the drafter's context went on too
        conversation = conversation + result.tokens[0]
        held = len(conversation) - 1  # all but the last answer token, which the target has not seen yet
    assert not [c for c in compiles if "extend" in c[1]] and session.turns == 4  # (the references compile theirs)


def test_a_changed_history_prefills_from_where_it_differs():
    """A turn whose prompt rewrites part of what the cache holds (a template that renders an answer otherwise, a
    user who edits a message) runs from the first differing token, and decodes as a fresh call."""
    target = tiny_pair(VOCAB)[0]
    session = _decoder("ddtree").session(12, context=128, chunk=16)
    first = session.send(USER_TURNS[0])
    edited = USER_TURNS[0][:3] + [7, 7] + first.tokens[0][:5]
    result = session.send(edited)
    assert result.stats["cached_tokens"] == 3 and result.stats["prefill_tokens"] == len(edited) - 3
    assert result.tokens == target.generate([edited], 12).tokens
    # The same prompt again: only its last token runs (a turn needs the logits there).
    again = session.send(edited)
    assert again.stats["prefill_tokens"] == 1 and again.tokens == result.tokens


def test_a_streamed_turn_ends_with_the_sent_one():
    session, other = (_decoder("ddtree").session(16, context=128, chunk=16) for _ in range(2))
    snapshots = list(session.turn(USER_TURNS[0], chunk=1))
    assert len(snapshots) > 2 and snapshots[0].finish_reasons == ["running"]
    assert snapshots[-1].tokens == other.send(USER_TURNS[0]).tokens


def test_sampled_turns_follow_the_target_law():
    """T = 1: every turn after the first reuses the cached prefix and prefills the rest; its first two tokens
    follow the target's exact law given the whole prompt (chi-square over 1,500 turns of one session)."""
    target, drafter = tiny_pair(6)
    session = SpeculativeDecoder(target, drafter, "ddtree", 8).session(2, context=64, chunk=8, temperature=1.0,
                                                                      seed=3)
    base, prompt = [1, 2, 3, 4, 5, 0, 1, 2, 3], [1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    session.send(base)
    counts = np.zeros((6, 6))
    for _ in range(1500):
        tokens = session.send(prompt).tokens[0]
        counts[tokens[0], tokens[1]] += 1
    assert_follows(counts, two_token_law(target, prompt, 6))


def test_sizes_and_overflow_are_refused_before_any_work(no_tracing):
    target = tiny_pair(VOCAB)[0]  # max_position_embeddings 4096 (ModelConfig's default)
    limit = target.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"context of at most {limit - 16}"):
        target.session(8, context=limit, chunk=16)
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        target.session(64, context=64, chunk=16)
    with pytest.raises(ValueError, match="context must be a positive integer"):
        target.session(8, context=0)
    session = target.session(8, context=32, chunk=16)
    with pytest.raises(ValueError, match="needs 33 of the session's 32 context tokens: start a new session"):
        session.send(list(range(5)) * 5)
    assert session.turns == 0


@pytest.fixture(scope="module")
def chat_target_dir(tmp_path_factory):
    """A 2-layer random target with the default set's tokenizer and a chat template (what --chat needs)."""
    from flax import nnx

    from taps_jax.api import Target
    from taps_jax.checkpoints.tokenizer import Tokenizer
    from taps_jax.config import ModelConfig
    from taps_jax.decoder import DEFAULT_MODEL_DIR
    from taps_jax.models.transformer import Transformer

    path = tmp_path_factory.mktemp("session") / "target"
    cfg = ModelConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, tie_embeddings=True)
    tokenizer = Tokenizer.from_file(DEFAULT_MODEL_DIR / "target" / "tokenizer.json")
    Target(Transformer(cfg, nnx.Rngs(0)), tokenizer, ()).save(path)
    template = ("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}<|endoftext|>\n{% endfor %}"
                "{% if add_generation_prompt %}### assistant:\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    return path


def test_cli_session_of_six_turns_compiles_once_and_prefills_new_tokens(chat_target_dir, monkeypatch, capsys):
    """taps-decode --chat on stdin: six answers, each a fresh chat call's on the conversation so far; --stats
    shows no compile wait after the first turn and a prefill of only the turn's new tokens."""
    import taps_jax
    from decode import cli

    turns = ["Write a function that adds two numbers.", "Now make it multiply.", "Add a docstring.",
             "Write a test for it.", "What is its complexity?", "Thanks!"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in turns)))
    argv = ["--target", str(chat_target_dir), "--chat", "--policy", "ar", "--max-new-tokens", "16", "--stats",
            "--context", "512"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    stats = [dict(kv.split("=") for kv in line.split()[1:]) for line in captured.err.splitlines()
             if line.startswith("[ar]")]
    assert len(stats) == 6
    assert float(stats[0]["compile_s"]) > 0 and all(float(s["compile_s"]) == 0 for s in stats[1:])
    target, messages, answers, last_prompt = taps_jax.load_target(chat_target_dir), [], [], 0
    for i, (text, s) in enumerate(zip(turns, stats)):
        messages.append({"role": "user", "content": text})
        prompt = len(target.encode([messages])[0])
        want = target.chat(messages, 16)
        answers.append(want.texts[0])
        messages.append({"role": "assistant", "content": want.texts[0]})
        # The cache keeps at least the last turn's prompt (a random model's answer text may re-encode to other ids
        # than it generated, and the template's last token may merge with it; SmolLM2's re-encode exactly: the
        # figures in docs/cli.md) and at most that prompt and its answer but the last token.
        assert max(last_prompt - 1, 0) <= int(s["cached_tokens"]) <= max(last_prompt + 15, 0), i
        assert int(s["cached_tokens"]) + int(s["prefill_tokens"]) == prompt, i
        last_prompt = prompt
    assert captured.out == "".join(a + "\n" for a in answers)


def test_cli_context_is_only_for_a_session():
    from decode import cli

    for argv in (["--prompt", "hi", "--context", "64"], ["--chat", "--prompt", "hi", "--context", "64"]):
        with pytest.raises(ValueError, match="--context sizes an interactive chat session"):
            cli.check_args(cli.build_parser().parse_args(argv))
    cli.check_args(cli.build_parser().parse_args(["--chat", "--context", "64"]))
