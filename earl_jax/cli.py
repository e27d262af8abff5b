"""Dataclass configs from the command line: every field is a flag, `--help` lists them with their help.

`--preset NAME` picks a named preset first; later flags override its fields. A preset is a function: with
no argument, or with one, the fields the command line sets ({name: value}), for a preset that depends on
them (the pod preset reads --hf-checkpoint and --devices). A flag that names no field, a value that does
not parse, or a preset that refuses the machine or the flags fails at start with a message naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {s!r} (true / false)")  # argparse prints this message


def _converter(tp: Any) -> Callable[[str], Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        conv = _converter(inner[0])
        return lambda s: None if s.strip().lower() in ("none", "null", "") else conv(s)
    if origin is typing.Literal:
        def lit(s: str):
            for a in args:
                if str(a) == s:
                    return a
            raise argparse.ArgumentTypeError(f"{s!r} is not one of {', '.join(map(str, args))}")
        return lit
    if origin in (tuple, list):
        conv = _converter(args[0]) if args else str
        return lambda s: tuple(conv(x) for x in s.split(",") if x.strip() != "")
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    raise TypeError(f"unsupported config field type {tp!r}")


def build_parser(cls: type, description: str = "", presets: Mapping[str, Callable[[], Any]] | None = None
                 ) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if presets:
        parser.add_argument("--preset", choices=sorted(presets), default=None, help="start from a named preset")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_ = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(flag, nargs="?", const=True, default=None, type=_parse_bool,
                                metavar="BOOL", help=f"{help_} (default: {default})")
        else:
            parser.add_argument(flag, default=None, type=_converter(tp), metavar=f.name.upper(),
                                help=f"{help_} (default: {default})")
    return parser


def parse_config(cls: type[T], argv: Sequence[str] | None = None, *, description: str = "",
                 presets: Mapping[str, Callable[[], T]] | None = None, base: T | None = None) -> T:
    """Parse argv into `cls`. Unknown flags and bad values exit with a message naming the field."""
    parser = build_parser(cls, description, presets)
    ns = parser.parse_args(argv)
    cfg = base if base is not None else cls()
    overrides = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if getattr(ns, f.name) is not None}
    if presets and ns.preset:
        make = presets[ns.preset]
        try:
            cfg = make(dict(overrides)) if inspect.signature(make).parameters else make()
        except ValueError as e:
            parser.error(f"--preset {ns.preset}: {e}")
    try:
        return dataclasses.replace(cfg, **overrides)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
