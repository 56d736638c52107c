"""Ahead-of-time compile, one decode per prompt, and streaming (same tokens as one generate).

Everything here runs on the lite set (conftest `lite_set_dir`: the default set cut to a 2-layer target): what
is tested is the engine's streaming and compiling, not how well the shipped set drafts.
"""

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
def models(lite_set_dir):
    return load_model_set(lite_set_dir)


def test_lite_set_is_the_default_set_cut_to_two_layers(models):
    """The lite set (conftest) holds the default set's first 2 target layers, its drafter, scorers and table."""
    import numpy as np
    from flax import nnx

    default = load_model_set(DEFAULT_MODEL_DIR)  # loading compiles nothing
    assert models.target.config == default.target.config.replace(num_layers=2)
    assert models.drafter.config == default.drafter.config.replace(num_target_layers=2, target_layer_ids=(0, 1))
    lite, full = nnx.to_pure_dict(models.target.params), nnx.to_pure_dict(default.target.params)
    assert sorted(lite["layers"]) == [0, 1]
    for a, b in zip(jax.tree.leaves({**lite, "layers": None}), jax.tree.leaves({**full, "layers": None})):
        np.testing.assert_array_equal(a, b)  # embedding, final norm
    for i in (0, 1):
        for a, b in zip(jax.tree.leaves(lite["layers"][i]), jax.tree.leaves(full["layers"][i])):
            np.testing.assert_array_equal(a, b)
    D = models.drafter.config.hidden_size
    fc, full_fc = (np.asarray(m.drafter.module.fc.kernel.get_value()) for m in (models, default))  # [in, out]
    assert fc.shape == (2 * D, D)
    np.testing.assert_array_equal(fc[D:], full_fc[:D])  # tap 1: the block that read layer 1, which is unchanged
    np.testing.assert_array_equal(fc[:D], full_fc[D:2 * D])  # tap 0: the block that read layer 3
    assert models.target.tokenizer.encode(PROMPTS[1]) == default.target.tokenizer.encode(PROMPTS[1])
    assert models.scorer.config == default.scorer.config and models.greedy_scorer.config == default.greedy_scorer.config
    assert models.table is not None and models.table.budgets == default.table.budgets


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
    if temperature == 0:  # greedy speculative decoding is lossless on this set too: AR's tokens
        assert whole.tokens == models.target.generate(PROMPTS, 24).tokens


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


def test_cli_decodes_once_compiled_ahead_of_time(lite_set_dir, monkeypatch, capsys):
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
    _, err = _cli(["--model", str(lite_set_dir), "--prompt", "def fibonacci(n):", "--max-new-tokens", "24",
                   "--stats"], capsys)
    assert runs == [1]
    assert "compile_s=" in err and "decode_s=" in err and "tau=" in err


@pytest.mark.parametrize("policy", ["ddtree", "ar"])
def test_cli_stream_prints_what_the_plain_command_prints(lite_set_dir, policy, capsys):
    args = ["--model", str(lite_set_dir), "--prompt", "class Stack:\n    def push(self, item):",
            "--max-new-tokens", "40", "--policy", policy]
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
