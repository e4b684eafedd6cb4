"""The server's TLS credentials: PEM files read and checked once, before anything starts.

gRPC itself reads a certificate only when a client connects, and then fails every handshake
without saying why; checking here turns a wrong file into one clear error at start.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from service.config import ServiceConfig


class TlsError(ValueError):
    """A TLS file the server cannot use: unreadable, not PEM, or a key that is not the
    certificate's. The message names the config field and the file."""


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """The credentials of `config`'s TLS files, or None when it serves plaintext.

    With `tls_client_ca_file`, clients must present a certificate signed by one of its CAs."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    cert = _read("tls_cert_file", config.tls_cert_file)
    key = _read("tls_key_file", config.tls_key_file)
    _check_certificates("tls_cert_file", config.tls_cert_file, cert)
    _check_key_matches(config.tls_cert_file, config.tls_key_file)
    client_ca = None
    if config.tls_client_ca_file is not None:
        client_ca = _read("tls_client_ca_file", config.tls_client_ca_file)
        _check_certificates("tls_client_ca_file", config.tls_client_ca_file, client_ca)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _read(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{field}: cannot read {path}: {exc.strerror or exc}") from exc


def _check_certificates(field: str, path: str, pem: bytes) -> None:
    """At least one PEM certificate, and nothing in the file that fails to parse."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError) as exc:
        raise TlsError(f"{field}: {path} is not a PEM certificate file") from exc


def _check_key_matches(cert_path: str, key_path: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # NOTE: without a password callback OpenSSL would prompt on the terminal for an
        # encrypted key; gRPC cannot use one anyway.
        context.load_cert_chain(cert_path, key_path, password=_no_password)
    except _EncryptedKey as exc:
        raise TlsError(f"tls_key_file: {key_path} is encrypted; give an unencrypted key") from exc
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(
                f"tls_key_file: {key_path} is not the key of the certificate in {cert_path}"
            ) from exc
        raise TlsError(f"tls_key_file: {key_path} is not a PEM private key") from exc
    except OSError as exc:  # the file went away since it was read
        raise TlsError(f"tls_key_file: cannot read {key_path}: {exc.strerror or exc}") from exc


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    raise _EncryptedKey
