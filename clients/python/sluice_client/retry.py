"""The retry policy both clients give their channel: gRPC itself retries refused calls.

A Generation call that ends RESOURCE_EXHAUSTED (the server is overloaded) or UNAVAILABLE (the
engine is starting or restarting, the server is shutting down, or it cannot be reached) is tried
again, up to 5 attempts in all. Between attempts gRPC waits the server's `grpc-retry-pushback-ms`
when it sends one (Sluice does, with jitter, beside google.rpc.RetryInfo), else a random
exponential backoff from 0.25 s up to 4 s. The same policy as the Node.js client's.

gRPC retries a streaming call only until its first response arrives, and only while what the
client sent fits its retry buffer (256 KiB by default): no event is ever delivered twice, and a
GenerateStream retried after a refusal resends its starts, none of which was admitted. A
`refused` event inside a GenerateStream is not a call status and is never retried. Admin calls
(weight updates) are never retried.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

DEFAULT_SERVICE_CONFIG: Mapping[str, Any] = {
    "methodConfig": [
        {
            "name": [{"service": "sluice.v1.Generation"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.25s",
                "maxBackoff": "4s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
            },
        }
    ]
}

# What a client constructor's `retry` takes: True (DEFAULT_SERVICE_CONFIG), False (no retries),
# or a gRPC service config of your own (a JSON-able mapping, used instead of the default).
Retry = bool | Mapping[str, Any]


# The largest message a Sluice server sends (a Started with the prompt logprobs of a long
# prompt); gRPC's default receive limit is 4 MiB.
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(retry: Retry = True) -> list[tuple[str, Any]]:
    """The options of a channel to a Sluice server (`grpc.insecure_channel(target, options)`)."""
    limits = [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
    if retry is False:
        return [("grpc.enable_retries", 0), *limits]
    config = DEFAULT_SERVICE_CONFIG if retry is True else retry
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config)), *limits]
