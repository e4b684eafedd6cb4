"""docs/architecture.md's map names every module of engine/ and service/, in the folder that
holds it, and names no module that is not there: the map a newcomer reads is the layout."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("engine", "service")
FILE = re.compile(r"(?<![\w./])((?:\w+/)*\w+\.(?:py|c|h))\b")


def _map_entries() -> dict[Path, str]:
    """The map's text by the folder it describes: a root line (`engine/ ...`), a folder entry
    (`  models/ ...`, or `    validation/ ...` below the folder above it) and its indented
    continuation lines; a file entry (`  process.py ...`) belongs to its root."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## The map", 1)[1].split("```", 2)[1]
    entries: dict[Path, str] = {}
    root = current = folder = REPO
    for line in block.splitlines()[1:]:
        head = line.split()[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if indent == 0 and head.rstrip("/") in ROOTS:
            root = current = REPO / head.rstrip("/")
            line = line[len(head) :]
        elif indent in (2, 4) and head.endswith("/"):
            current = (root if indent == 2 else folder) / head.rstrip("/")
            folder = current if indent == 2 else folder
            line = line[indent + len(head) :]
        elif indent == 2:
            current = root
        entries[current] = entries.get(current, "") + "\n" + line
    return entries


def test_every_module_is_on_the_map_in_its_folder() -> None:
    entries = _map_entries()
    missing = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if path.name == "__init__.py" or path.name == "__main__.py":
                continue
            folder = next(
                (f for f in (path.parent, path.parent.parent) if f in entries and f != REPO), None
            )
            named = (
                {m.group(1) for m in FILE.finditer(entries.get(folder, ""))} if folder else set()
            )
            if str(path.relative_to(folder)) not in named if folder else True:
                missing.append(str(path.relative_to(REPO)))
    assert not missing, f"modules missing from docs/architecture.md's map: {missing}"


def test_the_map_names_only_modules_that_exist() -> None:
    absent = [
        str((folder / m.group(1)).relative_to(REPO))
        for folder, text in _map_entries().items()
        if folder != REPO
        for m in FILE.finditer(text)
        if not (folder / m.group(1)).exists()
    ]
    assert not absent, f"docs/architecture.md's map names modules that are not there: {absent}"


def test_every_package_is_on_the_map() -> None:
    entries = _map_entries()
    packages = {p.parent for root in ROOTS for p in (REPO / root).rglob("__init__.py")}
    assert not sorted(str(p.relative_to(REPO)) for p in packages - set(entries))
