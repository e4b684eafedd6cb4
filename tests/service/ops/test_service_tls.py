"""TLS and mTLS: the server's --tls-* flags, the Python client's TlsConfig and the CLI's flags.

Certificates are made at test time with the `openssl` command: a CA, a server certificate for
localhost and 127.0.0.1, a client certificate, and a second CA with a client certificate of its
own. Servers run on the fake engine; the start failures run `python -m service` itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sluice.v1 import generation_pb2 as pb
from sluice.v1 import generation_pb2_grpc
from sluice_client import AsyncClient, TlsConfig, cli

from tests.support.server_process import run_serve
from tests.support.service_harness import health_status, make_fake_model, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")
REPO = Path(__file__).resolve().parents[3]
API_TOKEN = "tls-test-token"
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path


def make_certificate(
    directory: Path, name: str, *, ca: tuple[Path, Path] | None = None, extensions: list[str]
) -> tuple[Path, Path]:
    """A P-256 key and a certificate (CN=name) valid for a day: self-signed without `ca`,
    else signed by the (certificate, key) pair `ca`."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt"]
    command += ["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", f"/CN={name}"]
    command += ["-keyout", str(key), "-out", str(cert)]
    if ca is not None:
        command += ["-CA", str(ca[0]), "-CAkey", str(ca[1])]
    for extension in extensions:
        command += ["-addext", extension]
    subprocess.run(command, check=True, capture_output=True, timeout=30)
    return cert, key


def make_pki(directory: Path) -> Pki:
    leaf = "basicConstraints=critical,CA:FALSE"
    ca = make_certificate(directory, "ca", extensions=[])
    other_ca = make_certificate(directory, "other-ca", extensions=[])
    server = make_certificate(
        directory,
        "server",
        ca=ca,
        extensions=[
            leaf,
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "extendedKeyUsage=serverAuth",
        ],
    )
    client_usage = [leaf, "extendedKeyUsage=clientAuth"]
    client = make_certificate(directory, "client", ca=ca, extensions=client_usage)
    other_client = make_certificate(directory, "other-client", ca=other_ca, extensions=client_usage)
    return Pki(ca[0], *server, *client, other_ca[0], *other_client)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tls_target(model_dir, pki):
    """A TLS server (no client certificates) that requires the API token."""
    files = {"tls_cert_file": str(pki.server_cert), "tls_key_file": str(pki.server_key)}
    async with running_server(model_dir, api_token=API_TOKEN, **files) as (_, target):
        yield target


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mtls_target(model_dir, pki):
    """A server that requires client certificates signed by `pki.ca`; no token."""
    files = {
        "tls_cert_file": str(pki.server_cert),
        "tls_key_file": str(pki.server_key),
        "tls_client_ca_file": str(pki.ca),
    }
    async with running_server(model_dir, **files) as (_, target):
        yield target


async def complete(target: str, tls: TlsConfig | None, api_token: str | None = None) -> str:
    """One short Generate call; its finish reason."""
    async with AsyncClient(target, tls=tls, api_token=api_token) as client:
        completion = await client.complete([0, 5], max_tokens=3, timeout=10)
    return completion.reason


async def refusal(target: str, tls: TlsConfig | None, api_token: str | None = None) -> str:
    """The status code name a Generate call fails with."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(target, tls, api_token)
    return refused.value.code().name


# ---- TLS ----


async def test_generate_health_and_reflection_work_over_tls(tls_target, pki):
    tls = TlsConfig(ca_file=pki.ca)
    assert await complete(tls_target, tls, API_TOKEN) == "LENGTH"
    async with grpc.aio.secure_channel(tls_target, tls.credentials()) as channel:
        assert await health_status(channel) == SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        services = [s.name async for reply in replies for s in reply.list_services_response.service]
    assert "sluice.v1.Generation" in services


async def test_a_certificate_for_localhost_is_accepted_by_name(tls_target, pki):
    port = tls_target.rsplit(":", 1)[1]
    assert await complete(f"localhost:{port}", TlsConfig(ca_file=pki.ca), API_TOKEN) == "LENGTH"


async def test_a_plaintext_client_is_unavailable_on_a_tls_port(tls_target):
    assert await refusal(tls_target, None, API_TOKEN) == "UNAVAILABLE"


async def test_a_client_that_does_not_trust_the_servers_ca_is_unavailable(tls_target, pki):
    assert await refusal(tls_target, TlsConfig(ca_file=pki.other_ca), API_TOKEN) == "UNAVAILABLE"


async def test_a_server_name_the_certificate_does_not_hold_is_unavailable(tls_target, pki):
    tls = TlsConfig(ca_file=pki.ca, server_name="elsewhere.example")
    assert await refusal(tls_target, tls, API_TOKEN) == "UNAVAILABLE"


async def test_the_api_token_still_applies_over_tls(tls_target, pki):
    tls = TlsConfig(ca_file=pki.ca)
    assert await refusal(tls_target, tls) == "UNAUTHENTICATED"
    assert await refusal(tls_target, tls, "wrong") == "PERMISSION_DENIED"


@pytest.mark.parametrize("right_first", [True, False])
async def test_two_authorization_entries_are_unauthenticated_whichever_order(
    tls_target, pki, right_first
):
    entries = [("authorization", f"Bearer {API_TOKEN}"), ("authorization", "Bearer wrong")]
    metadata = entries if right_first else entries[::-1]
    credentials = TlsConfig(ca_file=pki.ca).credentials()
    async with grpc.aio.secure_channel(tls_target, credentials) as channel:
        generation = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generation.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "more than one authorization" in (refused.value.details() or "")


# ---- mTLS ----


async def test_mtls_serves_a_client_with_a_certificate_from_its_ca(mtls_target, pki):
    tls = TlsConfig(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    assert await complete(mtls_target, tls) == "LENGTH"


async def test_mtls_refuses_a_client_without_a_certificate(mtls_target, pki):
    assert await refusal(mtls_target, TlsConfig(ca_file=pki.ca)) == "UNAVAILABLE"


async def test_mtls_refuses_a_client_certificate_from_another_ca(mtls_target, pki):
    tls = TlsConfig(ca_file=pki.ca, cert_file=pki.other_client_cert, key_file=pki.other_client_key)
    assert await refusal(mtls_target, tls) == "UNAVAILABLE"


async def test_mtls_refuses_health_checks_without_a_certificate(mtls_target, pki):
    credentials = TlsConfig(ca_file=pki.ca).credentials()
    async with grpc.aio.secure_channel(mtls_target, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_status(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- the CLI ----


async def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`sluice ARGV` in this process: exit code, stdout, stderr."""
    # NOTE: the in-process server's log lines go to this process's stdout too (a request's
    # `request.finished` can come just after its last event): drop what came before.
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_cli_health_and_generate_over_tls(tls_target, pki, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text(API_TOKEN)
    tls = ("--target", tls_target, "--tls-ca-file", str(pki.ca))
    code, out, err = await run(capsys, "health", *tls)
    assert (code, out) == (0, "SERVING\n"), err
    code, out, err = await run(capsys, "generate", *tls, "--api-token-file", str(token), "ab")
    assert code == 0 and out.startswith("ab") and "[FINISH_REASON_LENGTH]" in err
    code, out, err = await run(capsys, "health", "--target", tls_target)  # plaintext
    assert code == 1 and err.startswith("unreachable (UNAVAILABLE)")


async def test_cli_health_and_generate_over_mtls(mtls_target, pki, capsys):
    tls = ("--target", mtls_target, "--tls-ca-file", str(pki.ca))
    client = ("--tls-cert-file", str(pki.client_cert), "--tls-key-file", str(pki.client_key))
    code, out, err = await run(capsys, "health", *tls, *client)
    assert (code, out) == (0, "SERVING\n"), err
    code, out, err = await run(capsys, "generate", *tls, *client, "ab", "--max-tokens", "2")
    assert code == 0 and out.startswith("ab") and "[FINISH_REASON_LENGTH]" in err
    code, out, err = await run(capsys, "health", *tls)  # no client certificate
    assert code == 1 and err.startswith("unreachable (UNAVAILABLE)")


@pytest.mark.parametrize(
    "verb", [["info"], ["tokenize", "hello"], ["cancel", "no-such-request"]], ids=lambda v: v[0]
)
async def test_every_cli_verb_takes_the_tls_flags(mtls_target, pki, capsys, verb):
    client = ("--tls-cert-file", str(pki.client_cert), "--tls-key-file", str(pki.client_key))
    flags = ("--target", mtls_target, "--tls-ca-file", str(pki.ca), *client)
    code, out, err = await run(capsys, *verb, *flags)
    assert code == 0 and json.loads(out), err


async def test_cli_update_weights_reaches_the_server_over_mtls(mtls_target, pki, capsys):
    # The server has no admin token, so the call gets through TLS and is then refused by it.
    flags = ("--target", mtls_target, "--tls-ca-file", str(pki.ca), "--checkpoint", "/nowhere")
    client = ("--tls-cert-file", str(pki.client_cert), "--tls-key-file", str(pki.client_key))
    code, _, err = await run(capsys, "update-weights", *flags, *client)
    assert code == 1 and err.startswith("PERMISSION_DENIED: "), err
    code, _, err = await run(capsys, "update-weights", *flags)  # no client certificate
    assert code == 1 and err.startswith("UNAVAILABLE: "), err


async def test_cli_tls_flag_errors_are_one_line_and_exit_1(pki, capsys):
    code, out, err = await run(capsys, "health", "--tls-ca-file", str(pki.ca.parent / "nope.pem"))
    assert code == 1 and out == "" and err.startswith("error: ") and "nope.pem" in err
    assert len(err.splitlines()) == 1
    code, out, err = await run(capsys, "generate", "--tls-cert-file", str(pki.client_cert), "x")
    assert code == 1 and out == "" and len(err.splitlines()) == 1
    assert err.startswith("error: TLS: give a client certificate and its key together")


async def test_a_client_certificate_without_its_key_is_refused():
    with pytest.raises(ValueError, match="together"):
        TlsConfig(cert_file="client.pem")


# ---- bad TLS files at start ----


def bad_start_cases(pki: Pki, tmp: Path) -> dict[str, tuple[list[str], str, str]]:
    """name: (flags, the event of the one line logged, a part of its error)."""
    not_pem = tmp / "not-pem.txt"
    not_pem.write_text("not a certificate\n")
    encrypted = tmp / "encrypted.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(pki.server_key), "-aes256", "-passout", "pass:pw"]
        + ["-out", str(encrypted)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    server = ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)]
    missing = tmp / "missing.pem"
    return {
        "key of another certificate": (
            ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.client_key)],
            "server.tls_invalid",
            f"tls_key_file: {pki.client_key} is not the key of the certificate in "
            f"{pki.server_cert}",
        ),
        "missing cert file": (
            ["--tls-cert-file", str(missing), "--tls-key-file", str(pki.server_key)],
            "server.tls_invalid",
            f"tls_cert_file: cannot read {missing}: No such file or directory",
        ),
        "cert path is a directory": (
            ["--tls-cert-file", str(tmp), "--tls-key-file", str(pki.server_key)],
            "server.tls_invalid",
            f"tls_cert_file: cannot read {tmp}: Is a directory",
        ),
        "cert file not PEM": (
            ["--tls-cert-file", str(not_pem), "--tls-key-file", str(pki.server_key)],
            "server.tls_invalid",
            f"tls_cert_file: {not_pem} is not a PEM certificate file",
        ),
        "encrypted key": (
            ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(encrypted)],
            "server.tls_invalid",
            f"tls_key_file: {encrypted} is encrypted",
        ),
        "only the key": (
            ["--tls-key-file", str(pki.server_key)],
            "serve.bad_config",
            "tls_cert_file and tls_key_file: give both or neither",
        ),
        "client CA without cert and key": (
            ["--tls-client-ca-file", str(pki.ca)],
            "serve.bad_config",
            "tls_client_ca_file: needs tls_cert_file and tls_key_file",
        ),
        "client CA not PEM": (
            [*server, "--tls-client-ca-file", str(not_pem)],
            "server.tls_invalid",
            f"tls_client_ca_file: {not_pem} is not a PEM certificate file",
        ),
    }


CASES = [
    "key of another certificate",
    "missing cert file",
    "cert path is a directory",
    "cert file not PEM",
    "encrypted key",
    "only the key",
    "client CA without cert and key",
    "client CA not PEM",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES)
async def test_a_bad_tls_file_is_exit_1_with_one_line_before_any_engine(
    case, pki, model_dir, tmp_path
):
    flags, event, error = bad_start_cases(pki, tmp_path)[case]
    start = ("--model", str(model_dir), "--device", "cpu", "--port", "0")
    code, stderr = await run_serve(*start, *flags, timeout=30)
    lines = stderr.splitlines()
    assert code == 1, lines
    assert len(lines) == 1, lines
    line = json.loads(lines[0])
    assert line["event"] == event and line["level"] == "error"
    assert error in line["error"]


@pytest.mark.timeout(120)
async def test_failed_handshakes_leave_sluice_serves_stderr_all_json(pki, tiny_llama, tmp_path):
    """gRPC's C core logs each failed handshake as plain text unless told not to before gRPC is
    imported: `sluice serve` (the client package's command, as installed) does so."""
    log = tmp_path / "server.log"
    flags = ["serve", "--model", str(tiny_llama), "--device", "cpu", "--port", "0"]
    flags += ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)]
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "sluice_client.cli", *flags],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        port = await asyncio.to_thread(wait_for_port, log, server)
        target = f"127.0.0.1:{port}"
        assert await refusal(target, None) == "UNAVAILABLE"  # plaintext: a failed handshake
        assert await complete(target, TlsConfig(ca_file=pki.ca)) == "LENGTH"
    finally:
        server.send_signal(signal.SIGTERM)
        await asyncio.to_thread(server.wait, 30)
    lines = log.read_text().splitlines()
    assert lines and all(isinstance(json.loads(line), dict) for line in lines), lines


def wait_for_port(log: Path, server: subprocess.Popen[bytes]) -> int:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert server.poll() is None, log.read_text()
        for line in log.read_text().splitlines():
            if '"server.serving"' in line:
                events = [json.loads(x) for x in log.read_text().splitlines() if "listening" in x]
                return int(events[0]["port"])
        time.sleep(0.1)
    raise AssertionError(f"not serving within 60 s: {log.read_text()}")
