"""Where the policy version rides on the worker protocol: a weight swap in the middle of a
Generate (inflight continue, on the fake engine) shows as two spans in the trailing metadata,
after the version the request started under in the initial metadata."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from sluice_client import Client

from service.vllm_worker.pb import vllm_engine_pb2 as vpb
from tests.support.service_harness import make_fake_model, running_server
from tests.support.worker_calls import engine_stub

pytestmark = pytest.mark.asyncio

ADMIN = "adm1n"
START = 4  # --policy-version


async def test_a_swap_mid_request_shows_as_two_version_spans(tmp_path) -> None:
    model = make_fake_model(tmp_path / "fake", step_delay=0.01, max_model_len=100_000)
    async with (
        running_server(model, engine={"policy_version": START}, admin_token=ADMIN) as (
            server,
            target,
        ),
        grpc.aio.insecure_channel(target) as channel,
    ):
        request = vpb.GenerateRequest(
            request_id="swapped",
            tokenized=vpb.TokenizedInput(input_ids=[1, 5, 6, 7]),
            stream=True,
            sampling_params=vpb.SamplingParams(max_tokens=90_000, ignore_eos=True),
        )
        call = engine_stub(channel).Generate(request)
        first = await call.read()
        assert first.WhichOneof("response") == "chunk"
        assert dict(await call.initial_metadata())["sluice-policy-version"] == str(START)

        def swap() -> int:
            with Client(target, admin_token=ADMIN) as admin:
                return admin.update_weights(str(model), inflight="continue").policy_version

        assert await asyncio.to_thread(swap) == START + 1
        # Stats ride on every step's output: once they carry the new version, a step of the
        # new weights (this request's token included: it is the only one) has reached the
        # server, so aborting now leaves tokens of both versions.
        deadline = time.monotonic() + 30
        while server.engine.stats.policy_version != START + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polls the condition, bounded
        await engine_stub(channel).Abort(vpb.AbortRequest(request_ids=["swapped"]))
        ids, completes = list(first.chunk.token_ids), []
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.WhichOneof("response") == "chunk":
                ids += response.chunk.token_ids
            else:
                completes.append(response.complete)
        spans = json.loads(dict(await call.trailing_metadata())["sluice-version-spans"])["0"]
        assert [c.finish_reason for c in completes] == ["abort"]
        assert [s["policy_version"] for s in spans] == [START, START + 1]
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
        assert spans[1]["end"] == len(ids) == completes[0].completion_tokens
