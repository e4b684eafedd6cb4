"""What the `sluice` command prints for a failed call: the server's status, then what to do.

A status's details say what went wrong on the server's side; a person at a terminal also needs
the flag or verb that fixes it. `explain` adds that remedy for the refusals a new user meets
first (no server, a sleeping engine, a missing token, no LoRA slots, no chat template); any other
status is printed as the server sent it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: the CLI module imports this one before gRPC may load (quiet_grpc_core)
    import grpc


def _start_a_server(target: str) -> str:
    port = target.rsplit(":", 1)[-1] if ":" in target else "50051"
    port = port if port.isdigit() else "50051"
    return f"start one with `sluice serve --model demo --port {port}`, or point --target at one"


class NoServerError(Exception):
    """No connection could be made to the target; the message says what to do."""


def no_server(target: str, tls: bool) -> str:
    """The line for a target where no connection could be made: nothing listens, the name does
    not resolve, or the two ends disagree about TLS."""
    if tls:
        return (
            f"UNAVAILABLE: cannot connect to {target} over TLS: no server there "
            f"({_start_a_server(target)}), or one whose TLS refuses these --tls flags"
        )
    return (
        f"UNAVAILABLE: no server at {target} ({_start_a_server(target)}), or one that wants TLS "
        "(--tls, --tls-ca-file)"
    )


def explain(code: grpc.StatusCode, details: str, target: str) -> str:
    """`CODE: details`, followed by the remedy when one is known."""
    line = f"{code.name}: {details}"
    remedy = _remedy(code, details, target)
    return f"{line}; {remedy}" if remedy else line


def _remedy(code: grpc.StatusCode, details: str, target: str) -> str | None:
    if code.name == "UNAVAILABLE" and _is_connection_failure(details):
        return f"no server at {target}? {_start_a_server(target)}"
    if "the engine is sleeping" in details or "the server sleeps" in details:
        return f"wake it with `sluice wake --target {target} --admin-token-file FILE`"
    if "max_loras is 0" in details:
        return "restart the server with `--max-loras N` (N adapters resident at once)"
    if "the Admin service is disabled" in details:
        return (
            "start the server with `--admin-token-file FILE` and give this verb the same "
            "--admin-token-file FILE"
        )
    if "admin token" in details:
        # Both ends name the file the same way: the server reads its token from one, the
        # verbs send the one they are given.
        return (
            "give the admin verb the server's admin token with --admin-token-file FILE "
            "(the file the server was started with, `sluice serve --admin-token-file FILE`)"
        )
    if "bearer token" in details:
        return (
            "give the server's API token with --api-token-file FILE "
            "(the file the server was started with, `sluice serve --api-token-file FILE`)"
        )
    if "has no chat template" in details:
        return (
            "start the server with --chat-template FILE (a Jinja chat template), "
            "or use `sluice generate` with plain text"
        )
    return None


def _is_connection_failure(details: str) -> bool:
    """gRPC's own details for a channel that never connected (no server said anything)."""
    lowered = details.lower()
    return any(
        phrase in lowered
        for phrase in ("failed to connect", "connection refused", "dns resolution failed")
    )
