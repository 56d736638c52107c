"""Decoding jobs over a prompt file: what a pod job runs (`taps-decode --prompts IN --out OUT`).

Input: JSONL, one object per line with a string "prompt" (or "ids", a list
of token ids) and an optional "id" (a string or an integer; default: the
prompt's 0-based position among the file's prompts). Ids must be unique.

Output: JSONL, one line per prompt, appended as soon as it finishes:
    {"id": ..., "text": "<continuation>", "num_tokens": N, "finish_reason": "eos"|"length"|"capacity",
     "tau": <mean accepted tokens per round for this prompt; 1.0 for ar>}
(plus "token_ids" when the target has no tokenizer).
Lines are in completion order, not input order (join on "id").

A job owns its output (DESIGN.md section 12). Beside OUT it keeps:
  OUT.job.json  the manifest: what produced OUT (input digest, model digests,
                policy, budget, sampling, max_new_tokens, dtype, seed, shard,
                package version). Written before OUT's first line, never rewritten.
  OUT.lock      flock'ed for the job's life (one writer per output; the OS
                releases it when the process dies); holds the holder's pid and host.
A run refuses, with a one-line ValueError and without changing any file: an
OUT that is the input file, an OUT that exists without a manifest (not
ours), a manifest with other settings, a line that is not one of our result
lines, an id that is not in the input (or this shard) or appears twice, an
output another job holds. `force_new` moves an existing OUT and manifest
aside (OUT.old1, OUT.old1.job.json, ...) and starts over; nothing is deleted.

Restart safety (preemption, SIGKILL, Ctrl-C): each group of finished prompts is written
with ONE append `write` of whole lines followed by `fsync`, so the only damage
an interruption can do is a torn last line (no trailing newline). That tail,
and nothing else, is cut on resume; prompts already in OUT are skipped.

Continuous batching (the default): the prompts, tokenized and sorted by
length, are one run on --batch-size rows in which a row that finishes
(EOS, its token limit) hands its result out and takes the next prompt
(`taps_jax.calls.Refilled`; the cache is sized for the longest prompt, as
the static batch holding it would be): the loop returns to the host once K rows have
finished (--refill-rows, default an eighth of the batch), their lines are
written in one append, and one compiled refill program prefills K new
prompts into those rows. Programs: start and until, compiled once for the
job's (batch rows, prompt buffer, cache slots), and refill, once per
prompt bucket of the prompts it fills (short prompts prefill short chunks).

Static batches (--static-batches; always on a data-parallel mesh): a
program is compiled per shape (batch rows, prompt buffer, cache slots; the
last two are powers of two of the longest prompt, and of it +
max_new_tokens + tree headroom). So prompts are tokenized, sorted by length
and cut into batches of --batch-size in that order: a batch holds prompts of nearby lengths (little padding) and the
batches of one length bucket share one program; the last batch is topped up
with copies of its first prompt (their results are dropped) so that it runs
the same batch shape as the others. A job of L length buckets compiles at
most about L programs (one more where a bucket's prompts straddle a cache
bucket), and calibrates the adaptive policy once per cache size. The decoder
pads a batch to a power of two and to a multiple of the mesh's data axis.

Shards (`Shard(i, n)`, `--shard I/N`): the prompts sorted by id, every n-th
from the i-th, each shard its own job with its own OUT; `decode.merge`
checks and joins them.

The summary's slot utilisation: the share of batch-row loop steps that
decoded a prompt (the rest: finished rows and padding riding along).

Multi-host: all processes run the same batches; process 0 alone checks, locks
and writes OUT, and broadcasts what is left (or that it refused, so no
process waits on it).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

from decode.common import check_output_path
from taps_jax.engine.batching import bucket
from taps_jax.prompt_file import PromptRecord, prompt_key, read_prompt_file

MANIFEST_FORMAT = "taps-jax-job"
MANIFEST_VERSION = 1
SET_TABLES = ("lookup", "adaptive")  # a model set's table files, recorded beside its checkpoint dirs
# Free disk a job asks for before starting: a generous bound on one result line.
BYTES_PER_TOKEN, BYTES_PER_LINE = 8, 256
SAMPLED_BLOCKS, BLOCK_BYTES = 16, 4096


# --------------------------------------------------------------------------- what a job is


@dataclasses.dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`: every count-th prompt in id order, from the index-th."""

    index: int
    count: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: need 0 <= I < N (I counts from 0)")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        try:
            index, count = (int(x) for x in text.split("/"))
        except ValueError:
            raise ValueError(f"--shard expects I/N (e.g. 0/4), got {text!r}") from None
        return cls(index, count)

    def select(self, prompts: list[PromptRecord]) -> list[PromptRecord]:
        """This shard's prompts, in file order; by id, so the split does not depend on line order."""
        ordered = sorted(range(len(prompts)), key=lambda i: prompt_key(prompts[i].id))
        mine = set(ordered[self.index::self.count])
        return [p for i, p in enumerate(prompts) if i in mine]

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What decides a job's results: recorded in its manifest, and a resume must match it field by field.

    models: part name -> digest (`part_digest` of a checkpoint dir or a set's
    table file, or `memory_digest`). Settings a run does not use are None, so
    they cannot block a resume: budget and the drafter for "ar", the scorer
    outside "taps", top_k, top_p and seed when greedy. The set's tables
    ("lookup": lookup.json, "adaptive": adaptive.json) are kept only for a
    sampled run that uses them: they shape the trees, so which random draws a
    sampled run makes, while a greedy run's text is the target's whatever
    they say (absent, not None, when unused: manifests from before them match).
    """

    policy: str
    budget: int | None
    models: dict
    dtype: str
    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    chat: bool | None = None  # True: "prompt" lines are chat-templated as one user turn (None, not False, when
    # off, so manifests written before the flag existed still match)

    @classmethod
    def create(cls, models: dict, policy: str, budget: int, dtype: str, max_new_tokens: int,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               chat: bool = False) -> "JobSettings":
        from taps_jax.engine.sampling import SamplingConfig

        SamplingConfig(temperature, top_k, top_p)  # bad values fail here, before a manifest records them
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        greedy = temperature == 0
        used = {"target": True, "drafter": policy != "ar", "scorer": policy in ("taps", "adaptive"),
                "lookup": policy != "ar" and not greedy, "adaptive": policy == "adaptive" and not greedy}
        models = {name: digest for name, digest in models.items()
                  if used.get(name, True) and not (name in SET_TABLES and digest is None)}
        return cls(policy, None if policy == "ar" else budget, models, dtype, max_new_tokens, float(temperature),
                   None if greedy else top_k, None if greedy else float(top_p), None if greedy else seed,
                   True if chat else None)

    @property
    def sampling(self) -> dict:
        """The `generate` keyword arguments (greedy ignores top_k, top_p and seed)."""
        return dict(temperature=self.temperature, top_k=self.top_k or 0,
                    top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed or 0)


@dataclasses.dataclass(frozen=True)
class JobFiles:
    """The output and the two files a job keeps beside it."""

    out: Path
    manifest: Path
    lock: Path

    @classmethod
    def beside(cls, out) -> "JobFiles":
        out = Path(out)
        return cls(out, out.with_name(out.name + ".job.json"), out.with_name(out.name + ".lock"))

    def aside(self) -> "JobFiles":
        """The first free OUT.oldK (with its own manifest name): where --force-new moves this output."""
        k = 1
        while True:
            moved = JobFiles.beside(self.out.with_name(f"{self.out.name}.old{k}"))
            if not moved.out.exists() and not moved.manifest.exists():
                return moved
            k += 1


# --------------------------------------------------------------------------- digests


def _sha(h) -> str:
    return h.hexdigest()[:16]


def file_digest(path) -> str:
    """sha256 (first 16 hex digits) of a whole file (the input file: small next to a job's work)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return _sha(h)


def part_digest(path) -> str:
    """A cheap digest of a checkpoint dir (target, drafter or scorer).

    Hashes every *.json file whole (config, generation config, tokenizer,
    safetensors index) and, for each *.safetensors file, its name, size,
    header (tensor names, dtypes, shapes, offsets) and 16 blocks of 4 KiB
    taken evenly through it: well under a MiB read per file, yet any
    re-export or retraining changes it. Not a hash of every weight byte.
    """
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file():  # a single-file checkpoint (GGUF): its name, size and sampled blocks
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for i in range(SAMPLED_BLOCKS):
                f.seek(max(size - BLOCK_BYTES, 0) * i // (SAMPLED_BLOCKS - 1))
                h.update(f.read(BLOCK_BYTES))
        return _sha(h)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {str(path)!r} does not exist or is not a directory; check the path")
    for file in sorted(path.glob("*.json")):
        h.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(header_len, 1 << 26)))
            for i in range(SAMPLED_BLOCKS):
                f.seek(max(size - BLOCK_BYTES, 0) * i // (SAMPLED_BLOCKS - 1))
                h.update(f.read(BLOCK_BYTES))
    return _sha(h)


def memory_digest(*parts) -> str:
    """A digest of in-memory model descriptions (configs, probes) for jobs started from the Python API."""
    return _sha(hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()))


def decoder_settings(decoder, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, seed: int = 0) -> JobSettings:
    """JobSettings of a decoder built in Python: each model part by its config (and the target by its
    embedding probe, which tells targets of one shape apart); the CLI digests checkpoint dirs instead."""
    from taps_jax.checkpoints.scorer import embed_probe

    target, drafter, scorer = decoder.target, decoder.drafter, getattr(decoder, "scorer", None)
    embed = target.model.embed_tokens.embedding.get_value()
    lookup, table = getattr(decoder, "lookup", None), getattr(decoder, "table", None)
    models = {"target": memory_digest(dataclasses.asdict(target.config), embed_probe(embed), target.eos_ids),
              "drafter": None if drafter is None else memory_digest(dataclasses.asdict(drafter.config)),
              "scorer": None if scorer is None else memory_digest(dataclasses.asdict(scorer.config), scorer.training),
              "lookup": None if lookup is None else memory_digest(lookup.agreed, lookup.tried),
              "adaptive": None if table is None else memory_digest(dataclasses.asdict(table))}
    budget = decoder.tree.budget if decoder.tree is not None else None
    return JobSettings.create(models, decoder.policy, budget, target.config.dtype, max_new_tokens, temperature,
                              top_k, top_p, seed)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("taps-jax")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def build_manifest(settings: JobSettings, prompts_path, prompts: int, shard: Shard | None) -> dict:
    """prompts: how many the input file holds (all shards together)."""
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "settings": {
            "input": {"sha256": file_digest(prompts_path), "prompts": prompts},
            "shard": None if shard is None else str(shard),
            **dataclasses.asdict(settings),
            "package_version": package_version(),
        },
        "input_path": str(Path(prompts_path).resolve()),  # where `decode.merge` finds the ids; not compared
    }


def read_manifest(file: Path) -> dict | None:
    """A manifest, None if absent; ValueError if it is there but not ours."""
    if not file.exists():
        return None
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a readable job manifest ({e}); move it away (it is not ours to "
                         "change)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{file}: not a taps-decode job manifest; move it away or choose another --out")
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{file}: job manifest version {manifest.get('version')!r}, this taps-decode writes "
                         f"{MANIFEST_VERSION}; resume with the version that started it, or pass --force-new")
    return manifest


def settings_diff(old, new, prefix: str = "") -> tuple[str, object, object] | None:
    """The first differing field between two settings dicts: (dotted name, old value, new value)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*new, *(k for k in old if k not in new)]:  # in the manifest's order: policy before models
            d = settings_diff(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
            if d:
                return d
        return None
    return None if old == new else (prefix, old, new)


def write_atomic(path: Path, data: bytes) -> None:
    """Write a whole file or nothing: temp file beside it, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- one writer


class JobLock:
    """An exclusive `flock` on OUT.lock: held while the job runs, dropped by the OS when the process dies.

    shared=True: a reader's lock (decode.merge), which no writer can take meanwhile; it records nothing.
    """

    def __init__(self, path: Path, what: Path, shared: bool = False):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ValueError(f"cannot open the lock file {path} ({e.strerror}); it is not ours: move it away or "
                             "give the results another --out") from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "a process that just started"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ValueError(f"{what} is being written by another job ({holder}, lock {path}); one job per "
                                 "output: wait for it to end or stop it, or give this run another --out") from None
            raise ValueError(f"cannot lock {path} ({e.strerror}); put --out on a filesystem with file locks") from None
        if not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the descriptor; the file stays (unlinking it would race)
            self.fd = None


# --------------------------------------------------------------------------- the output's own state


def scan_output(path: Path, ids: set[str], prompts_path, shard: Shard | None) -> tuple[set[str], int]:
    """(ids already written, bytes to keep) of our own output; ValueError on anything we did not write.

    ids: the prompt_keys of the prompts this job decodes. Every line
    ending in a newline must be a result line of one of them, each at most
    once; what follows the last newline (a torn write) is the only thing
    a resume may cut, so `keep` is the offset of that tail.
    """
    if not path.exists():
        return set(), 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    fix = "nothing was changed; fix or remove that line, or pass --force-new to move the file aside and start over"
    where = f"{prompts_path}" + (f" (shard {shard})" if shard else "")
    done: dict[str, int] = {}
    for lineno, raw in enumerate(data[:keep].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict) or "id" not in record:
                raise ValueError("not an object with an \"id\"")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
            raise ValueError(f"{path}:{lineno}: not a result line ({_reason(e)}); {fix}") from None
        key = prompt_key(record["id"])
        if key not in ids:
            raise ValueError(f"{path}:{lineno}: id {record['id']!r} is not a prompt of {where}; {fix}")
        if key in done:
            raise ValueError(f"{path}:{lineno}: id {record['id']!r} again (first on line {done[key]}); {fix}")
        done[key] = lineno
    return set(done), keep


def _reason(e: ValueError) -> str:
    from taps_jax.prompt_file import json_error

    if isinstance(e, json.JSONDecodeError):
        return f"malformed JSON: {json_error(e)}"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 at byte {e.start + 1}"
    return str(e)


def _same_file(a: Path, b: Path) -> bool:
    return a.exists() and b.exists() and os.path.samefile(a, b)


def check_ownership(files: JobFiles, prompts_path, manifest: dict, force_new: bool) -> dict | None:
    """ValueError unless OUT is ours with these settings (or new); returns the manifest found, if any.

    Read-only: safe to call before holding the lock, and again under it.
    """
    for f in (files.out, files.manifest, files.lock):
        if _same_file(f, Path(prompts_path)):
            raise ValueError(f"--out {files.out} would overwrite the prompt file {prompts_path} ({f} is that "
                             "file); give the results another path")
    if files.out.exists() and not files.out.is_file():
        raise ValueError(f"{files.out} is not a regular file; a job appends to, locks and repairs its output: "
                         "give a file path")
    old = read_manifest(files.manifest)
    if force_new:
        return old
    if old is None:
        if files.out.exists() and files.out.stat().st_size > 0:
            raise ValueError(f"refusing to overwrite {files.out}: it has no job manifest ({files.manifest.name}), so "
                             "it is not a taps-decode output; give the results another --out (or pass --force-new to "
                             f"move it aside to {files.aside().out.name})")
        return None
    diff = settings_diff(old.get("settings"), manifest["settings"])
    if diff:
        field, was, now = diff
        raise ValueError(f"{files.out} was written with other settings ({field} was {was!r}, this run has {now!r}); "
                         "to keep it, give this run another --out; to start over, pass --force-new (moves it and its "
                         f"manifest aside to {files.aside().out.name})")
    return old


def move_aside(files: JobFiles) -> JobFiles | None:
    """--force-new: rename OUT and its manifest to the first free OUT.oldK pair (never delete)."""
    if not files.out.exists() and not files.manifest.exists():
        return None
    moved = files.aside()
    for src, dst in ((files.manifest, moved.manifest), (files.out, moved.out)):
        if src.exists():
            os.rename(src, dst)
    return moved


# --------------------------------------------------------------------------- opening a job


class Job:
    """An opened job: its prompts still to do and, on process 0, the lock (and later the output descriptor).

    new_manifest: the manifest of a new output, written just before its first
    line, so a job that fails before decoding anything (a model that does not
    load) leaves no output and no manifest behind, only the lock file.
    Use as a context manager (or call close()): the lock is held until then.
    """

    def __init__(self, files: JobFiles, settings: JobSettings, prompts: int, todo: list[PromptRecord],
                 lock: JobLock | None, shard: Shard | None, new_manifest: bytes | None = None):
        self.files, self.settings, self.prompts, self.todo = files, settings, prompts, todo
        self.lock, self.shard, self.new_manifest = lock, shard, new_manifest
        self.fd = None

    @property
    def skipped(self) -> int:
        return self.prompts - len(self.todo)

    def append(self, lines: list[str]) -> None:
        """One write of whole lines, then fsync: an interruption can only tear the last line."""
        if self.lock is None:
            return  # not process 0
        if self.fd is None:
            if self.new_manifest is not None:
                write_atomic(self.files.manifest, self.new_manifest)
                self.new_manifest = None
            self.fd = os.open(self.files.out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        view = memoryview("".join(lines).encode("utf-8"))
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_job(prompts_path, out_path, settings: JobSettings, *, shard: Shard | None = None,
             force_new: bool = False, progress: bool = True) -> Job:
    """Check everything, take the lock, trim a torn tail: a Job whose `todo` is what is left.

    Every refusal is a ValueError raised before any file is changed (on every
    process: process 0 broadcasts whether it refused).
    """
    import jax

    all_prompts = read_prompt_file(prompts_path, chat=bool(settings.chat))
    prompts = shard.select(all_prompts) if shard else all_prompts
    files = JobFiles.beside(out_path)
    manifest = build_manifest(settings, prompts_path, len(all_prompts), shard)
    main = jax.process_index() == 0
    error, lock, done, new_manifest = None, None, set(), None
    if main:
        try:
            lock, done, new_manifest = _claim(files, prompts_path, prompts, manifest, settings, shard, force_new,
                                              progress)
        except ValueError as e:
            error = e
    todo_mask = np.array([error is None] + [prompt_key(p.id) not in done for p in prompts])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        todo_mask = np.asarray(multihost_utils.broadcast_one_to_all(todo_mask))
    if error is not None:
        raise error
    if not todo_mask[0]:
        raise ValueError(f"process 0 refused the job on {files.out} (its error says why); nothing was changed")
    todo = [p for p, left in zip(prompts, todo_mask[1:]) if left]
    return Job(files, settings, len(prompts), todo, lock, shard, new_manifest)


def _claim(files: JobFiles, prompts_path, prompts, manifest, settings, shard, force_new, progress):
    """Process 0: the checks, the lock, then (under it) the checks again and the repairs a job may make.

    Returns (lock, ids already done, the manifest to write before the first line of a new output).
    """
    check_output_path(files.out)
    manifest = json.loads(json.dumps(manifest))  # compare as read back (tuples -> lists)
    check_ownership(files, prompts_path, manifest, force_new)  # before the lock: no lock file beside others' files
    lock = JobLock(files.lock, files.out)
    try:
        old = check_ownership(files, prompts_path, manifest, force_new)  # another job may have started meanwhile
        ids = {prompt_key(p.id) for p in prompts}
        done, keep = (set(), 0) if force_new else scan_output(files.out, ids, prompts_path, shard)
        left = len(prompts) - len(done)
        check_output_path(files.out, left * (settings.max_new_tokens * BYTES_PER_TOKEN + BYTES_PER_LINE))
        # Checks done; from here on the job changes files, all of them ours.
        if force_new:
            moved = move_aside(files)
            if moved and progress:
                tqdm.write(f"--force-new: moved the old {files.out} and its manifest to {moved.out}", file=sys.stderr)
            old = None
        _trim(files.out, keep, progress)
    except BaseException:
        lock.release()
        raise
    return lock, done, None if old is not None else (json.dumps(manifest, indent=2) + "\n").encode()


def _trim(path: Path, keep: int, progress: bool) -> None:
    """Cut a torn last line (no newline: a write an interruption cut short) of our own output."""
    if not path.exists() or path.stat().st_size == keep:
        return
    if progress:
        tqdm.write(f"{path}: cutting {path.stat().st_size - keep} bytes of a torn last line (a write cut by an "
                   "interruption); those prompts are decoded again", file=sys.stderr)
    with path.open("r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- decoding


def plan_batches(items: list[tuple[PromptRecord, int]], batch_size: int) -> list[list[PromptRecord]]:
    """(prompt, token count) pairs -> batches of `batch_size` (the last one may be short), shortest first.

    Cut in length order, not per length bucket: a bucket's short last batch
    would be a batch shape of its own, hence a compile of its own.
    """
    ordered = [prompt for prompt, _ in sorted(items, key=lambda it: it[1])]
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


def batch_prompts(batch: list[PromptRecord], rows: int) -> list:
    """The prompts a batch decodes: its own, then copies of its first up to `rows` (same shape as the others)."""
    return [p.prompt for p in batch] + [batch[0].prompt] * (rows - len(batch))


def _batch_seed(seed: int, batch: list[PromptRecord]) -> int:
    """A per-batch seed that does not depend on what an earlier run already finished."""
    return (seed + zlib.crc32(prompt_key(batch[0].id).encode())) % (2**31 - 1)


def _check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {batch_size!r}")


def _check_refill_rows(refill_rows, batch_size: int) -> None:
    if refill_rows is not None and (isinstance(refill_rows, bool) or not isinstance(refill_rows, int)
                                    or not 1 <= refill_rows <= batch_size):
        raise ValueError(f"--refill-rows must be an integer in [1, --batch-size={batch_size}], got {refill_rows!r}")


def default_refill_rows(batch_size: int) -> int:
    """Rows a refill fills at once: an eighth of the batch. Measured on the default set, AR at batch 8 (64
    prompts, `python -m decode.job_bench --refill-rows 1,2,4`): K = 1, 2, 4 ran x1.31, x1.27, x1.14 the
    tokens/s of static batches (slot utilisation 92%, 84%, 71% against 54%): a row idling until K are free
    costs more than the host returns a small K adds; a larger batch returns to the host less often per row."""
    return max(1, batch_size // 8)


class _Tally:
    """What a job's summary counts: tokens, rounds, accepted tokens, and loop steps per batch row (utilisation)."""

    def __init__(self):
        self.tokens = self.rounds = self.accepted = self.steps = self.row_steps = 0
        self.programs = set()

    def record(self, prompt: PromptRecord, tokens: list[int], text, reason: str, accepted) -> str:
        """The result line of one prompt (accepted: per-round accepted lengths; None for AR)."""
        n = len(tokens)
        if accepted is not None:
            tau = float(sum(accepted) / max(len(accepted), 1))
            self.rounds += len(accepted)
            self.accepted += sum(accepted)
        else:
            tau = 1.0
            self.rounds += n
            self.accepted += n
        self.tokens += n
        record = {"id": prompt.id, "text": text, "num_tokens": n, "finish_reason": reason, "tau": tau}
        if text is None:
            record["token_ids"] = tokens
        return json.dumps(record, ensure_ascii=False) + "\n"

    @property
    def utilisation(self) -> float:
        return self.row_steps / max(self.steps, 1)


def decode_job(decoder, job: Job, *, batch_size: int = 8, progress: bool = True, static_batches: bool = False,
               refill_rows: int | None = None) -> dict:
    """Decode an opened job's `todo` with its settings' sampling; returns a summary dict.

    By default the prompts run with continuous batching: a row that finishes
    hands its result out and takes the next prompt (`taps_jax.calls.Refilled`;
    refill_rows at a time, default `default_refill_rows`). static_batches:
    batches of `batch_size` that each end with their longest answer. Either
    way each line is written as its prompt (or batch) finishes. The summary's
    "utilisation" is the share of batch-row loop steps that decoded a prompt.
    """
    import jax

    from taps_jax import sharding

    _check_batch_size(batch_size)
    _check_refill_rows(refill_rows, batch_size)
    out_path, todo, skipped = job.files.out, job.todo, job.skipped
    summary = {"prompts": job.prompts, "skipped": skipped, "written": 0, "tokens": 0, "seconds": 0.0}
    progress = progress and jax.process_index() == 0  # one progress report per job, from process 0
    if not todo:
        if progress:
            tqdm.write(f"{out_path}: all {job.prompts} prompts are already done", file=sys.stderr)
        return summary
    ids = decoder.target.encode([p.prompt for p in todo])  # checks every prompt before any work
    # Refilled rows need one batch placement for a handful of rows: on a data-parallel mesh, static batches.
    static_batches = static_batches or sharding.data_size(getattr(decoder, "mesh", None)) > 1
    if progress and skipped:
        tqdm.write(f"{out_path}: {skipped} prompts already done (from an earlier run); {len(todo)} to go",
                   file=sys.stderr)
    report = Progress(len(todo), progress)
    tally = _Tally()
    start = time.perf_counter()
    try:
        if static_batches:
            _decode_static(decoder, job, ids, batch_size, tally, report, summary, progress)
        else:
            _decode_refilled(decoder, job, ids, batch_size, refill_rows or default_refill_rows(batch_size), tally,
                             report, summary, progress)
    finally:
        report.close()
    elapsed = time.perf_counter() - start
    # (batch rows, prompt buffer, cache slots) of each program: its shape, the config's capacity.
    shapes = sorted((*program[3], getattr(program[1], "decode", program[1]).capacity) for program in tally.programs)
    tau = tally.accepted / max(tally.rounds, 1)
    summary.update(tokens=tally.tokens, seconds=elapsed, tau=tau, programs=len(tally.programs),
                   utilisation=tally.utilisation)
    if progress:
        sizes = ", ".join("x".join(map(str, shape)) for shape in shapes)
        tqdm.write(f"wrote {summary['written']} prompts to {out_path} ({skipped} were already done): "
                   f"{summary['written'] / elapsed:.2f} prompts/s, {tally.tokens / elapsed:,.1f} tokens/s, "
                   f"tau {tau:.2f}, slot utilisation {tally.utilisation:.0%}; {len(tally.programs)} decode "
                   f"program{'s' if len(tally.programs) != 1 else ''} (batch x prompt buffer x cache slots: {sizes})",
                   file=sys.stderr)
    return summary


def _text(decoder, tokens: list[int]):
    return decoder.target.decode(tokens) if decoder.target.tokenizer is not None else None


def _decode_static(decoder, job: Job, ids, batch_size: int, tally: _Tally, report, summary: dict,
                   progress: bool) -> None:
    """Static batches in length order: each batch ends with its longest answer (finished rows ride along)."""
    from taps_jax.calls import program_id
    from taps_jax.sharding import describe

    sampling, max_new_tokens = job.settings.sampling, job.settings.max_new_tokens
    batches = plan_batches(list(zip(job.todo, map(len, ids))), batch_size)
    if progress:
        tqdm.write(f"decoding {len(job.todo)} prompts in {len(batches)} batches of {min(batch_size, len(job.todo))} "
                   f"(in length order) on {describe(getattr(decoder, 'mesh', None))}", file=sys.stderr)
    rows = len(batches[0]) if len(batches) > 1 else 0  # one batch shape for all (a lone batch is not topped up)
    for batch in batches:
        call = decoder.prepare(batch_prompts(batch, rows), max_new_tokens,
                               **{**sampling, "seed": _batch_seed(sampling["seed"], batch)})
        tally.programs.add(program_id(call.programs.generate.__name__, call.args, call.kwargs))
        res = call.run()  # == decoder.generate(...)
        lines, steps = [], []
        for i, p in enumerate(batch):
            accepted = res.stats["accepted_lengths"][i] if "accepted_lengths" in res.stats else None
            # Loop steps this row ran (AR: the first token comes with the prefill).
            steps.append(len(accepted) if accepted is not None else len(res.tokens[i]) - 1)
            lines.append(tally.record(p, res.tokens[i], None if res.texts is None else res.texts[i],
                                      res.finish_reasons[i], accepted))
        tally.steps += call.args[-4].shape[0] * max(steps)  # every row of the batch, for its longest answer
        tally.row_steps += sum(steps)
        job.append(lines)
        summary["written"] += len(batch)
        report.update(len(batch), tally.tokens, tally.accepted / max(tally.rounds, 1))


def _decode_refilled(decoder, job: Job, ids, batch_size: int, refill_rows: int, tally: _Tally, report,
                     summary: dict, progress: bool) -> None:
    """Continuous batching, one run for the whole job, prompts in length order (rows side by side have nearby
    lengths, so attention's key loop, which runs to the longest row, wastes little): each finished row's line
    is written when the loop next returns to the host (one append per return), and its row takes the next
    prompt. The run's cache is sized for the job's longest prompt, as the static batch holding it would be."""
    from taps_jax.calls import program_id, refilled
    from taps_jax.sharding import describe

    sampling, max_new_tokens = job.settings.sampling, job.settings.max_new_tokens
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    prompts = [job.todo[i] for i in order]
    rows = min(batch_size, len(prompts))
    if progress:
        tqdm.write(f"decoding {len(prompts)} prompts on {rows} rows in length order, a finished row taking the "
                   f"next prompt ({min(refill_rows, rows)} at a time) on {describe(getattr(decoder, 'mesh', None))}",
                   file=sys.stderr)
    run = refilled(decoder, [ids[i] for i in order], max_new_tokens, rows=rows, refill_rows=min(refill_rows, rows),
                   **{**sampling, "seed": _batch_seed(sampling["seed"], prompts)})
    tally.programs.add(program_id(run.call.programs.until.__name__, run.call.args, run.call.kwargs))
    for done in run:
        lines = [tally.record(prompts[f.index], f.tokens, _text(decoder, f.tokens), f.finish_reason,
                              f.accepted_lengths) for f in done]
        job.append(lines)
        summary["written"] += len(lines)
        report.update(len(lines), tally.tokens, tally.accepted / max(tally.rounds, 1))
    tally.steps += run.rows * run.steps
    tally.row_steps += run.row_steps


class Progress:
    """The job's progress on stderr: a live bar on a terminal (cleared at the end, the summary line stays);
    elsewhere (a log file) one plain line at most every 30 s, so no line is printed twice."""

    INTERVAL_S = 30.0

    def __init__(self, total: int, show: bool):
        self.total, self.done, self.show = total, 0, show
        self.start = self.last = time.perf_counter()
        self.bar = tqdm(total=total, unit="prompt", desc="decode", dynamic_ncols=True, leave=False,
                        file=sys.stderr) if show and sys.stderr.isatty() else None

    def update(self, n: int, tokens: int, tau: float) -> None:
        self.done += n
        now = time.perf_counter()
        rate = tokens / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix(tok_s=f"{rate:,.0f}", tau=f"{tau:.2f}", refresh=False)
            self.bar.update(n)
        elif self.show and now - self.last >= self.INTERVAL_S and self.done < self.total:
            self.last = now
            # No time left: the first batches of each shape also compile, so the rate so far says little.
            tqdm.write(f"decode: {self.done}/{self.total} prompts after {now - self.start:.0f} s, {rate:,.0f} "
                       f"tokens/s, tau {tau:.2f}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_job(decoder, prompts_path, out_path, *, batch_size: int = 8, max_new_tokens: int = 128,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
            shard: Shard | None = None, force_new: bool = False, progress: bool = True,
            static_batches: bool = False, refill_rows: int | None = None) -> dict:
    """Decode every prompt of `prompts_path` (or of `shard`) not yet in `out_path`; returns a summary dict.

    The Python-API form of `taps-decode --prompts --out`: the manifest
    records the decoder's models by their configs (see `decoder_settings`).
    """
    _check_batch_size(batch_size)
    _check_refill_rows(refill_rows, batch_size)
    settings = decoder_settings(decoder, max_new_tokens, temperature, top_k, top_p, seed)
    with open_job(prompts_path, out_path, settings, shard=shard, force_new=force_new, progress=progress) as job:
        return decode_job(decoder, job, batch_size=batch_size, progress=progress, static_batches=static_batches,
                          refill_rows=refill_rows)
