"""`sluice serve`'s flags, derived from the config dataclasses' fields.

Every `setting` field of ServiceConfig and of its EngineConfig is one flag: `--max-num-seqs` for
`max_num_seqs`, its type, default and help from the field (service/config.py, engine/protocol/config.py),
so a new setting is a flag at once and the two cannot drift. A flag not given falls back to the
environment variable `SLUICE_<FIELD>` (`SLUICE_MAX_NUM_SEQS=64`), for containers, then to the
field's default. Booleans are `--x/--no-x` (environment: true/false, 1/0, yes/no, on/off);
secrets are read from the file the flag names (`--api-token-file`, `SLUICE_API_TOKEN_FILE`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from sluice_client.verb_flags import parse_bytes, read_token

from engine.protocol.settings import GROUPS, is_setting
from service.config import ServiceConfig

ENV_PREFIX = "SLUICE_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
C = TypeVar("C")
# Spellings of a flag documented before the flags were derived from the config, kept so that
# scripts written against them still start: option -> (flag name, the value it gives).
ALIASES: dict[str, tuple[str, Any]] = {"--disable-prefix-cache": ("enable_prefix_cache", False)}


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in TRUE + FALSE:
        raise ValueError(f"not a boolean: {text!r} (true/false, 1/0, yes/no, on/off)")
    return lowered in TRUE


@dataclasses.dataclass(frozen=True)
class Flag:
    """One config field as a command-line flag."""

    field: dataclasses.Field[Any]
    path: tuple[str, ...]  # attribute path from the root config, e.g. ("engine", "seed")
    kind: type  # int, float, str or bool

    @property
    def name(self) -> str:
        """The field name, plus `_file` for a secret read from a file."""
        return self.field.name + ("_file" if self.field.metadata["from_file"] else "")

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def convert(self) -> Callable[[str], Any]:
        """Text (of the flag, or of its environment variable) -> the parsed value."""
        if self.field.metadata["from_file"]:
            return Path
        if self.field.metadata["size"]:
            return parse_bytes
        return parse_bool if self.kind is bool else self.kind

    @property
    def metavar(self) -> str | None:
        if self.field.metadata["choices"]:
            return None  # argparse shows them
        if self.field.metadata["from_file"]:
            return "FILE"
        if self.field.metadata["size"]:
            return "SIZE"
        return {int: "N", float: "X", str: "VALUE", bool: ""}[self.kind]


def config_flags(cls: type, path: tuple[str, ...] = ()) -> Iterator[Flag]:
    """The flags of `cls`'s setting fields, and of the dataclass-typed fields within."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from config_flags(typing.cast(type, hint), (*path, field.name))
        elif is_setting(field):
            kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
            assert kind in (int, float, str, bool), f"{cls.__name__}.{field.name}: {hint}"
            yield Flag(field, (*path, field.name), kind)


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one flag per setting of `cls`, in --help groups.

    A flag not given is None in the namespace: `config_from_args` then looks at the environment
    and the field's default."""
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for flag in config_flags(cls):
        meta, default = flag.field.metadata, flag.field.default
        shown = "" if default in (None, dataclasses.MISSING) else f"; default: {default}"
        text = f"{meta['help']} [env {flag.env}{shown}]"
        group = groups[meta["group"]]
        if flag.kind is bool:
            group.add_argument(flag.option, action=argparse.BooleanOptionalAction, help=text)
        else:
            group.add_argument(
                flag.option,
                type=flag.convert,
                choices=meta["choices"],
                help=text,
                metavar=flag.metavar,
            )
    for alias, (name, value) in ALIASES.items():
        option = "--" + name.replace("_", "-")
        shown = option if value else "--no-" + option.removeprefix("--")
        parser.add_argument(
            alias, dest=name, action="store_const", const=value, help=f"the same as {shown}"
        )


def config_from_args(
    cls: type[C], args: argparse.Namespace, env: Mapping[str, str] = os.environ
) -> C:
    """The config the parsed flags describe, with `env` for the flags not given.

    Raises ValueError (a bad value, naming the field or the environment variable) or OSError (a
    secret file that cannot be read)."""
    values: dict[tuple[str, ...], Any] = {}
    for flag in config_flags(cls):
        value = getattr(args, flag.name)
        if value is None and flag.env in env:
            text = env[flag.env]
            try:
                value = flag.convert(text)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"{flag.env}={text!r}: {exc}") from None
        if value is None:
            continue  # the field's default
        if flag.field.metadata["from_file"]:
            value = read_token(value)
        values[flag.path] = value
    return _build(cls, (), values)


def _build(cls: type[C], path: tuple[str, ...], values: dict[tuple[str, ...], Any]) -> C:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(typing.cast(Any, cls)):
        here = (*path, field.name)
        if dataclasses.is_dataclass(hints[field.name]):
            kwargs[field.name] = _build(hints[field.name], here, values)
        elif here in values:
            kwargs[field.name] = values[here]
    return cls(**kwargs)


def flag_tables() -> str:
    """Markdown: one table of flags per --help group (docs/service.md holds this text; a test
    checks it is current). `python -m service.flags` prints it."""
    rows: dict[str, list[str]] = {group: [] for group in GROUPS}
    for flag in config_flags(ServiceConfig):
        meta, default = flag.field.metadata, flag.field.default
        option = flag.option + (" FILE" if meta["from_file"] else "")
        if flag.kind is bool:
            option = f"{flag.option} / --no-{flag.option.removeprefix('--')}"
        if default is None or default is dataclasses.MISSING:
            shown = "-"
        elif meta["size"]:
            shown = f"{default // 2**20} MiB"
        else:
            shown = str(default)
        rows[meta["group"]].append(f"| `{option}` | {shown} | {meta['help']} |")
    tables = [
        f"**{group[0].upper()}{group[1:]}**\n\n| Flag | Default | |\n|---|---|---|\n"
        + "\n".join(rows[group])
        for group in GROUPS
    ]
    return "\n\n".join(tables) + "\n"


if __name__ == "__main__":
    print(flag_tables(), end="")
