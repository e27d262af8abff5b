"""Nested dataclass configs from the command line, presets as TOML files, one-line errors.

Every field of every component is a flag named by its path, `--rollout.temperature 0.7` (underscores or hyphens,
`--rollout.top-k` = `--rollout.top_k`); `--help` lists them grouped by component, with the value the job will
actually use (the script's default, or the preset's when `--preset` comes first). A config is built in layers:

    the dataclasses' defaults <- the script's default file <- --preset NAME <- --config FILE <- flags

A preset is a TOML file (`[rollout]` / `temperature = 0.7`, as the flags' paths), or a function of the flags for a
preset that depends on the machine (the pod preset). `Parsed.typed` holds the fields the user set (by flag, preset
or config file): what `--resume` applies over a run's saved config.

Why not tyro (which turns nested dataclasses into a grouped CLI too): resume needs to know which flags were typed,
and a bad value must be one plain line naming the flag, never a usage dump or a multi-line panel; both are ~100 lines
here on top of argparse, and the GPU image needs no extra wheel.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

T = TypeVar("T")
Path_ = tuple[str, ...]  # a field's path in the nested config, e.g. ("rollout", "temperature")
# A preset: a TOML file, or a function (base config, {path: value} the flags set) -> config.
Preset = Path | str | Callable[[Any, Mapping[Path_, Any]], Any]


class ConfigError(ValueError):
    """Bad input in a config: the message is one line that names the flag (or file), the value and what is accepted."""


def field_help(default: Any, help: str | Callable[[], str], *, path: bool = False, **kw) -> Any:
    """A dataclass field whose help text the CLI shows (a function: the text when it is shown, e.g. a registry's
    names); `path`: a file or folder, which a config file gives relative to itself (a preset names the base it
    starts from wherever the command runs) and a flag relative to the working directory; both are kept absolute."""
    return dataclasses.field(default=default, metadata={"help": help, "path": path}, **kw)


def absolute(path: str, start: Path | None = None) -> str:
    """A path field's value made absolute (relative to `start`, default the working directory); "" stays "" (none)."""
    if not path or Path(path).is_absolute():
        return path
    return str(((start or Path.cwd()) / path).resolve())


def flag_of(path: Path_) -> str:
    return "--" + ".".join(p.replace("_", "-") for p in path)


# ------------------------------------------------------------------------------------------------ converting values

def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {s!r} (true or false)")


def converter(tp: Any) -> Callable[[str], Any]:
    """Text -> value of type `tp` (int, float, str, bool, Literal, Optional, tuple); ValueError says what is
    accepted."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        conv = converter(next(a for a in args if a is not type(None)))
        return lambda s: None if s.strip().lower() in ("none", "null") else conv(s)
    if origin is typing.Literal:
        def literal(s: str):
            for a in args:
                if str(a) == s:
                    return a
            raise ValueError(f"{s!r} is not one of {', '.join(map(str, args))}")
        return literal
    if origin in (tuple, list):
        conv = converter(args[0]) if args else str
        return lambda s: tuple(conv(x.strip()) for x in s.split(",") if x.strip())
    if tp is bool:
        return _parse_bool
    if tp in (int, float):
        def number(s: str):
            try:
                return tp(s)
            except ValueError:
                raise ValueError(f"{s!r} is not {'an integer' if tp is int else 'a number'}") from None
        return number
    if tp is str:
        return str
    raise TypeError(f"unsupported config field type {tp!r}")


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _from_file_value(tp: Any, value: Any) -> Any:
    """A TOML value as field type `tp`: strings parse as on the command line, lists become tuples. A value of another
    type is refused, naming the type expected (`steps = 2.5`, `groups = true`, `learning_rate = [1e-3]`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str) and tp is not str and origin is not typing.Literal:
        return converter(tp)(value)
    if origin in (typing.Union, types.UnionType):
        return _from_file_value(next(a for a in args if a is not type(None)), value)
    if origin is typing.Literal:
        if isinstance(value, bool) and str(value).lower() in args:  # `resume = true` means the setting "true"
            return str(value).lower()
        if value not in args:
            raise ValueError(f"{_toml(value)} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise ValueError(f"expected a list (or a comma-separated string), got {_toml(value)}")
        return tuple(_from_file_value(args[0], v) for v in value) if args else tuple(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in _KINDS and not (isinstance(value, tp) and (tp is bool or not isinstance(value, bool))):
        raise ValueError(f"expected {_KINDS[tp]}, got {_toml(value)}")
    return value


def _toml(value: Any) -> str:
    """A value as the TOML file wrote it (true, [0.001], "text")."""
    return json.dumps(value, default=str)


# ------------------------------------------------------------------------------------------------ the fields

@dataclasses.dataclass(frozen=True)
class Field:
    path: Path_
    type: Any
    help: str
    section_help: str
    is_path: bool = False

    @property
    def flag(self) -> str:
        return flag_of(self.path)


def fields_of(cfg: Any, prefix: Path_ = (), section_help: str = "") -> list[Field]:
    """Every leaf field of a nested dataclass config, depth first."""
    out = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            doc = (type(value).__doc__ or "").strip().split("\n")[0]
            out += fields_of(value, prefix + (f.name,), doc)
        elif f.init:
            help_ = f.metadata.get("help", "")
            out.append(Field(prefix + (f.name,), hints[f.name], help_() if callable(help_) else help_, section_help,
                             f.metadata.get("path", False)))
    return out


def get_path(cfg: Any, path: Path_) -> Any:
    for p in path:
        cfg = getattr(cfg, p)
    return cfg


def _flag_error(e: Exception, section: Path_) -> ConfigError:
    """A component's ValueError "field: why (got x)" as a message naming the flag."""
    msg = str(e).split("\n")[0]
    m = re.match(r"^(\w+): (.*)$", msg)
    if m and not msg.startswith("--"):
        return ConfigError(f"{flag_of(section + (m.group(1),))}: {m.group(2)}")
    return ConfigError(msg)


def replace_paths(cfg: T, values: Mapping[Path_, Any]) -> T:
    """`cfg` with each path set to its value; each component is rebuilt once, so its checks see all its new fields.
    A component's check failing raises ConfigError naming the flag."""
    return _replace(cfg, values, ())


def _replace(cfg: Any, values: Mapping[Path_, Any], prefix: Path_) -> Any:
    here = {p[0]: v for p, v in values.items() if len(p) == 1}
    below: dict[str, dict[Path_, Any]] = {}
    for p, v in values.items():
        if len(p) > 1:
            below.setdefault(p[0], {})[p[1:]] = v
    changes = dict(here)
    for name, sub in below.items():
        changes[name] = _replace(getattr(cfg, name), sub, prefix + (name,))
    if not changes:
        return cfg
    try:
        return dataclasses.replace(cfg, **changes)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise _flag_error(e, prefix) from None


# ------------------------------------------------------------------------------------------------ TOML files

def read_toml(path: Path | str, cfg: Any) -> dict[Path_, Any]:
    """{path: value} of a TOML config file, checked against `cfg`'s fields; an unknown key or a bad value names the
    file and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path}: not valid TOML ({e})") from None
    fields = {f.path: f for f in fields_of(cfg)}
    out: dict[Path_, Any] = {}

    def walk(d: Mapping[str, Any], prefix: Path_):
        for k, v in d.items():
            p = prefix + (k.replace("-", "_"),)
            if isinstance(v, dict):
                walk(v, p)
            elif p not in fields:
                near = difflib.get_close_matches(".".join(p), [".".join(q) for q in fields], n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise ConfigError(f"config file {path}: unknown key {'.'.join(p)}{hint}")
            else:
                try:
                    out[p] = _from_file_value(fields[p].type, v)
                    if fields[p].is_path and isinstance(out[p], str):
                        out[p] = absolute(out[p], path.parent)  # relative to the file that names it
                except ValueError as e:
                    raise ConfigError(f"config file {path}: {'.'.join(p)}: {e}") from None
    walk(data, ())
    return out


def load_file(path: Path | str, cfg: T) -> T:
    values = read_toml(path, cfg)
    try:
        return replace_paths(cfg, values)
    except ConfigError as e:
        raise ConfigError(f"config file {path}: {str(e).lstrip('-')}") from None


# ------------------------------------------------------------------------------------------------ the parser

@dataclasses.dataclass
class Parsed(Generic[T]):
    config: T
    typed: dict[Path_, Any]  # what the user set: flags, and every field of a preset or config file
    preset: str | None = None
    flags: dict[Path_, Any] = dataclasses.field(default_factory=dict)  # the fields set by flag alone
    by_preset: frozenset[Path_] = frozenset()  # the fields a file preset set that no config file or flag set again


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise ConfigError(message)


class _Help(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=40, width=110)


def _metavar(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _metavar(next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(tp))) + "}"
    if origin in (tuple, list):
        return "A,B,..."
    return {int: "N", float: "X", str: "TEXT"}.get(tp, "V")


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(map(str, v)) or '""'
    if isinstance(v, str):
        return v or '""'
    return str(v)


def _argv_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in argv (`--FLAG V` or `--FLAG=V`), the last one given."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _normalize(argv: Sequence[str]) -> list[str]:
    """--rollout.top_k -> --rollout.top-k (the flag part only)."""
    out = []
    for a in argv:
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            a = name.replace("_", "-") + eq + val
        out.append(a)
    return out


def parse(argv: Sequence[str] | None, base: T, *, presets: Mapping[str, Preset] | None = None,
          aliases: Mapping[str, Path_] | None = None, prog: str | None = None, description: str = "",
          extra: Callable[[argparse.ArgumentParser], None] | None = None) -> Parsed[T]:
    """argv -> Parsed(config, typed). `base`: the script's default config. `aliases`: short flags for common fields
    ({"--seed": ("run", "seed")}). `extra(parser)` adds flags that are not config fields (read from Parsed via
    `parse_extra`). Bad input raises ConfigError with one line naming the flag; `--help` prints and exits 0."""
    argv = _normalize(sys.argv[1:] if argv is None else argv)
    presets, aliases = presets or {}, aliases or {}
    preset_name = _argv_value(argv, "--preset")
    if preset_name is not None and preset_name not in presets:
        raise ConfigError(f"--preset: {preset_name!r} is not one of {', '.join(sorted(presets))}")
    preset = presets.get(preset_name) if preset_name else None
    config_file = _argv_value(argv, "--config")

    shown = base  # the defaults --help shows: the script's, with a file preset and --config applied
    typed: dict[Path_, Any] = {}
    by_preset: set[Path_] = set()
    if preset is not None and not callable(preset):
        typed.update(read_toml(preset, base))
        by_preset = set(typed)
        shown = load_file(preset, base)
    if config_file:
        file_values = read_toml(config_file, shown)
        by_preset -= set(file_values)
        typed.update(file_values)
        shown = load_file(config_file, shown)

    fields = fields_of(base)
    parser = _Parser(prog=prog, description=description, formatter_class=_Help, add_help=True,
                     usage="%(prog)s [--preset NAME] [--config FILE] [--SECTION.FIELD VALUE ...]",
                     argument_default=argparse.SUPPRESS)
    top = parser.add_argument_group("presets")
    if presets:
        top.add_argument("--preset", choices=sorted(presets), metavar="NAME",
                         help=f"start from a preset: {', '.join(sorted(presets))}")
    top.add_argument("--config", metavar="FILE",
                     help="a TOML config file (sections as the flags' paths), over the preset")
    if extra:
        extra(top)
    by_path = {f.path: f for f in fields}
    alias_of: dict[Path_, list[str]] = {}
    for a, p in aliases.items():
        if p not in by_path:
            raise ValueError(f"alias {a} names no field {'.'.join(p)}")
        alias_of.setdefault(p, []).append(a)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields:
        section = f.path[0] if len(f.path) > 1 else "job"
        if section not in groups:
            about = f.section_help.split(":", 1)[1].strip() if ":" in f.section_help else f.section_help
            groups[section] = parser.add_argument_group(section, about or None)
        names = [f.flag.replace("_", "-")] + alias_of.get(f.path, [])
        default = get_path(shown, f.path)
        help_ = f"{f.help} (default: {_show(default)})" if f.help else f"(default: {_show(default)})"
        conv = converter(f.type)

        def typed_conv(s: str, conv=conv):
            try:
                return conv(s)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        kw = dict(dest=".".join(f.path), help=help_.replace("%", "%%"), type=typed_conv)
        if f.type is bool:
            groups[section].add_argument(*names, nargs="?", const=True, metavar="BOOL", **kw)
        elif typing.get_origin(f.type) is typing.Literal and "true" in typing.get_args(f.type):
            # a switch with more settings (`--resume`, `--resume auto`): the bare flag means "true"
            groups[section].add_argument(*names, nargs="?", const="true", metavar=_metavar(f.type), **kw)
        else:
            groups[section].add_argument(*names, metavar=_metavar(f.type), **kw)
    try:
        ns = parser.parse_args(argv)
    except ConfigError as e:
        raise ConfigError(_explain(str(e), [f.flag for f in fields] + list(aliases))) from None

    flags = {tuple(k.split(".")): v for k, v in vars(ns).items() if k not in ("preset", "config") and "." in k}
    flags.update({(k,): v for k, v in vars(ns).items() if k in {f.path[0] for f in fields if len(f.path) == 1}})
    flags = {p: v for p, v in flags.items() if p in by_path}
    # a path typed as a flag is the working directory's, recorded absolute (as a file's is), so that a resume or an
    # evaluation from another directory finds the same folder
    flags.update({p: absolute(v) for p, v in flags.items() if by_path[p].is_path and isinstance(v, str)})
    cfg = shown
    if callable(preset):
        try:
            cfg = preset(cfg, dict(flags))
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"--preset {preset_name}: {e}") from None
        typed.update({f.path: get_path(cfg, f.path) for f in fields
                      if get_path(cfg, f.path) != get_path(shown, f.path)})
    cfg = replace_paths(cfg, flags)
    typed.update(flags)
    return Parsed(cfg, typed, preset_name, dict(flags), frozenset(by_preset - set(flags)))


def _explain(message: str, flags: list[str]) -> str:
    """argparse's messages, shortened to one line with a suggestion for a mistyped flag."""
    m = re.match(r"unrecognized arguments: (\S+)", message)
    if m:
        name = m.group(1).split("=")[0]
        near = difflib.get_close_matches(name, flags, n=1)
        return f"unknown flag {name}" + (f" (did you mean {near[0]}?)" if near else "; --help lists them")
    m = re.match(r"argument ([^:]+): (.*)", message)
    if m:
        return f"{m.group(1).split('/')[0]}: {m.group(2)}"
    return message
