"""The real `openai` SDK through the real SMG gateway to two Sluice workers: what comes back
equals what sluice.v1 Generate answers for the same prompt on a worker directly.

SMG tokenizes and detokenizes itself (with the tokenizer it loads from the worker's
GetModelInfo path) and returns no token ids, so each test compares the gateway's text with the
checkpoint's own tokenizer (transformers) decoding the ids sluice.v1 generated. One difference
is SMG's own: its detokenizer drops the bytes of a character an answer ends inside of (the
tiny random model often stops mid-character), where transformers and Sluice write U+FFFD. SMG tokenizes a
completion's prompt without special tokens (no BOS) and renders a chat with the checkpoint's
template itself; the direct calls are given the same ids and the same conversation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import transformers
from sluice_client import Client

from tests.support.gateway_workers import MODEL
from tests.support.server_process import ServerProcess
from tests.support.smg_process import SmgProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PROMPTS = ["The quick brown fox", "Call me Ishmael. In the beginning", "Numbers: 0 1 2 3"]
CHAT = [{"role": "user", "content": "It was the best of times, it was the"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
}


@pytest.fixture(scope="module")
def tokenizer(checkpoint_a: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(checkpoint_a)


@pytest.fixture(scope="module")
def api(gateway: SmgProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def direct(workers: list[ServerProcess]) -> Iterator[Client]:
    """sluice.v1 on the first worker (both serve the same weights)."""
    with Client(workers[0].target) as client:
        yield client


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
