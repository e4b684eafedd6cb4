"""The package layout's rules, read from the source: no import cycle among the modules of
engine/, service/ and the Python client, each package's "May import:" rule, no two packages
that import each other, and the boundary between the service and the engine.

The graph is built with `ast`, not by importing: every `import` and `from ... import` in a
module counts, at module level or inside a function (a function-level import still runs, and a
cycle through one fails at run time). The module cycle check leaves out those under `if
TYPE_CHECKING:` (a second check counts them); the package rules and the package pairs count
them: a type named in a signature is still something the package must know of. `from engine.x
import name` is an edge to `engine.x.name` when that is a module, else to `engine.x` (a
package means its `__init__`). Importing a submodule also runs its parents' `__init__`s, but
those are not edges here: every `__init__` that imports its own submodules would be a cycle.

A package's rule is one line of its `__init__`'s docstring, `May import: a, b, c`: dotted names
of packages (each meaning the package and everything below it) or modules, or `May import:
nothing`. Its own modules (its `__init__`, the modules beside it and everything in the
packages below it) are always allowed; the rule governs the modules directly in the package,
and names only what they import of engine, service, sluice_client and the generated stubs
(sluice): the standard library and third-party packages are not its concern (torch, grpc and
asyncio have checks of their own below).
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLIENT = REPO / "clients" / "python"
PACKAGES = ("engine", "service")
# Where each top-level package's source lives; the stubs (sluice) are import targets only.
SOURCES = {"engine": REPO, "service": REPO, "sluice_client": CLIENT, "sluice": CLIENT}
ALL = tuple(SOURCES)
RULED = ("engine", "service", "sluice_client")  # every package below these states its rule
RULE = re.compile(r"^May import: (.*)$", re.MULTILINE)
NAME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*")

# What service/ may import from engine/: the contract (engine/protocol/: the pipe's messages,
# the config with the setting fields it is made of, the result types and the rules both
# processes apply to requests, schemas and adapter configs), the process entry (a spawn target
# that imports torch only inside it, and parent_death, which it calls first), the logs both
# processes configure alike, and the package itself (which loads LLMEngine lazily, the
# plain-data GenerationResult at once).
SHARED = {
    "engine",
    "engine.protocol.generation_result",
    "engine.protocol.config",
    "engine.protocol.messages",
    "engine.protocol.sampling_params",
    "engine.protocol.admin_messages",
    "engine.protocol.settings",
    "engine.protocol.error_code",
    "engine.protocol.kv_events",
    "engine.protocol.engine_stats",
    "engine.protocol.validation",
    "engine.protocol.validation.adapter_config",
    "engine.protocol.validation.schema_rules",
    "engine.protocol.validation.pattern_grammar",
    "engine.protocol.validation.request_rules",
    "engine.process",
    "engine.parent_death",
    "engine.logs",
}


def module_files(roots: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    modules = {}
    for package in roots:
        base = SOURCES[package]
        for path in sorted((base / package).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, module_level_only: bool, type_checking: bool
) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            ):
                continue
            if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        visit(node)

    visit(tree)
    return found


def imported_modules(
    name: str,
    path: Path,
    modules: set[str],
    module_level_only: bool = False,
    type_checking: bool = False,
) -> set[str]:
    """The engine/service modules `name` (at `path`) imports: outside TYPE_CHECKING blocks
    unless `type_checking`, and with `module_level_only` outside functions (what importing
    `name` runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in _imports(tree, module_level_only, type_checking):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        for target in targets:
            # `import engine.x.y` names a module; the longest known prefix is the one run.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
    return edges


def import_graph(
    module_level_only: bool = False,
    type_checking: bool = False,
    roots: tuple[str, ...] = PACKAGES,
) -> dict[str, set[str]]:
    files = module_files(roots)
    names = set(files)
    return {
        name: imported_modules(name, path, names, module_level_only, type_checking)
        for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


@functools.cache
def whole_graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    """Every module of ALL by name, and what each imports (TYPE_CHECKING blocks included)."""
    return module_files(ALL), import_graph(type_checking=True, roots=ALL)


def ruled_packages() -> dict[str, Path]:
    """Every package below RULED, by dotted name, with its `__init__.py`."""
    return {name: path for name, path in module_files(RULED).items() if path.name == "__init__.py"}


def package_of(name: str, path: Path) -> str:
    """The package whose rule governs module `name`: itself for an `__init__`."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def read_rule(init: Path) -> set[str]:
    """The names of the one `May import:` line of a package's docstring (empty for
    `nothing`); AssertionError, naming the file, when there is no such line or it is malformed."""
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    lines = RULE.findall(docstring)
    where = init.relative_to(REPO) if init.is_relative_to(REPO) else init
    assert len(lines) == 1, f"{where}: {len(lines)} `May import:` lines in the docstring, not 1"
    if lines[0].strip() == "nothing":
        return set()
    names = [n.strip() for n in lines[0].split(",")]
    bad = [n for n in names if not NAME.fullmatch(n)]
    assert not bad, f"{where}: `May import:` takes dotted names, not {bad}"
    return set(names)


def rule_breaks(
    package: str, rule: set[str], graph: dict[str, set[str]], files: dict[str, Path]
) -> list[str]:
    """`module imports target` for each import of a module directly in `package` that is
    neither its own nor under a name of `rule`."""
    return [
        f"{name} imports {target}"
        for name in sorted(graph)
        if package_of(name, files[name]) == package
        for target in sorted(graph[name])
        if not within(target, package) and not any(within(target, r) for r in rule)
    ]


def node_of(name: str, path: Path) -> str:
    """A module's node in the package graph: its package, except that the modules directly in
    a top-level package (engine/process.py beside engine/logs.py) are nodes of their own: that
    folder holds both its side's entry points and what every folder below uses."""
    package = package_of(name, path)
    return name if package in ALL else package


def package_edges(
    graph: dict[str, set[str]], files: dict[str, Path]
) -> dict[tuple[str, str], set[str]]:
    """(importer's node, imported node) -> the `module -> module` imports that make the edge."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for name, targets in graph.items():
        for target in targets:
            pair = (node_of(name, files[name]), node_of(target, files[target]))
            if pair[0] != pair[1]:
                edges[pair].add(f"{name} -> {target}")
    return edges


def test_no_import_cycle_among_engine_and_service_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_cycle_is_closed_by_a_type_checking_import_either():
    # Such a cycle runs nowhere, but it says two modules each need the other: the layout keeps
    # one of them below (service.engine_link.supervisor names what it needs in a Protocol).
    cycle = find_cycle(import_graph(type_checking=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("from engine.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from engine import a\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.a import x\n"
    )
    names = {"engine", "engine.a", "engine.b", "engine.c"}
    graph = {
        f"engine.{m}": imported_modules(f"engine.{m}", tmp_path / f"{m}.py", names) for m in "abc"
    }
    assert graph == {"engine.a": {"engine.b"}, "engine.b": {"engine.a"}, "engine.c": set()}
    assert find_cycle(graph) == ["engine.a", "engine.b", "engine.a"]


def test_service_imports_from_the_engine_only_the_shared_modules():
    crossing = {
        (name, target)
        for name, targets in import_graph().items()
        if name.split(".")[0] == "service"
        for target in targets
        if target.split(".")[0] == "engine" and target not in SHARED
    }
    assert crossing == set()


def test_importing_a_shared_engine_module_imports_only_shared_ones():
    # engine.process imports LLMEngine inside engine_main, in the engine process only.
    graph = import_graph(module_level_only=True)
    assert {(m, t) for m in SHARED for t in graph[m] if t not in SHARED} == set()


def test_engine_never_imports_grpc_asyncio_or_the_generated_stubs():
    banned = ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "asyncio", "sluice")
    found = []
    for name, path in module_files().items():
        if not name.startswith("engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = []
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = [node.module.split(".")[0]]
            found += [(name, root) for root in roots if root in banned]
    assert found == []


def test_service_never_imports_torch_by_name():
    found = []
    for name, path in module_files().items():
        if not name.startswith("service"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(name, a.name) for a in node.names if a.name.split(".")[0] == "torch"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                found.append((name, node.module))
    assert found == []


def test_every_package_says_what_lives_there():
    missing = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in (REPO / package).rglob("__init__.py")
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert missing == []


def test_every_package_is_in_the_distribution():
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(path.parent.relative_to(REPO).parts)
        for package in PACKAGES
        for path in (REPO / package).rglob("__init__.py")
    }
    assert found == listed


def test_no_import_cycle_among_the_client_modules():
    # The `sluice` command's verbs share their flags through verb_flags.py, not through cli.py.
    graph = import_graph(type_checking=True, roots=("sluice_client", "sluice"))
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", sorted(ruled_packages()))
def test_the_package_imports_only_what_its_rule_names(package: str):
    files, graph = whole_graph()
    rule = read_rule(files[package])
    stale = sorted(r for r in rule if r not in files)
    assert stale == [], f"{package}'s rule names what does not exist: {stale}"
    breaks = rule_breaks(package, rule, graph, files)
    assert breaks == [], f"{package} may import {sorted(rule) or 'nothing'}, but:\n" + "\n".join(
        breaks
    )


@pytest.mark.parametrize("package", sorted(ruled_packages()))
def test_the_package_and_no_other_import_each_other(package: str):
    files, graph = whole_graph()
    edges = package_edges(graph, files)
    pairs = sorted(
        f"{a} <-> {b}: " + "; ".join(sorted(edges[a, b] | edges[b, a]))
        for a, b in edges
        if a == package and (b, a) in edges
    )
    assert pairs == [], "\n".join(pairs)


def test_the_rule_checker_names_the_module_and_the_import_that_break_a_rule(tmp_path):
    (tmp_path / "pkg").mkdir()
    init = tmp_path / "pkg" / "__init__.py"
    init.write_text('"""A package.\n\nMay import: engine.protocol, engine.logs\n"""\n')
    files = {"engine.pkg": init, "engine.pkg.a": tmp_path / "pkg" / "a.py"}
    graph = {
        "engine.pkg": set(),
        "engine.pkg.a": {"engine.protocol.messages", "engine.logs", "engine.pkg", "engine.models"},
    }
    rule = read_rule(init)
    assert rule == {"engine.protocol", "engine.logs"}
    assert rule_breaks("engine.pkg", rule, graph, files) == ["engine.pkg.a imports engine.models"]
    init.write_text('"""A package that may import `engine.protocol` (prose)."""\n')
    with pytest.raises(AssertionError, match="0 `May import:` lines"):
        read_rule(init)


def test_the_pair_check_sees_a_pair_through_a_type_checking_import(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "a" / "x.py").write_text("from engine.b.y import Y\n")
    (tmp_path / "b" / "y.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.a.x import X\n"
    )
    files = {
        "engine.a": tmp_path / "a" / "__init__.py",
        "engine.b": tmp_path / "b" / "__init__.py",
        "engine.a.x": tmp_path / "a" / "x.py",
        "engine.b.y": tmp_path / "b" / "y.py",
    }
    names = set(files)
    graph = {
        name: imported_modules(name, path, names, type_checking=True)
        for name, path in files.items()
    }
    edges = package_edges(graph, files)
    assert edges[("engine.a", "engine.b")] == {"engine.a.x -> engine.b.y"}
    assert edges[("engine.b", "engine.a")] == {"engine.b.y -> engine.a.x"}
