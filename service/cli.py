"""`sluice serve`: the server's flags and start.

The `sluice` command itself belongs to the client package (`sluice_client.cli`, the client verbs);
this distribution adds `serve` to it through the `sluice.commands` entry point (`register`).
`python -m service [flags]` is `sluice serve [flags]`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice_client.cli import parse_bytes, read_token

from engine.config import ATTENTION_BACKENDS, DEVICES, DTYPES, LOG_FORMATS, LOG_LEVELS, EngineConfig

if TYPE_CHECKING:
    from service.config import ServiceConfig


def register(verbs: Any) -> None:
    """The `sluice.commands` entry point: adds `serve` to the `sluice` command's verbs."""
    serve = verbs.add_parser("serve", help="run the gRPC server")
    add_serve_flags(serve)
    serve.set_defaults(run=run_serve)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `sluice serve`'s flags alone (`python -m service`)."""
    parser = argparse.ArgumentParser(prog="sluice serve", description=__doc__)
    add_serve_flags(parser)
    return parser


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="HF checkpoint directory, or 'demo'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (logged)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-memory", type=parse_bytes, help="bytes for KV pages, e.g. 2GiB")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-kv-pages", type=int)
    p.add_argument("--disable-prefix-cache", action="store_true")
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto = triton on CUDA when installed, else torch_ref",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--api-token-file", type=Path, help="require 'authorization: Bearer <it>'")
    p.add_argument(
        "--admin-token-file", type=Path, help="enables Admin (UpdateWeights) with this token"
    )
    p.add_argument("--tls-cert-file", help="serve TLS with this PEM certificate (chain)")
    p.add_argument("--tls-key-file", help="the certificate's PEM private key (unencrypted)")
    p.add_argument(
        "--tls-client-ca-file",
        help="require client certificates signed by a CA in this PEM file (mTLS)",
    )
    p.add_argument("--weights-dir", help="where inline weight updates are assembled (temp dir)")
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting queue bound")
    p.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=2048,
        help="Generation calls running at once; more are RESOURCE_EXHAUSTED (Cancel exempt)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=parse_bytes,
        default="16M",
        help="largest request message (prompt, weight chunk); larger ones: RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--update-idle-timeout",
        type=float,
        default=60.0,
        help="seconds UpdateWeights waits for the caller's next message before failing (ABORTED)",
    )
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds, on SIGTERM")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds without engine progress while work is in flight before it is restarted "
        "(must exceed the longest engine step)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=15.0,
        help="seconds without a heartbeat from an idle engine before it is restarted",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics over HTTP at /metrics on this port (0 = any free port, "
        "logged); off by default",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics port")
    p.add_argument("--policy-version", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="both processes")
    p.add_argument(
        "--log-format",
        default="json",
        choices=LOG_FORMATS,
        help="stderr of both processes: json (one object per line) or console (for a terminal)",
    )


def service_config(args: argparse.Namespace) -> ServiceConfig:
    from service.config import ServiceConfig

    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        page_size=args.page_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_pages=args.num_kv_pages,
        enable_prefix_cache=not args.disable_prefix_cache,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        compile=args.compile,
        policy_version=args.policy_version,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    return ServiceConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        api_token=read_token(args.api_token_file),
        admin_token=read_token(args.admin_token_file),
        weights_dir=args.weights_dir,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_client_ca_file=args.tls_client_ca_file,
        max_waiting=args.max_waiting,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_message_bytes=args.max_message_bytes,
        update_idle_timeout=args.update_idle_timeout,
        shutdown_grace=args.shutdown_grace,
        stall_timeout=args.stall_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )


def run_serve(args: argparse.Namespace) -> int:
    import structlog

    from engine.logs import configure_logging
    from service.server import serve

    configure_logging(args.log_level, args.log_format, process="service")
    try:
        config = service_config(args)
    except (ValueError, OSError) as exc:  # a bad flag value or an unreadable token file
        structlog.get_logger("sluice.cli").error("serve.bad_config", error=str(exc))
        return 1
    return asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> int:
    return run_serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
