"""The `sluice sleep` and `sluice wake` verbs: Admin Sleep and Wake of one server, each
printing the response as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sluice_client.verb_flags import (
    DEFAULT_TARGET,
    UINT32,
    add_tls_flags,
    int_in,
    reachable_tls,
    read_token,
)


def add_sleep_verbs(verbs: Any) -> None:
    """Add `sleep` and `wake` to the `sluice` command's subparsers."""

    sleep = verbs.add_parser(
        "sleep", help="free the server's KV cache (and weights, level 2) until `wake`"
    )
    wake = verbs.add_parser("wake", help="serve again after `sleep`")
    for verb in (sleep, wake):
        verb.add_argument("--target", default=DEFAULT_TARGET, help="HOST:PORT")
        verb.add_argument("--admin-token-file", type=Path)
        add_tls_flags(verb)
    sleep.add_argument(
        "--level",
        type=int,
        choices=[1, 2],
        default=1,
        help="1: free the KV cache and prefix cache; 2: the weights too",
    )
    sleep.add_argument(
        "--inflight",
        choices=["drain", "abort"],
        default="drain",
        help="admitted requests finish first (drain) or end ABORTED (abort)",
    )
    sleep.add_argument(
        "--drain-timeout-ms", type=int_in(0, UINT32), help="drain: fail after this long"
    )
    sleep.set_defaults(run=run_sleep)
    wake.set_defaults(run=run_wake)


def run_sleep(args: argparse.Namespace) -> int:
    with _admin_client(args) as client:
        response = client.sleep(
            args.level, inflight=args.inflight, drain_timeout_ms=args.drain_timeout_ms
        )
    print(json.dumps(_fields(response), indent=2))
    return 0


def run_wake(args: argparse.Namespace) -> int:
    with _admin_client(args) as client:
        response = client.wake()
    print(json.dumps(_fields(response), indent=2))
    return 0


def _admin_client(args: argparse.Namespace) -> Any:
    from sluice_client import Client

    tls = reachable_tls(args)
    return Client(args.target, admin_token=read_token(args.admin_token_file), tls=tls)


def _fields(message: Any) -> dict[str, object]:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)
