"""Settings declared once, as dataclass fields made with `setting`: each becomes a command-line option with
its `TRITONLLM_<NAME>` environment variable and help (`add_options`), and a field of the settings object
(`from_options`). Engine settings also travel as Triton model parameters (strings; `from_strings`,
`to_strings`), and options pass on to child commands as environment variables (`to_env`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable

ENV_PREFIX = "TRITONLLM_"


def setting(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, option: str | None = None,
            secret: bool = False, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field that is also an option. `parse` turns a string into the value (default: by the field's
    type); `option` renames the command-line option; a secret's value never appears in --help."""
    return dataclasses.field(default=default, metadata={
        "help": help, "parse": parse, "option": option, "secret": secret, "choices": choices})


def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"not a boolean: {text!r} (true or false)")
    return lowered in ("1", "true", "yes", "on")


def _parser_of(field: dataclasses.Field) -> Callable[[str], Any]:
    if field.metadata["parse"] is not None:
        return field.metadata["parse"]
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    kind = kind.replace(" | None", "")
    return {"int": int, "float": float, "bool": parse_bool}.get(kind, str)


def option_name(field: dataclasses.Field) -> str:
    return field.metadata["option"] or field.name.replace("_", "-")


def env_name(field: dataclasses.Field) -> str:
    return ENV_PREFIX + option_name(field).upper().replace("-", "_")


def settings_fields(cls: type) -> list[dataclasses.Field]:
    return [field for field in dataclasses.fields(cls) if "help" in field.metadata]


def add_options(parser: argparse.ArgumentParser, cls: type, *, exclude: tuple[str, ...] = ()) -> None:
    """--option for each setting of cls, defaulting to its environment variable, else its declared default."""
    for field in settings_fields(cls):
        if field.name in exclude:
            continue
        env = env_name(field)
        parse = _parser_of(field)
        raw = os.environ.get(env)
        default = field.default if raw is None else parse(raw)
        shown = "unset" if default is None else "hidden" if field.metadata["secret"] else default
        parser.add_argument(f"--{option_name(field)}", dest=field.name, default=default, type=parse,
                            metavar=option_name(field).upper().replace("-", "_"),
                            choices=field.metadata["choices"],
                            help=f"{field.metadata['help']} (default: {shown}) [env {env}]")


def from_options(cls: type, args: argparse.Namespace, **overrides: Any):
    values = {field.name: getattr(args, field.name) for field in settings_fields(cls) if hasattr(args, field.name)}
    return cls(**{**values, **overrides})


def from_strings(cls: type, values: dict[str, str]):
    """Settings from strings (Triton model parameters); unknown keys are ignored, empty values keep the
    default."""
    kwargs = {}
    for field in settings_fields(cls):
        raw = values.get(field.name)
        if raw is not None and str(raw).strip() != "":
            kwargs[field.name] = _parser_of(field)(str(raw).strip())
    return cls(**kwargs)


def _text(value: Any) -> str:
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def to_strings(settings) -> dict[str, str]:
    return {field.name: _text(getattr(settings, field.name)) for field in settings_fields(type(settings))}


def to_env(cls: type, args: argparse.Namespace) -> dict[str, str]:
    """The `TRITONLLM_*` variables that give a child command the option values of `args` (those of cls it has;
    unset ones left out). Through the environment, secrets stay off command lines."""
    return {env_name(field): _text(getattr(args, field.name)) for field in settings_fields(cls)
            if getattr(args, field.name, None) is not None}
