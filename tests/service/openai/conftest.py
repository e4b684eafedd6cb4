"""A real server (tiny llama checkpoint with a chat template, real engine) with the OpenAI front
on a free loopback port, shared by the module's tests, and the real `openai` SDK against it."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from sluice_client import AsyncClient

from service.server import SluiceServer
from tests.support.service_harness import running_server

API_TOKEN = "openai-test-token"
# A small template on the tiny tokenizer's own <s> and </s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class Front:
    server: SluiceServer
    base_url: str  # http://127.0.0.1:PORT
    grpc: AsyncClient
    sdk: openai.AsyncOpenAI
    model: str
    checkpoint: Path


@pytest.fixture(scope="session")
def chat_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with CHAT_TEMPLATE in its tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("chat_llama")
    for path in tiny_llama.iterdir():
        shutil.copy(path, directory / path.name)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def front(chat_llama: Path) -> AsyncIterator[Front]:
    async with running_server(
        chat_llama,
        fake=False,
        engine={"num_kv_pages": 128},
        api_token=API_TOKEN,
        openai_port=0,
    ) as (server, target):
        assert server.openai is not None
        base_url = f"http://127.0.0.1:{server.openai.port}"
        sdk = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=API_TOKEN, max_retries=0)
        async with AsyncClient(target, api_token=API_TOKEN) as grpc_client:
            info = await grpc_client.info()
            yield Front(server, base_url, grpc_client, sdk, info.model, chat_llama)
        await sdk.close()
