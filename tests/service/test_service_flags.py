"""`sluice serve`'s flags are the config's fields: every field has one, each reaches the config
(from the command line and from its SLUICE_* variable), and a bad one is exit 1 with one line."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient

from engine.protocol.config import EngineConfig
from service.cli import build_parser, service_config
from service.config import ServiceConfig
from service.flags import Flag, config_flags, config_from_args, flag_tables
from tests.support.service_harness import make_fake_model, running_server

REPO = Path(__file__).resolve().parents[2]
FLAGS = list(config_flags(ServiceConfig))


def all_fields() -> set[tuple[str, ...]]:
    service = {(f.name,) for f in dataclasses.fields(ServiceConfig) if f.name != "engine"}
    return service | {("engine", f.name) for f in dataclasses.fields(EngineConfig)}


def test_every_config_field_has_exactly_one_flag():
    assert sorted(flag.path for flag in FLAGS) == sorted(all_fields())
    options = [flag.option for flag in FLAGS]
    assert len(options) == len(set(options))


def value_at(config: ServiceConfig, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def other_value(flag: Flag, tmp_path: Path) -> tuple[str, Any]:
    """(text for the flag, the config value it must give): valid, and not the default."""
    default, meta = flag.field.default, flag.field.metadata
    if meta["from_file"]:
        (tmp_path / flag.name).write_text(f"secret-of-{flag.name}\n")
        return str(tmp_path / flag.name), f"secret-of-{flag.name}"
    if meta["choices"]:
        choice = next(c for c in meta["choices"] if c != default)
        return choice, choice
    if meta["size"]:
        return "3MiB", 3 * 2**20
    if flag.kind is bool:
        return str(not default).lower(), not default
    if flag.kind is int:
        value = 3 if default is None else default + 1
    elif flag.kind is float:
        # Every float setting stays valid halved (0.9 -> 0.45, 15 -> 7.5); one off at 0 gets 0.25.
        value = default / 2 if default else 0.25
    else:
        value = "other-value"
    return str(value), value


# Settings valid only with others: a certificate needs its key, a client CA both.
COMPANIONS = {
    "tls_cert_file": ["--tls-key-file", "key.pem"],
    "tls_key_file": ["--tls-cert-file", "cert.pem"],
    "tls_client_ca_file": ["--tls-cert-file", "cert.pem", "--tls-key-file", "key.pem"],
}


@pytest.mark.parametrize("flag", FLAGS, ids=[flag.option for flag in FLAGS])
def test_each_flag_and_its_variable_reach_the_config(flag: Flag, tmp_path: Path):
    text, expected = other_value(flag, tmp_path)
    if flag.kind is bool:
        argv = [flag.option if expected else "--no-" + flag.option.removeprefix("--")]
    else:
        argv = [flag.option, text]
    companions = COMPANIONS.get(flag.field.name, [])
    default_config = service_config(build_parser().parse_args([]))
    assert value_at(default_config, flag.path) != expected
    parsed = build_parser().parse_args([*argv, *companions])
    assert value_at(service_config(parsed), flag.path) == expected
    from_env = config_from_args(
        ServiceConfig, build_parser().parse_args(companions), {flag.env: text}
    )
    assert value_at(from_env, flag.path) == expected


def test_the_command_line_wins_over_the_environment():
    args = build_parser().parse_args(["--max-num-seqs", "7"])
    env = {"SLUICE_MAX_NUM_SEQS": "9", "SLUICE_PORT": "6000"}
    config = config_from_args(ServiceConfig, args, env)
    assert (config.engine.max_num_seqs, config.port) == (7, 6000)


def test_help_groups_the_flags_by_concern():
    text = " ".join(build_parser().format_help().split())
    order = [text.index(f" {group}: ") for group in ("model", "scheduling and KV cache")]
    assert order == sorted(order)
    assert "--gpu-memory-utilization" in text and "[env SLUICE_GPU_MEMORY_UTILIZATION" in text


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--port", "x"], {}, "argument --port: invalid int value: 'x'"),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["--device", "tpu"], {}, "argument --device: invalid choice: 'tpu'"),
        ([], {"SLUICE_PORT": "abc"}, "SLUICE_PORT='abc'"),
        ([], {"SLUICE_ENFORCE_EAGER": "maybe"}, "SLUICE_ENFORCE_EAGER='maybe': not a boolean"),
        (["--gpu-memory-utilization", "1.5"], {}, "gpu_memory_utilization: must be in (0, 1]"),
        (["--api-token-file", "/no/such/file"], {}, "No such file or directory"),
    ],
)
def test_a_bad_flag_or_variable_is_exit_1_with_one_line(argv, env, says):
    result = subprocess.run(
        [sys.executable, "-m", "service", *argv],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1 and says in result.stderr, result.stderr


HOLD = 300


async def test_served_model_name_and_the_per_connection_stream_limit(tmp_path):
    model_dir = make_fake_model(tmp_path / "fake", hold_token=HOLD)
    config = {"served_model_name": "my-model", "max_concurrent_streams": 1}
    async with running_server(model_dir, **config) as (_, target):
        # NOTE: its own subchannel pool, or gRPC would share the first client's connection.
        own = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        async with AsyncClient(target) as client, AsyncClient(target, channel=own) as other:
            assert (await client.info()).model == "my-model"
            held = client.generate([5, HOLD], request_id="held", max_tokens=2)
            first = asyncio.ensure_future(anext(held))  # holds the connection's only stream
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as waited:
                await client.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=0.5)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await other.info()).state == pb.SERVING_STATE_SERVING  # its own connection
            await other.cancel(["held"])
            assert (await first).WhichOneof("event") == "started"
            assert [e async for e in held][-1].finished.reason == pb.FINISH_REASON_CANCELLED


def test_the_flag_tables_in_the_docs_are_current():
    text = (REPO / "docs" / "service.md").read_text()
    documented = text.split("<!-- flags: begin -->\n")[1].split("<!-- flags: end -->")[0]
    assert documented == flag_tables(), "regenerate with: python -m service.flags"


def test_the_older_spelling_disable_prefix_cache_still_turns_the_prefix_cache_off():
    parsed = build_parser().parse_args(["--disable-prefix-cache"])
    assert service_config(parsed).engine.enable_prefix_cache is False
    assert service_config(build_parser().parse_args([])).engine.enable_prefix_cache is True
