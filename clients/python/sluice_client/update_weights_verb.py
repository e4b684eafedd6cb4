"""The `sluice update-weights` verb: swap the served weights live, from a checkpoint directory on
the server's machine or a local .safetensors file sent inline, on one server or on several
replicas in parallel (sluice_client.replicas), printing the Applied event(s) as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice_client.verb_flags import (
    DEFAULT_TARGET,
    UINT32,
    UINT64,
    add_tls_flags,
    client_tls,
    int_in,
    parse_bytes,
    read_token,
)

if TYPE_CHECKING:
    from sluice.v1 import admin_pb2


def add_update_weights_verb(verbs: Any) -> None:
    """Add `update-weights` to the `sluice` command's subparsers."""

    update = verbs.add_parser(
        "update-weights", help="swap the served weights live; prints Applied as JSON"
    )
    update.add_argument(
        "--target",
        action="append",
        help=f"HOST:PORT (default {DEFAULT_TARGET}); repeat it to update several replicas in "
        "parallel, each at its own address (never a load balancer's)",
    )
    source = update.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="HF checkpoint directory on the server's machine")
    source.add_argument(
        "--tensors", type=Path, help="a local .safetensors file: its tensors are sent inline"
    )
    update.add_argument(
        "--inflight", choices=["drain", "abort", "continue", "recompute"], default="drain"
    )
    update.add_argument(
        "--version", type=int_in(0, UINT64), default=0, help="new policy version (0 = +1)"
    )
    update.add_argument(
        "--drain-timeout-ms", type=int_in(0, UINT32), help="DRAIN: fail after this long"
    )
    update.add_argument("--chunk-bytes", type=parse_bytes, default="4M", help="--tensors chunks")
    update.add_argument("--admin-token-file", type=Path)
    update.add_argument(
        "--api-token-file",
        type=Path,
        help="several targets and --version 0: the API token to read their versions with",
    )
    add_tls_flags(update)
    update.set_defaults(run=run_update_weights)


def run_update_weights(args: argparse.Namespace) -> int:
    """One target: progress on stderr, Applied as JSON. Several: each replica's progress lines
    prefixed with its target, then a JSON list of results; exit 1 when any replica failed."""
    from sluice_client import Client, read_safetensors

    targets = args.target or [DEFAULT_TARGET]
    admin_token = read_token(args.admin_token_file)
    tensors = None if args.tensors is None else read_safetensors(args.tensors)
    if len(targets) > 1:
        return _update_replicas(args, targets, admin_token, tensors)
    options = {
        "policy_version": args.version,
        "inflight": args.inflight,
        "drain_timeout_ms": args.drain_timeout_ms,
        "on_progress": lambda event: _show_progress("", event, sys.stderr.isatty()),
    }
    with Client(targets[0], admin_token=admin_token, tls=client_tls(args)) as client:
        if tensors is None:
            applied = client.update_weights(args.checkpoint, **options)
        else:
            applied = client.update_weights_inline(tensors, chunk_bytes=args.chunk_bytes, **options)
    print(json.dumps(_applied_fields(applied), indent=2))
    return 0


def _update_replicas(
    args: argparse.Namespace,
    targets: list[str],
    admin_token: str | None,
    tensors: dict[str, tuple[str, list[int], memoryview]] | None,
) -> int:
    from sluice_client.replicas import update_all

    results = update_all(
        targets,
        checkpoint_dir=args.checkpoint,
        tensors=tensors,
        admin_token=admin_token,
        api_token=read_token(args.api_token_file),
        tls=client_tls(args),
        policy_version=args.version,
        inflight=args.inflight,
        drain_timeout_ms=args.drain_timeout_ms,
        chunk_bytes=args.chunk_bytes,
        on_progress=lambda target, event: _show_progress(f"{target}: ", event, False),
    )
    report = []
    for result in results:
        if result.applied is not None:
            report.append({"target": result.target, "applied": _applied_fields(result.applied)})
        else:
            print(f"{result.target}: {result.code}: {result.message}", file=sys.stderr)
            report.append(
                {"target": result.target, "error": {"code": result.code, "message": result.message}}
            )
    print(json.dumps(report, indent=2))
    return 0 if all(r.ok for r in results) else 1


def _show_progress(prefix: str, event: admin_pb2.UpdateWeightsProgress, redraw: bool) -> None:
    """One update's progress on stderr; `redraw`: the loading bar rewrites one line."""
    match event.WhichOneof("event"):
        case "paused":
            print(f"{prefix}paused: {event.paused.in_flight} requests in flight", file=sys.stderr)
        case "loading":
            end = "\r" if redraw else "\n"
            print(prefix + _progress_bar(event.loading), end=end, file=sys.stderr, flush=True)
        case "applied" if redraw:
            print(file=sys.stderr)
        case "applied":
            applied = event.applied
            print(
                f"{prefix}applied: version {applied.previous_version} -> {applied.policy_version}",
                file=sys.stderr,
            )


def _applied_fields(applied: admin_pb2.Applied) -> dict[str, object]:
    from google.protobuf import json_format

    return json_format.MessageToDict(applied, always_print_fields_with_no_presence=True)


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
