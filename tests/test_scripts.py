"""scripts/setup.sh and scripts/test.sh, as a new user meets them.

setup.sh: a run that finds .venv set up calls no pip (a second demo works offline). test.sh:
it ends with the skipped tests' reasons and its duration. Each runs the real script in a copy of
the files it reads, with a .venv whose tools are stand-ins that record each call: what is under
test is what the script decides to run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAND_IN = '#!/usr/bin/env bash\necho "$(basename "$0") $*" >>"$(dirname "$0")/../calls"\n'


def make_checkout(root: Path) -> Path:
    for name in ("scripts/setup.sh", "pyproject.toml", "clients/python/pyproject.toml"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, root / name)
    for tool in ("python", "pip"):
        path = root / ".venv/bin" / tool
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STAND_IN)
        path.chmod(0o755)
    return root


def setup(root: Path, *extras: str) -> tuple[list[str], str]:
    """The pip calls of one run of setup.sh, and what it printed on stderr."""
    calls = root / ".venv/calls"
    calls.unlink(missing_ok=True)
    run = subprocess.run(
        ["bash", "scripts/setup.sh", *extras], cwd=root, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr
    lines = calls.read_text().splitlines() if calls.exists() else []
    return [line for line in lines if line.startswith("pip ")], run.stderr


def test_a_second_run_calls_no_pip_and_prints_nothing(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    first, said = setup(root)
    assert any("-e ./clients/python -e ." in call for call in first)
    assert said.startswith("Installing torch 2.13.0 and Sluice into .venv")
    assert setup(root) == ([], "")


def test_dev_extras_or_a_changed_pyproject_install_again(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    setup(root)
    dev, said = setup(root, "dev")
    assert any('".[dev]"' in call or ".[dev]" in call for call in dev) and "test tools" in said
    assert setup(root) == ([], "")  # dev covers the plain install
    with (root / "pyproject.toml").open("a") as handle:
        handle.write("\n# a new dependency\n")
    again, _ = setup(root)
    assert any("-e ./clients/python -e ." in call for call in again)


def test_the_test_script_prints_skip_reasons_and_its_duration(tmp_path: Path) -> None:
    root = make_checkout(tmp_path)
    shutil.copy(REPO / "scripts/test.sh", root / "scripts/test.sh")
    for stand_in in ("scripts/setup.sh", "scripts/gen_protos.sh"):
        (root / stand_in).write_text("exit 0\n")
    for tool in ("ruff", "mypy"):
        path = root / ".venv/bin" / tool
        path.write_text(STAND_IN)
        path.chmod(0o755)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True, timeout=30)
    run = subprocess.run(
        ["bash", "scripts/test.sh", "-k", "x"], cwd=root, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr
    calls = (root / ".venv/calls").read_text().splitlines()
    assert "python -m pytest -q -rs -n auto --dist loadfile -k x" in calls
    assert run.stdout.splitlines()[-1].startswith("== scripts/test.sh: ")
    assert run.stdout.splitlines()[-1].endswith(" s in all")
