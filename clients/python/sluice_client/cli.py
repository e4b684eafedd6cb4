"""The `sluice` command's client verbs: generate, info, health, tokenize, cancel, update-weights
(update_weights_verb.py), sleep and wake (sleep_verbs.py), chat (chat_verb.py) and adapters
(adapter_verbs.py).

They need only this package (no torch). The server distribution adds `serve` to the same command
through the `sluice.commands` entry point group: each entry point is a function that adds its
verbs to the subparsers it is given, with `set_defaults(run=...)`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import typing
from importlib.metadata import entry_points
from typing import Any

from sluice_client import verb_flags
from sluice_client.adapter_verbs import add_adapter_verbs
from sluice_client.chat_verb import add_chat_verb
from sluice_client.remedies import NoServerError, explain
from sluice_client.server_wait import until_started
from sluice_client.sleep_verbs import add_sleep_verbs
from sluice_client.structured_flags import add_structured_flags, structured_options
from sluice_client.update_weights_verb import add_update_weights_verb
from sluice_client.verb_flags import (
    UINT32,
    UINT64,
    add_affinity_flag,
    add_client_flags,
    add_wait_flag,
    client_tls,
    int_in,
)

SERVER_MISSING = (
    "sluice serve: the server is not installed (this is the client package alone); install it "
    "from a checkout of the repository: pip install . (at its root), or bash scripts/setup.sh"
)


def quiet_grpc_core() -> None:
    """Only errors from gRPC's C core on stderr: at its default level it writes a plain-text line
    per failed TLS handshake (a plaintext or untrusted client), which would break the server's
    one-JSON-object-per-line stderr. Read when gRPC is imported, so call this before (a
    GRPC_VERBOSITY already set wins)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


class CommandParser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 1 (argparse's own: the usage, then exit 2)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="sluice", description="Sluice: text generation over gRPC.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    for entry in entry_points(group="sluice.commands"):
        entry.load()(verbs)
    if "serve" not in verbs.choices:
        add_serve_missing(verbs)

    gen = verbs.add_parser("generate", help="stream a completion to stdout")
    add_client_flags(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int_in(1, UINT32), default=64)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int_in(-(2**31), 2**31 - 1))
    gen.add_argument("--seed", type=int_in(0, UINT64))
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--adapter", default="", help="a loaded LoRA adapter's name")
    gen.add_argument(
        "--request-id",
        default="",
        help="the request's id, for `sluice cancel` (default: the server makes one); either way "
        "it is printed on stderr when the request starts",
    )
    add_affinity_flag(gen)
    add_wait_flag(gen)
    add_structured_flags(gen)
    gen.set_defaults(run=run_generate)

    info = verbs.add_parser("info", help="print the server's model and state as JSON")
    add_client_flags(info)
    info.set_defaults(run=run_info)

    health = verbs.add_parser("health", help="exit 0 once the server is SERVING")
    add_client_flags(health)
    health.add_argument("--wait", type=float, default=0.0, help="seconds to keep trying")
    health.set_defaults(run=run_health)

    tokenize = verbs.add_parser("tokenize", help="print the token ids of a text as JSON")
    add_client_flags(tokenize)
    tokenize.add_argument("text")
    tokenize.add_argument(
        "--add-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add the special tokens (BOS) the server adds to a text prompt (default: on)",
    )
    tokenize.set_defaults(run=run_tokenize)

    cancel = verbs.add_parser("cancel", help="cancel requests by id (from any connection)")
    add_client_flags(cancel)
    cancel.add_argument("request_ids", nargs="+", metavar="REQUEST_ID")
    add_affinity_flag(cancel)
    cancel.set_defaults(run=run_cancel)

    add_update_weights_verb(verbs)
    add_sleep_verbs(verbs)
    add_chat_verb(verbs)
    add_adapter_verbs(verbs)
    return parser


def add_serve_missing(verbs: Any) -> None:
    """`serve` where only the client is installed: whatever its flags, it says what to install."""
    # NOTE: no prefix characters, so every flag of the real `serve` is a plain argument here.
    serve = verbs.add_parser(
        "serve", help="run the server (needs the server package)", prefix_chars="\0", add_help=False
    )
    serve.add_argument("flags", nargs="*")
    serve.set_defaults(run=run_serve_missing)


def run_serve_missing(args: argparse.Namespace) -> int:
    print(SERVER_MISSING, file=sys.stderr)
    return 1


def run_generate(args: argparse.Namespace) -> int:
    from sluice_client import pb

    structured = structured_options(args)  # NOTE: before connecting: a bad file makes no RPC
    with verb_flags.connect(args) as client:

        def opening() -> tuple[Any, Any]:
            events = client.generate(
                args.prompt,
                request_id=args.request_id,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
                affinity=args.affinity,
                adapter=args.adapter,
                **structured,
            )
            return next(events), events  # a refusal raises here, before anything is printed

        first, rest = until_started(opening, args.target, args.wait_timeout)
        for event in itertools.chain([first], rest):
            match event.WhichOneof("event"):
                case "started":  # the call was accepted: only now is the prompt echoed
                    print(
                        f"[request {event.request_id}: `sluice cancel --target {args.target} "
                        f"{event.request_id}` stops it]",
                        file=sys.stderr,
                        flush=True,
                    )
                    sys.stdout.write(args.prompt)
                    sys.stdout.flush()
                case "tokens":
                    sys.stdout.write(event.tokens.text)
                    sys.stdout.flush()
                case "finished":
                    reason = pb.FinishReason.Name(event.finished.reason)
                    print(file=sys.stdout)
                    print(
                        f"[{reason} {event.finished.message}]".replace(" ]", "]"), file=sys.stderr
                    )
                    return 0 if event.finished.reason != pb.FINISH_REASON_ERROR else 1
    return 1


def run_info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    with verb_flags.connect(args) as client:
        info = client.info()
    # Every field, 0 and empty ones too: a policy version of 0 is a version.
    fields = json_format.MessageToDict(info, always_print_fields_with_no_presence=True)
    print(json.dumps(fields, indent=2))
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    with verb_flags.connect(args) as client:
        ids = client.tokenize(args.text, add_special_tokens=args.add_special_tokens)
    print(json.dumps(ids))
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    """Prints which ids were cancelled and which the server did not know (finished, or never)."""
    with verb_flags.connect(args) as client:
        response = client.cancel(args.request_ids, affinity=args.affinity)
    print(
        json.dumps({"cancelled": list(response.cancelled), "not_found": list(response.not_found)})
    )
    return 0


def run_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from sluice_client.channels import secure_or_insecure

    end = time.monotonic() + args.wait
    with secure_or_insecure(args.target, client_tls(args)) as channel:
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


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success; a failed call prints `CODE: details` on stderr and exits 1, a file
    that cannot be read (a token, a TLS file) or a bad value `error: ...`."""
    quiet_grpc_core()
    import grpc

    args = build_parser().parse_args(argv)
    target = getattr(args, "target", None)
    try:
        return int(args.run(args))
    except NoServerError as exc:
        print(exc, file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(explain(exc.code(), exc.details() or "", target or "the target"), file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
