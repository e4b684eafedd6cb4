"""Two real Sluice workers and the real SMG gateway in front of them, on loopback, once per
session of these tests (tests/support/gateway_workers.py, smg_process.py): the fleet takes
seconds to start, and each test leaves it as it found it (both workers SERVING checkpoint A).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import transformers
from sluice_client import Client

from tests.support.gateway_workers import MODEL, kill_group, start_worker, with_chat_template
from tests.support.server_process import ServerProcess
from tests.support.smg_process import SmgProcess, smg_process
from tests.support.tiny_models import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(make_checkpoint(tmp_path_factory.mktemp("gateway_a"), "llama"))


@pytest.fixture(scope="session")
def checkpoint_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoint A's shapes and tokenizer, other weights."""
    return make_checkpoint(tmp_path_factory.mktemp("gateway_b"), "llama", seed=1)


@pytest.fixture(scope="session")
def workers(
    checkpoint_a: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    """Two workers started together (their engines load in parallel), SERVING."""
    root = tmp_path_factory.mktemp("workers")
    started: list[ServerProcess] = []
    try:
        for i in range(2):
            started.append(start_worker(root / f"w{i}", checkpoint_a))
        for worker in started:
            worker.wait_health("SERVING", timeout=120)
        yield started
    finally:
        for worker in started:
            kill_group(worker)


@pytest.fixture(scope="session")
def gateway(
    workers: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SmgProcess]:
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    with smg_process(log, [w.target for w in workers], model=MODEL) as running:
        yield running


@pytest.fixture(scope="session")
def api(gateway: SmgProcess) -> Iterator[openai.OpenAI]:
    """The real OpenAI SDK, pointed at the gateway."""
    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="session")
def direct(workers: list[ServerProcess]) -> Iterator[Client]:
    """sluice.v1 on the first worker (both serve the same weights)."""
    with Client(workers[0].target) as client:
        yield client


@pytest.fixture(scope="session")
def tokenizer(checkpoint_a: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(checkpoint_a)
