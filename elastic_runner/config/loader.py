"""Loading a configuration: defaults < YAML file < ``--set`` overrides, then validation.

Loading never raises a traceback at the user: every problem becomes one
:class:`~elastic_runner.config.ConfigError` line that names where the value came from (the file or
the ``--set`` flag), the dotted key, what is wrong, and what to set instead.
"""

from __future__ import annotations

import argparse

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ..printable import printable
from .root import SECTIONS, Config, ConfigError

#: YAML 1.2's float (core schema). PyYAML implements YAML 1.1, where a float needs a dot: 3e-4 and
#: 1e-2, how almost every optimizer setting is written, would be read as strings.
YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats (``3e-4``, ``1E+3``) as numbers."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

def _resolve_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        # Not "a | b": a bar would split the README's markdown table cell.
        *first, last = (repr(a) for a in typing.get_args(tp))
        return f"{', '.join(first)} or {last}" if first else last
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is dict:
        return "mapping"
    if origin is list:
        return "list"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert where lossless."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        concrete = [a for a in args if a is not type(None)]
        nullable = len(concrete) < len(args)
        if len(concrete) == 1:
            try:
                return coerce(value, concrete[0], key)
            except ConfigError as exc:
                if not nullable:
                    raise
                raise ConfigError(key, exc.problem + " or null", exc.fix + " (or null)") from None
        for arg in concrete:
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"got {value!r}, expected {_type_name(tp)}", f"Set {key} to {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            # YAML 1.1 reads on/off/yes/no as booleans; for a key whose values are words they mean on/off.
            return "on" if value else "off"
        if value in allowed and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r}, expected one of {', '.join(map(str, allowed))}", f"Set {key} to one of {list(allowed)}")
    if origin is list:
        if isinstance(value, list):
            (item_type,) = typing.get_args(tp) or (Any,)
            return [v if item_type is Any else coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(key, f"got {value!r}, expected a list", f"Write {key} as a YAML list, e.g. [a, b]")
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(key, f"got {value!r}, expected a mapping", f"Write {key} as a YAML mapping, e.g. {{key: value}}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"got {value!r}, expected true or false", f"Set {key} to true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"got {value!r}, expected an integer", f"Set {key} to a whole number")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and YAML12_FLOAT.fullmatch(value.strip()):
            return float(value)  # e.g. "3e-4" written as a string (a config built in Python)
        raise ConfigError(key, f"got {value!r}, expected a number", f"Set {key} to a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"got {value!r}, expected a string", f"Set {key} to a string")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(key, f"got {value!r}, expected null", f"Set {key} to null")
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def _suggest(name: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, choices, n=1)
    return f"Did you mean {close[0]!r}? " if close else ""


def _apply(config: Config, key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    if len(parts) == 1:
        if parts[0] not in SECTIONS:
            raise ConfigError(
                key, "unknown section",
                f"{_suggest(parts[0], list(SECTIONS))}Valid sections: {', '.join(SECTIONS)}", source,
            )
        raise ConfigError(key, "is a section, not a value", f"Set a key inside it, e.g. {key}.{dataclasses.fields(SECTIONS[key])[0].name}", source)
    section_name = parts[0]
    if section_name not in SECTIONS:
        raise ConfigError(
            key, f"unknown section {section_name!r}",
            f"{_suggest(section_name, list(SECTIONS))}Valid sections: {', '.join(SECTIONS)}", source,
        )
    section = getattr(config, section_name)
    hints = _resolve_hints(type(section))
    top_field = parts[1]
    if top_field not in hints:
        raise ConfigError(
            key, "unknown key",
            f"{_suggest(top_field, list(hints))}Valid keys in {section_name}: {', '.join(hints)}", source,
        )
    tp = hints[top_field]
    if len(parts) > 2:
        # Dotted override inside a free-form mapping, e.g. --set model.params.hidden=64.
        if typing.get_origin(tp) is not dict:
            raise ConfigError(key, f"{section_name}.{top_field} is not a mapping", f"Set {section_name}.{top_field} directly", source)
        target = getattr(section, top_field)
        for part in parts[2:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(key, f"{part} is not a mapping", "Override the enclosing key instead", source)
        target[parts[-1]] = value
        return
    try:
        setattr(section, top_field, coerce(value, tp, key))
    except ConfigError as exc:
        raise exc.with_source(source) from None


def _flatten(data: dict[str, Any], source: str) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for section_name, body in data.items():
        if not isinstance(section_name, str):
            raise ConfigError(str(section_name), "section names must be strings", "Use e.g. 'run:'", source)
        if section_name not in SECTIONS:
            raise ConfigError(
                section_name, "unknown section",
                f"{_suggest(section_name, list(SECTIONS))}Valid sections: {', '.join(SECTIONS)}", source,
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(section_name, f"got {body!r}, expected a mapping of keys", f"Write {section_name}: followed by indented key: value lines", source)
        for key, value in body.items():
            items.append((f"{section_name}.{key}", value))
    return items


def add_overrides_option(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE ...``: one or more per flag, and the flag repeatable (``--set a=1 b=2`` is ``--set a=1 --set
    b=2``), into ``overrides``."""
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config values, e.g. --set optim.lr=0.05 train.epochs=3 (repeatable; beats the "
                             "file)")


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` → ("a.b", parsed c). Values are parsed as YAML scalars/flow."""
    if "=" not in text:
        raise ConfigError(text, "override has no '='", "Write overrides as --set section.key=value, e.g. --set optim.lr=0.05", f"--set {text}")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.load(raw, Loader=ConfigLoader) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"cannot parse value {raw!r}: {exc.problem}", "Quote the value or fix its YAML syntax", f"--set {text}") from exc
    return key, value


def load_config(path: str | os.PathLike[str] | Mapping[str, Any] | None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file (or a mapping of sections) < ``--set`` overrides, then validation.

    Raises :class:`ConfigError` (one line, with the source) on any problem.
    """
    config = Config()
    sources: dict[str, str] = {}
    if isinstance(path, Mapping):
        for key, value in _flatten(dict(path), "config mapping"):
            _apply(config, key, value, "config mapping")
            sources[key] = "config mapping"
    elif path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError as exc:
            raise ConfigError("--config", f"file {source!r} not found", "Pass an existing YAML file, e.g. configs/quickstart.yaml") from exc
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {source!r}: {exc.strerror}", "Check the path and its permissions") from exc
        try:
            data = yaml.load(text, Loader=ConfigLoader) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError("(file)", f"invalid YAML{where}: {getattr(exc, 'problem', exc)}", "Fix the YAML syntax", source) from exc
        if not isinstance(data, dict):
            raise ConfigError("(file)", "top level must be a mapping of sections", "Start the file with e.g. 'run:'", source)
        for key, value in _flatten(data, source):
            _apply(config, key, value, source)
            sources[key] = source
    for text in overrides:
        key, value = parse_override(text)
        _apply(config, key, value, f"--set {text}")
        sources[key] = f"--set {text}"
    try:
        config.validate()
    except ConfigError as exc:
        raise exc.with_source(_origin(exc.key, sources, path)) from None
    return config


def _origin(key: str, sources: dict[str, str], path: Any) -> str:
    """Where the value behind a validation error came from: the key's own source, else that of a key below it or in
    its section (``data.path`` is required *because* the file set ``data.name``), else the file that left it out.
    "defaults" only where nothing was given at all: the defaults alone are what the user did not choose."""
    section = key.split(".", 1)[0]
    return (sources.get(key)
            or next((src for k, src in sources.items() if k.startswith(key + ".")), None)
            or next((src for k, src in reversed(list(sources.items())) if k.split(".", 1)[0] == section), None)
            or (str(path) if path is not None and not isinstance(path, Mapping) else None)
            or ("config mapping" if isinstance(path, Mapping) else "defaults"))


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a :class:`Config` from :meth:`Config.to_dict` output (e.g. a snapshot)."""
    config = Config()
    for key, value in _flatten(data, "(snapshot)"):
        _apply(config, key, value, "(snapshot)")
    return config


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def write_effective_config(config: Config, run_dir: str) -> Path:
    """Write the config the run actually uses (atomic replace, the run's file mode)."""
    from ..files import makedirs, write_file_atomically

    target = makedirs(run_dir) / "config.yaml"
    write_file_atomically(target, ("# effective configuration (defaults < file < --set)\n" + dump_yaml(config)).encode())
    return target


def reference_markdown() -> str:
    """The configuration reference (docs/reference/configuration.md), generated from the sections' field docs."""
    lines: list[str] = []
    for section_name, cls in SECTIONS.items():
        hints = _resolve_hints(cls)
        lines += [f"## `{section_name}`", "", (cls.__doc__ or "").strip(), "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                default = f.default_factory()  # type: ignore[misc]
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(
                f"| `{section_name}.{f.name}` | {_type_name(hints[f.name])} | `{shown}` | {f.metadata.get('help', '')} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def diff_configs(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys: list[str] = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        dotted = f"{prefix}{k}"
        if isinstance(va, dict) and isinstance(vb, dict) and prefix.count(".") < 1:
            keys.extend(diff_configs(va, vb, dotted + "."))
        elif va != vb:
            keys.append(printable(dotted, 80))  # (a key of a saved config: the snapshot's, others may write it)
    return keys
