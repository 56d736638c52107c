"""Decoding jobs (`taps-decode --prompts IN --out OUT`): batching, output, restart after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from decode import jobs
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


def test_recover_output_cuts_a_torn_tail(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": 0, "text": "a"}\n\n{"id": "1", "text": "b"}\n{"id": 2, "te')
    assert jobs.recover_output(out) == {"0", '"1"'}
    assert out.read_bytes() == b'{"id": 0, "text": "a"}\n\n{"id": "1", "text": "b"}\n'
    out.write_bytes(b'{"id": 0}\n{"id": 1}')  # complete JSON but no newline: the write was cut
    assert jobs.recover_output(out) == {"0"} and out.read_bytes() == b'{"id": 0}\n'
    assert jobs.recover_output(tmp_path / "missing.jsonl") == set()


def test_plan_batches_by_length_bucket():
    items = [(jobs.PromptRecord(i, "p"), n) for i, n in enumerate([3, 40, 5, 17, 16, 2, 33, 1])]
    batches = jobs.plan_batches(items, batch_size=2)
    assert [[p.id for p in b] for b in batches] == [[7, 5], [0, 2], [4], [3], [6, 1]]


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
    # Drop one result and tear the next line: a rerun redoes exactly those two.
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])
    s = jobs.run_job(decoder, f, out, batch_size=2, max_new_tokens=NEW, progress=False)
    assert s["skipped"] == 2 and s["written"] == 2
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == [f"q{i}" for i in range(4)]
    assert {r["id"]: r["token_ids"] for r in rows} == {f"q{i}": want[i] for i in range(4)}
    assert jobs.run_job(decoder, f, out, batch_size=2, max_new_tokens=NEW, progress=False)["written"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


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
    port = _free_port()
    hosts = [subprocess.Popen(cmd + ["--mesh", "2,1", "--distributed", "--coordinator", f"localhost:{port}",
                                     "--num-processes", "2", "--process-id", str(i)],
                              cwd=REPO, env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errs = [h.communicate(timeout=300)[1] for h in hosts]
    finally:
        for h in hosts:
            if h.poll() is None:
                h.kill()
                h.wait()
    assert [h.returncode for h in hosts] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert f"{len(first)} prompts already done" in errs[0] and "already done" not in errs[1]
    rows = read_rows(out)  # every line parses, none torn
    assert sorted(r["id"] for r in rows) == list(range(len(prompts)))  # each id exactly once
    want = target.generate(prompts, NEW).tokens
    assert {r["id"]: r["token_ids"] for r in rows} == dict(enumerate(want))
