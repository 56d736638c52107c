"""Pieces shared by the command-line tools: model flags, loading, error handling."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from taps_jax import load_scorer, load_target
from taps_jax.sharding import add_mesh_args, positive_int, setup_mesh  # noqa: F401  (re-exported for the CLIs)
from taps_jax.decoder import DEFAULT_MODEL_DIR, ModelSet, load_drafter
from taps_jax.engine.adaptive import TABLE_FILE, AdaptiveTable
from taps_jax.tree.lookup import LOOKUP_FILE, LookupTable
from taps_jax.model_sets import NAMED_SETS, resolve_set, set_name, target_of


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def choice_list(choices, what: str = "policy"):
    """An argparse type: comma-separated names, each one of `choices` (at least one)."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0] if bad else text!r}; choose from "
                                             f"{', '.join(choices)}")
        return names

    return parse


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--model", type=Path, default=None,
                   help=f"model set: a directory with target/, drafter/ (and scorer/), or a shipped set by name "
                        f"({', '.join(NAMED_SETS)}); default: the embedded set ({DEFAULT_MODEL_DIR})")
    g.add_argument("--target", type=Path,
                   help="target checkpoint: a Hugging Face dir or a GGUF file (llama.cpp); overrides --model's")
    g.add_argument("--drafter", type=Path, help="DFlash drafter checkpoint dir; overrides --model's")
    g.add_argument("--scorer", type=Path,
                   help="TAPS scorer dir (for --policy taps) used at every temperature; overrides --model's scorer/ "
                        "and scorer_greedy/ (by default a set's scorer_greedy/ serves temperature 0, its scorer/ "
                        "the rest)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter/activation dtype (default float32)")
    g.add_argument("--no-lookup", action="store_true",
                   help="do not mix the text's earlier continuation into the drafts (the set's lookup.json)")


def _model_base(args) -> Path | None:
    """The model set the parts come from: --model (a dir or a shipped name), else the embedded set unless --target."""
    base = resolve_set(args.model) if args.model is not None else (DEFAULT_MODEL_DIR if args.target is None else None)
    if base == DEFAULT_MODEL_DIR and not base.is_dir():
        raise ValueError(f"the embedded default model set is not installed ({base} is missing); "
                         "pass --model DIR or --target DIR --drafter DIR, or build it with python -m train.recipe")
    if base is not None and not Path(base).is_dir():
        raise ValueError(f"model directory {str(base)!r} does not exist; pass --model DIR (or one of "
                         f"{', '.join(NAMED_SETS)}) or --target DIR --drafter DIR")
    return base


def _part(args, base, flag, name):
    if flag is not None:
        return flag
    if base is None:
        return None
    if name == "target":
        target = target_of(base)
        if target is None:
            raise ValueError(f"{base}: no target/ subdirectory; pass --target DIR or a --model dir with target/")
        return target
    return base / name if (base / name).is_dir() else None


def load_models(args, mesh=None) -> ModelSet:
    """Each part from its own flag, else from --model (the embedded set when neither --model nor --target).

    mesh: target and drafter are loaded sharded onto it (each host reads only its shards).
    """
    base = _model_base(args)
    target_dir = _part(args, base, args.target, "target")
    drafter_dir, scorer_dir = _part(args, base, args.drafter, "drafter"), _part(args, base, args.scorer, "scorer")
    greedy_dir = _part(args, base, None, "scorer_greedy")
    tables = _set_tables(args, base, drafter_dir)
    return ModelSet(
        load_target(target_dir, args.dtype, mesh),
        load_drafter(drafter_dir, args.dtype, mesh) if drafter_dir else None,
        load_scorer(scorer_dir) if scorer_dir else None,
        load_scorer(greedy_dir) if greedy_dir and args.scorer is None else None,
        set_name(base) if base is not None and args.drafter is None else None,
        AdaptiveTable.load(tables["adaptive"]) if tables["adaptive"] else None,
        LookupTable.load(tables["lookup"]) if tables["lookup"] else None,
    )


def _set_tables(args, base, drafter_dir) -> dict[str, Path | None]:
    """The set's table files a run uses, None where absent or not this run's."""
    if base is None:
        return {"adaptive": None, "lookup": None}
    # The fitted adaptive prior belongs to the set's own drafter; the lookup weights are statistics of the
    # set target's text.
    adaptive = Path(base) / TABLE_FILE if args.drafter is None and drafter_dir else None
    lookup = Path(base) / LOOKUP_FILE if args.target is None and not args.no_lookup else None
    return {name: path if path is not None and path.is_file() else None
            for name, path in (("adaptive", adaptive), ("lookup", lookup))}


def read_prompts(source, chat: bool = False, limit: int | None = None) -> list:
    """Prompts for the benchmarks: a prompt file (taps_jax.prompt_file), or "humaneval" (its problems as chats)."""
    if str(source) == "humaneval" and not Path(source).is_file():
        from decode.humaneval import humaneval_chats

        return humaneval_chats(limit)[1]
    from taps_jax.prompt_file import read_prompt_file

    return [r.prompt for r in read_prompt_file(source, chat=chat)][:limit]


def run(main, prog: str) -> None:
    """Turn user errors (ValueError) into one line on stderr and exit status 2, and an
    out-of-memory that escaped the size checks (MemoryError, with the sizes) into one line and status 1."""
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except MemoryError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)


def check_output_path(path, expected_bytes: int = 0, *, directory: bool = False) -> Path | None:
    """ValueError unless `path` can be written: call it before any work, so a bad path costs nothing.

    path: an output file (directory=False) or an output directory; None = the flag was not given.
    Checks: it is not a directory (or, with directory=True, not a file); the
    directory it goes in (the nearest existing one, as missing ones will be
    created) is a directory we can create files in; that filesystem has
    `expected_bytes` free. Writability is probed by creating and removing a
    temporary file there, because permission bits lie (root, read-only mounts).
    Nothing else is created or changed.
    """
    if path is None:
        return None
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; give a directory (or a new name) for the output")
    if not directory and path.is_dir():
        raise ValueError(f"{path} is a directory; give a file name for the output")
    folder = path if directory else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"cannot write {path}: {folder} is not a directory; choose another output path")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".taps-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"cannot write {path}: cannot create files in {folder} ({e.strerror}); "
                         "choose another output path or fix its permissions") from None
    if not directory and path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write {path}: the file is not writable; choose another output path")
    free = shutil.disk_usage(folder).free
    if free < expected_bytes:
        raise ValueError(f"cannot write {path}: {folder} has {free / 2**20:,.1f} MiB free, the output needs about "
                         f"{expected_bytes / 2**20:,.1f} MiB; free some space or choose another output path")
    return path


def model_part_dirs(args) -> dict[str, Path | None]:
    """The checkpoint dir each part will come from, resolved as `load_models` and `ModelSet.scorer_for` do.

    Read without loading anything, so a job can record (and check) its models
    before paying for them. "scorer" is the one --policy taps would use at
    --temperature; "adaptive" and "lookup" the set's table files the run
    reads; None where a part is absent.
    """
    base = _model_base(args)
    scorer = args.scorer
    if scorer is None:
        greedy = _part(args, base, None, "scorer_greedy")
        scorer = greedy if args.temperature == 0 and greedy is not None else _part(args, base, None, "scorer")
    drafter = _part(args, base, args.drafter, "drafter")
    return {"target": _part(args, base, args.target, "target"), "drafter": drafter, "scorer": scorer,
            **_set_tables(args, base, drafter)}
