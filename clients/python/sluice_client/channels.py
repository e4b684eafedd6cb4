"""The clients' gRPC channels: plaintext, TLS, or TLS with a client certificate (mTLS)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings of a client; the files are PEM, read when a channel is opened.

    `ca_file`: the root certificates the server's certificate must chain to (None: the public
    roots that gRPC ships). `cert_file` and `key_file`: this client's certificate and key, for a
    server that requires client certificates; both or neither. `server_name`: the name the
    server's certificate must hold, when it is not the target's host (a certificate for
    `sluice.internal` reached at 127.0.0.1, say).
    """

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TLS: give a client certificate and its key together, or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the files (OSError if one cannot be read)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def options(self) -> list[tuple[str, Any]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def secure_or_insecure(
    target: str, tls: TlsConfig | None = None, options: ChannelOptions = ()
) -> grpc.Channel:
    """A channel to `target`: TLS when `tls` is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])


def aio_secure_or_insecure(
    target: str, tls: TlsConfig | None = None, options: ChannelOptions = ()
) -> grpc.aio.Channel:
    """`secure_or_insecure` for asyncio code."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()
