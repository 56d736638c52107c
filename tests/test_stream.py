"""Ahead-of-time compile, one decode per prompt, and streaming (same tokens as one generate)."""

from __future__ import annotations

import inspect

import jax
import pytest

import taps_jax.decoder as decoder_module
from decode import cli
from taps_jax.calls import GenerateCall
from taps_jax.engine.adaptive import AdaptiveConfig
from taps_jax.decoder import DEFAULT_MODEL_DIR, SpeculativeDecoder, load_model_set
from spec_helpers import primitives

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):"]


@pytest.fixture(scope="module")
def models():
    return load_model_set(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("policy", ["ar", "ddtree", "taps"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_ends_with_generate_and_only_grows(models, policy, temperature):
    scorer = models.scorer_for(temperature) if policy == "taps" else None
    dec = SpeculativeDecoder(models.target, models.drafter, policy, 16, scorer=scorer)
    options = dict(temperature=temperature, seed=7)
    whole = dec.generate(PROMPTS, 24, **options)
    snapshots = list(dec.stream(PROMPTS, 24, chunk=2, **options))
    assert len(snapshots) > 3  # the prefill, then every 2 rounds
    assert snapshots[0].finish_reasons == ["running", "running"]
    for before, after in zip(snapshots, snapshots[1:]):
        for b in range(len(PROMPTS)):
            assert after.tokens[b][: len(before.tokens[b])] == before.tokens[b]
    last = snapshots[-1]
    assert last.tokens == whole.tokens and last.texts == whole.texts
    assert last.finish_reasons == whole.finish_reasons
    assert last.stats == whole.stats


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_adaptive_stream_ends_with_generate(models, temperature):
    """The adaptive loop's statistics travel in the streamed carry: same branches, tokens and stats."""
    budgets = AdaptiveConfig.for_budget(16).budgets
    costs = [1.0 + 0.3 * m for m in budgets]  # trees cheap enough that branches change during the call

    def fresh():  # a decoder carries estimates across calls, so each side starts from none
        return SpeculativeDecoder(models.target, models.drafter, "adaptive", 16,
                                  scorer=models.scorer_for(temperature), costs=costs)

    whole = fresh().generate(PROMPTS, 32, temperature=temperature, seed=7)
    last = list(fresh().stream(PROMPTS, 32, chunk=3, temperature=temperature, seed=7))[-1]
    assert len(set(whole.stats["budgets"])) > 1
    assert last.tokens == whole.tokens and last.stats == whole.stats


def test_compiled_call_runs_the_executable_and_times_it_apart(models):
    dec = SpeculativeDecoder(models.target, models.drafter, "ddtree", 16)
    call = dec.prepare(PROMPTS[:1], 16)
    seconds = call.compile()
    result = call.run()
    assert result.tokens == dec.generate(PROMPTS[:1], 16).tokens
    assert result.stats["compile_s"] == seconds > 0 and result.stats["decode_s"] > 0


def test_advance_programs_have_one_loop_and_no_host_callbacks(models):
    dec = SpeculativeDecoder(models.target, models.drafter, "ddtree", 16)
    for call in (dec.prepare(PROMPTS[:1], 8), models.target.prepare(PROMPTS[:1], 8)):
        p = call.programs
        state = p.start.eval_shape(*call.args, **call.kwargs)
        jaxpr = jax.make_jaxpr(lambda *a, p=p, kw=call.kwargs: p.advance(*a, **kw))(*call.args[:-4], state, 2)
        (advance,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
        top = [e.primitive.name for e in advance.params["jaxpr"].jaxpr.eqns]
        assert top.count("while") == 1, top  # the rounds; key-block loops are nested inside
        host = [n for n in primitives(jaxpr.jaxpr) if "callback" in n or n in ("infeed", "outfeed")]
        assert not host, host


def test_stream_rejects_a_bad_chunk(models):
    with pytest.raises(ValueError, match="chunk must be a positive number of rounds"):
        models.target.stream(PROMPTS[:1], 4, chunk=0)  # at the call, before any device work


def _cli(args, capsys):
    assert cli.main(args) == 0
    return capsys.readouterr()


def test_cli_decodes_once_compiled_ahead_of_time(monkeypatch, capsys):
    """`taps-decode --prompt` runs the compiled executable once and never the jitted program itself."""
    real = decoder_module.spec_generate
    runs = []

    class OnlyAheadOfTime:
        lower = staticmethod(real.lower)
        __signature__ = inspect.signature(real)

        def __call__(self, *args, **kwargs):
            raise AssertionError("the CLI called the jitted generate instead of the compiled executable")

    original_run = GenerateCall.run

    def counted_run(self):
        runs.append(1)
        return original_run(self)

    monkeypatch.setattr(decoder_module, "spec_generate", OnlyAheadOfTime())
    monkeypatch.setattr(GenerateCall, "run", counted_run)
    _, err = _cli(["--prompt", "def fibonacci(n):", "--max-new-tokens", "24", "--stats"], capsys)
    assert runs == [1]
    assert "compile_s=" in err and "decode_s=" in err and "tau=" in err


@pytest.mark.parametrize("policy", ["ddtree", "ar"])
def test_cli_stream_prints_what_the_plain_command_prints(policy, capsys):
    args = ["--prompt", "class Stack:\n    def push(self, item):", "--max-new-tokens", "40", "--policy", policy]
    plain = _cli(args, capsys).out
    streamed, err = _cli(args + ["--stream", "--stats"], capsys)
    assert streamed == plain and plain.startswith("class Stack:")
    assert "compile_s=" in err


def test_stream_is_for_a_single_prompt(tmp_path, capsys):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="--stream is for"):
        cli.main(["--prompts", str(prompts), "--out", str(tmp_path / "out.jsonl"), "--stream"])
    assert not (tmp_path / "out.jsonl").exists()


def test_text_deltas_hold_back_partial_characters(capsys):
    out = cli.TextDeltas("p:")
    for text in ["ab", "ab \ufffd", "ab é", "ab é ", "ab é."]:  # " ." -> "." (tokenizer clean-up)
        out.show(text)
    out.show("ab é.", final=True)
    assert capsys.readouterr().out == "p:ab é.\n"
