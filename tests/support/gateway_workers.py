"""Sluice workers for the gateway tests: `python -m service` on a tiny checkpoint with a chat
template, each in its own process group (its engine joins it, so a crash kill takes both) with
its own metrics port, whose counters say which worker served what.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

from tests.support.serve_tiny import CHAT_TEMPLATE
from tests.support.server_process import ServerProcess

MODEL = "tiny"
ADMIN_TOKEN = "gateway-admin"
FINISHED = "sluice_requests_finished_total"
PREFIX_HITS = "sluice_prefix_cache_hit_tokens_total"


def with_chat_template(checkpoint: Path) -> Path:
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return checkpoint


def start_worker(directory: Path, checkpoint: Path) -> ServerProcess:
    directory.mkdir()
    (directory / "admin_token").write_text(ADMIN_TOKEN)
    flags = ["--model", str(checkpoint), "--device", "cpu", "--dtype", "float32"]
    flags += ["--served-model-name", MODEL, "--num-kv-pages", "512"]
    flags += ["--metrics-port", "0", "--metrics-host", "127.0.0.1"]
    flags += ["--admin-token-file", str(directory / "admin_token")]
    return ServerProcess(directory / "server.log", *flags, new_session=True)


def kill_group(worker: ServerProcess) -> None:
    if worker.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
    worker.stop()
