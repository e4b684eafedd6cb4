"""Chat prompts over gRPC: RenderChat, a `chat` Generate, their refusals, --chat-template."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.v1 import generation_pb2 as pb
from sluice_client import AsyncClient, build_request

from tests.support.service_harness import running_server
from tests.support.tiny_models import write_chat_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The quick brown fox?"},
]


def chat_model(directory, family="qwen3", **knobs):
    """A fake model whose tokenizer carries `family`'s chat template and tokens."""
    import json

    write_chat_tokenizer(directory, family)
    (directory / "fake.json").write_text(
        json.dumps({"vocab_size": 400, "max_model_len": 128, **knobs})
    )
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory):
    async with running_server(chat_model(tmp_path_factory.mktemp("qwen3"))) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with AsyncClient(server[1]) as c:
        yield c


def violated_fields(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    return [v.field for v in bad.field_violations]


async def test_render_chat_returns_the_template_text_and_its_ids(client, server):
    rendered = await client.render_chat(CHAT, template_kwargs={"enable_thinking": False})
    assert rendered.text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nThe quick brown fox?"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    tokenizer = server[0].servicer.tokenizer
    assert list(rendered.token_ids) == await tokenizer.encode(rendered.text, False)


async def test_add_generation_prompt_false_ends_after_the_last_turn(client):
    rendered = await client.render_chat(CHAT, add_generation_prompt=False)
    assert rendered.text.endswith("fox?<|im_end|>\n")


async def test_a_chat_generate_equals_a_generate_on_the_rendered_ids(client):
    rendered = await client.render_chat(CHAT)
    chat = await client.complete(CHAT, max_tokens=6, temperature=0)
    ids = await client.complete(list(rendered.token_ids), max_tokens=6, temperature=0)
    assert chat.started.prompt_tokens == len(rendered.token_ids)
    assert chat.token_ids == ids.token_ids and len(chat.token_ids) == 6


async def test_generate_stream_accepts_a_chat_start(client):
    stream = client.stream()
    await stream.start(build_request(CHAT, request_id="c1", max_tokens=3))
    await stream.done_sending()
    kinds = [e.WhichOneof("event") async for e in stream]
    assert kinds[0] == "started" and kinds[-1] == "finished"


DEEP_ARRAY = "[" * 65 + "]" * 65


@pytest.mark.parametrize(
    ("name", "chat", "field"),
    [
        ("no messages", pb.ChatPrompt(), "chat.messages"),
        (
            "a message without a role",
            pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="a"), pb.ChatMessage()]),
            "chat.messages[1].role",
        ),
        (
            "tools not a JSON array",
            pb.ChatPrompt(messages=[pb.ChatMessage(role="user")], tools_json="{"),
            "chat.tools_json",
        ),
        (
            "tools nested deeper than 64 (json.loads meets depth with a RecursionError)",
            pb.ChatPrompt(messages=[pb.ChatMessage(role="user")], tools_json=DEEP_ARRAY),
            "chat.tools_json",
        ),
        (
            "extra_json nested deeper than 64",
            pb.ChatPrompt(
                messages=[pb.ChatMessage(role="user", extra_json='{"a": ' + DEEP_ARRAY + "}")]
            ),
            "chat.messages[0].extra_json",
        ),
        (
            "template arguments not an object",
            pb.ChatPrompt(messages=[pb.ChatMessage(role="user")], template_kwargs_json="[1]"),
            "chat.template_kwargs_json",
        ),
        (
            "a role in extra_json",
            pb.ChatPrompt(messages=[pb.ChatMessage(role="user", extra_json='{"role": "x"}')]),
            "chat.messages[0].extra_json",
        ),
        (
            "content both in the field and in extra_json",
            pb.ChatPrompt(
                messages=[pb.ChatMessage(role="user", content="a", extra_json='{"content": "b"}')]
            ),
            "chat.messages[0].extra_json",
        ),
        (
            "template arguments that set the messages",
            pb.ChatPrompt(
                messages=[pb.ChatMessage(role="user")], template_kwargs_json='{"messages": []}'
            ),
            "chat.template_kwargs_json",
        ),
        (
            "continue_final_message with a generation prompt",
            pb.ChatPrompt(
                messages=[pb.ChatMessage(role="user", content="a")],
                continue_final_message=True,
                add_generation_prompt=True,
            ),
            "chat.add_generation_prompt",
        ),
        (
            "more messages than --max-chat-messages",
            pb.ChatPrompt(messages=[pb.ChatMessage(role="user")] * 2049),
            "chat.messages",
        ),
        (
            "more bytes than the context could hold",
            pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="a" * 100_000)]),
            "chat",
        ),
    ],
)
async def test_an_invalid_chat_is_invalid_argument_naming_the_field(client, name, chat, field):
    for call in (
        client.render_chat(chat),
        client.complete(pb.GenerateRequest(chat=chat)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in violated_fields(err.value)


async def test_a_rendered_prompt_past_the_context_is_invalid_argument(client):
    # Fits the byte bound, but tokenizes to more than max_model_len (128) tokens.
    long = [{"role": "user", "content": "1 2 3 4 5 6 7 8 9 " * 20}]
    for call in (client.complete(long, max_tokens=1), client.render_chat(long)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in violated_fields(err.value)


async def test_raise_exception_in_the_template_is_invalid_argument_with_its_message(tmp_path):
    model = chat_model(tmp_path, "mistral")
    async with running_server(model) as (_, target), AsyncClient(target) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.render_chat([{"role": "assistant", "content": "x"}])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "roles must alternate" in err.value.details()


async def test_a_model_without_a_template_is_failed_precondition(tmp_path):
    directory = chat_model(tmp_path)
    (directory / "tokenizer_config.json").write_text("{}")
    async with running_server(directory) as (_, target), AsyncClient(target) as client:
        for call in (client.render_chat(CHAT), client.complete(CHAT, max_tokens=1)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (await client.complete("plain text", max_tokens=1)).token_ids


async def test_chat_template_flag_overrides_the_checkpoints(tmp_path):
    override = tmp_path / "override.jinja"
    override.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    directory = chat_model(tmp_path / "model")
    served = running_server(directory, chat_template=str(override))
    async with served as (_, target), AsyncClient(target) as client:
        rendered = await client.render_chat(CHAT)
    assert rendered.text == "[system] You are terse.\n[user] The quick brown fox?\n"


async def test_none_fields_render_as_transformers_renders_them(tmp_path):
    # transformers drops None-valued keys, as OpenAI-style clients send them; Llama 3.2's
    # template failed on `tool_calls: None` (NoneType has no len()).
    from transformers import AutoTokenizer

    call = {"type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather?", "tool_calls": None, "name": None},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": None},
        {"role": "tool", "content": "21 C", "tool_call_id": None},
        {"role": "assistant", "content": "21 C.", "tool_calls": None},
    ]
    date = {"date_string": "26 Jul 2024"}
    directory = chat_model(tmp_path, "llama3", max_model_len=1024)
    async with running_server(directory) as (_, target), AsyncClient(target) as client:
        rendered = await client.render_chat(messages, template_kwargs=date)
    reference = AutoTokenizer.from_pretrained(directory)
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **date
    )
    assert rendered.text == expected
    assert "None" not in rendered.text


async def test_max_chat_messages_bounds_a_chat(tmp_path):
    served = running_server(chat_model(tmp_path), max_chat_messages=2)
    async with served as (_, target), AsyncClient(target) as client:
        assert (await client.render_chat(CHAT)).text
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.render_chat([*CHAT, CHAT[1]])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(err.value) == ["chat.messages"]
    assert "3 messages: at most 2" in err.value.details()


async def test_a_chat_template_flag_with_generation_tags_serves(tmp_path):
    # TRL's training templates mark assistant turns with {% generation %}; the server used to
    # stop at start on the tag ("unknown tag"). transformers renders the tag's body.
    from pathlib import Path

    from transformers import AutoTokenizer

    override = Path(__file__).resolve().parents[2] / "chat_templates/trl/qwen2_5_training.jinja"
    directory = chat_model(tmp_path, "qwen2_5", max_model_len=1024)
    messages = [*CHAT, {"role": "assistant", "content": "A fox."}]
    served = running_server(directory, chat_template=str(override))
    async with served as (_, target), AsyncClient(target) as client:
        rendered = await client.render_chat(messages, add_generation_prompt=False)
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, chat_template=override.read_text(), tokenize=False
    )
    assert rendered.text == expected
