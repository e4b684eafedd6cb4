"""The OpenAI port serves the gRPC port's TLS: HTTPS with its certificate, and with a client
CA configured, only to clients whose certificate that CA signed (fake engine; certificates made
with the `openssl` command at test time)."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tests.support.service_harness import make_fake_model, running_server

pytestmark = pytest.mark.asyncio


def certificate(directory: Path, name: str, ca: tuple[Path, Path] | None, *ext: str):
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt"]
    command += ["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", f"/CN={name}"]
    command += ["-keyout", str(key), "-out", str(cert)]
    if ca is not None:
        command += ["-CA", str(ca[0]), "-CAkey", str(ca[1])]
    for extension in ext:
        command += ["-addext", extension]
    subprocess.run(command, check=True, capture_output=True, timeout=30)
    return cert, key


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    ca = certificate(tmp_path, "ca", None)
    leaf = "basicConstraints=critical,CA:FALSE"
    server = certificate(
        tmp_path, "server", ca, leaf, "subjectAltName=IP:127.0.0.1", "extendedKeyUsage=serverAuth"
    )
    client = certificate(tmp_path, "client", ca, leaf, "extendedKeyUsage=clientAuth")
    return {"ca": ca, "server": server, "client": client}


async def health(url: str, context: ssl.SSLContext) -> int:
    async with aiohttp.ClientSession() as session, session.get(url, ssl=context) as response:
        return response.status


async def test_https_with_the_grpc_ports_certificate_and_mtls(tmp_path: Path, pki):
    model = make_fake_model(tmp_path / "fake")
    async with running_server(
        model,
        openai_port=0,
        tls_cert_file=str(pki["server"][0]),
        tls_key_file=str(pki["server"][1]),
        tls_client_ca_file=str(pki["ca"][0]),
    ) as (server, _):
        assert server.openai is not None
        url = f"https://127.0.0.1:{server.openai.port}/health"
        trusting = ssl.create_default_context(cafile=str(pki["ca"][0]))
        with pytest.raises(aiohttp.ClientError):
            await health(url, trusting)  # no client certificate: refused in the handshake
        trusting.load_cert_chain(*pki["client"])
        assert await health(url, trusting) == 200
        with pytest.raises(aiohttp.ClientError):
            await health(url, ssl.create_default_context())  # an untrusted server certificate
