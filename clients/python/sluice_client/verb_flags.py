"""What the `sluice` verbs share: the target, token, TLS, wait and affinity flags, the integer
and size parsers their flags use, and the Client the flags describe (`connect`).

The verb modules (cli.py and the *_verb(s).py beside it) import this module and never each
other's, so the command has no import circle. Like cli.py it is importable without grpc: what
needs grpc (the Client, the channel's TLS) is imported when a verb runs.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sluice_client.remedies import NoServerError, no_server
from sluice_client.server_wait import DEFAULT_WAIT_S, reachable

if TYPE_CHECKING:
    from sluice_client import Client
    from sluice_client.channels import TlsConfig

UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
DEFAULT_TARGET = "127.0.0.1:50051"
UINT32, UINT64 = 2**32 - 1, 2**64 - 1


def parse_bytes(text: str) -> int:
    """'4096', '512M', '2GiB', '1.5g' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2GiB)")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], the range the request field takes, so that
    a bad value is a usage error naming its flag (protobuf's own names no field)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


def read_token(path: Path | None) -> str | None:
    return None if path is None else path.read_text().strip()


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="HOST:PORT")
    p.add_argument("--api-token-file", type=Path)
    add_tls_flags(p)


def add_wait_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help="while the server's engine is starting, keep trying this long (default: "
        f"{DEFAULT_WAIT_S:g}; 0: fail at once)",
    )


def add_affinity_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--affinity",
        metavar="KEY",
        help="routing key (x-sluice-affinity) for a load balancer: calls with one key go to one "
        "replica",
    )


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    tls = p.add_argument_group("TLS (on when any of these is given)")
    tls.add_argument("--tls", action="store_true", help="TLS, trusting gRPC's public roots")
    tls.add_argument(
        "--tls-ca-file", type=Path, help="PEM roots the server's certificate must chain to"
    )
    tls.add_argument("--tls-cert-file", type=Path, help="client certificate (PEM), for mTLS")
    tls.add_argument("--tls-key-file", type=Path, help="its private key (PEM)")
    tls.add_argument(
        "--tls-server-name", help="the name the server's certificate holds, if not the target's"
    )


def connect(args: argparse.Namespace) -> Client:
    """A Client from the flags of `add_client_flags`; NoServerError where none answers."""
    from sluice_client import Client

    tls = reachable_tls(args)
    return Client(args.target, api_token=read_token(args.api_token_file), tls=tls)


def reachable_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS flags' TlsConfig, once a connection to `--target` has been made with it: where
    none can be, NoServerError says so at once, with what to do, rather than the call failing
    after the channel's retries (`health` does not call this: it reports in its own words)."""
    tls = client_tls(args)
    if not reachable(args.target, tls):
        raise NoServerError(no_server(args.target, tls is not None))
    return tls


def client_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig of the TLS flags, None (plaintext) when none is given."""
    from sluice_client.channels import TlsConfig

    tls = TlsConfig(
        ca_file=args.tls_ca_file,
        cert_file=args.tls_cert_file,
        key_file=args.tls_key_file,
        server_name=args.tls_server_name,
    )
    return tls if args.tls or tls != TlsConfig() else None
