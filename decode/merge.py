"""Join the outputs of a sharded decoding job into one file.

    python -m decode.merge OUT_0.jsonl OUT_1.jsonl ... --out ALL.jsonl [--prompts IN.jsonl]

Each OUT_i is the output of `taps-decode --prompts IN --out OUT_i --shard i/N`.
The merge refuses (one line, exit status 2, nothing written) unless: every
OUT_i has a job manifest, the manifests agree on everything but the shard,
the shards are 0..N-1 exactly once, no shard job is still running (their
locks are free), IN is the file they were decoded from (by digest), and
every prompt of IN appears exactly once, on a complete line. ALL.jsonl then
holds the shards' result lines verbatim, in input order, written atomically,
with a manifest like an unsharded job's (so `taps-decode` with the same
settings on ALL.jsonl finds everything done). An existing ALL.jsonl is never
overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path

from decode.common import Parser, check_output_path, run
from decode.jobs import JobFiles, JobLock, Shard, file_digest, read_manifest, scan_output, settings_diff, write_atomic
from taps_jax.prompt_file import prompt_key, read_prompt_file


@dataclasses.dataclass(frozen=True)
class ShardOutput:
    files: JobFiles
    manifest: dict
    shard: Shard


def read_shard(out: Path) -> ShardOutput:
    files = JobFiles.beside(out)
    if not files.out.is_file():
        raise ValueError(f"{out} does not exist; give the outputs of the shard jobs")
    manifest = read_manifest(files.manifest)
    if manifest is None:
        raise ValueError(f"{out} has no job manifest ({files.manifest.name}), so it is not a taps-decode job output")
    spec = manifest["settings"].get("shard")
    if spec is None:
        raise ValueError(f"{out} is the output of an unsharded job (no --shard); it needs no merge")
    return ShardOutput(files, manifest, Shard.parse(spec))


def check_shards(shards: list[ShardOutput]) -> None:
    """Same settings everywhere but the shard; shards 0..N-1 exactly once."""
    first = shards[0]
    for s in shards[1:]:
        diff = settings_diff({**first.manifest["settings"], "shard": None}, {**s.manifest["settings"], "shard": None})
        if diff:
            field, a, b = diff
            raise ValueError(f"{s.files.out} was decoded with other settings than {first.files.out} ({field} {b!r} vs "
                             f"{a!r}); merge only shards of one job")
    count = first.shard.count
    seen: dict[int, Path] = {}
    for s in shards:
        if s.shard.count != count:
            raise ValueError(f"{s.files.out} is shard {s.shard}, {first.files.out} is shard {first.shard}; "
                             "merge only shards of one split")
        if s.shard.index in seen:
            raise ValueError(f"{s.files.out} and {seen[s.shard.index]} are both shard {s.shard}; give each shard once")
        seen[s.shard.index] = s.files.out
    missing = [f"{i}/{count}" for i in range(count) if i not in seen]
    if missing:
        raise ValueError(f"shard {', '.join(missing)} is missing; give all {count} shard outputs")


def input_file(shards: list[ShardOutput], prompts: Path | None) -> Path:
    """The prompt file the shards were decoded from: --prompts, else the path their manifest recorded."""
    want = shards[0].manifest["settings"]["input"]["sha256"]
    path = prompts or Path(shards[0].manifest["input_path"])
    if not path.is_file():
        raise ValueError(f"the prompt file {path} (recorded in {shards[0].files.manifest}) does not exist; "
                         "pass --prompts IN.jsonl")
    if file_digest(path) != want:
        raise ValueError(f"{path} is not the prompt file the shards were decoded from (sha256 {file_digest(path)} "
                         f"vs {want}); pass that file with --prompts")
    return path


def shard_lines(s: ShardOutput, prompts_path: Path, ids: set[str]) -> dict[str, bytes]:
    """id key -> its result line (verbatim) of one finished shard."""
    done, keep = scan_output(s.files.out, ids, prompts_path, s.shard)
    data = s.files.out.read_bytes()
    if keep < len(data):
        raise ValueError(f"{s.files.out} ends in a torn line: its job was interrupted; rerun it to finish")
    missing = sorted(ids - done)
    if missing:
        raise ValueError(f"{s.files.out} lacks {len(missing)} of the {len(ids)} prompts of shard {s.shard} (ids "
                         f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); rerun its job to finish")
    lines = {}
    for raw in data.splitlines(keepends=True):
        if raw.strip():
            lines[prompt_key(json.loads(raw.decode("utf-8"))["id"])] = raw
    return lines


def merge(outs: list[Path], out: Path, prompts: Path | None = None) -> dict:
    """Check the shard outputs and write `out` (+ its manifest); returns {"prompts", "shards"}."""
    check_output_path(out)
    target = JobFiles.beside(out)
    if target.out.exists() or target.manifest.exists():
        raise ValueError(f"refusing to overwrite {target.out if target.out.exists() else target.manifest}: "
                         "give the merged file a new --out")
    shards = [read_shard(Path(p)) for p in outs]
    check_shards(shards)
    prompts_path = input_file(shards, prompts)
    all_prompts = read_prompt_file(prompts_path)
    with ExitStack() as stack:
        for s in shards:  # no shard job may write while we read (their jobs left these lock files)
            stack.callback(JobLock(s.files.lock, s.files.out, shared=True).release)
        lines: dict[str, bytes] = {}
        for s in shards:
            lines.update(shard_lines(s, prompts_path, {prompt_key(p.id) for p in s.shard.select(all_prompts)}))
        merged = b"".join(lines[prompt_key(p.id)] for p in all_prompts)  # input order
        # All checked; now the only files we create: ALL, its manifest and lock (one merge per output).
        stack.callback(JobLock(target.lock, target.out).release)
        if target.out.exists() or target.manifest.exists():
            raise ValueError(f"{target.out} appeared while merging (another merge?); give the merged file a new --out")
        # The manifest an unsharded job over all of IN would have written.
        settings = {**shards[0].manifest["settings"], "shard": None}
        manifest = {**shards[0].manifest, "settings": settings, "input_path": str(prompts_path.resolve())}
        write_atomic(target.manifest, (json.dumps(manifest, indent=2) + "\n").encode())
        write_atomic(target.out, merged)
    return {"prompts": len(all_prompts), "shards": len(shards)}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m decode.merge", description="Join the outputs of a sharded taps-decode job.")
    p.add_argument("shards", nargs="+", type=Path, metavar="OUT_I.jsonl", help="the shard jobs' outputs")
    p.add_argument("--out", type=Path, required=True, metavar="ALL.jsonl", help="the merged output (must not exist)")
    p.add_argument("--prompts", type=Path, metavar="IN.jsonl",
                   help="the prompt file of the job (default: the path its manifests recorded)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    summary = merge(args.shards, args.out, args.prompts)
    print(f"merged {summary['prompts']} prompts from {summary['shards']} shards into {args.out}")
    return 0


if __name__ == "__main__":
    run(main, "python -m decode.merge")
