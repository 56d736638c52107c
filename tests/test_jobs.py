"""Decoding jobs (`taps-decode --prompts IN --out OUT`): batching, output, restart after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from decode import jobs
from process_helpers import run_two_hosts
from spec_helpers import tiny_pair
from taps_jax.decoder import SpeculativeDecoder

REPO = Path(__file__).resolve().parent.parent
VOCAB = 16
NEW = 6


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_rows(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), "torn last line"
    return [json.loads(line) for line in text.splitlines()]


def test_read_job_prompts_ids_and_errors(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"id": "x", "prompt": "b"}, {"ids": [1, 2]}])
    got = jobs.read_prompt_file(f)
    assert [(p.id, p.prompt) for p in got] == [(0, "a"), ("x", "b"), (2, [1, 2])]
    write_jsonl(f, [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    with pytest.raises(ValueError, match=r"in.jsonl:2: duplicate id 1 \(first on line 1\)"):
        jobs.read_prompt_file(f)
    f.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="in.jsonl:2: malformed JSON"):
        jobs.read_prompt_file(f)
    write_jsonl(f, [{"id": [1], "prompt": "a"}])
    with pytest.raises(ValueError, match="must be a string or an integer"):
        jobs.read_prompt_file(f)


@pytest.mark.parametrize("line, message", [
    (b'{"prompt": "caf\xe9"}', r"in.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\); prompts are UTF-8 text; "
                                r"for raw token ids use \{\"ids\": \[...\]\} lines$"),
    (b'{"prompt": "x\\ud800"}', r"in.jsonl:2: the prompt is not valid UTF-8 text \(unpaired surrogate \\ud800 at "
                                 r"character 2\); .*\{\"ids\": \[...\]\}"),
    # The reason is whole ("Invalid control character at" alone ends mid-sentence) and says where.
    (b'{"prompt": "a\tb"}', r"in.jsonl:2: malformed JSON \(Invalid control character at column 14\); each line "
                            r"must be \{\"prompt\": \"...\"\}, \{\"ids\": \[...\]\} or \{\"messages\": \[\{\"role\": ..., "
                            r"\"content\": ...\}, ...\]\} with an optional \"id\"$"),
])
def test_prompt_file_errors_name_file_and_line_and_print_whole(tmp_path, line, message):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n' + line + b"\n")
    with pytest.raises(ValueError, match=message):
        jobs.read_prompt_file(f)


def test_scan_output_trims_only_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    ids = {jobs.prompt_key(i) for i in (0, "1", 2)}
    good = b'{"id": 0, "text": "a"}\n\n{"id": "1", "text": "b"}\n'
    out.write_bytes(good + b'{"id": 2, "te')
    assert jobs.scan_output(out, ids, "in.jsonl", None) == ({"0", '"1"'}, len(good))
    out.write_bytes(b'{"id": 0}\n{"id": 2}')  # complete JSON but no newline: the write was cut
    assert jobs.scan_output(out, ids, "in.jsonl", None) == ({"0"}, 10)
    assert jobs.scan_output(tmp_path / "missing.jsonl", ids, "in.jsonl", None) == (set(), 0)
    for data, message in [
        (b'{"id": 0}\ngarbage\n{"id": 2}\n', r"out.jsonl:2: not a result line \(malformed JSON: Expecting value at "
                                             r"column 1\); nothing was changed"),
        (b'{"id": 0}\n[1]\n', r"out.jsonl:2: not a result line \(not an object with an \"id\"\)"),
        (b'{"id": 0}\n{"id": 7}\n', r"out.jsonl:2: id 7 is not a prompt of in.jsonl; nothing was changed"),
        (b'{"id": 0}\n{"id": "1"}\n{"id": 0}\n', r"out.jsonl:3: id 0 again \(first on line 1\)"),
    ]:
        out.write_bytes(data)
        with pytest.raises(ValueError, match=message):
            jobs.scan_output(out, ids, "in.jsonl", None)
        assert out.read_bytes() == data


def test_shards_split_the_prompts_by_id():
    prompts = [jobs.PromptRecord(i, "p") for i in (5, "a", 3, 0, "b", 9, 1)]
    parts = [jobs.Shard(i, 3).select(prompts) for i in range(3)]
    keys = sorted(jobs.prompt_key(p.id) for p in prompts)
    assert sorted(jobs.prompt_key(p.id) for part in parts for p in part) == keys
    assert [len(part) for part in parts] == [3, 2, 2]
    assert jobs.Shard(1, 3).select(prompts[::-1]) == parts[1][::-1]  # by id, not by line
    assert jobs.Shard.parse("2/4") == jobs.Shard(2, 4) and str(jobs.Shard(2, 4)) == "2/4"
    for bad, message in [("4/4", "need 0 <= I < N"), ("1", "expects I/N"), ("a/b", "expects I/N")]:
        with pytest.raises(ValueError, match=message):
            jobs.Shard.parse(bad)


def test_plan_batches_in_length_order_one_batch_shape():
    items = [(jobs.PromptRecord(i, f"p{i}"), n) for i, n in enumerate([3, 40, 5, 17, 16, 2, 33, 1, 9])]
    batches = jobs.plan_batches(items, batch_size=2)
    # Cut in length order across buckets (16 and 17 share a batch): no bucket leaves a short batch of its own.
    assert [[p.id for p in b] for b in batches] == [[7, 5], [0, 2], [8, 4], [3, 6], [1]]
    # The last batch is topped up with copies of its first prompt: the same batch shape as the others.
    assert jobs.batch_prompts(batches[-1], 2) == ["p1", "p1"] and jobs.batch_prompts(batches[0], 2) == ["p7", "p5"]
    assert jobs.batch_prompts(batches[-1], 0) == ["p1"]  # a lone batch is not topped up


def test_run_job_writes_each_prompt_once_and_resumes(tmp_path):
    target, _ = tiny_pair(VOCAB)
    decoder = SpeculativeDecoder(target, None, "ar")
    prompts = [[1 + i % 7] * (1 + i) for i in range(4)]
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "ids": p} for i, p in enumerate(prompts)])
    out = tmp_path / "out.jsonl"
    want = target.generate(prompts[:2], NEW).tokens + target.generate(prompts[2:], NEW).tokens  # the job's shapes
    s = jobs.run_job(decoder, f, out, batch_size=2, max_new_tokens=NEW, progress=False)
    assert s["written"] == 4 and s["skipped"] == 0 and s["tokens"] == 4 * NEW
    rows = {r["id"]: r for r in read_rows(out)}
    assert [rows[f"q{i}"]["token_ids"] for i in range(4)] == want
    assert all(r["num_tokens"] == NEW and r["finish_reason"] == "length" and r["tau"] == 1.0 for r in rows.values())
    manifest = json.loads((tmp_path / "out.jsonl.job.json").read_text())["settings"]
    assert manifest["policy"] == "ar" and manifest["max_new_tokens"] == NEW and manifest["input"]["prompts"] == 4
    assert manifest["budget"] is None and manifest["seed"] is None and set(manifest["models"]) == {"target"}
    # Drop one result and tear the next line: a rerun redoes exactly those two.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])
    s = jobs.run_job(decoder, f, out, batch_size=2, max_new_tokens=NEW, progress=False)
    assert s["skipped"] == 2 and s["written"] == 2
    rows = read_rows(out)
    assert out.read_text().startswith("".join(lines[:2]))
    assert sorted(r["id"] for r in rows) == [f"q{i}" for i in range(4)]
    assert {r["id"]: r["token_ids"] for r in rows} == {f"q{i}": want[i] for i in range(4)}
    assert jobs.run_job(decoder, f, out, batch_size=2, max_new_tokens=NEW, progress=False)["written"] == 0


def test_a_job_shares_programs_and_reports_them(tmp_path, capsys):
    """Static batches in length order, the last one topped up: one program per (prompt buffer, cache) shape,
    listed. Refilled rows (the default): one run per prompt bucket, its cache sized for the bucket's longest."""
    target, _ = tiny_pair(VOCAB)
    decoder = SpeculativeDecoder(target, None, "ar")
    lengths = [12, 9, 12, 9, 12]  # prompt buffer 16 for all; cache 16 (9 + NEW) or 32 (12 + NEW)
    f = write_jsonl(tmp_path / "in.jsonl", [{"ids": [1 + i] * n} for i, n in enumerate(lengths)])
    s = jobs.run_job(decoder, f, tmp_path / "out.jsonl", batch_size=2, max_new_tokens=NEW, static_batches=True)
    assert s["written"] == 5 and s["programs"] == 2  # the lone 12-token prompt runs the full batch's program
    err = capsys.readouterr().err
    assert "2 decode programs (batch x prompt buffer x cache slots: 2x16x16, 2x16x32)" in err
    assert "slot utilisation 83%" in err  # 3 batches x 2 rows x 5 steps; the last batch's copy rides along
    rows = {r["id"]: r["token_ids"] for r in read_rows(tmp_path / "out.jsonl")}
    alone = target.generate([[1 + 4] * 12], NEW).tokens[0]  # the topped-up batch's copies change nothing
    assert rows[4] == alone and len(rows) == 5
    s = jobs.run_job(decoder, f, tmp_path / "refilled.jsonl", batch_size=2, max_new_tokens=NEW)
    assert s["written"] == 5 and s["programs"] == 1 and s["utilisation"] > 0.8
    assert "1 decode program (batch x prompt buffer x cache slots: 2x16x32)" in capsys.readouterr().err
    assert {r["id"]: r["token_ids"] for r in read_rows(tmp_path / "refilled.jsonl")} == rows


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_sets_tables_are_recorded_for_the_sampled_runs_they_shape():
    from decode.cli import build_parser
    from decode.common import model_part_dirs
    from taps_jax.model_sets import resolve_set

    dirs = model_part_dirs(build_parser().parse_args(["--model", "smollm2", "--policy", "adaptive"]))
    assert dirs["lookup"] == resolve_set("smollm2") / "lookup.json" and dirs["adaptive"].name == "adaptive.json"
    assert model_part_dirs(build_parser().parse_args(["--model", "smollm2", "--no-lookup"]))["lookup"] is None
    parts = {name: jobs.part_digest(d) for name, d in dirs.items()}
    assert parts["lookup"] != parts["adaptive"]  # a table file digests like a single-file checkpoint

    def recorded(policy, temperature, **changed):
        return set(jobs.JobSettings.create(dict(parts, **changed), policy, 8, "float32", 16, temperature).models)

    assert recorded("adaptive", 1.0) == {"target", "drafter", "scorer", "lookup", "adaptive"}
    assert recorded("ddtree", 1.0) == {"target", "drafter", "lookup"}
    # Greedy text is the target's whatever the tables say; a table not in use leaves no key (older manifests match).
    assert recorded("adaptive", 0.0) == recorded("adaptive", 1.0, lookup=None, adaptive=None) \
        == {"target", "drafter", "scorer"}


def test_run_job_refuses_what_is_not_its_own_and_force_new_moves_aside(tmp_path):
    """The API form of the refusals: ValueError, and every file byte-identical (none created)."""
    target, drafter = tiny_pair(VOCAB)
    ar = SpeculativeDecoder(target, None, "ar")
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "ids": [1 + i, 2]} for i in range(3)])
    out = tmp_path / "out.jsonl"
    jobs.run_job(ar, f, out, max_new_tokens=NEW, progress=False)
    (tmp_path / "notes.txt").write_text("my notes\n")
    other_target, _ = tiny_pair(VOCAB, seed=5)  # same shapes, other weights
    cases = [
        (lambda: jobs.run_job(ar, f, f, max_new_tokens=NEW, progress=False), "would overwrite the prompt file"),
        (lambda: jobs.run_job(ar, f, tmp_path / "notes.txt", max_new_tokens=NEW, progress=False),
         r"refusing to overwrite .*notes.txt: it has no job manifest \(notes.txt.job.json\)"),
        (lambda: jobs.run_job(ar, f, out, max_new_tokens=NEW + 1, progress=False),
         rf"out.jsonl was written with other settings \(max_new_tokens was {NEW}, this run has {NEW + 1}\); .*"
         r"--force-new \(moves it and its manifest aside to out.jsonl.old1\)"),
        (lambda: jobs.run_job(ar, f, out, max_new_tokens=NEW, temperature=1.0, progress=False),
         r"temperature was 0.0, this run has 1.0"),
        (lambda: jobs.run_job(SpeculativeDecoder(target, drafter, "chain", 4), f, out, max_new_tokens=NEW,
                              progress=False), r"policy was 'ar', this run has 'chain'"),
        (lambda: jobs.run_job(SpeculativeDecoder(other_target, None, "ar"), f, out, max_new_tokens=NEW,
                              progress=False), r"models.target was '\w+', this run has '\w+'"),
        (lambda: jobs.run_job(ar, f, out, max_new_tokens=NEW, temperature=float("nan"), progress=False),
         "temperature must be a finite number"),
    ]
    before = snapshot(tmp_path)
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert snapshot(tmp_path) == before
    jobs.run_job(ar, f, out, max_new_tokens=NEW + 1, force_new=True, progress=False)
    after = snapshot(tmp_path)
    assert after["out.jsonl.old1"] == before["out.jsonl"]
    assert after["out.jsonl.old1.job.json"] == before["out.jsonl.job.json"]
    assert all(r["num_tokens"] == NEW + 1 for r in read_rows(out)) and len(read_rows(out)) == 3


def test_sigkill_then_rerun_loses_and_duplicates_nothing(tmp_path):
    """Run the CLI job in a subprocess, SIGKILL it after its first lines, rerun: each id exactly once.

    The rerun is a 2-process multi-host job (`--distributed`, one CPU device
    per process, a (2,1) mesh across them), as when a preempted pod job
    restarts on all its hosts: process 0 finds what is done and broadcasts
    it, both decode the rest, only process 0 writes.
    """
    target, _ = tiny_pair(VOCAB)
    target.save(tmp_path / "target")  # no tokenizer: the job reads token ids and writes token_ids
    rng = np.random.default_rng(0)
    # Batches of three shapes (length bucket, cache capacity): the job compiles as it goes, so after its first
    # lines it is busy compiling the next shape when the kill comes.
    lengths = [4, 9, 12, 14, 20, 25]
    prompts = [rng.integers(0, VOCAB - 1, n).tolist() for n in lengths]
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "ids": p} for i, p in enumerate(prompts)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "decode.cli", "--target", str(tmp_path / "target"), "--policy", "ar",
           "--prompts", str(f), "--out", str(out), "--batch-size", "2", "--max-new-tokens", str(NEW)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.01)
        assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    proc.stderr.close()
    first = read_rows(out)
    assert 1 <= len(first) < len(prompts), "the kill should land mid-job"
    with out.open("ab") as fh:  # and a torn line, as if the kill had cut a write
        fh.write(b'{"id": 999, "token_ids": [1, 2')
    codes, errs = run_two_hosts(cmd, env, timeout=300)
    assert codes == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert f"{len(first)} prompts already done" in errs[0] and "already done" not in errs[1]
    rows = read_rows(out)  # every line parses, none torn
    assert sorted(r["id"] for r in rows) == list(range(len(prompts)))  # each id exactly once
    want = target.generate(prompts, NEW).tokens
    assert {r["id"]: r["token_ids"] for r in rows} == dict(enumerate(want))
