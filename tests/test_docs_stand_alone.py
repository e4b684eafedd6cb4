"""The repository's docs, comments and scripts point only at files inside the repository.

Design notes, style guides and machine notes kept outside the repository are not there for a
reader of a clone: what callers rely on is written in docs/ in the project's own words, and a
citation of such a file (or of one of its sections) must not come back.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# The notes outside the repository that earlier docs cited, by name or by section ("DESIGN §3",
# "DESIGN.md section 3"); a section sign appears in none of the repository's own texts.
OUTSIDE_CITATION = re.compile(r"\b(?:DESIGN|DEVICE|STYLE)\.md\b|\bDESIGN\s*(?:§|section\b)|§")


def repository_files() -> list[str]:
    """Tracked files and new ones not ignored: what a commit of the work tree would hold."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name})


def citations(files: list[str]) -> list[str]:
    found = []
    for name in files:
        path = ROOT / name
        if name == THIS_FILE or not path.is_file():  # a file deleted but not yet committed
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if OUTSIDE_CITATION.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_the_pattern_catches_every_form_of_citation():
    for cited in (
        "see DESIGN.md",
        "(DESIGN §7)",
        "DESIGN.md section 3",
        "../shared/DEVICE.md",
        "STYLE.md habit 5",
        "§5",
    ):
        assert OUTSIDE_CITATION.search(cited), cited
    for own in ("docs/service.md", "designed for it", "DESIGNS", "device.md"):
        assert not OUTSIDE_CITATION.search(own), own


def test_no_file_in_the_repository_cites_notes_outside_it():
    files = repository_files()
    assert "README.md" in files and "docs/service.md" in files
    found = citations(files)
    assert not found, "say it in our own words instead:\n" + "\n".join(found)
