"""train.set_recipe end to end on a tiny set: a chat-templated target of ours, the tiny drafter preset."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from taps_jax.api import Target
from taps_jax.checkpoints.tokenizer import Tokenizer
from taps_jax.config import ModelConfig
from taps_jax.decoder import DEFAULT_MODEL_DIR, load_model_set
from taps_jax.models.transformer import Transformer
from train import set_recipe

TEMPLATE = ("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")


def tiny_set(tmp_path):
    """A 2-layer random target with the default set's tokenizer (vocab 8192) and a chat template: every stage runs
    as on a real set (this test: 307 s against 370 s on the default 6-layer target, run side by side)."""
    target = tmp_path / "target"
    cfg = ModelConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=32, rope_theta=10000.0, tie_embeddings=True)
    tokenizer = Tokenizer.from_file(DEFAULT_MODEL_DIR / "target" / "tokenizer.json")
    Target(Transformer(cfg, nnx.Rngs(0)), tokenizer, (0,)).save(target)
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    spec = {
        "target": str(target), "assets": str(tmp_path / "assets"), "drafter_preset": "tiny",
        "answers": str(tmp_path / "answers"), "drafter_legs": ["tiny"], "drafter_state": str(tmp_path / "state"),
        "more_prompts": {"2": 4},  # leg 2 trains on 4 more train-split prompts' answers too
        "prompts": {"seed": 0, "max_prompt_tokens": 400,
                    "counts": {"train": 16, "validation": 4, "traces": 3, "heldout": 2}},
        "traces": {"max_new_tokens": 8, "budget": 4, "batch_size": 3, "pool_width": 4},
        "scorer": {"steps": 4},
        "adaptive": {"num_prompts": 2, "max_new_tokens": 8, "batch_size": 2},
        "lookup": {"num_prompts": 3, "max_new_tokens": 24, "batch_size": 3},
        "report": {"prompts": "humaneval", "num_prompts": 1, "budgets": "4", "max_new_tokens": 8},
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(spec))
    return path


def test_set_recipe_builds_a_set_that_decodes_losslessly(tmp_path, capsys):
    spec, work = tiny_set(tmp_path), tmp_path / "work"
    argv = ["--set", str(spec), "--work", str(work), "--stages",
            "prompts,drafter,answers,state,traces,scorer,lookup,adaptive,assemble"]
    assert set_recipe.main(argv) == 0
    # Two legs: the second starts from the first's drafter; the state holds the second's, as the set ships it.
    leg2 = json.loads((work / "distill-2" / "run.json").read_text())
    assert leg2["settings"]["drafter"]["init_drafter"] == str(work / "distill" / "export")
    assert (work / "distill-2" / "data").resolve() == (work / "distill" / "data").resolve()
    assert leg2["data"]["more_prompts"] == [str(work / "prompts_train_leg2.jsonl")]
    assert json.loads((work / "distill" / "run.json").read_text())["data"]["more_prompts"] == []
    legs = json.loads((tmp_path / "state" / set_recipe.LEGS_FILE).read_text())["legs"]
    assert [r["leg"] for r in legs] == [1, 2] and all(r["validation"] and r["cpu_s"] > 0 for r in legs)
    assert "more_prompts" not in legs[0] and legs[1]["more_prompts"] == 4
    assert legs[1]["settings"]["drafter"]["init_drafter"] is None  # the preset's, not this run's start
    shipped = (tmp_path / "assets" / "drafter" / "model.safetensors").read_bytes()
    assert (tmp_path / "state" / "model.safetensors").read_bytes() == shipped  # one blob in git
    packed = sorted((tmp_path / "answers").glob("*.npz"))  # the answers to commit: the drafter's data cache
    assert sorted(p.name.split("-")[0] for p in packed) == ["train", "train", "validation"]  # leg 2's answers too
    rows = sorted(json.loads(p.with_suffix(".json").read_text())["sequences"] for p in packed)
    for p in packed:
        with np.load(p) as z:
            np.testing.assert_array_equal(z["tokens"], np.load(work / "distill" / "data" / p.stem / "tokens.npy"))
    prompts = {s: [json.loads(line) for line in (work / f"prompts_{s}.jsonl").open()]
               for s in (*set_recipe.SPLITS, "train_leg2")}
    assert all(r["prompt"].startswith("### user:\n") for rows in prompts.values() for r in rows)
    ids = {s: {r["id"] for r in rows} for s, rows in prompts.items()}
    assert not ids["train"] & ids["traces"] and not ids["train"] & ids["validation"]
    assert len(ids["train_leg2"]) == 4 and not ids["train_leg2"] & (ids["train"] | ids["validation"])
    assert rows == sorted([len(prompts["validation"]), len(prompts["train"]), 4])
    models = load_model_set(tmp_path / "assets")
    assert models.drafter is not None and models.scorer is not None and models.greedy_scorer is not None
    assert models.table is not None and models.table.meta["prompts_file"] == "prompts_traces.jsonl"
    assert models.lookup is not None and models.lookup.meta["prompts"] == 3
    horizon = models.drafter.config.block_size - 1  # the tiny preset's, not SmolLM2's 15
    assert models.lookup.weights(True).shape == (9, horizon)
    assert json.loads((work / "traces" / "meta.json").read_text())["pool"]["beam_width"] == 4  # the set's pool_width
    chat = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    ar = models.target.chat(chat, 12)
    for policy in ("ddtree", "taps", "adaptive"):
        assert models.decoder(policy, 4).generate(chat, 12).tokens == ar.tokens
    # A rerun skips every finished stage.
    capsys.readouterr()
    assert set_recipe.main(argv[:4] + ["--stages", "prompts,drafter,traces,scorer,lookup,adaptive"]) == 0
    out = capsys.readouterr().out
    # 4 prompt splits and leg 2's, 2 drafter legs, traces, 2 scorers, lookup, table
    assert out.count("skipped") == 12 and "running" not in out
    # A new machine: both legs are the committed state's, so nothing trains and the later stages read the state.
    fresh = tmp_path / "fresh"
    assert set_recipe.main(argv[:2] + ["--work", str(fresh), "--stages", "drafter,state"]) == 0
    out = capsys.readouterr().out
    assert out.count("the committed state") == 2 and "running" not in out and "nothing newer" in out
    assert set_recipe.drafter_export(set_recipe.SetSpec.read(str(spec)), fresh) == tmp_path / "state"
    # A third leg starts from the state, not from a replay of the first two.
    raw = json.loads(spec.read_text())
    raw["drafter_legs"] = ["tiny", "tiny"]
    spec.write_text(json.dumps(raw))
    with_more = set_recipe.SetSpec.read(str(spec))
    leg3 = set_recipe.stage_configs("drafter", set_recipe.SetSpec.read(str(spec)), fresh)[2]
    assert leg3.settings.drafter.init_drafter == str(tmp_path / "state") and leg3.out == fresh / "distill-3"
    assert leg3.more_prompts == (fresh / "prompts_train_leg2.jsonl",)  # what leg 2 added stays in the data
    raw["drafter_legs"], _ = [], raw.pop("more_prompts")  # another chain: the state's two legs are not this set's
    spec.write_text(json.dumps(raw))
    capsys.readouterr()
    assert set_recipe.committed_legs(set_recipe.SetSpec.read(str(spec))) == 0
    assert set_recipe.committed_legs(set_recipe.SetSpec.read(str(spec))) == 0
    assert capsys.readouterr().out.count("not used") == 1  # said once per run, not at every stage that asks
    raw["drafter_legs"], raw["more_prompts"] = ["tiny", "tiny"], {"3": 4}  # its leg 2 added no prompts
    spec.write_text(json.dumps(raw))
    assert set_recipe.committed_legs(set_recipe.SetSpec.read(str(spec))) == 0
    assert set_recipe.committed_legs(with_more) == 2


def test_a_state_recorded_before_a_setting_existed_matches_its_default():
    """A committed leg's record lacks the fields added since; they stand for their defaults, nothing else does."""
    recorded = set_recipe._leg_settings("tiny")
    older = copy.deepcopy(recorded)
    del older["train"]["data_seed"]
    assert set_recipe._same_settings(recorded, "tiny") and set_recipe._same_settings(older, "tiny")
    for section, key, value in (("train", "data_seed", 7), ("train", "steps", recorded["train"]["steps"] + 1)):
        changed = copy.deepcopy(older)
        changed[section][key] = value
        assert not set_recipe._same_settings(changed, "tiny")
    # The committed SmolLM2 chain was recorded before data_seed existed and is still this set's.
    spec = set_recipe.SetSpec.read("smollm2")
    done = json.loads((spec.state_dir() / set_recipe.LEGS_FILE).read_text())["legs"]
    assert set_recipe.committed_legs(spec) == len(done) >= 7


def test_set_recipe_refuses_an_unknown_set_or_stage(tmp_path, capsys):
    assert set_recipe.main(["--set", "nosuchset"]) == 2
    assert "no set 'nosuchset'" in capsys.readouterr().err
    assert set_recipe.main(["--set", str(tiny_set(tmp_path)), "--stages", "target"]) == 2
    assert "unknown stage 'target'" in capsys.readouterr().err


@pytest.mark.parametrize("more, message", [
    ({"1": 8}, "more_prompts has leg '1'; its keys are leg numbers of drafter_legs, 2 to 2"),
    ({"3": 8}, "more_prompts has leg '3'"),
    ({"2": 0}, r"more_prompts\['2'\] must be a positive number of prompts or .*got 0"),
    ({"2": "8"}, "must be a positive number"),
    ({"2": {"count": 8}}, r"more_prompts\['2'\]: packages must be a list of installed package names"),
    ({"2": {"count": 0, "packages": ["jax"]}}, "count must be a positive number of prompts, got 0"),
    ({"2": {"count": 8, "packages": ["jax"], "kinds": ["poem"]}}, "kinds must be a list of some of write_function"),
    ({"2": {"count": 8, "packages": ["jax"], "kind": ["complete"]}}, "unknown key 'kind'; known: count, packages"),
    ({"2": {"count": 8, "packages": ["jax"], "answers": "human"}}, "answers must be one of target, source"),
    ({"2": {"count": 8, "packages": ["jax"], "kinds": ["explain_code"], "answers": "source"}},
     r"answers \"source\" needs kinds with a source of their own"),
    ({"2": {"count": 8, "packages": ["jax"], "answers": "source"}}, "needs kinds with a source of their own"),
])
def test_set_recipe_refuses_bad_added_prompts(tmp_path, capsys, more, message):
    spec = tiny_set(tmp_path)
    raw = json.loads(spec.read_text())
    raw["more_prompts"] = more
    spec.write_text(json.dumps(raw))
    assert set_recipe.main(["--set", str(spec), "--dry-run"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_legs_add_code_tasks_from_installed_packages(tmp_path, monkeypatch, capsys):
    """A leg's added prompts may be code tasks of installed packages' sources; legs that draw from one pool
    continue it, and a stdlib leg after them continues the stdlib's train split."""
    site = tmp_path / "site"
    shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "json", site / "pkgdemo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py", site / "pkgdemo" / "textwrap.py")
    monkeypatch.syspath_prepend(str(site))
    spec, work = tiny_set(tmp_path), tmp_path / "work"
    raw = json.loads(spec.read_text())
    code = {"count": 2, "packages": ["pkgdemo"], "kinds": ["complete", "write_function"]}
    raw["drafter_legs"], raw["more_prompts"] = ["tiny"] * 3, {"2": code, "3": 4, "4": {**code, "answers": "source"}}
    spec.write_text(json.dumps(raw))
    assert [d[1:] for d in set_recipe.SetSpec.read(str(spec)).more_draws()] == [
        ((("pkgdemo",), ("write_function", "complete")), 0, 2), ((), 16, 20),
        ((("pkgdemo",), ("write_function", "complete")), 2, 4)]
    assert set_recipe.main(["--set", str(spec), "--work", str(work), "--stages", "prompts"]) == 0
    assert "code tasks from pkgdemo" in capsys.readouterr().out
    ids = {k: [json.loads(line)["id"] for line in (work / f"prompts_{k}.jsonl").open()]
           for k in ("train", "train_leg2", "train_leg3", "train_leg4")}
    for k in ("train_leg2", "train_leg4"):
        assert len(ids[k]) == 2 and all(re.match(r"(write_function|complete):pkg:pkgdemo/", i) for i in ids[k])
    assert not set(ids["train_leg2"]) & set(ids["train_leg4"])  # leg 4 continues leg 2's draw
    # Leg 4's tasks are answered by their own source: each line's response is the function it was drawn from.
    given = [json.loads(line) for line in (work / "prompts_train_leg4.jsonl").open()]
    sources = {p.name: p.read_text() for p in (site / "pkgdemo").rglob("*.py")}
    for r in given:
        code = r["response"].removeprefix("```python\n").removesuffix("```")
        assert code.startswith("def ") and any(code.splitlines()[1] in text for text in sources.values())
    assert all("response" not in json.loads(line) for line in (work / "prompts_train_leg2.jsonl").open())
    assert len(ids["train_leg3"]) == 4 and all(":stdlib:" in i for i in ids["train_leg3"])
    assert not set(ids["train_leg3"]) & set(ids["train"])
    raw["more_prompts"]["2"]["packages"] = ["nosuchpkg"]  # refused before the target loads or anything is drawn
    spec.write_text(json.dumps(raw))
    (work / "prompts_train_leg2.jsonl").unlink()
    assert set_recipe.main(["--set", str(spec), "--work", str(work), "--stages", "prompts"]) == 2
    assert "no installed package 'nosuchpkg'" in capsys.readouterr().err


def test_set_recipe_refuses_an_unknown_trace_setting(tmp_path, capsys):
    spec = tiny_set(tmp_path)
    raw = json.loads(spec.read_text())
    raw["traces"]["pool_widht"] = 8
    spec.write_text(json.dumps(raw))
    assert set_recipe.main(["--set", str(spec), "--dry-run"]) == 2
    assert "unknown traces setting 'pool_widht'" in capsys.readouterr().err


def test_through_leg_builds_on_an_earlier_leg_of_the_chain(tmp_path, capsys):
    """--through-leg K: the later stages fit on leg K's drafter and leave out the prompts later legs add (a refit
    on the committed leg while the next one trains); a leg the chain lacks is refused."""
    spec, work = tiny_set(tmp_path), tmp_path / "work"
    raw = json.loads(spec.read_text())
    raw["drafter_legs"], raw["more_prompts"] = ["tiny", "tiny"], {"2": 4, "3": 4}
    spec.write_text(json.dumps(raw))
    argv = ["--set", str(spec), "--work", str(work), "--stages", "drafter,traces", "--dry-run"]
    assert set_recipe.main(argv) == 0
    whole = capsys.readouterr().out
    assert whole.count("drafter: run(") == 3 and "distill-3/export" in whole and "prompts_train_leg3" in whole
    assert set_recipe.main([*argv, "--through-leg", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("drafter: run(") == 2 and "prompts_train_leg3" not in out
    (traces,) = [line for line in out.splitlines() if line.startswith("[recipe] traces")]
    assert "distill-2/export" in traces and "prompts_train_leg2" in traces
    assert set_recipe.main([*argv, "--through-leg", "4"]) == 2
    assert "--through-leg 4: the set's drafter chain has legs 1 to 3" in capsys.readouterr().err
