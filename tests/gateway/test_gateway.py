"""The real SMG gateway (`smg launch --backend vllm --policy cache_aware`) in front of two real
Sluice workers, called with the real `openai` SDK (fixtures in conftest.py).

What comes back equals what sluice.v1 Generate answers on a worker directly. SMG tokenizes and
detokenizes itself (with the tokenizer it loads from the worker's GetModelInfo path) and returns
no token ids, so the tests compare the gateway's text with the checkpoint's own tokenizer
(transformers) decoding the ids sluice.v1 generated. One difference is SMG's own: its
detokenizer drops the bytes of a character an answer ends inside of (the tiny random model
often stops mid-character), where transformers and Sluice write U+FFFD. SMG tokenizes a
completion's prompt without special tokens (no BOS) and renders a chat with the checkpoint's
template itself; the direct calls are given the same ids and the same conversation.

Then the fleet: cache-aware routing by prefix, a worker's engine killed and back, a weight
update pushed to both. Which worker served a request is read from the workers' own counters
(sluice_requests_finished_total, sluice_prefix_cache_hit_tokens_total); requests are sent one
after another, and each test leaves the fleet as it found it (both workers SERVING checkpoint
A's weights).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from sluice_client import update_all

from tests.support.gateway_workers import ADMIN_TOKEN, FINISHED, MODEL, PREFIX_HITS
from tests.support.server_process import ServerProcess, wait_gone
from tests.support.smg_process import SmgProcess
from tests.support.tiny_models import hf_greedy, load_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPTS = ["The quick brown fox", "Call me Ishmael. In the beginning", "Numbers: 0 1 2 3"]
CHAT = [{"role": "user", "content": "It was the best of times, it was the"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
}
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
STORED = "smg_kv_event_blocks_total"  # smg's count of the pages workers' KV events reported
POLICY_BRANCH = "smg_cache_aware_policy_branch_total"  # how smg's cache_aware chose
PAGE = 16  # Sluice's default page size, which is also smg's default --block-size
FILLER = "apples, pears and plums lay on the table in the harbour house today"


def text_of(tokenizer: Any, ids: list[int]) -> str:
    """The text SMG makes of `ids`: transformers' decoding, less the U+FFFD of an unfinished
    last character."""
    return str(tokenizer.decode(ids, skip_special_tokens=True)).rstrip("\ufffd")


def test_greedy_completions_through_the_gateway_equal_sluice_generate(api, direct, tokenizer):
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = direct.complete(ids, temperature=0.0, max_tokens=8)
        answer = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
        (choice,) = answer.choices
        assert choice.text == text_of(tokenizer, expected.token_ids), prompt
        assert choice.finish_reason == expected.reason.lower()
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == len(ids)
        assert answer.usage.completion_tokens == len(expected.token_ids)


def test_streamed_completion_pieces_add_up_to_the_greedy_text_with_usage_last(
    api, direct, tokenizer
):
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    expected = direct.complete(ids, temperature=0.0, max_tokens=8, ignore_eos=True)
    stream = api.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        temperature=0,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(
        tokenizer, expected.token_ids
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 8)


def test_chat_with_the_checkpoints_template_streamed_and_not_equals_sluice_chat(
    api, direct, tokenizer
):
    expected = direct.complete(CHAT, temperature=0.0, max_tokens=10, ignore_eos=True)
    rendered = direct.render_chat(CHAT)
    params: dict[str, Any] = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=10)
    params["extra_body"] = {"ignore_eos": True}
    answer = api.chat.completions.create(**params)
    (choice,) = answer.choices
    assert (choice.message.content or "") == text_of(tokenizer, expected.token_ids)
    assert choice.finish_reason == "length"

    stream = api.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == (choice.message.content or "")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(rendered.token_ids), 10)


def test_chat_json_schema_with_n_and_seed_validates_and_equals_sluice_seeded_sampling(api, direct):
    expected = direct.complete(
        CHAT, n=2, temperature=1.0, seed=11, max_tokens=200, json_schema=SCHEMA
    )
    answer = api.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
        },
    )
    assert len(answer.choices) == 2
    texts = [c.message.content or "" for c in sorted(answer.choices, key=lambda c: c.index)]
    for choice, text in zip(answer.choices, texts, strict=True):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert texts == [c.text for c in expected]


def test_chat_stop_strings_end_the_answer_where_sluice_ends_it(api, direct, tokenizer):
    free = direct.complete(CHAT, temperature=0.0, max_tokens=16, ignore_eos=True)
    text = text_of(tokenizer, free.token_ids)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    expected = direct.complete(CHAT, temperature=0.0, max_tokens=16, stop=[stop])
    answer = api.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=16, stop=[stop]
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop"
    assert (choice.message.content or "") == expected.text == text[: text.index(stop)]


def test_a_named_tool_choice_comes_back_as_a_tool_call_whose_arguments_validate(api):
    # SMG turns a named tool choice into a JSON schema constraint for the worker, which Sluice
    # enforces token by token, and parses the text it gets back into a tool call.
    answer = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather like?"}],
        tools=[{"type": "function", "function": WEATHER}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])


def learnt(gateway: SmgProcess, worker: ServerProcess) -> float:
    """The pages smg has learnt `worker` stores, from its KV events."""
    return gateway.metric(STORED, worker=f"grpc://{worker.target}", op="stored")


def served_by(workers: list[ServerProcess], call: Callable[[], Any]) -> tuple[Any, list[float]]:
    """What `call` returned and how many requests each worker finished meanwhile."""
    before = [w.metric(FINISHED) for w in workers]
    result = call()
    return result, [w.metric(FINISHED) - b for w, b in zip(workers, before, strict=True)]


def complete(api: openai.OpenAI, prompt: str, max_tokens: int = 1) -> str | None:
    answer = api.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens
    )
    return answer.choices[0].finish_reason


def test_requests_sharing_a_long_prefix_land_on_the_worker_that_holds_it(
    api, workers, gateway, tokenizer
):
    prefix = "To be, or not to be, that is the question. " * 8
    pages = len(tokenizer.encode(prefix, add_special_tokens=False)) // PAGE
    assert pages >= 4
    before = [(w.metric(FINISHED), w.metric(PREFIX_HITS), learnt(gateway, w)) for w in workers]
    event_hits = gateway.metric(POLICY_BRANCH, branch="event_hit")
    for i in range(6):
        assert complete(api, f"{prefix}Question {i}:") == "length"
    event_hits = gateway.metric(POLICY_BRANCH, branch="event_hit") - event_hits
    served = [w.metric(FINISHED) - b[0] for w, b in zip(workers, before, strict=True)]
    hits = [w.metric(PREFIX_HITS) - b[1] for w, b in zip(workers, before, strict=True)]
    assert sorted(served) == [0, 6], served
    holder = served.index(6)
    # Every request after the first finds the prefix's full pages in the holder's cache.
    assert hits[holder] >= 5 * pages * PAGE and hits[1 - holder] == 0, hits
    # smg chose the holder for each from its index of the workers' KV events (not its own
    # guess of what each worker holds), and the holder's events reported the prefix's pages.
    assert event_hits == 5
    deadline = time.monotonic() + 10
    while learnt(gateway, workers[holder]) - before[holder][2] < pages:
        assert time.monotonic() < deadline, "smg never learnt the prefix's pages from the events"
        time.sleep(0.05)
    assert learnt(gateway, workers[1 - holder]) == before[1 - holder][2]


def test_a_workers_engine_killed_the_gateway_serves_through_the_other_then_routes_back(
    api, workers, gateway
):
    killed = workers[1]
    incarnation = len(killed.events("engine.spawned"))
    engine = killed.engine_pid(incarnation)
    os.kill(engine, signal.SIGKILL)
    assert wait_gone(engine, timeout=10)
    killed.wait_health("NOT_SERVING", timeout=10)

    during = []
    for i in range(6):
        reason, served = served_by(workers, lambda i=i: complete(api, f"While one is down {i}"))
        down = killed.health() == "NOT_SERVING"
        during.append((reason, served, down))
    # Every call succeeds; those that ended while the engine was still down were served by the
    # other worker (smg retries a worker's UNAVAILABLE elsewhere).
    assert all(reason == "length" for reason, _, _ in during), during
    assert all(served == [1, 0] for _, served, down in during if down), during
    assert any(down for _, _, down in during), "the engine was back before any call: no test"

    killed.wait_health("SERVING", timeout=60)
    assert killed.engine_pid(incarnation + 1) != engine
    gateway.wait_worker_healthy(killed.target)
    # A prompt no worker holds (no two of these share more than their first few tokens) goes to
    # the worker smg has sent the fewest requests (cache_aware's min-load tie-break), so the
    # restarted worker gets one within as many requests as it is behind.
    routed_back = False
    for n in range(100, 164):
        reason, served = served_by(workers, lambda n=n: complete(api, f"{n} {FILLER}"))
        assert reason == "length"
        routed_back = served == [0, 1]
        if routed_back:
            break
    assert routed_back, "the gateway did not route to the restarted worker in 64 requests"


def serve_weights(workers: list[ServerProcess], checkpoint: Path) -> int:
    """Both workers updated to `checkpoint`'s weights; the policy version they then serve."""
    targets = [w.target for w in workers]
    results = update_all(targets, checkpoint_dir=str(checkpoint), admin_token=ADMIN_TOKEN)
    assert all(r.ok and r.applied is not None for r in results), results
    versions = {r.applied.policy_version for r in results if r.applied is not None}
    assert len(versions) == 1
    return versions.pop()


def test_a_weight_update_pushed_to_both_workers_shows_in_the_gateways_answers(
    api, workers, tokenizer, checkpoint_a, checkpoint_b
):
    prompts = ["The quick brown fox", "It was the best of times", "Call me Ishmael"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    def greedy_texts() -> list[str]:
        texts = []
        for prompt in prompts:
            answer = api.completions.create(
                model=MODEL,
                prompt=prompt,
                temperature=0,
                max_tokens=6,
                extra_body={"ignore_eos": True},
            )
            texts.append(answer.choices[0].text)
        return texts

    def reference(checkpoint: Path) -> list[str]:
        model = load_hf_model(checkpoint)
        return [str(tokenizer.decode(hf_greedy(model, p, 6)[0])).rstrip("\ufffd") for p in ids]

    expected_a, expected_b = reference(checkpoint_a), reference(checkpoint_b)
    assert expected_a != expected_b
    assert greedy_texts() == expected_a
    try:
        serve_weights(workers, checkpoint_b)
        assert greedy_texts() == expected_b
    finally:
        serve_weights(workers, checkpoint_a)
    assert greedy_texts() == expected_a
