"""The `sluice` command's client verbs (sluice_client.cli) against a server on the fake engine."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import pytest_asyncio
from sluice_client import AsyncClient, cli, pb

from tests.support.service_harness import make_fake_model, running_server
from tests.support.tiny_models import make_tokenizer, write_chat_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")
HOLD = 300  # a prompt holding this token stays queued until cancelled


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_fake_model(tmp_path_factory.mktemp("fake"), hold_token=HOLD)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def target(model_dir):
    async with running_server(model_dir) as (_, target):
        yield target


async def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_tokenize_counts_the_tokens_the_server_makes_of_a_text_prompt(target, capsys):
    code, out, _ = await run(capsys, "tokenize", "--target", target, "hello world")
    async with AsyncClient(target) as client:
        expected = await client.tokenize("hello world", add_special_tokens=True)
        started = (await client.complete("hello world", max_tokens=1)).started
    assert code == 0 and json.loads(out) == expected and expected
    assert started is not None and len(expected) == started.prompt_tokens  # BOS included
    code, out, _ = await run(
        capsys, "tokenize", "--target", target, "--no-add-special-tokens", "hello world"
    )
    assert code == 0 and json.loads(out) == expected[1:]


async def test_cancel_ends_a_request_started_on_another_connection(target, capsys):
    async with AsyncClient(target) as client:
        events = client.generate([5, HOLD, 7], request_id="held-1", max_tokens=4)
        first = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.2)  # the request reaches the server
        code, out, _ = await run(capsys, "cancel", "--target", target, "held-1", "never-was")
        assert (await first).WhichOneof("event") == "started"
        assert code == 0
        assert json.loads(out) == {"cancelled": ["held-1"], "not_found": ["never-was"]}
        last = [event async for event in events][-1]
    assert last.finished.reason == pb.FINISH_REASON_CANCELLED


async def test_generate_info_and_health_verbs(target, capsys):
    code, out, err = await run(capsys, "generate", "--target", target, "abc", "--max-tokens", "3")
    assert code == 0 and out.startswith("abc") and "[FINISH_REASON_LENGTH]" in err
    code, out, _ = await run(capsys, "info", "--target", target)
    info = json.loads(out)
    assert code == 0 and info["state"] == "SERVING_STATE_SERVING"
    assert info["policyVersion"] == "0"  # a field at 0 is shown too (uint64: a JSON string)
    code, out, _ = await run(capsys, "health", "--target", target)
    assert code == 0 and out.endswith("SERVING\n")


async def test_generate_prints_its_request_id_and_sluice_cancel_stops_it_by_that_id(target, capsys):
    held_text = make_tokenizer().decode([HOLD])  # a text prompt that holds its request
    argv = ["generate", "--target", target, "--request-id", "cli-held", held_text]
    generating = asyncio.ensure_future(asyncio.to_thread(cli.main, argv))
    async with AsyncClient(target) as client:
        for _ in range(200):  # until the server has admitted it (each try is one RPC)
            if list((await client.cancel(["cli-held"])).cancelled) == ["cli-held"]:
                break
            await asyncio.sleep(0.05)
    code = await asyncio.wait_for(generating, 30)
    _, err = capsys.readouterr()
    assert code == 0 and "[request cli-held: `sluice cancel" in err
    assert "[FINISH_REASON_CANCELLED" in err


async def test_generate_prints_the_id_the_server_gave_a_request_without_one(target, capsys):
    code, out, err = await run(capsys, "generate", "--target", target, "abc", "--max-tokens", "2")
    request_id = err.split("[request ", 1)[1].split(":", 1)[0]
    assert code == 0 and out.startswith("abc") and request_id
    assert f"sluice cancel --target {target} {request_id}" in err


async def test_a_failed_call_is_one_line_and_exit_1(target, capsys):
    code, out, err = await run(capsys, "tokenize", "--target", "127.0.0.1:1", "x")
    assert code == 1 and out == "" and err.startswith("UNAVAILABLE: ")


async def test_generate_prints_nothing_on_stdout_when_the_call_fails(capsys):
    code, out, err = await run(capsys, "generate", "--target", "127.0.0.1:1", "my prompt")
    assert code == 1 and out == "" and err.startswith("UNAVAILABLE: ")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["generate", "--max-tokens", "-1", "x"], "--max-tokens"),
        (["generate", "--seed", "-3", "x"], "--seed"),
        (["generate", "--max-tokens", "4294967296", "x"], "--max-tokens"),
        (["update-weights", "--checkpoint", "d", "--version", "-1"], "--version"),
        (["update-weights", "--checkpoint", "d", "--drain-timeout-ms", "-5"], "--drain-timeout-ms"),
    ],
)
async def test_a_number_out_of_its_range_is_a_usage_error_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 1
    assert f"argument {flag}: must be in [" in err and len(err.splitlines()) == 1, err


async def test_serve_without_the_server_package_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cli, "entry_points", lambda group: [])  # the client package alone
    for argv in (["serve", "--model", "m", "--port", "1"], ["serve", "--help"]):
        code, out, err = await run(capsys, *argv)
        assert code == 1 and out == "" and "pip install" in err and "scripts/setup.sh" in err


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat_target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat")
    write_chat_tokenizer(directory, "qwen2_5")
    (directory / "fake.json").write_text(json.dumps({"vocab_size": 400, "max_model_len": 256}))
    async with running_server(directory) as (_, target):
        yield target


async def test_chat_replies_to_the_conversation_in_a_file(chat_target, capsys, tmp_path):
    messages = [{"role": "user", "content": "Call me Ishmael."}]
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps({"messages": messages}))
    code, out, _ = await run(
        capsys, "chat", "--target", chat_target, "--file", str(conversation), "--max-tokens", "4"
    )
    async with AsyncClient(chat_target) as client:
        expected = await client.complete(messages, max_tokens=4)
    assert code == 0 and out == expected.text + "\n"


async def test_chat_render_prints_the_servers_rendering(chat_target, capsys, tmp_path):
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "Hi"}]))
    argv = ["chat", "--target", chat_target, "--file", str(conversation), "--render"]
    code, out, _ = await run(capsys, *argv, "--system", "Be brief.")
    rendered = json.loads(out)
    assert code == 0 and rendered["text"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert len(rendered["token_ids"]) > 0


async def test_chat_without_a_file_keeps_the_conversation_read_from_stdin(
    chat_target, capsys, monkeypatch
):
    monkeypatch.setattr("sys.stdin", io.StringIO("first\nsecond\n"))
    code, out, _ = await run(capsys, "chat", "--target", chat_target, "--max-tokens", "3")
    first, second = out.splitlines()
    async with AsyncClient(chat_target) as client:
        turns = [{"role": "user", "content": "first"}]
        assert (await client.complete(turns, max_tokens=3)).text == first
        turns += [{"role": "assistant", "content": first}, {"role": "user", "content": "second"}]
        assert (await client.complete(turns, max_tokens=3)).text == second
    assert code == 0


async def test_chat_with_a_model_without_a_template_says_to_start_with_chat_template(
    target, capsys, tmp_path
):
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    code, out, err = await run(capsys, "chat", "--target", target, "--file", str(conversation))
    assert code == 1 and out == ""
    assert err.startswith("FAILED_PRECONDITION: the served model has no chat template")
    assert "start the server with --chat-template FILE" in err


async def test_an_admin_verb_against_a_server_without_admin_says_how_to_enable_it(target, capsys):
    code, _, err = await run(capsys, "sleep", "--target", target)
    assert code == 1 and err.startswith("PERMISSION_DENIED: the Admin service is disabled")
    assert "start the server with `--admin-token-file FILE`" in err
