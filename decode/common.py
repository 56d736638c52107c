"""Pieces shared by the command-line tools: model flags, loading, error handling."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from taps_jax.decoder import DEFAULT_MODEL_DIR, ModelSet, load_drafter, load_model_set
from taps_jax.api import load_target


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--model", type=Path, default=None,
                   help=f"model directory with target/, drafter/ (and scorer/); default: the embedded set ({DEFAULT_MODEL_DIR})")
    g.add_argument("--target", type=Path, help="target checkpoint dir (Hugging Face layout); overrides --model's")
    g.add_argument("--drafter", type=Path, help="DFlash drafter checkpoint dir; overrides --model's")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter/activation dtype (default float32)")


def load_models(args) -> ModelSet:
    """--target/--drafter override the parts of --model (or the embedded default)."""
    if args.target is None or (args.drafter is None and getattr(args, "policy", "ar") != "ar"):
        base = args.model or DEFAULT_MODEL_DIR
        models = load_model_set(base, args.dtype)
    else:
        models = ModelSet(load_target(args.target, args.dtype))
    if args.target is not None:
        models.target = load_target(args.target, args.dtype)
    if args.drafter is not None:
        models.drafter = load_drafter(args.drafter, args.dtype)
    return models


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def run(main, prog: str) -> None:
    """Turn user errors (ValueError) into one line on stderr and exit status 2."""
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
