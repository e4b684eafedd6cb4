"""Config fields that describe their own command-line flag.

`setting(default, help, group=...)` is a dataclass field whose metadata says how `sluice serve`
exposes it (service/flags.py builds the flags from it): so the flag's name, type, default and
help cannot drift from the config. Standard library only.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, field
from typing import Any

# --help groups, in the order they are shown.
MODEL = "model"
SCHEDULING = "scheduling and KV cache"
EXECUTION = "execution"
NETWORK = "network and gRPC"
SECURITY = "authentication and TLS"
WEIGHTS = "weight updates"
SUPERVISION = "engine supervision and load shedding"
OBSERVABILITY = "logs and metrics"
GROUPS = (MODEL, SCHEDULING, EXECUTION, NETWORK, SECURITY, WEIGHTS, SUPERVISION, OBSERVABILITY)


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    group: str,
    choices: tuple[str, ...] | None = None,
    size: bool = False,
    from_file: bool = False,
) -> Any:
    """A config field with its flag's description.

    `size`: the flag takes a byte size ("512M", "2GiB"). `from_file`: the field holds a secret,
    and the flag `--<name>-file` names the file it is read from (so it never sits in argv).
    """
    assert group in GROUPS, group
    return field(
        default=default,
        metadata={
            "help": help,
            "group": group,
            "choices": choices,
            "size": size,
            "from_file": from_file,
        },
    )


def is_setting(f: Field[Any]) -> bool:
    return "group" in f.metadata
