"""The adaptive policy: every branch is an exact round, the loop stays one loop, costs are cached."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_helpers import assert_follows, tiny_pair
from taps_helpers import random_scorer, sharp_pair
from taps_jax.decoder import DEFAULT_MODEL_DIR, SpeculativeDecoder, load_model_set
from taps_jax.engine import calibrate
from taps_jax.engine.adaptive import (AdaptiveConfig, AdaptiveState, accepted_by_budget, after_ar_steps, choose,
                                     probe_due, start_clock, tree_ranks, trees_never_pay, update)
from taps_jax.engine.speculative import spec_generate
from taps_jax.tree.policies import TreeConfig, draft_tree

PROMPTS = [[3, 1, 4, 1, 5], [6, 2, 6], [5, 3, 5, 0, 1, 7, 2, 3, 2], [2, 7]]
VOCAB = 8
CYCLE = AdaptiveConfig((0, 2, 4, 8, 16), force_cycle=True)  # switches branch every round


@pytest.fixture(autouse=True)
def _private_cost_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPS_JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "_memory", {})


def test_greedy_is_lossless_switching_every_round():
    target, drafter = tiny_pair(VOCAB, eos=(6,))
    want = target.generate(PROMPTS, 40)
    dec = SpeculativeDecoder(target, drafter, "adaptive", 16, adaptive=CYCLE, costs=(1, 1, 1, 1, 1))
    got = dec.generate(PROMPTS, 40)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    budgets = got.stats["budgets"]
    assert budgets[:6] == [16, 8, 4, 2, 0, 16], budgets
    assert max(x for a in got.stats["accepted_lengths"] for x in a) >= 3  # spec rounds accepted drafts


def test_taps_trees_when_a_scorer_is_given():
    target, drafter = sharp_pair(VOCAB, block_size=8)
    scorer = random_scorer(target, drafter, seed=1)
    want = target.generate(PROMPTS, 32).tokens
    cycle = AdaptiveConfig((0, 3, 12), force_cycle=True)
    dec = SpeculativeDecoder(target, drafter, "adaptive", 12, scorer=scorer, adaptive=cycle, costs=(1, 2, 3))
    assert dec.tree.policy == "taps" and dec.tree.budget == 12
    assert dec.generate(PROMPTS, 32).tokens == want


def test_ties_pick_the_cheapest_and_probing_is_rare():
    """All branches tie in cost: a branch that accepts more wins; AR-level acceptance keeps the AR step."""
    target, drafter = tiny_pair(VOCAB)
    want = target.generate(PROMPTS, 48).tokens
    got = SpeculativeDecoder(target, drafter, "adaptive", 16, costs=(1, 1, 1, 1, 1)).generate(PROMPTS, 48)
    assert got.tokens == want
    assert got.stats["budgets"][0] == 16  # the first round probes the largest tree
    # Equal costs: a tree accepts at least the one token an AR step emits, so the AR step never wins.
    assert 0 not in got.stats["budgets"] and len(set(got.stats["budgets"])) >= 1
    dec = SpeculativeDecoder(target, drafter, "adaptive", 16, costs=(1, 50, 50, 50, 50))
    expensive = dec.generate(PROMPTS, 48)
    assert expensive.tokens == want
    assert expensive.stats["budgets"][0] == 16 and set(expensive.stats["budgets"][1:]) == {0}
    # The next call starts from this one's estimates: no probe at its start (the wait is 20x a probe's cost).
    again = dec.generate(PROMPTS, 48)
    assert again.tokens == want and set(again.stats["budgets"]) == {0}
    # Other sampling settings have their own estimates: that call probes first again.
    assert dec.generate(PROMPTS, 8, temperature=1.0).stats["budgets"][0] == 16


def test_counterfactual_accepted_lengths_match_smaller_trees():
    """A round of budget M says what budget m would have accepted: the tree of m is the top-m of M's."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 6)) * 2, jnp.float32)
    root = jnp.asarray([1, 2, 3], jnp.int32)
    big, aux = draft_tree(TreeConfig("ddtree", 16, 6, 16), logits, root)
    rank = tree_ranks(big, aux.log_reach_BN)
    from taps_jax.tree.accept import accept_walk

    for trial in range(5):
        target_BT = jnp.asarray(rng.integers(0, 6, size=big.tokens_BT.shape), jnp.int32)
        # The target's token at a node depends on the node (its prefix), not on the tree it sits in.
        prefix_token = {}
        for b in range(3):
            for i in range(big.tokens_BT.shape[1]):
                prefix_token[(b, int(big.pool_index_BT[b, i]))] = int(target_BT[b, i])
        acc = accept_walk(big, target_BT)
        got = accepted_by_budget(rank, acc.path_BA, acc.path_valid_BA, (0, 2, 5, 16))
        for col, m in enumerate((2, 5, 16)):
            small, _ = draft_tree(TreeConfig("ddtree", m, 6, 16), logits, root)
            small_target = np.array([[prefix_token[(b, int(p))] for p in small.pool_index_BT[b]] for b in range(3)])
            want = accept_walk(small, jnp.asarray(small_target)).num_accepted_B
            np.testing.assert_array_equal(got[:, col + 1], want, err_msg=f"budget {m}, trial {trial}")
        assert (got[:, 0] == 1).all()


def test_sampling_follows_the_target_distribution():
    """Chi-square on the first three tokens at T=1 while the branch changes every round."""
    target, drafter = tiny_pair(vocab=5, block_size=4, seed=3)
    prompt = [1, 2, 3]

    def probs(ctx):
        logits = np.asarray(target.logits([ctx]))[0, -1]
        p = np.exp(logits - logits.max())
        return p / p.sum()

    p1 = probs(prompt)
    exact = np.zeros((5, 5, 5))
    for a in range(5):
        p2 = probs(prompt + [a])
        for b in range(5):
            exact[a, b] = p1[a] * p2[b] * probs(prompt + [a, b])
    dec = SpeculativeDecoder(target, drafter, "adaptive", 4, adaptive=AdaptiveConfig((0, 1, 4), force_cycle=True),
                             costs=(1, 1, 1))
    counts = np.zeros((5, 5, 5))
    for seed in range(500):
        for t in dec.generate([prompt] * 8, 3, temperature=1.0, seed=seed).tokens:
            counts[tuple(t)] += 1
    assert_follows(counts, exact)


def test_one_generate_loop_and_no_host_callbacks():
    target, drafter = tiny_pair(VOCAB)
    dec = SpeculativeDecoder(target, drafter, "adaptive", 16, costs=(1, 2, 3, 4, 5))
    call = dec.prepare([[1, 2, 3]], 16)
    args, kwargs = call.args, call.kwargs
    fixed = SpeculativeDecoder(target, drafter, "ddtree", 16)
    fcall = fixed.prepare([[1, 2, 3]], 16)
    fargs, fkwargs = fcall.args, fcall.kwargs

    def top_level(a, kw):
        jaxpr = jax.make_jaxpr(lambda *x: spec_generate(*x, **kw))(*a)
        (gen,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
        return [e.primitive.name for e in gen.params["jaxpr"].jaxpr.eqns], jaxpr

    top, jaxpr = top_level(args, kwargs)
    fixed_top, _ = top_level(fargs, fkwargs)
    assert top.count("while") == fixed_top.count("while") == 2, top  # prefill chunks + the generate loop
    from spec_helpers import primitives

    names = list(primitives(jaxpr.jaxpr))
    # Branches are while loops of 0 or 1 trips (`run_if`): a conditional writing the caches copies them.
    assert "cond" not in names
    host = [n for n in names if "callback" in n or n in ("infeed", "outfeed")]
    assert not host, host
    before = spec_generate._cache_size()
    dec.generate([[4, 5, 6]], 16)
    SpeculativeDecoder(target, drafter, "adaptive", 16, costs=(2, 2, 2, 2, 2)).generate([[4, 5, 6]], 16)
    assert spec_generate._cache_size() - before == 1  # new costs are data, not a new program


def test_caches_are_updated_in_place():
    """The compiled adaptive program never copies a whole KV cache (as a conditional's operand would be)."""
    import re

    from taps_jax.engine.speculative import spec_start

    target, drafter = tiny_pair(VOCAB)
    call = SpeculativeDecoder(target, drafter, "adaptive", 16, costs=(1, 2, 3, 4, 5)).prepare([[1, 2, 3]], 16)
    s, _ = jax.eval_shape(lambda *a: spec_start(*a, **call.kwargs), *call.args)
    caches = {tuple(x.shape) for x in (s.cache.k_LBKHS, s.cache.v_LBKSH, s.dcache.k_LBKHS, s.dcache.v_LBKSH)}
    hlo = spec_generate.lower(*call.args, **call.kwargs).compile().as_text()
    copied = [tuple(int(d) for d in m.split(",")) for m in re.findall(r"= f32\[([0-9,]*)\]\S* copy\(", hlo) if m]
    assert copied and not caches & set(copied), (caches, copied)


def test_costs_are_measured_once_and_cached_on_disk(tmp_path, monkeypatch):
    target, drafter = tiny_pair(VOCAB)
    dec = SpeculativeDecoder(target, drafter, "adaptive", 4)
    want = target.generate(PROMPTS[:2], 12).tokens
    before = spec_generate._cache_size()
    assert dec.generate(PROMPTS[:2], 12).tokens == want
    assert spec_generate._cache_size() - before == 1  # the calibration runs the program generate runs
    table = json.loads((tmp_path / "cache" / calibrate.CACHE_FILE).read_text())
    (entry,) = table.values()
    assert len(entry["ms"]) == 4 and all(ms > 0 for ms in entry["ms"])  # budgets 0, 1, 2, 4
    assert tuple(entry["ms"]) == dec.branch_costs
    # A new process (empty memory) reads the file instead of measuring.
    monkeypatch.setattr(calibrate, "_memory", {})
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert SpeculativeDecoder(target, drafter, "adaptive", 4).generate(PROMPTS[:2], 12).tokens == want


def test_a_cost_lost_in_timing_noise_is_timed_again_then_bounded(monkeypatch):
    """Timings in which a busy machine hides a round's cost never become a near-zero cached cost."""
    config = type("C", (), {"adaptive": AdaptiveConfig((0, 4))})()
    # (seconds of a 1-round run, of a long run) per repeat, per branch. Noise only adds time: branch 0's
    # short runs are all slowed in its first two passes of 5 (its long run looks no slower than its short
    # one), its third pass resolves; branch 1 resolves at once.
    script = {0: iter([(2.0, 1.8)] * 10 + [(1.0, 1.8)] * 5), 1: iter([(1.0, 2.0)] * 5)}
    pending = {}

    def forced_run(args, kwargs, branch, rounds):
        if rounds == 1:
            pending[branch] = next(script[branch])
            return pending[branch][0], 1
        return (pending.pop(branch, (None, 9.0))[1], rounds)

    monkeypatch.setattr(calibrate, "forced_run", forced_run)
    ms, timed = calibrate.measure(None, {"config": config}, max_new_tokens=17)
    assert ms == pytest.approx((0.8 / 16 * 1e3, 1.0 / 5 * 1e3)) and timed  # branch 0: 17 rounds, branch 1: 6

    script = {0: iter([(2.0, 1.8)] * 15), 1: iter([(1.0, 2.0)] * 5)}  # never resolves: time per round, bounded
    ms, timed = calibrate.measure(None, {"config": config}, max_new_tokens=17, retries=2)
    assert ms[0] == pytest.approx(1.8 / 17 * 1e3) and ms[1] == pytest.approx(1.0 / 5 * 1e3) and timed
    assert calibrate.per_round_ms((1.0, 1), (1.005, 17)) is None  # under 1%: noise, not a cost


def test_a_batch_too_short_to_time_a_round_is_measured_for_its_call_only(tmp_path, monkeypatch):
    """Every sequence stopped after one round: the figures are whole runs, prefill and all, and never kept."""
    config = type("C", (), {"adaptive": AdaptiveConfig((0, 4))})()
    real_forced_run = calibrate.forced_run
    monkeypatch.setattr(calibrate, "forced_run", lambda args, kwargs, branch, rounds: (1.0 + branch, 1))
    assert calibrate.measure(None, {"config": config}, max_new_tokens=64) == ((1e3, 2e3), False)

    monkeypatch.setattr(calibrate, "forced_run", real_forced_run)
    calls = []
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: calls.append(1) or ((1.0, 5.0, 5.0, 5.0), False))
    target, drafter = tiny_pair(VOCAB)
    want = target.generate(PROMPTS[:2], 12).tokens
    dec = SpeculativeDecoder(target, drafter, "adaptive", 4)
    for _ in range(2):  # not kept, in memory or on disk: the second call measures again
        assert dec.generate(PROMPTS[:2], 12).tokens == want
    assert len(calls) == 2 and not (tmp_path / "cache" / calibrate.CACHE_FILE).exists()
    # A call of at most one round runs the AR program and measures nothing.
    before = spec_generate._cache_size()
    got = dec.generate(PROMPTS, 2)
    assert got.tokens == target.generate(PROMPTS, 2).tokens and len(calls) == 2
    assert spec_generate._cache_size() == before and got.stats["budgets"] == [0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="adaptive", costs=(1, 2)), "costs must be 5 positive numbers"),
    (dict(policy="adaptive", costs=(1, 2, 3, 4, -1)), "costs must be 5 positive numbers"),
    (dict(policy="ddtree", costs=(1, 2, 3, 4, 5)), "for policy 'adaptive'"),
    (dict(policy="adaptive", adaptive=AdaptiveConfig((2, 4))), "must start with 0"),
])
def test_bad_adaptive_settings(kwargs, message, no_tracing):
    target, drafter = tiny_pair(VOCAB)
    policy = kwargs.pop("policy")
    with pytest.raises(ValueError, match=message):
        SpeculativeDecoder(target, drafter, policy, 16, **kwargs)


@pytest.fixture(scope="module")
def models():
    return load_model_set(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def lite_models(lite_set_dir):
    """The default set cut to a 2-layer target (conftest), with the same adaptive table: for the tests whose
    property is the decoder's schedule and bookkeeping, not how many tokens the shipped drafter gets accepted."""
    return load_model_set(lite_set_dir)


def test_mixed_batch_repeating_and_random_text_is_lossless(models):
    """One sequence loops (drafts accepted), the other is noise (drafts rejected): one branch per round for both."""
    tok = models.target.tokenizer
    rng = np.random.default_rng(0)
    repeating = tok.encode("x = 1\ny = 2\n" * 12)
    noise = rng.integers(10, models.target.config.vocab_size, size=40).tolist()
    want = models.target.generate([repeating, noise], 48)
    costs = (4.0, 5.0, 5.0, 6.0, 7.0)  # accelerator-like: a round costs little more than an AR step
    dec = SpeculativeDecoder(models.target, models.drafter, "adaptive", 32, costs=costs)
    got = dec.generate([repeating, noise], 48)
    assert got.tokens == want.tokens
    accepted = got.stats["accepted_lengths"]
    assert np.mean(accepted[0]) > np.mean(accepted[1])
    # The repeating text pays for trees for both (one budget per round for the whole batch).
    budgets = got.stats["budgets"]
    assert budgets[0] == 32 and len(set(budgets)) > 1, budgets


# ----------------------------------------------------------------------------- the text signal and fitted tables


def test_signal_reads_the_prompt_and_the_output():
    """The match may start in the prompt and end in the output; the prompt's padding is not text."""
    from taps_jax.engine.adaptive import signal_buckets

    config = AdaptiveConfig((0, 4), match_buckets=5)
    prompt = jnp.asarray([[7, 1, 2, 3, 0, 0], [1, 2, 0, 0, 0, 0]], jnp.int32)  # right-padded with 0
    lens = jnp.asarray([4, 2])
    out = jnp.asarray([[9, 1, 2, 3, 0], [0, 0, 0, 0, 0]], jnp.int32)
    # Row 0: 7 1 2 3 | 9 1 2 3 -> "1 2 3" repeats (3); row 1: 1 2 | 0 0 -> "0" after "0" (1), padding unseen.
    np.testing.assert_array_equal(signal_buckets(prompt, lens, out, jnp.asarray([4, 2]), config), [3, 1])
    # Row 0: 7 1 2 3 | 9 1 -> "1" (1); row 1: 1 2 | 0 -> nothing earlier (the padding zeros are not text).
    np.testing.assert_array_equal(signal_buckets(prompt, lens, out, jnp.asarray([2, 1]), config), [1, 0])


@pytest.fixture(scope="module")
def shipped_table(models):
    assert models.table is not None, "the default set ships adaptive.json (python -m train.adaptive_table)"
    return models.table


def test_fitted_table_means_grow_with_the_budget(shipped_table):
    """Trees are nested, so per round (and so per bucket) a larger budget accepts at least as much."""
    for kind in ("greedy", "sampled"):
        means = shipped_table.means(kind)[:, 1:]
        seen = ~np.isnan(means).any(axis=1)
        assert seen.sum() >= 5, means
        assert (np.diff(means[seen], axis=1) >= -1e-6).all(), means
        # Repeated text is where drafts are accepted: the longest-match bucket beats the no-match one.
        assert means[-1, -1] > means[0, -1] + (1.0 if kind == "greedy" else 0.0), means


def test_the_choice_follows_the_text(models, shipped_table):
    """Costs between what a tree yields on novel text and on repeated text: AR on the first, trees on the second."""
    tok = models.target.tokenizer
    repeating = tok.encode("    self.a = a\n    self.b = b\n" * 8 + "    self.a")  # ends mid-repeat
    novel = np.random.default_rng(1).integers(10, models.target.config.vocab_size, size=40).tolist()
    config = AdaptiveConfig.for_budget(32)
    means = shipped_table.means("greedy")[:, [shipped_table.budgets.index(b) for b in config.budgets]]
    # A tree round costs c AR steps: a little more than any tree yields with no match, far less than the
    # largest yields after a long one (the table's own figures: 4.6 and 9.4 tokens greedy).
    c = 1.15 * float(np.nanmax(means[0, 1:]))
    assert c < means[-1, -1] / 1.5, (means, c)
    costs = (1.0,) + (c,) * (len(config.budgets) - 1)
    dec = models.decoder("adaptive", 32, costs=costs)
    for prompt, trees in ((novel, False), (repeating, True)):
        want = models.target.generate([prompt], 24)
        got = dec.generate([prompt], 24)
        assert got.tokens == want.tokens
        budgets = got.stats["budgets"]
        if trees:  # most tokens come from tree rounds
            from_trees = sum(a for a, b in zip(got.stats["accepted_lengths"][0], budgets) if b > 0)
            assert budgets[0] > 0 and from_trees > 0.5 * len(got.tokens[0]), (budgets, got.stats["accepted_lengths"])
        else:
            assert budgets[:8] == [0] * 8, budgets


def test_a_call_where_no_tree_can_pay_runs_the_ar_program(models, shipped_table):
    """Trees dearer than their best bucket's yield and no probe due: the AR program itself, same tokens."""
    config = AdaptiveConfig.for_budget(16)
    prior = shipped_table.prior(config, greedy=True)
    means, dear = _dear_costs(shipped_table, config)
    cheap = (1.0,) + (0.8 * float(np.nanmax(means[:, 1:])),) * 4
    assert trees_never_pay(prior, dear, config)
    assert not trees_never_pay(prior, cheap, config)  # a long match makes a tree the better round
    assert not trees_never_pay(config.empty_prior(), dear, config)  # nothing known: round 0 probes
    clock = np.asarray(start_clock(config, prior, jnp.asarray(dear)))
    wait = dear[-1] / config.probe_fraction  # what a decoder spends before its first probe
    assert clock.tolist() == pytest.approx([0.0, wait, 0.0])
    assert not probe_due(clock, dear, 64) and probe_due(clock, dear, int(wait) + 1)  # a call that long probes
    assert probe_due(after_ar_steps(clock, dear, int(wait) - 63), dear, 64)  # so does one after that much spent

    prompts = [models.target.tokenizer.encode("    self.a = a\n    self.b = b\n" * 8 + "    self.a"), [5, 6, 7, 8]]
    want = models.target.generate(prompts, 24)
    dec = models.decoder("adaptive", 16, costs=dear)
    before = spec_generate._cache_size()
    got = dec.generate(prompts, 24)
    assert spec_generate._cache_size() == before  # the AR program ran, not the speculative one
    assert got.tokens == want.tokens and got.stats["tau"] == 1.0
    assert got.stats["budgets"] == [0] * 23 and got.stats["rounds"] == [23, 23]
    # warm_up: generate, then the speculative program too (compiled for a later probe), what it learns dropped.
    (prior, clock), = dec._priors.values()
    warm = dec.warm_up(prompts, 24)
    assert warm.tokens == want.tokens and warm.stats["budgets"] == [0] * 23
    assert spec_generate._cache_size() == before + 1
    (prior2, clock2), = dec._priors.values()
    assert (prior2 == prior).all() and clock2.tolist() == pytest.approx(clock.tolist())
    # Trees at a cost the repeated text's bucket pays for: the speculative program, and its first round a tree.
    cheap = (1.0,) + (0.5 * float(means[-1, -1]),) * 4
    assert models.decoder("adaptive", 16, costs=cheap).generate(prompts[:1], 24).stats["budgets"][0] > 0


def _dear_costs(table, config):
    """(the table's mean accepted lengths for config's budgets, costs at which no tree pays in any bucket)."""
    means = table.means("greedy")[:, [table.budgets.index(b) for b in config.budgets]]
    best = float(np.nanmax(means[:, 1:]))  # the most any of these trees yields, in any bucket
    return means, (1.0,) + (1.2 * best,) * (len(config.budgets) - 1)


def test_a_probe_that_changes_nothing_backs_off_even_at_a_calls_first_round():
    """The clock carries across calls, so a due probe can be a call's round 0: it still doubles the wait."""
    config, costs = AdaptiveConfig((0, 4)), jnp.asarray([1.0, 10.0])
    prior = np.zeros((2, config.match_buckets, 2), np.float32)
    prior[:, :, 1] = [[2.0], [1.0]]  # every bucket: a tree yields 2 tokens for 10x an AR step's cost
    st = AdaptiveState.init(8, config, prior, costs, clock=np.asarray([250.0, 200.0, 1.0], np.float32))
    q, running = jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)
    k, probe = choose(st, q, running, costs, config)
    assert int(k) == 1 and bool(probe) and int(st.round) == 0
    st = update(st, k, probe, jnp.asarray([[1, 2]]), running, q, costs, config)  # it yields 2 again: still AR
    assert int(st.backoff) == 2 and float(st.spent) == 0.0 and float(st.wait) == pytest.approx(10 / 0.05 * 4)
    # The first probe of a decoder with no estimates has nothing to confirm: no backoff.
    fresh = AdaptiveState.init(8, config, config.empty_prior(), costs)
    k, probe = choose(fresh, q, running, costs, config)
    assert int(k) == 1 and bool(probe)
    assert int(update(fresh, k, probe, jnp.asarray([[1, 2]]), running, q, costs, config).backoff) == 0


def test_the_probe_schedule_runs_across_calls(lite_models, shipped_table):
    """carry_clock: calls too short to reach a probe on their own still probe, at the pace of the decoder's whole
    life: each call's AR steps add to the cost spent, and the call that reaches the wait probes where it is due."""
    config = AdaptiveConfig.for_budget(16, carry_clock=True)
    _, dear = _dear_costs(shipped_table, config)
    wait = dear[-1] / config.probe_fraction  # about 20 x 1.2 x 8 AR steps: several 24-token calls
    dec = lite_models.decoder("adaptive", 16, costs=dear, adaptive=config)
    prompt = [lite_models.target.tokenizer.encode("def area(width, height):\n")]
    want = lite_models.target.generate(prompt, 24).tokens
    spent, before = 0.0, spec_generate._cache_size()
    while spent + 24 < wait:  # no probe due within the call: the AR program, 23 AR steps spent
        got = dec.generate(prompt, 24)
        assert got.tokens == want and got.stats["budgets"] == [0] * 23
        spent += 23
    assert spent > 0 and spec_generate._cache_size() == before
    got = dec.generate(prompt, 24)  # this one reaches the wait: the speculative program, a probe where it is due
    assert got.tokens == want
    first = next(i for i, b in enumerate(got.stats["budgets"]) if b > 0)
    assert got.stats["budgets"][first] == 16 and abs(first - (wait - spent)) <= 1, (got.stats["budgets"], wait)
    # The wait starts again from the probe (at least a full period): the next call is AR's program again.
    again = dec.generate(prompt, 24)
    assert again.tokens == want and again.stats["budgets"] == [0] * 23
    # The default restarts the clock with each call: calls this short never reach a probe.
    dec = lite_models.decoder("adaptive", 16, costs=dear)
    for _ in range(int(wait // 23) + 2):
        assert dec.generate(prompt, 24).stats["budgets"] == [0] * 23


def test_fit_counts_every_round(lite_models):
    from train.adaptive_table import fit_kind

    budgets = (0, 2, 8)
    prompts = [[5, 6, 7, 8], lite_models.target.tokenizer.encode("x = 1\ny = 2\n" * 4)]
    sums, counts = fit_kind(lite_models, prompts, 16, 0.0, budgets, batch_size=2)
    assert counts.shape == (9, 3) and (counts[:, 0] == 0).all()
    assert counts[:, 1].sum() == counts[:, 2].sum() > 0  # every round observes every budget up to the largest
    assert (sums[:, 2] >= sums[:, 1]).all() and (sums[:, 1] >= counts[:, 1]).all()


def test_bad_table_file_is_refused(tmp_path, no_tracing):
    from taps_jax.engine.adaptive import AdaptiveTable

    bad = tmp_path / "adaptive.json"
    bad.write_text('{"budgets": [0, 4], "match_buckets": 9, "sums": {"greedy": [[1, 2]]}, "counts": {"greedy": [[1, 2]]}}')
    with pytest.raises(ValueError, match="adaptive.json: not an adaptive table .*not 9 x 2"):
        AdaptiveTable.load(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="refit it with python -m train.adaptive_table"):
        AdaptiveTable.load(bad)
