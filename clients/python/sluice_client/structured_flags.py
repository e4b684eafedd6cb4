"""The structured-output flags of `sluice generate` and `sluice chat`: at most one constraint on
the completion's text (GenerateRequest.structured), as build_request's keyword arguments.

The files named by `--json-schema` and `--grammar` are read when the verb runs, before it
connects: a missing file, or a schema that is not JSON, is an `error: ...` line with no RPC made.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

STDIN = "-"


def add_structured_flags(p: argparse.ArgumentParser) -> None:
    """Add the mutually exclusive constraint flags to a verb's parser."""
    group = p.add_argument_group("structured output (at most one)")
    kinds = group.add_mutually_exclusive_group()
    kinds.add_argument(
        "--json-schema",
        metavar="FILE",
        help="a file holding a JSON schema the completion is valid under ('-': stdin)",
    )
    kinds.add_argument(
        "--json-object", action="store_true", help="the completion is any JSON object"
    )
    kinds.add_argument(
        "--regex", metavar="PATTERN", help="a regular expression the whole completion matches"
    )
    kinds.add_argument(
        "--grammar",
        metavar="FILE",
        help="a file holding a GBNF grammar; the completion derives from its `root` rule "
        "('-': stdin)",
    )
    kinds.add_argument(
        "--choice",
        action="append",
        metavar="STRING",
        help="the completion is exactly one of these strings (repeatable)",
    )


def structured_options(args: argparse.Namespace, *, stdin_free: bool = True) -> dict[str, Any]:
    """build_request's keyword arguments for the flags given ({} for none). `stdin_free`: False
    where the verb reads stdin itself (chat turns), so that `-` there is an error."""
    if STDIN in (args.json_schema, args.grammar) and not stdin_free:
        raise ValueError("'-' (stdin) names no schema or grammar here: stdin holds the turns")
    if args.json_schema is not None:
        text = _read(args.json_schema)
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON: {exc}") from None
        return {"json_schema": text}
    if args.grammar is not None:
        return {"grammar": _read(args.grammar)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    return {}


def _read(path: str) -> str:
    if path == STDIN:
        return sys.stdin.read()
    with open(path, encoding="utf-8") as file:
        return file.read()
