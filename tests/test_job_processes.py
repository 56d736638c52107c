"""Jobs as real processes: one writer per output (flock), and shards killed, resumed and merged."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from decode import merge
from decode.common import run
from decode.jobs import JobSettings, Shard, build_manifest
from process_helpers import run_two_hosts
from spec_helpers import tiny_pair

REPO = Path(__file__).resolve().parent.parent
VOCAB = 16
NEW = 6
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
# Lengths in three length buckets: a job compiles as it goes, so after its first line it is still busy.
LENGTHS = [4, 9, 12, 14, 20, 25]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target without tokenizer (prompts are ids, results token_ids), a prompt file, the reference."""
    root = tmp_path_factory.mktemp("jobs")
    target, _ = tiny_pair(VOCAB)
    target.save(root / "target")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB - 1, n).tolist() for n in LENGTHS]
    (root / "in.jsonl").write_text("".join(json.dumps({"id": i, "ids": p}) + "\n" for i, p in enumerate(prompts)))
    return root, dict(enumerate(target.generate(prompts, NEW).tokens))


def job_cmd(root: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, "-m", "decode.cli", "--target", str(root / "target"), "--policy", "ar",
            "--prompts", str(root / "in.jsonl"), "--out", str(out), "--batch-size", "1",
            "--max-new-tokens", str(NEW), *extra]


def start_and_wait_for_first_line(cmd, out: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            return proc
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"the job wrote nothing or ended early: {proc.stderr.read().decode()[-2000:]}")


def rows(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n"), "torn last line"
    return [json.loads(line) for line in text.splitlines()]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_second_job_on_the_same_output_stops_at_once_naming_the_holder(setup, tmp_path):
    root, want = setup
    out = tmp_path / "out.jsonl"
    first = start_and_wait_for_first_line(job_cmd(root, out), out)
    try:
        os.kill(first.pid, signal.SIGSTOP)  # holds the lock, writes nothing while the second one runs
        before = files_of(tmp_path)
        second = subprocess.run(job_cmd(root, out), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        assert (f"taps-decode: error: {out} is being written by another job (pid {first.pid} on "
                f"{socket.gethostname()}, lock {out}.lock); one job per output") in second.stderr
        assert files_of(tmp_path) == before
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=120) == 0, first.stderr.read().decode()[-2000:]
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
            first.wait()
        first.stderr.close()
    assert {r["id"]: r["token_ids"] for r in rows(out)} == want and len(rows(out)) == len(want)


def test_shard_killed_resumed_and_merged_has_every_id_once(setup, tmp_path, capsys):
    root, want = setup
    outs = [tmp_path / f"out_{i}.jsonl" for i in range(2)]
    killed = start_and_wait_for_first_line(job_cmd(root, outs[0], "--shard", "0/2"), outs[0])
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    killed.stderr.close()
    done = len(rows(outs[0]))
    assert 1 <= done < 3, "the kill should land mid-shard"
    with outs[0].open("ab") as f:  # and a torn line, as if the kill had cut a write
        f.write(b'{"id": 2, "token_ids": [1, 2')
    resumed = subprocess.run(job_cmd(root, outs[0], "--shard", "0/2"), cwd=REPO, env=ENV, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{done} prompts already done" in resumed.stderr and "cutting 28 bytes of a torn last line" in resumed.stderr
    other = subprocess.run(job_cmd(root, outs[1], "--shard", "1/2"), cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=300)
    assert other.returncode == 0, other.stderr[-2000:]
    assert sorted(r["id"] for r in rows(outs[0])) == [0, 2, 4] and sorted(r["id"] for r in rows(outs[1])) == [1, 3, 5]

    merged = tmp_path / "all.jsonl"
    res = subprocess.run([sys.executable, "-m", "decode.merge", *map(str, outs[::-1]), "--out", str(merged)],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"merged 6 prompts from 2 shards into {merged}" in res.stdout
    got = rows(merged)
    assert [r["id"] for r in got] == list(range(6))  # every id exactly once, in input order
    assert {r["id"]: r["token_ids"] for r in got} == want
    shard_lines = set(outs[0].read_text().splitlines()) | set(outs[1].read_text().splitlines())
    assert set(merged.read_text().splitlines()) == shard_lines  # lines copied verbatim
    # The merged file is what an unsharded job with these settings owns: that job finds it done.
    assert json.loads((tmp_path / "all.jsonl.job.json").read_text())["settings"]["shard"] is None
    capsys.readouterr()
    from decode import cli

    with pytest.raises(SystemExit) as e:
        run(lambda: cli.main(job_cmd(root, merged)[3:]), "taps-decode")
    assert e.value.code == 0 and "all 6 prompts are already done" in capsys.readouterr().err


# --------------------------------------------------------------------------- merge refusals (no decoding)


def fake_shards(folder: Path, count: int = 2, changes: dict[int, dict] | None = None) -> list[Path]:
    """Shard outputs with manifests as taps-decode writes them, and made-up result lines.

    changes: shard index -> JobSettings.create keyword arguments that differ for it.
    """
    prompts = folder / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(5)))
    from taps_jax.prompt_file import read_prompt_file

    outs = []
    for i in range(count):
        shard = Shard(i, count)
        settings = JobSettings.create(**{"models": {"target": "t0"}, "policy": "ar", "budget": 32, "dtype": "float32",
                                         "max_new_tokens": 4, **(changes or {}).get(i, {})})
        picked = shard.select(read_prompt_file(prompts))
        out = folder / f"out_{i}.jsonl"
        out.write_text("".join(json.dumps({"id": p.id, "text": "x"}) + "\n" for p in picked))
        manifest = build_manifest(settings, prompts, 5, shard)
        (folder / f"out_{i}.jsonl.job.json").write_text(json.dumps(manifest))
        (folder / f"out_{i}.jsonl.lock").write_text("pid 1 on h\n")  # a finished job leaves its lock file
        outs.append(out)
    return outs


def merge_cli(*argv) -> int:
    with pytest.raises(SystemExit) as e:
        run(lambda: merge.main([str(a) for a in argv]), "python -m decode.merge")
    return e.value.code


@pytest.mark.parametrize("case, message", [
    ("one shard missing", r"shard 1/2 is missing; give all 2 shard outputs"),
    ("settings differ", r"out_1.jsonl was decoded with other settings than .*out_0.jsonl \(max_new_tokens 5 vs 4\)"),
    ("unfinished shard", r"out_1.jsonl lacks 1 of the 2 prompts of shard 1/2 \(ids 3\); rerun its job to finish"),
    ("torn shard", r"out_1.jsonl ends in a torn line: its job was interrupted; rerun it to finish"),
    ("no manifest", r"out_1.jsonl has no job manifest \(out_1.jsonl.job.json\), so it is not a taps-decode"),
    ("out exists", r"refusing to overwrite .*all.jsonl: give the merged file a new --out"),
    ("input changed", r"in.jsonl is not the prompt file the shards were decoded from"),
    ("shard running", r"out_0.jsonl is being written by another job \(pid \d+ on "),
])
def test_merge_refuses_and_writes_nothing(tmp_path, capsys, case, message):
    outs = fake_shards(tmp_path, changes={1: {"max_new_tokens": 5}} if case == "settings differ" else None)
    all_out = tmp_path / "all.jsonl"
    if case == "one shard missing":
        outs = outs[:1]
    elif case == "unfinished shard":
        outs[1].write_text(outs[1].read_text().splitlines(keepends=True)[0])
    elif case == "torn shard":
        outs[1].write_text(outs[1].read_text()[:-3])
    elif case == "no manifest":
        (tmp_path / "out_1.jsonl.job.json").unlink()
    elif case == "out exists":
        all_out.write_text("keep me\n")
    elif case == "input changed":
        with (tmp_path / "in.jsonl").open("a") as f:
            f.write('{"prompt": "new"}\n')
    before = files_of(tmp_path)
    holder = None
    if case == "shard running":  # another process holds the shard's lock, as its job would
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                                   "os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
                                   "os.write(fd, f'pid {os.getpid()} on h'.encode()); print(1, flush=True); "
                                   "time.sleep(60)", f"{outs[0]}.lock"], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "1"
        before = files_of(tmp_path)
    try:
        assert merge_cli(*outs, "--out", all_out) == 2
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m decode.merge: error: ")
    assert re.search(message, err), err
    assert files_of(tmp_path) == before


def test_merge_of_fake_shards_is_in_input_order(tmp_path, capsys):
    outs = fake_shards(tmp_path, count=3)
    assert merge_cli(*outs, "--out", tmp_path / "all.jsonl") == 0
    assert [r["id"] for r in rows(tmp_path / "all.jsonl")] == list(range(5))


def test_multi_host_job_refused_by_process_0_stops_every_process(setup, tmp_path):
    """Process 0 alone checks the output; it tells the others it refused, so none waits on it."""
    root, _ = setup
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    codes, errs = run_two_hosts(job_cmd(root, notes), ENV, timeout=120)
    assert codes == [2, 2], errs
    assert f"taps-decode: error: refusing to overwrite {notes}: it has no job manifest" in errs[0]
    assert f"taps-decode: error: process 0 refused the job on {notes} (its error says why)" in errs[1]
    assert notes.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
