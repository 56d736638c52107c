"""taps-decode on the embedded default set: every mistake of the issue refused with exit 2, one line, files untouched.

Each case runs the console script's code path in process (`decode.common.run`
around `cli.main`), compares every file of the job folder byte for byte
before and after (so nothing is changed, and nothing is created), and most
refusals come before any model is loaded.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from decode import bench, cli, longrun
from decode.common import run
from taps_jax.decoder import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [{"id": "a", "prompt": "def add(a, b):"}, {"id": "b", "prompt": "import os\n"}, {"id": 3, "prompt": "x = "}]
NEW = "4"


def taps_decode(capsys, *argv) -> tuple[int, str]:
    """(exit status, stderr) of taps-decode ARGV, run in process."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(lambda: cli.main([str(a) for a in argv]), "taps-decode")
    return e.value.code, capsys.readouterr().err


def job_args(folder: Path, *extra) -> list:
    return ["--prompts", folder / "in.jsonl", "--out", folder / "out.jsonl", "--policy", "ar",
            "--max-new-tokens", NEW, *extra]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def part_copy(folder: Path, part: str, config_edit=None, name: str | None = None) -> Path:
    """A copy of an embedded part (weights linked, not copied) with its config.json edited."""
    dst = folder / (name or part)
    dst.mkdir()
    for f in (DEFAULT_MODEL_DIR / part).iterdir():
        (dst / f.name).symlink_to(f)
    if config_edit is not None:
        (dst / "config.json").unlink()
        raw = json.loads((DEFAULT_MODEL_DIR / part / "config.json").read_text())
        config_edit(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory):
    """A folder with in.jsonl and the out.jsonl (+ manifest, lock) of a finished greedy AR job."""
    folder = tmp_path_factory.mktemp("job")
    (folder / "in.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    assert cli.main([str(a) for a in job_args(folder)]) == 0
    assert len((folder / "out.jsonl").read_text().splitlines()) == len(PROMPTS)
    return folder


@pytest.fixture
def job(finished_job, tmp_path) -> Path:
    return Path(shutil.copytree(finished_job, tmp_path / "job"))


def _insert_garbage(folder):
    lines = (folder / "out.jsonl").read_text().splitlines(keepends=True)
    (folder / "out.jsonl").write_text(lines[0] + "garbage\n" + "".join(lines[1:]))


def _append(text):
    def edit(folder):
        with (folder / "out.jsonl").open("a") as f:
            f.write(text)
    return edit


def _duplicate_first_line(folder):
    _append((folder / "out.jsonl").read_text().splitlines(keepends=True)[0])(folder)


def _other_target(folder):
    return ["--target", part_copy(folder.parent, "target", lambda raw: raw.update(rms_norm_eps=1e-5))]


def _foreign_scorer(folder):
    """The embedded scorer, recorded as fitted on a target with other embedding weights."""
    def edit(raw):
        raw["training"]["target"]["embed_probe"] = [x + 0.05 for x in raw["training"]["target"]["embed_probe"]]
    return ["--policy", "taps", "--scorer", part_copy(folder.parent, "scorer_greedy", edit, "foreign_scorer")]


# (case, prepare(folder) -> extra args or None, message regex)
CASES = [
    ("out is the prompt file", lambda d: ["--out", d / "in.jsonl"],
     r"--out .*in.jsonl would overwrite the prompt file .*in.jsonl \(.*\); give the results another path"),
    ("out is someone's notes", lambda d: _notes(d),
     r"refusing to overwrite .*notes.txt: it has no job manifest \(notes.txt.job.json\), so it is not a taps-decode "
     r"output; give the results another --out \(or pass --force-new to move it aside to notes.txt.old1\)"),
    ("garbage line in the middle", _insert_garbage,
     r"out.jsonl:2: not a result line \(malformed JSON: Expecting value at column 1\); nothing was changed; fix or "
     r"remove that line, or pass --force-new"),
    ("id not in the input", _append('{"id": "zz", "text": "x"}\n'),
     r"out.jsonl:4: id 'zz' is not a prompt of .*in.jsonl; nothing was changed"),
    ("id twice", _duplicate_first_line, r"out.jsonl:4: id .* again \(first on line 1\); nothing was changed"),
    ("other max-new-tokens", lambda d: ["--max-new-tokens", "5"],
     r"out.jsonl was written with other settings \(max_new_tokens was 4, this run has 5\); to keep it, give this run "
     r"another --out; to start over, pass --force-new \(moves it and its manifest aside to out.jsonl.old1\)"),
    ("other temperature", lambda d: ["--temperature", "0.5"], r"\(temperature was 0.0, this run has 0.5\)"),
    ("other policy", lambda d: ["--policy", "ddtree"], r"\(policy was 'ar', this run has 'ddtree'\)"),
    ("other model", _other_target, r"\(models.target was '\w{16}', this run has '\w{16}'\)"),
    ("other dtype", lambda d: ["--dtype", "bfloat16"], r"\(dtype was 'float32', this run has 'bfloat16'\)"),
    ("input file changed", lambda d: _append_prompt(d), r"\(input.sha256 was '\w{16}', this run has '\w{16}'\)"),
    ("out in a place nobody can write", lambda d: ["--out", "/sys/taps-job/out.jsonl"],
     r"cannot write /sys/taps-job/out.jsonl: cannot create files in /sys \(.+\); choose another output path"),
    ("out under a file", lambda d: ["--out", d / "in.jsonl" / "out.jsonl"],
     r"cannot write .*in.jsonl/out.jsonl: .*in.jsonl is not a directory; choose another output path"),
    ("out is a directory", lambda d: ["--out", d], r"job is a directory; give a file name for the output"),
    ("out is a device", lambda d: ["--out", "/dev/null"], r"/dev/null is not a regular file; .* give a file path"),
    ("shard out of range", lambda d: ["--shard", "2/2"], r"argument --shard: shard 2/2: need 0 <= I < N"),
    ("scorer fitted on another target", _foreign_scorer,
     r"the scorer .*foreign_scorer was fitted on another target \(the embedding entries it recorded, .*, are not "
     r"this target's, .*\); train a scorer for this target .* or use policy 'ddtree'"),
]


def _notes(folder):
    (folder / "notes.txt").write_text("my notes\n")
    return ["--out", folder / "notes.txt"]


def _append_prompt(folder):
    with (folder / "in.jsonl").open("a") as f:
        f.write('{"id": "new", "prompt": "y = "}\n')


@pytest.mark.parametrize("case, prepare, message", CASES, ids=[c[0] for c in CASES])
def test_job_mistakes_are_refused_and_touch_nothing(job, capsys, case, prepare, message):
    extra = prepare(job) or []
    before = files_of(job)
    status, err = taps_decode(capsys, *job_args(job), *extra)
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("taps-decode: error: "), err
    assert re.search(message, err), err
    assert files_of(job) == before


def test_force_new_moves_the_old_output_aside_and_starts_over(job, capsys):
    before = files_of(job)
    status, err = taps_decode(capsys, *job_args(job, "--max-new-tokens", "5", "--force-new"))
    assert status == 0, err
    assert "--force-new: moved the old" in err and "out.jsonl.old1" in err
    after = files_of(job)
    assert after["out.jsonl.old1"] == before["out.jsonl"]
    assert after["out.jsonl.old1.job.json"] == before["out.jsonl.job.json"]
    rows = [json.loads(line) for line in after["out.jsonl"].decode().splitlines()]
    assert sorted(map(str, (r["id"] for r in rows))) == ["3", "a", "b"] and {r["num_tokens"] for r in rows} == {5}


def test_only_a_torn_last_line_is_cut_on_resume(job, capsys):
    lines = (job / "out.jsonl").read_bytes().splitlines(keepends=True)
    (job / "out.jsonl").write_bytes(b"".join(lines[:2]) + lines[2][:15])  # the kill cut the last write
    manifest = (job / "out.jsonl.job.json").read_bytes()
    status, err = taps_decode(capsys, *job_args(job))
    assert status == 0, err
    assert "cutting 15 bytes of a torn last line" in err and "2 prompts already done" in err
    data = (job / "out.jsonl").read_bytes()
    assert data.startswith(b"".join(lines[:2])) and sorted(data.splitlines(keepends=True)) == sorted(lines)
    assert (job / "out.jsonl.job.json").read_bytes() == manifest


def test_an_empty_output_file_is_adopted(tmp_path, capsys, finished_job):
    shutil.copy(finished_job / "in.jsonl", tmp_path / "in.jsonl")
    (tmp_path / "out.jsonl").touch()  # e.g. from mktemp: nothing in it to lose
    status, err = taps_decode(capsys, *job_args(tmp_path))
    assert status == 0, err
    assert (tmp_path / "out.jsonl").read_bytes() == (finished_job / "out.jsonl").read_bytes()


# --------------------------------------------------------------------------- text in, text out


def test_prompt_with_invalid_utf8_is_one_line(tmp_path):
    """Real argv bytes: Python hands them over as surrogates, which the tokenizer used to choke on."""
    res = subprocess.run([sys.executable.encode(), b"-m", b"decode.cli", b"--prompt", b"caf\xe9 au lait", b"--policy",
                          b"ar"], cwd=REPO, capture_output=True)
    assert res.returncode == 2
    err = res.stderr.decode()
    assert err == ("taps-decode: error: --prompt is not valid UTF-8 text (byte 0xe9 at character 4); give text, or "
                   'for raw token ids use --prompts FILE with {"ids": [...]} lines\n')


def test_prompt_file_with_invalid_utf8_names_file_and_line(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    before = files_of(tmp_path)
    status, err = taps_decode(capsys, *job_args(tmp_path))
    assert status == 2 and files_of(tmp_path) == before
    assert err == (f"taps-decode: error: {tmp_path}/in.jsonl:2: not valid UTF-8 (byte 0xe9 at column 16); prompts "
                   'are UTF-8 text; for raw token ids use {"ids": [...]} lines\n')


# --------------------------------------------------------------------------- output paths of the other tools


@pytest.mark.parametrize("tool, argv, message", [
    (bench.main, ["--json", "/sys/taps/bench.json"], r"cannot write /sys/taps/bench.json: cannot create files in /sys"),
    (bench.main, ["--plot", "{d}"], r"{d} is a directory; give a file name for the output"),
    (longrun.main, ["--json", "{d}/notes.txt/longrun.json"], r"{d}/notes.txt is not a directory"),
])
def test_decode_tools_check_outputs_before_any_work(tmp_path, capsys, tool, argv, message):
    (tmp_path / "notes.txt").write_text("mine\n")
    before = files_of(tmp_path)
    with pytest.raises(SystemExit) as e:
        run(lambda: tool([a.format(d=tmp_path) for a in argv]), "tool")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and re.search(message.format(d=re.escape(str(tmp_path))), err)
    assert files_of(tmp_path) == before


@pytest.mark.parametrize("module, argv", [
    ("train.target", ["--out", "{d}/notes.txt"]),
    ("train.distill", ["--target", "t", "--out", "{d}/notes.txt"]),
    ("train.scorer", ["--traces", "t", "--target", "t", "--out", "{d}/notes.txt/run"]),
    ("train.traces", ["--target", "t", "--drafter", "d", "--prompts", "p", "--out", "/sys/taps/traces"]),
    ("train.recipe", ["--work", "{d}/notes.txt"]),
])
def test_training_commands_check_outputs_before_any_work(tmp_path, capsys, module, argv):
    import importlib

    (tmp_path / "notes.txt").write_text("mine\n")
    before = files_of(tmp_path)
    assert importlib.import_module(module).main([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(r"error: (cannot write .*: .* is not a directory|.*notes.txt exists and "
                                              r"is not a directory|cannot write /sys/taps/traces: cannot create files)",
                                              err), err
    assert files_of(tmp_path) == before


# --------------------------------------------------------------------------- parts that belong together


def test_model_type_must_agree_with_architectures(tmp_path, capsys):
    target = part_copy(tmp_path, "target", lambda raw: raw.update(model_type="gpt2"))
    status, err = taps_decode(capsys, "--target", target, "--policy", "ar", "--prompt", "x", "--max-new-tokens", "2")
    assert status == 2 and err == (f"taps-decode: error: {target}/config.json: model_type 'gpt2' does not match "
                                   "architectures ['Qwen3ForCausalLM'] (model_type 'qwen3'); fix the config so both "
                                   "name the same model\n")


def test_scorer_probe_of_the_loaded_target_matches_the_checkpoints():
    """The in-memory check (for the API) and the file check (for the CLI) see the same 12 entries."""
    import numpy as np

    from taps_jax import load_target
    from taps_jax.checkpoints.scorer import checkpoint_embed_probe, embed_probe, load_scorer

    scorer = load_scorer(DEFAULT_MODEL_DIR / "scorer")
    for dtype in ("float32", "bfloat16"):
        table = load_target(DEFAULT_MODEL_DIR / "target", dtype).model.embed_tokens.embedding.get_value()
        assert embed_probe(table) == checkpoint_embed_probe(DEFAULT_MODEL_DIR / "target") == scorer.target_probe
        scorer.check_target_embedding(table)
    with pytest.raises(ValueError, match=r"this scorer was fitted on another target .* or use policy 'ddtree'"):
        scorer.check_target_embedding(np.asarray(table) * 1.5)


def test_api_refuses_a_scorer_fitted_on_another_target(tmp_path):
    """SpeculativeDecoder and load_model_set run the same probe check as the CLI."""
    import dataclasses

    from taps_jax.checkpoints.scorer import load_scorer
    from taps_jax.decoder import SpeculativeDecoder, load_model_set

    models = load_model_set(DEFAULT_MODEL_DIR)
    good = models.scorer_for(0.0)
    SpeculativeDecoder(models.target, models.drafter, "taps", 16, scorer=good)
    training = json.loads(json.dumps(good.training))
    training["target"]["embed_probe"] = [x + 0.05 for x in training["target"]["embed_probe"]]
    foreign = dataclasses.replace(good, training=training)
    with pytest.raises(ValueError, match=r"this scorer was fitted on another target .* or use policy 'ddtree'"):
        SpeculativeDecoder(models.target, models.drafter, "taps", 16, scorer=foreign)
    folder = tmp_path / "set"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    foreign.save(folder / "scorer")
    assert load_scorer(folder / "scorer").target_probe == training["target"]["embed_probe"]
    with pytest.raises(ValueError, match=r"the model set's parts do not fit together: this scorer was fitted on "
                                         r"another target"):
        load_model_set(folder)
