"""The `sluice adapters` verb: `load NAME PATH [--pinned] [--replace] [--policy-version V]
[--inflight POLICY]`, `unload NAME` and `list`, the LoRA
adapters of one server (Admin LoadAdapter and UnloadAdapter; ServerInfo.adapters). `load` and
`list` print JSON; `generate --adapter NAME` selects one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sluice_client.verb_flags import DEFAULT_TARGET, add_tls_flags, reachable_tls, read_token


def add_adapter_verbs(verbs: Any) -> None:
    """Add `adapters` (with its three actions) to the `sluice` command's subparsers."""

    adapters = verbs.add_parser("adapters", help="load, unload or list the server's LoRA adapters")
    actions = adapters.add_subparsers(dest="action", required=True)
    load = actions.add_parser("load", help="load a PEFT adapter directory (on the server's disk)")
    load.add_argument("name", help="the name requests select it by (generate --adapter)")
    load.add_argument("path", help="the adapter directory, as the server sees it")
    load.add_argument("--pinned", action="store_true", help="never evicted from its slot")
    load.add_argument(
        "--replace", action="store_true", help="update the loaded NAME in place, to a new version"
    )
    load.add_argument(
        "--policy-version",
        type=int,
        default=0,
        help="the adapter's version after it (default: 1; with --replace: its version + 1)",
    )
    load.add_argument(
        "--inflight",
        choices=["drain", "abort", "continue", "recompute"],
        default="drain",
        help="with --replace: what requests running the adapter do",
    )
    load.set_defaults(run=run_load)
    unload = actions.add_parser("unload", help="forget a loaded adapter")
    unload.add_argument("name")
    unload.set_defaults(run=run_unload)
    listing = actions.add_parser("list", help="print the loaded adapters as JSON")
    listing.set_defaults(run=run_list)
    for action in (load, unload, listing):
        action.add_argument("--target", default=DEFAULT_TARGET, help="HOST:PORT")
        action.add_argument("--admin-token-file", type=Path, help="load and unload need it")
        add_tls_flags(action)


def run_load(args: argparse.Namespace) -> int:
    with _client(args) as client:
        adapter = client.load_adapter(
            args.name,
            args.path,
            pinned=args.pinned,
            replace=args.replace,
            policy_version=args.policy_version,
            inflight=args.inflight,
        )
    print(json.dumps(_fields(adapter), indent=2))
    return 0


def run_unload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.unload_adapter(args.name)
    return 0


def run_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        adapters = client.adapters()
    print(json.dumps([_fields(adapter) for adapter in adapters], indent=2))
    return 0


def _client(args: argparse.Namespace) -> Any:
    from sluice_client import Client

    tls = reachable_tls(args)
    return Client(args.target, admin_token=read_token(args.admin_token_file), tls=tls)


def _fields(message: Any) -> dict[str, object]:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)
