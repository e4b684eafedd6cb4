"""docs/clients.md tells a caller in another language what it needs, versions included."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def section(title: str) -> str:
    text = (ROOT / "docs" / "clients.md").read_text()
    return text.split(f"\n## {title}\n")[1].split("\n## ")[0]


def test_the_go_section_names_the_minimum_grpc_go_and_protobuf_go_versions():
    go = section("Go and Java")
    for module in (
        "google.golang.org/grpc",
        "google.golang.org/protobuf",
        "github.com/golang/protobuf",
    ):
        row = next((line for line in go.splitlines() if line.startswith(f"| `{module}`")), "")
        assert re.search(r"\| v1\.\d+\.\d+", row), f"no minimum version for {module}: {row!r}"
