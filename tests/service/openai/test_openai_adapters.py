"""A loaded LoRA adapter is a model of the OpenAI front, as vLLM serves them: /v1/models lists
it, and a request naming it generates with it, token for token as sluice.v1 does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from sluice.v1 import admin_pb2 as apb
from sluice_client import AsyncClient, build_request

from tests.support.adapter_calls import ADMIN_TOKEN, PROMPT, admin_call
from tests.support.lora_adapters import make_adapter
from tests.support.service_harness import running_server

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


async def test_a_loaded_adapter_is_listed_and_served_by_its_name(tiny_llama: Path, tmp_path):
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", r=4)
    async with running_server(
        tiny_llama,
        fake=False,
        engine={"num_kv_pages": 64, "max_loras": 1},
        admin_token=ADMIN_TOKEN,
        openai_port=0,
    ) as (server, target):
        request = apb.LoadAdapterRequest(name="tuned", path=str(adapter))
        await asyncio.to_thread(admin_call, target, "LoadAdapter", request)
        assert server.openai is not None
        sdk = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.openai.port}/v1", api_key="-", max_retries=0
        )
        models = [m.id for m in (await sdk.models.list()).data]
        assert models[1:] == ["tuned"]
        answer = await sdk.completions.create(
            model="tuned",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async with AsyncClient(target) as client:
            tuned = await client.complete(
                build_request(
                    PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, adapter="tuned"
                )
            )
            base = await client.complete(
                build_request(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
            )
        await sdk.close()
    assert answer.choices[0].model_dump()["token_ids"] == tuned.token_ids != base.token_ids
