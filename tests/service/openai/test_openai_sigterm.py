"""`sluice serve --openai-port` as a real process: SIGTERM drains the HTTP port with the gRPC
one (uvicorn must not take the signal for itself): a stream in flight finishes, the process
exits 0."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.support.server_process import server_process

pytestmark = pytest.mark.slow


def test_sigterm_drains_the_openai_port_and_exits_0(tiny_llama: Path, tmp_path: Path):
    flags = ["--model", str(tiny_llama), "--device", "cpu", "--openai-port", "0"]
    with server_process(tmp_path / "server.log", *flags) as server:
        port = server.wait_for("server.listening")["openai_port"]
        server.wait_for("server.serving")
        body = {"prompt": "Once upon a time", "max_tokens": 48, "stream": True, "ignore_eos": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            first = response.readline()  # the stream is under way
            server.proc.send_signal(signal.SIGTERM)
            rest = response.read().splitlines()
        assert server.proc.wait(60) == 0
    events = [line for line in [first, *rest] if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    finish = json.loads(events[-2][len(b"data: ") :])["choices"][0]["finish_reason"]
    assert finish == "length"
    assert server.events("server.draining")
