"""The Dockerfile and docker-compose.yml agree with the `sluice` command and with each other.

No image can be built here, so these read the files: every `sluice serve` command line in them
must parse with the real CLI parser (a renamed or removed flag fails here, not in a container),
each health check must probe the port its server listens on, and the pieces an operator relies
on (GPU reservation, read-only checkpoint, admin token secret, the CPU demo profile, a non-root
user) must be present. `scripts/check_compose.sh` validates the compose schema itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from sluice_client.cli import build_parser as sluice_parser

from engine.protocol.config import EngineConfig
from service.cli import build_parser as serve_parser

ROOT = Path(__file__).resolve().parents[1]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def dockerfile(instruction: str) -> list[str]:
    return [args for name, args in dockerfile_instructions() if name == instruction]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def service(name: str) -> dict:
    return compose()["services"][name]


def parse(argv: list[str], capsys: pytest.CaptureFixture[str]) -> argparse.Namespace:
    """`argv` of `sluice serve` (the flags alone) or of another `sluice` verb, parsed."""
    parser, command = (
        (sluice_parser(), "sluice") if argv[0] == "health" else (serve_parser(), "sluice serve")
    )
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`{command} {shlex.join(argv)}` does not parse: {capsys.readouterr().err}")


def sluice_services() -> dict[str, dict]:
    """The compose services that run the Sluice image (built from the root Dockerfile), not
    nginx's or SMG's."""
    return {
        name: spec
        for name, spec in compose()["services"].items()
        if "build" in spec and "dockerfile" not in spec["build"]
    }


def serve_commands() -> dict[str, list[str]]:
    """Every `sluice serve` argument list: the image's default CMD and each compose command."""
    (entrypoint,) = dockerfile("ENTRYPOINT")
    assert json.loads(entrypoint) == ["sluice", "serve"]
    (cmd,) = dockerfile("CMD")
    commands = {"Dockerfile CMD": json.loads(cmd)}
    for name, spec in sluice_services().items():
        commands[f"compose {name}"] = list(spec["command"])
    return commands


def health_checks() -> dict[str, list[str]]:
    """Every health check's command line, from the Dockerfile and each compose service."""
    (healthcheck,) = dockerfile("HEALTHCHECK")
    checks = {"Dockerfile CMD": json.loads(healthcheck.split(" CMD ", 1)[1])}
    for name, spec in sluice_services().items():
        test = spec["healthcheck"]["test"]
        assert test[0] == "CMD", f"compose {name}: exec form, no shell needed"
        checks[f"compose {name}"] = test[1:]
    return checks


def duration_seconds(text: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", text)
    assert "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def test_every_serve_command_in_the_deploy_files_parses(capsys: pytest.CaptureFixture[str]):
    commands = serve_commands()
    assert set(commands) >= {"Dockerfile CMD", "compose sluice", "compose sluice-cpu"}
    for args in commands.values():
        parsed = parse(args, capsys)
        assert parsed.host == "0.0.0.0", "a server in a container must listen beyond loopback"


def test_every_health_check_probes_its_own_server(capsys: pytest.CaptureFixture[str]):
    commands = serve_commands()
    for where, check in health_checks().items():
        assert check[:2] == ["sluice", "health"], where
        parsed = parse(check[1:], capsys)
        port = parse(commands[where], capsys).port
        assert parsed.target == f"127.0.0.1:{port}", where
        assert parsed.wait == 0, f"{where}: the check's own timeout bounds it, not --wait"


def test_gpu_service_reserves_a_gpu_and_mounts_the_checkpoint_read_only():
    sluice = service("sluice")
    assert "profiles" not in sluice, "the GPU service is the default one"
    devices = sluice["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "--device=cuda" in sluice["command"]
    model_mounts = [v for v in sluice["volumes"] if v.rsplit(":", 2)[1:] == ["/models/model", "ro"]]
    assert len(model_mounts) == 1 and model_mounts[0].startswith("${SLUICE_MODEL_DIR:-")
    assert "--model=/models/model" in sluice["command"]


def test_gpu_service_takes_the_admin_token_from_a_compose_secret():
    sluice = service("sluice")
    assert sluice["secrets"] == ["admin_token"]
    assert "file" in compose()["secrets"]["admin_token"]
    assert "--admin-token-file=/run/secrets/admin_token" in sluice["command"]


def test_services_publish_the_grpc_and_metrics_ports():
    for name in ("sluice", "sluice-cpu"):
        container_ports = {p.rsplit(":", 1)[1] for p in service(name)["ports"]}
        assert container_ports == {"50051", "9400"}, name
        command = service(name)["command"]
        assert "--port=50051" in command and "--metrics-port=9400" in command, name
    exposed = " ".join(dockerfile("EXPOSE")).split()
    assert {"50051", "9400"} <= set(exposed)


def test_cpu_profile_serves_the_demo_model_without_a_gpu():
    cpu = service("sluice-cpu")
    assert cpu["profiles"] == ["cpu"]
    assert "--model=demo" in cpu["command"] and "--device=cpu" in cpu["command"]
    assert "deploy" not in cpu
    # The demo model trains itself on first start: 1-2 minutes on two free cores, far more on
    # busy ones. A health check that gives up first would mark a healthy start unhealthy.
    assert duration_seconds(cpu["healthcheck"]["start_period"]) >= 10 * 60
    assert any(v.endswith(":/home/sluice/.cache/sluice") for v in cpu["volumes"])


def test_image_runs_as_a_non_root_user():
    users = dockerfile("USER")
    assert users and users[-1] not in {"root", "0"}
    assert re.search(rf"useradd .*--create-home .*{users[-1]}", " ".join(dockerfile("RUN")))


def test_image_pins_the_torch_of_setup_sh_and_installs_the_client_first():
    setup_pin = re.search(
        r"^TORCH_VERSION=([\w.]+)$", (ROOT / "scripts/setup.sh").read_text(), re.M
    )
    assert setup_pin is not None
    assert f"TORCH_VERSION={setup_pin.group(1)}" in dockerfile("ARG")
    install = " ".join(dockerfile("RUN"))
    client = re.search(r"pip install \./clients/python\b", install)
    server = re.search(r"pip install \.(\s|$)", install)
    assert client is not None and server is not None
    assert client.start() < server.start(), "the server depends on the client distribution"


def test_dockerignore_keeps_environments_secrets_and_checkpoints_out_of_the_image():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "**/node_modules", "bench/results", "secrets", "models"} <= ignored


REPLICAS = ("sluice-replica-1", "sluice-replica-2")


def nginx_upstreams() -> dict[str, list[str]]:
    """Each upstream block of deploy/nginx/sluice.conf: its `server` addresses."""
    text = (ROOT / "deploy/nginx/sluice.conf").read_text()
    blocks = re.findall(r"^upstream (\w+) \{(.*?)^\}", text, re.MULTILINE | re.DOTALL)
    return {name: re.findall(r"^\s*server (\S+)", body, re.MULTILINE) for name, body in blocks}


def test_replicas_profile_runs_health_checked_replicas_with_the_admin_token():
    for name in REPLICAS:
        replica = service(name)
        assert replica["profiles"] == ["replicas"], name
        assert "--admin-token-file=/run/secrets/admin_token" in replica["command"], name
        assert replica["secrets"] == ["admin_token"], name
        assert replica["healthcheck"]["test"][1:3] == ["sluice", "health"], name
        assert duration_seconds(replica["healthcheck"]["start_period"]) >= 10 * 60, name
        # Admin goes to each replica's own address: each publishes its gRPC port.
        assert any(p.endswith(":50051") for p in replica["ports"]), name


def test_nginx_lists_every_replica_at_its_port_in_both_upstreams(capsys):
    upstreams = nginx_upstreams()
    assert set(upstreams) == {"sluice_affinity", "sluice_least_conn"}
    expected = [f"{name}:{parse(service(name)['command'], capsys).port}" for name in REPLICAS]
    for name, servers in upstreams.items():
        assert servers == expected, name


def test_nginx_mounts_the_shipped_config_read_only_and_publishes_its_listen_port():
    lb = service("sluice-lb")
    assert lb["profiles"] == ["replicas"] and lb["image"] == "nginx:stable"
    assert "./deploy/nginx/sluice.conf:/etc/nginx/conf.d/default.conf:ro" in lb["volumes"]
    text = (ROOT / "deploy/nginx/sluice.conf").read_text()
    (listen,) = re.findall(r"^\s*listen (\d+) http2;", text, re.MULTILINE)
    assert [p.rsplit(":", 1)[1] for p in lb["ports"]] == [listen]
    assert set(lb["depends_on"]) == set(REPLICAS)


def test_nginx_hashes_the_affinity_header_and_refuses_admin():
    text = (ROOT / "deploy/nginx/sluice.conf").read_text()
    assert "hash $http_x_sluice_affinity consistent;" in text
    assert re.search(r"location /sluice\.v1\.Admin/ \{[^}]*add_header grpc-status 7 always;", text)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="needs docker-compose (CI)")
def test_check_compose_fails_when_a_service_is_in_the_wrong_profile(tmp_path: Path):
    text = (ROOT / "docker-compose.yml").read_text()
    assert text.count("profiles: [replicas]") == 2  # the replicas' anchor and nginx
    moved = tmp_path / "docker-compose.yml"
    moved.write_text(text.replace("profiles: [replicas]", "profiles: [cpu]"))
    shutil.copytree(ROOT / "deploy" / "smg", tmp_path / "deploy" / "smg")  # a build context

    def check(compose_file: Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "COMPOSE_FILE": str(compose_file)}
        script = ROOT / "scripts" / "check_compose.sh"
        return subprocess.run(
            ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120
        )

    assert check(ROOT / "docker-compose.yml").returncode == 0
    wrong = check(moved)
    assert wrong.returncode == 1 and "--profile 'cpu' selects:" in wrong.stderr, wrong.stderr


WORKERS = ("sluice-worker-1", "sluice-worker-2")


def smg_command() -> Any:
    """The gateway's `smg launch` flags, parsed by SMG's own parser (the pinned dev dependency)."""
    from smg.launch_router import parse_router_args

    return parse_router_args(list(service("sluice-gateway")["command"]))


def test_gateway_profile_runs_health_checked_workers_with_the_admin_token(capsys):
    for name in WORKERS:
        worker = service(name)
        assert worker["profiles"] == ["gateway"], name
        assert "--admin-token-file=/run/secrets/admin_token" in worker["command"], name
        assert worker["healthcheck"]["test"][1:3] == ["sluice", "health"], name
        assert parse(worker["command"], capsys).host == "0.0.0.0", name
        # Admin goes to each worker's own address: each publishes its gRPC port.
        assert any(p.endswith(":50051") for p in worker["ports"]), name


def test_the_gateway_speaks_the_vllm_protocol_to_every_worker_at_its_port(capsys):
    gateway = service("sluice-gateway")
    assert gateway["profiles"] == ["gateway"]
    args = smg_command()
    assert (args.backend, args.policy, args.host) == ("vllm", "cache_aware", "0.0.0.0")
    expected = [f"grpc://{name}:{parse(service(name)['command'], capsys).port}" for name in WORKERS]
    assert args.worker_urls == expected
    assert set(gateway["depends_on"]) == set(WORKERS)
    # smg hashes prompts into blocks of --block-size tokens to match the workers' KV events:
    # it must be their page size (none is set: Sluice's default).
    page_size = {f.name: f.default for f in dataclasses.fields(EngineConfig)}["page_size"]
    for name in WORKERS:
        assert parse(service(name)["command"], capsys).page_size is None, name
    assert args.block_size == page_size


def test_the_gateway_publishes_its_port_and_metrics_and_probes_its_own_health():
    gateway = service("sluice-gateway")
    args = smg_command()
    container_ports = {p.rsplit(":", 1)[1] for p in gateway["ports"]}
    assert container_ports == {str(args.port), str(args.prometheus_port)}
    assert args.prometheus_host == "0.0.0.0"
    probe = " ".join(gateway["healthcheck"]["test"])
    assert f"http://127.0.0.1:{args.port}/health" in probe


def test_the_gateway_image_pins_the_smg_the_tests_run():
    dockerfile_text = (ROOT / "deploy/smg/Dockerfile").read_text()
    (arg,) = re.findall(r"^ARG SMG_VERSION=(\S+)$", dockerfile_text, re.MULTILINE)
    pin = re.search(r'"smg==([\w.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None and arg == pin.group(1)
    assert service("sluice-gateway")["build"] == {
        "context": "deploy/smg",
        "dockerfile": "Dockerfile",
    }
    assert 'ENTRYPOINT ["smg", "launch"]' in dockerfile_text
