"""The `sluice chat` verb: a conversation with the served model through its chat template.

With `--file`, the conversation in a JSON file (a list of messages, or an object with
`messages` and optionally `tools` and `template_kwargs`) gets one reply, streamed to stdout.
Without it, each line read from stdin is a user turn: the reply is streamed, kept in the
conversation, and the next line continues it (end with EOF, Ctrl-D). `--render` prints the
server's rendering (RenderChat: text and token ids) as JSON instead of generating. The
structured-output flags (structured_flags.py) constrain every reply.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from sluice_client import verb_flags
from sluice_client.verb_flags import (
    UINT32,
    UINT64,
    add_affinity_flag,
    add_client_flags,
    add_wait_flag,
    int_in,
)


def add_chat_verb(verbs: Any) -> None:
    """Add `chat` to the `sluice` command's subparsers."""
    from sluice_client.structured_flags import add_structured_flags

    chat = verbs.add_parser("chat", help="talk to the model through its chat template")
    add_client_flags(chat)
    chat.add_argument(
        "--file",
        type=Path,
        help="a JSON conversation (a list of {role, content} messages, or an object with "
        "`messages`, `tools`, `template_kwargs`): print one reply; default: read user turns "
        "from stdin, one per line",
    )
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument(
        "--template-kwargs",
        type=json.loads,
        metavar="JSON",
        help="extra template variables, a JSON object, e.g. '{\"enable_thinking\": false}'",
    )
    chat.add_argument(
        "--render", action="store_true", help="print RenderChat's text and ids, do not generate"
    )
    chat.add_argument("--max-tokens", type=int_in(1, UINT32), default=256)
    chat.add_argument("--temperature", type=float)
    chat.add_argument("--seed", type=int_in(0, UINT64))
    add_affinity_flag(chat)
    add_wait_flag(chat)
    add_structured_flags(chat)
    chat.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from sluice_client.structured_flags import structured_options

    structured = structured_options(args, stdin_free=args.file is not None)
    conversation = _read_file(args.file) if args.file else {"messages": []}
    messages: list[dict[str, Any]] = list(conversation["messages"])
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    options = {
        "tools": conversation.get("tools"),
        "template_kwargs": args.template_kwargs or conversation.get("template_kwargs"),
    }
    with verb_flags.connect(args) as client:
        if args.file:
            if args.render:
                return _print_render(client, messages, options)
            return 0 if _reply(client, args, messages, options | structured) is not None else 1
        for line in sys.stdin:
            messages.append({"role": "user", "content": line.rstrip("\n")})
            if args.render:
                _print_render(client, messages, options)
                continue
            reply = _reply(client, args, messages, options | structured)
            if reply is None:
                return 1
            messages.append({"role": "assistant", "content": reply})
    return 0


def _read_file(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return {"messages": data} if isinstance(data, list) else dict(data)


def _print_render(client: Any, messages: list[dict[str, Any]], options: dict[str, Any]) -> int:
    rendered = client.render_chat(messages, **options)
    print(json.dumps({"text": rendered.text, "token_ids": list(rendered.token_ids)}))
    return 0


def _reply(
    client: Any, args: argparse.Namespace, messages: list[dict[str, Any]], options: dict[str, Any]
) -> str | None:
    """Stream the model's reply to stdout; its text, or None if it ended in an error.
    `options`: build_request's keyword arguments (chat extras, a structured constraint)."""
    from sluice_client import pb
    from sluice_client.server_wait import until_started

    def opening() -> tuple[Any, Any]:
        events = client.generate(
            messages,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            affinity=args.affinity,
            **options,
        )
        return next(events), events  # a refusal raises here, before anything is printed

    first, rest = until_started(opening, args.target, args.wait_timeout)
    pieces: list[str] = []
    for event in itertools.chain([first], rest):
        match event.WhichOneof("event"):
            case "tokens":
                pieces.append(event.tokens.text)
                sys.stdout.write(event.tokens.text)
                sys.stdout.flush()
            case "finished":
                print(file=sys.stdout, flush=True)
                if event.finished.reason == pb.FINISH_REASON_ERROR:
                    print(f"[{event.finished.message}]", file=sys.stderr)
                    return None
    return "".join(pieces)
