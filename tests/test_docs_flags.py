"""Every flag the README and docs/ show with a `sluice` verb is one that verb's parser accepts.

A flag renamed without an alias breaks every script written from the docs of its time; this
finds the flags in the commands of fenced code blocks (a line, with its `\\` continuations) and
of inline code spans, and asks the parser of the verb they follow.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from sluice_client.cli import build_parser

from service.cli import build_parser as serve_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VERB = r"\bsluice\s+([a-z][a-z-]*)|\bpython -m (service)\b"
NEXT_VERB = r"\bsluice\s+[a-z]|\bpython -m service\b"  # where the flags of the last one end
COMMAND = re.compile(rf"(?:{VERB})(.*?)(?={NEXT_VERB}|$)", re.DOTALL)
END = re.compile(r"\s[|;&#]")  # a pipe, `;`, `&&`, `&` or a comment ends a command
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def commands(text: str) -> list[str]:
    """Code in `text`: each command of a fenced block (a line, with its `\\` continuations and
    the indented lines under it), then each inline code span."""
    found, prose = [], []
    for number, block in enumerate(re.split(r"^```.*$", text, flags=re.MULTILINE)):
        if number % 2 == 0:
            prose.append(block)
            continue
        lines: list[str] = []
        for line in block.replace("\\\n", " ").splitlines():
            if lines and line[:1].isspace():
                lines[-1] += " " + line.strip()
            elif line.strip():
                lines.append(line)
        found += lines
    found += re.findall(r"`([^`]+)`", "\n".join(prose))
    return found


def verb_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [verbs] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {**verbs.choices, "service": serve_parser()}


def documented_flags() -> list[tuple[str, str, str]]:
    """(file, verb, flag) for each flag written after a `sluice VERB` or `python -m service`."""
    found = []
    for path in DOCS:
        for command in commands(path.read_text()):
            for part in END.split(command):
                for match in COMMAND.finditer(part):
                    verb = match.group(1) or match.group(2)
                    for flag in FLAG.findall(match.group(3)):
                        found.append((path.relative_to(ROOT).as_posix(), verb, flag))
    return sorted(set(found))


FLAGS = documented_flags()


def test_the_scan_finds_the_flags_of_each_verb():
    verbs = {verb for _, verb, _ in FLAGS}
    assert {"serve", "generate", "update-weights", "health", "tokenize"} <= verbs
    assert ("README.md", "serve", "--model") in FLAGS
    found = [m.groups() for m in COMMAND.finditer("sluice info --a sluice health --b")]
    assert found == [("info", None, " --a "), ("health", None, " --b")]
    fence = "```\nsluice serve \\\n  --port 1\nsluice info [--a\n     --b]  # x\n```\n"
    assert commands("x `sluice generate\n  --affinity K` y\n" + fence) == [
        "sluice serve    --port 1",
        "sluice info [--a --b]  # x",
        "sluice generate\n  --affinity K",
    ]


@pytest.mark.parametrize(("doc", "verb", "flag"), FLAGS, ids=[f"{d}:{v}:{f}" for d, v, f in FLAGS])
def test_each_documented_flag_is_accepted_by_its_verb(doc: str, verb: str, flag: str):
    parsers = verb_parsers()
    assert verb in parsers, f"{doc}: no verb `sluice {verb}`"
    assert flag in option_strings(parsers[verb]), f"{doc}: `sluice {verb}` has no {flag}"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """A verb's flags, and those of its actions (`sluice adapters load ...`) if it has any."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= option_strings(sub)
    return found
