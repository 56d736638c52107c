"""One mechanism for every training stage's settings: frozen dataclasses -> preset sections + CLI flags.

A setting is a dataclass field declared with `option(default, help)`: its
type (the annotation), default and help text live there and nowhere else.
`add_flags` turns a dataclass (or a nested one: a dataclass whose fields are
section dataclasses) into argparse flags (`num_layers` -> `--num-layers`, or
the field's own `flag=`), every flag defaulting to None so "not given" is
seen; `build` starts from the defaults, overlays a preset's sections and
then the flags that were given, and checks unknown preset keys.

    @dataclasses.dataclass(frozen=True)
    class Run:
        steps: int = option(1000, "optimizer steps")

    add_flags(parser, Run); config = build(Run, preset={"steps": 10}, args=parser.parse_args())
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def option(default, help: str, *, flag: str | None = None, choices=None, metavar: str | None = None):
    """A dataclass field with its help text (and optionally its flag name and choices)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                                         "metavar": metavar})


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _base(tp):
    """(base type, optional) of an annotation: `int | None` -> (int, True)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _parser_of(tp, name: str):
    base, _ = _base(tp)
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]

        def parse(text: str):
            try:
                return tuple(item(x) for x in text.split(",") if x.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated {item.__name__}s, got {text!r}")

        return parse
    return base


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _fields(cls):
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        yield f, hints[f.name]


def add_flags(parser, cls, skip: tuple[str, ...] = ()) -> None:
    """Flags for every field of `cls` (one argument group per section of a nested config)."""
    for f, tp in _fields(cls):
        if f.name in skip:
            continue
        if _is_section(tp):
            group = parser.add_argument_group(f.name) if isinstance(parser, argparse.ArgumentParser) else parser
            add_flags(group, tp, skip)
            continue
        if "help" not in f.metadata:
            continue  # not a user setting
        default = f.default
        shown = "" if default is None else f" (built-in: {','.join(map(str, default)) if isinstance(default, tuple) else default})"
        help_text = f.metadata["help"].replace("%", "%%") + shown
        base, _ = _base(tp)
        if base is bool:
            parser.add_argument(flag_name(f), dest=f.name, action="store_true", default=None, help=help_text)
            continue
        parser.add_argument(flag_name(f), dest=f.name, type=_parser_of(tp, f.name), default=None,
                            choices=f.metadata.get("choices"), metavar=f.metadata.get("metavar"), help=help_text)


def build(cls, preset: dict | None = None, args: argparse.Namespace | None = None, source: str = "preset"):
    """cls() <- preset sections/keys <- the flags that were given. Unknown preset keys are refused."""
    preset = dict(preset or {})
    preset.pop("comment", None)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(preset) - known)
    if unknown:
        raise ValueError(f"{source}: unknown {cls.__name__} fields {unknown}; known: {', '.join(sorted(known))}")
    values = {}
    for f, tp in _fields(cls):
        if _is_section(tp):
            section = preset.get(f.name) or {}
            if not isinstance(section, dict):
                raise ValueError(f"{source}: section {f.name!r} must be a JSON object")
            values[f.name] = build(tp, section, args, f"{source} [{f.name}]")
            continue
        if f.name in preset:
            value = preset[f.name]
            if isinstance(value, list):
                value = tuple(value)
            values[f.name] = value
        given = getattr(args, f.name, None) if args is not None and "help" in f.metadata else None
        if given is not None:
            values[f.name] = given
    return cls(**values)


def as_dict(config) -> dict:
    return dataclasses.asdict(config)
