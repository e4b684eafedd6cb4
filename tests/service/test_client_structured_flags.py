"""The structured-output flags of `sluice generate` and `sluice chat`: the GenerateRequest each
builds (`structured` set to the one constraint given), and what is refused before any call."""

from __future__ import annotations

import io
import json

import pytest
from sluice_client import build_request, cli, pb, verb_flags

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
GRAMMAR = 'root ::= "yes" | "no"\n'


class RecordingClient:
    """Stands in for the Client `connect` makes: keeps each request, answers it finished."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    def __enter__(self) -> RecordingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def generate(self, prompt, *, affinity=None, **params):
        self.requests.append(build_request(prompt, **params))
        yield pb.GenerateResponse(finished=pb.Finished(reason=pb.FINISH_REASON_STOP))


@pytest.fixture
def client(monkeypatch):
    recording = RecordingClient()
    monkeypatch.setattr(verb_flags, "connect", lambda args: recording)
    return recording


@pytest.fixture
def files(tmp_path):
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "root.gbnf").write_text(GRAMMAR)
    (tmp_path / "chat.json").write_text(json.dumps([{"role": "user", "content": "Well?"}]))
    return tmp_path


def verbs(files):
    """argv of each verb that takes the flags, before them."""
    return {"generate": ["generate", "Well?"], "chat": ["chat", "--file", str(files / "chat.json")]}


@pytest.mark.parametrize("verb", ["generate", "chat"])
@pytest.mark.parametrize(
    ("flags", "kind", "expected"),
    [
        (["--json-schema", "{files}/schema.json"], "json_schema", json.dumps(SCHEMA)),
        (["--json-object"], "json_object", True),
        (["--regex", r"\d{3}"], "regex", r"\d{3}"),
        (["--grammar", "{files}/root.gbnf"], "grammar", GRAMMAR),
        (["--choice", "yes", "--choice", "no"], "choice", pb.ChoiceList(choices=["yes", "no"])),
    ],
)
def test_each_flag_sets_its_member_of_the_structured_oneof(
    verb, flags, kind, expected, client, files
):
    argv = verbs(files)[verb] + [flag.replace("{files}", str(files)) for flag in flags]
    assert cli.main(argv) == 0
    [request] = client.requests
    assert request.structured.WhichOneof("kind") == kind
    assert getattr(request.structured, kind) == expected


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_without_a_flag_the_request_has_no_constraint(verb, client, files):
    assert cli.main(verbs(files)[verb]) == 0
    assert not client.requests[0].HasField("structured")


def test_generate_reads_the_schema_from_stdin_given_dash(client, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO('{"type": "integer"}'))
    assert cli.main(["generate", "x", "--json-schema", "-"]) == 0
    assert client.requests[0].structured.json_schema == '{"type": "integer"}'


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_two_constraints_are_a_one_line_usage_error(verb, client, files, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([*verbs(files)[verb], "--regex", "a+", "--choice", "a"])
    err = capsys.readouterr().err
    assert exited.value.code == 1 and len(err.splitlines()) == 1
    assert "argument --choice: not allowed with argument --regex" in err
    assert client.requests == []


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_a_schema_that_is_not_json_is_an_error_before_any_call(verb, files, monkeypatch, capsys):
    monkeypatch.setattr(verb_flags, "connect", lambda args: pytest.fail("connected"))
    (files / "bad.json").write_text("{type: object}")
    assert cli.main([*verbs(files)[verb], "--json-schema", str(files / "bad.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --json-schema {files / 'bad.json'}: not JSON: "), err


def test_a_missing_grammar_file_is_an_error_before_any_call(files, monkeypatch, capsys):
    monkeypatch.setattr(verb_flags, "connect", lambda args: pytest.fail("connected"))
    assert cli.main(["generate", "x", "--grammar", str(files / "none.gbnf")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def test_chat_reading_turns_from_stdin_refuses_a_schema_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr(verb_flags, "connect", lambda args: pytest.fail("connected"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert cli.main(["chat", "--json-schema", "-"]) == 1
    assert "stdin holds the turns" in capsys.readouterr().err
