"""`sluice serve`: the server's flags and start.

The `sluice` command itself belongs to the client package (`sluice_client.cli`, the client verbs);
this distribution adds `serve` to it through the `sluice.commands` entry point (`register`).
`python -m service [flags]` is `sluice serve [flags]`. The flags are the config's fields
(service/flags.py).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from sluice_client.cli import CommandParser, quiet_grpc_core

from service.config import ServiceConfig
from service.flags import add_config_flags, config_from_args

DESCRIPTION = (
    "Serve a Hugging Face checkpoint over gRPC. Every flag may also be given as an environment "
    "variable, SLUICE_<FLAG> (SLUICE_MAX_NUM_SEQS=64); a flag on the command line wins."
)


def register(verbs: Any) -> None:
    """The `sluice.commands` entry point: adds `serve` to the `sluice` command's verbs."""
    serve = verbs.add_parser("serve", help="run the gRPC server", description=DESCRIPTION)
    add_config_flags(serve, ServiceConfig)
    serve.set_defaults(run=run_serve)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `sluice serve`'s flags alone (`python -m service`)."""
    parser = CommandParser(prog="sluice serve", description=DESCRIPTION)
    add_config_flags(parser, ServiceConfig)
    return parser


def service_config(args: argparse.Namespace) -> ServiceConfig:
    return config_from_args(ServiceConfig, args)


def run_serve(args: argparse.Namespace) -> int:
    """Exit 1 with one log line for a bad value or an unreadable file; else serve until stopped."""
    import structlog

    from engine.logs import configure_logging
    from service.server import serve

    try:
        config = service_config(args)
    except (ValueError, OSError) as exc:
        configure_logging(process="service")
        structlog.get_logger("sluice.cli").error("serve.bad_config", error=str(exc))
        return 1
    configure_logging(config.engine.log_level, config.engine.log_format, process="service")
    return asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> int:
    quiet_grpc_core()
    return run_serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
