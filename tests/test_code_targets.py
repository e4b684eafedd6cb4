"""The layout's size targets, measured from the source: few modules at each package's top, no
module over 400 lines and no function over 60 in engine/ and service/ (Triton kernels aside:
a kernel is one GPU program, not a function to split), and none of the patterns the engine core
left behind (an `Engine(Protocol)` view of another class, a PENDING placeholder token)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
TOP_LEVEL_LIMITS = {"engine": 6, "bench": 12}  # modules directly in the folder, __init__ aside
TESTS_TOP_LEVEL_HELPERS = 3  # tests/ modules that are not tests (conftest.py counts)


def _sources() -> list[Path]:
    """Every module of engine/ and service/ but the generated protobuf stubs."""
    return sorted(
        p
        for root in ("engine", "service")
        for p in (REPO / root).rglob("*.py")
        if "_pb2" not in p.name
    )


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A function decorated `@triton.jit` (or `@triton.autotune(...)`, `@triton.heuristics(...)`)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and ast.unparse(target.value) in ("triton", "tl"):
            return True
    return False


def test_modules_are_at_most_400_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _sources()
        if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert not long, long


def test_functions_are_at_most_60_lines() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_kernel(node):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = lines
    assert not long, long


@pytest.mark.parametrize("folder", sorted(TOP_LEVEL_LIMITS))
def test_few_modules_at_the_top_of(folder: str) -> None:
    modules = sorted(p.name for p in (REPO / folder).glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= TOP_LEVEL_LIMITS[folder], modules


def test_test_helpers_live_in_tests_support() -> None:
    helpers = sorted(
        p.name for p in (REPO / "tests").glob("*.py") if not p.name.startswith("test_")
    )
    assert len(helpers) <= TESTS_TOP_LEVEL_HELPERS, helpers


def test_no_protocol_views_of_the_engine_and_no_pending_token() -> None:
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "Engine":
                found.append(f"{path.relative_to(REPO)}: class Engine")
            if isinstance(node, ast.Name) and node.id == "PENDING":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: PENDING")
    assert not found, found
