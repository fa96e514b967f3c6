"""Builds a service's Config dataclass from CLI flags, with TOKENWIRE_* env fallbacks.

Each service's __main__ calls parse_config(Config) once; the Config validates itself in
__post_init__ and is the only thing that reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")
# --log-level's values: logging's levels that uvicorn (the gateway's server) names too.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(prefix: str, name: str) -> str:
    return f"{prefix}{name.upper()}"


def _base_type(tp: Any) -> Any:
    """int for `int | None`, list[str] stays list[str]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _convert(tp: Any, raw: str) -> Any:
    tp = _base_type(tp)
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return [item(part.strip()) for part in raw.split(",") if part.strip()]
    value = tp(raw)
    if tp is float and not math.isfinite(value):  # float() takes "nan" and "inf": no flag means them
        raise ValueError(f"not a finite number: {raw!r}")
    return value


def _default_text(field: dataclasses.Field) -> str:
    """' (default: X)' for --help (the parser's own defaults are None, so that the environment
    comes between a flag and the field's default); nothing for an empty one, whose meaning the
    help says."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    if isinstance(value, bool):
        shown = "on" if value else "off"
    elif isinstance(value, float):
        shown = f"{value:g}"
    elif isinstance(value, (list, tuple)):
        shown = ",".join(str(v) for v in value)
    else:
        shown = str(value)
    return f" (default: {shown})".replace("%", "%%") if shown else ""


def parse_config(cls: type[ConfigT], argv: Sequence[str] | None = None, env_prefix: str = "TOKENWIRE_",
                 description: str | None = None) -> ConfigT:
    """Flags come from field names (max_num_seqs -> --max-num-seqs), help from field metadata.

    Precedence: flag, then environment (TOKENWIRE_MAX_NUM_SEQS), then the field default.
    List fields take comma-separated values.
    """
    hints = typing.get_type_hints(cls)
    # Named as it is run ("python -m model_worker"), not "__main__.py".
    # No abbreviations: "--hos" reached --host past the stack's check of the flags it sets itself.
    parser = argparse.ArgumentParser(prog=f"python -m {cls.__module__.split('.')[0]}", allow_abbrev=False,
                                     description=description or (cls.__doc__ or "").strip())
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        help_text = f"{field.metadata.get('help', '')}{_default_text(field)} [env {_env_name(env_prefix, field.name)}]"
        if _base_type(tp) is bool:
            parser.add_argument(_flag(field.name), dest=field.name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(_flag(field.name), dest=field.name, default=None, help=help_text)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(args, field.name)
        if raw is None:
            raw = os.environ.get(_env_name(env_prefix, field.name))
        if raw is None:
            continue
        tp = hints[field.name]
        try:
            values[field.name] = raw if isinstance(raw, bool) else _convert(tp, raw)
        except ValueError as exc:
            parser.error(f"{_flag(field.name)}: {exc}")
        choices = field.metadata.get("choices")
        if choices is not None:
            values[field.name] = str(values[field.name]).lower()
            if values[field.name] not in choices:
                parser.error(f"{_flag(field.name)}: {raw!r} is not one of {', '.join(choices)}")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def cli_flags(cls: type) -> set[str]:
    """The flags parse_config accepts for cls (compose.yaml is checked against these)."""
    flags = set()
    for field in dataclasses.fields(cls):
        flags.add(_flag(field.name))
        if _base_type(typing.get_type_hints(cls)[field.name]) is bool:
            flags.add("--no-" + field.name.replace("_", "-"))
    return flags
