"""How the `sluice` command meets a server that is not ready: absent, or its engine starting.

`reachable` tells at once whether anything answers at the target, so that a mistyped port or a
server not yet started is reported in a moment, with what to do (remedies.py), instead of after
the channel's retries (retry.py: about 5 s of silent backoff).

`until_started` is for a server that is up while its engine is not: the engine starts (or is
restarted) after the port is bound, 15-50 s for a checkpoint and longer while the demo model is
first built, and the server refuses calls meanwhile with UNAVAILABLE "the engine is starting".
The verbs that generate retry such a call until the engine serves, saying so once on stderr, up
to `--wait-timeout` seconds (DEFAULT_WAIT_S; 0: fail at once).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # NOTE: the CLI module imports this one before gRPC may load (quiet_grpc_core)
    from sluice_client.channels import TlsConfig

T = TypeVar("T")

DEFAULT_WAIT_S = 300.0  # the demo model's first build takes a few minutes on a busy machine
CONNECT_TIMEOUT_S = 10.0  # a target that neither answers nor refuses (a dropped SYN) by then
RETRY_EVERY_S = 0.5  # between calls refused as starting (each already retried by gRPC)
STARTING = ("the engine is starting", "the engine is restarting")


def reachable(target: str, tls: TlsConfig | None, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """False when a connection to `target` fails (refused, unresolvable, a TLS handshake that
    fails); True when one is made, or when neither happens within `timeout` (the call that
    follows then reports what it meets)."""
    import grpc

    from sluice_client.channels import secure_or_insecure

    settled = threading.Event()
    failed: list[bool] = []

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            settled.set()
        elif state in (
            grpc.ChannelConnectivity.TRANSIENT_FAILURE,
            grpc.ChannelConnectivity.SHUTDOWN,
        ):
            failed.append(True)
            settled.set()

    with secure_or_insecure(target, tls) as channel:
        channel.subscribe(watch, try_to_connect=True)
        settled.wait(timeout)
        channel.unsubscribe(watch)
    return not failed


def until_started(call: Callable[[], T], target: str, wait_s: float) -> T:
    """`call()`, retried while the server refuses it because its engine is starting; the refusal
    itself once `wait_s` seconds have passed. `call` must have no effect when refused (it is
    the opening of a call: nothing printed, nothing admitted)."""
    import grpc

    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if not _is_starting(exc) or time.monotonic() >= deadline:
                raise
            if not announced:
                print(
                    f"waiting for the server at {target} to start its engine "
                    f"(up to {wait_s:g} s, --wait-timeout)...",
                    file=sys.stderr,
                    flush=True,
                )
                announced = True
        time.sleep(min(RETRY_EVERY_S, max(0.0, deadline - time.monotonic())))


def _is_starting(exc: Exception) -> bool:
    """An RpcError (a call's, which has `code()` and `details()`) refusing as starting."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if not callable(code) or not callable(details):
        return False
    return getattr(code(), "name", None) == "UNAVAILABLE" and (details() or "").startswith(STARTING)
