"""Pieces shared by the command-line tools: model flags, loading, error handling."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from taps_jax import load_scorer, load_target
from taps_jax.sharding import add_mesh_args, positive_int, setup_mesh  # noqa: F401  (re-exported for the CLIs)
from taps_jax.decoder import DEFAULT_MODEL_DIR, ModelSet, load_drafter


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--model", type=Path, default=None,
                   help=f"model directory with target/, drafter/ (and scorer/); default: the embedded set ({DEFAULT_MODEL_DIR})")
    g.add_argument("--target", type=Path, help="target checkpoint dir (Hugging Face layout); overrides --model's")
    g.add_argument("--drafter", type=Path, help="DFlash drafter checkpoint dir; overrides --model's")
    g.add_argument("--scorer", type=Path,
                   help="TAPS scorer dir (for --policy taps) used at every temperature; overrides --model's scorer/ "
                        "and scorer_greedy/ (by default a set's scorer_greedy/ serves temperature 0, its scorer/ "
                        "the rest)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter/activation dtype (default float32)")


def load_models(args, mesh=None) -> ModelSet:
    """Each part from its own flag, else from --model (the embedded set when neither --model nor --target).

    mesh: target and drafter are loaded sharded onto it (each host reads only its shards).
    """
    base = args.model or (DEFAULT_MODEL_DIR if args.target is None else None)
    if base == DEFAULT_MODEL_DIR and not base.is_dir():
        raise ValueError(f"the embedded default model set is not installed ({base} is missing); "
                         "pass --model DIR or --target DIR --drafter DIR, or build it with python -m train.recipe")
    if base is not None and not Path(base).is_dir():
        raise ValueError(f"model directory {str(base)!r} does not exist")

    def part(flag, name):
        if flag is not None:
            return flag
        return base / name if base is not None and (base / name).is_dir() else None

    target_dir = part(args.target, "target")
    if target_dir is None:
        raise ValueError(f"{base}: no target/ subdirectory; pass --target DIR or a --model dir with target/")
    drafter_dir, scorer_dir = part(args.drafter, "drafter"), part(args.scorer, "scorer")
    greedy_dir = part(None, "scorer_greedy")
    return ModelSet(
        load_target(target_dir, args.dtype, mesh),
        load_drafter(drafter_dir, args.dtype, mesh) if drafter_dir else None,
        load_scorer(scorer_dir) if scorer_dir else None,
        load_scorer(greedy_dir) if greedy_dir and args.scorer is None else None,
    )


def run(main, prog: str) -> None:
    """Turn user errors (ValueError) into one line on stderr and exit status 2."""
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
