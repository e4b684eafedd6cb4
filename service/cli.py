"""The `sluice` command: `serve` runs the server; `generate`, `info`, `health` and
`update-weights` are clients.

`python -m service [flags]` is `sluice serve [flags]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import ATTENTION_BACKENDS, DEVICES, DTYPES, EngineConfig

if TYPE_CHECKING:
    from sluice.v1 import admin_pb2

    from service.config import ServiceConfig

UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """'4096', '512M', '2GiB', '1.5g' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2GiB)")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    add_serve_flags(verbs.add_parser("serve", help="run the gRPC server"))

    gen = verbs.add_parser("generate", help="stream a completion to stdout")
    add_client_flags(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")

    info = verbs.add_parser("info", help="print the server's model and state as JSON")
    add_client_flags(info)

    health = verbs.add_parser("health", help="exit 0 once the server is SERVING")
    add_client_flags(health)
    health.add_argument("--wait", type=float, default=0.0, help="seconds to keep trying")

    update = verbs.add_parser(
        "update-weights", help="swap the served weights live; prints Applied as JSON"
    )
    update.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    source = update.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="HF checkpoint directory on the server's machine")
    source.add_argument(
        "--tensors", type=Path, help="a local .safetensors file: its tensors are sent inline"
    )
    update.add_argument(
        "--inflight", choices=["drain", "abort", "continue", "recompute"], default="drain"
    )
    update.add_argument("--version", type=int, default=0, help="new policy version (0 = +1)")
    update.add_argument("--drain-timeout-ms", type=int, help="DRAIN: fail after this long")
    update.add_argument("--chunk-bytes", type=parse_bytes, default="4M", help="--tensors chunks")
    update.add_argument("--admin-token-file", type=Path)
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    p.add_argument("--api-token-file", type=Path)


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
    )
    return ServiceConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        api_token=_read_token(args.api_token_file),
        admin_token=_read_token(args.admin_token_file),
        weights_dir=args.weights_dir,
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


def _read_token(path: Path | None) -> str | None:
    return None if path is None else path.read_text().strip()


def run_serve(args: argparse.Namespace) -> int:
    from service.logs import configure_logging
    from service.server import serve

    configure_logging(args.log_level)
    try:
        config = service_config(args)
    except (ValueError, OSError) as exc:  # a bad flag value or an unreadable token file
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(serve(config))


def run_generate(args: argparse.Namespace) -> int:
    from sluice_client import Client

    with Client(args.target, api_token=_read_token(args.api_token_file)) as client:
        events = client.generate(
            args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        sys.stdout.write(args.prompt)
        for event in events:
            match event.WhichOneof("event"):
                case "tokens":
                    sys.stdout.write(event.tokens.text)
                    sys.stdout.flush()
                case "finished":
                    from sluice_client import pb

                    reason = pb.FinishReason.Name(event.finished.reason)
                    print(file=sys.stdout)
                    print(
                        f"[{reason} {event.finished.message}]".replace(" ]", "]"), file=sys.stderr
                    )
                    return 0 if event.finished.reason != pb.FINISH_REASON_ERROR else 1
    return 1


def run_info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format
    from sluice_client import Client

    with Client(args.target, api_token=_read_token(args.api_token_file)) as client:
        info = client.info()
    print(json.dumps(json_format.MessageToDict(info), indent=2))
    return 0


def run_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + args.wait
    with grpc.insecure_channel(args.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as exc:
                status = f"unreachable ({exc.code().name})"
            if status == "SERVING":
                print(status)
                return 0
            if time.monotonic() >= end:
                print(status, file=sys.stderr)
                return 1
            time.sleep(0.5)


def run_update_weights(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format
    from sluice_client import Client, admin_pb, read_safetensors

    def show(event: admin_pb.UpdateWeightsProgress) -> None:
        match event.WhichOneof("event"):
            case "paused":
                print(f"paused: {event.paused.in_flight} requests in flight", file=sys.stderr)
            case "loading":
                end = "\r" if sys.stderr.isatty() else "\n"
                print(_progress_bar(event.loading), end=end, file=sys.stderr, flush=True)
            case "applied":
                print(file=sys.stderr)

    options = {
        "policy_version": args.version,
        "inflight": args.inflight,
        "drain_timeout_ms": args.drain_timeout_ms,
        "on_progress": show,
    }
    with Client(args.target, admin_token=_read_token(args.admin_token_file)) as client:
        try:
            if args.checkpoint is not None:
                applied = client.update_weights(args.checkpoint, **options)
            else:
                tensors = read_safetensors(args.tensors)
                applied = client.update_weights_inline(
                    tensors, chunk_bytes=args.chunk_bytes, **options
                )
        except grpc.RpcError as exc:
            print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    fields = json_format.MessageToDict(applied, always_print_fields_with_no_presence=True)
    print(json.dumps(fields, indent=2))
    return 0


def _progress_bar(loading: admin_pb2.Loading, width: int = 30) -> str:
    """`loading [#########.....]  60%  12.0/20.0 MiB  3/5 tensors`"""
    done, total = loading.bytes_done, loading.bytes_total
    fraction = done / total if total else 0.0
    filled = int(fraction * width)
    mib = 2**20
    return (
        f"loading [{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%}  "
        f"{done / mib:.1f}/{total / mib:.1f} MiB  "
        f"{loading.tensors_done}/{loading.tensors_total} tensors"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    runners = {
        "serve": run_serve,
        "generate": run_generate,
        "info": run_info,
        "health": run_health,
        "update-weights": run_update_weights,
    }
    return runners[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
