"""The engine process: never silent for long while it works, never outliving its parent."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from engine.process import engine_main
from engine.protocol.config import EngineConfig
from engine.protocol.messages import (
    FromEngine,
    Heartbeat,
    InflightPolicy,
    Ready,
    Shutdown,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
)
from tests.support.service_harness import make_fake_model

REPO = Path(__file__).resolve().parents[2]
STAGE_DELAY_S = 0.1  # per tensor; the tiny Llama has 21, so staging takes over 2 s


def slow_staging_engine_main(config: EngineConfig, conn: Connection) -> None:
    """engine_main whose weight staging takes STAGE_DELAY_S per tensor read (a large
    checkpoint)."""
    from engine.weights.checkpoint_reader import CheckpointReader

    read = CheckpointReader.read

    def slow_read(self: CheckpointReader, *args: Any, **kwargs: Any) -> Any:
        time.sleep(STAGE_DELAY_S)
        return read(self, *args, **kwargs)

    CheckpointReader.read = slow_read  # type: ignore[method-assign]
    engine_main(config, conn)


def receive(conn: Connection, timeout: float) -> FromEngine:
    assert conn.poll(timeout), f"nothing from the engine for {timeout} s"
    msg: FromEngine = conn.recv()
    return msg


def test_a_long_staging_reports_loading_progress_while_it_loads(tiny_llama: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe(duplex=True)
    config = EngineConfig(model=str(tiny_llama), device="cpu", dtype="float32")
    process = ctx.Process(target=slow_staging_engine_main, args=(config, child_conn), daemon=True)
    process.start()
    child_conn.close()
    try:
        assert isinstance(receive(conn, 60.0), Ready)
        sent = time.monotonic()
        conn.send(UpdateWeights("u", 0, InflightPolicy.CONTINUE, checkpoint_dir=str(tiny_llama)))
        arrivals: list[tuple[float, WeightsProgress]] = []
        while not (arrivals and arrivals[-1][1].final):
            msg = receive(conn, 10.0)
            if not isinstance(msg, Heartbeat):  # an idle beat sent before the update arrived
                assert isinstance(msg, WeightsProgress), msg
                arrivals.append((time.monotonic(), msg))
        applied_at, applied = arrivals[-1]
        assert applied.phase == WeightsPhase.APPLIED and applied.policy_version == 1
        assert applied_at - sent > 2.0, "staging should have taken over 2 s"
        loading = [at for at, event in arrivals if event.phase == WeightsPhase.LOADING]
        assert applied_at - loading[0] > 1.5, "progress came only after the staging"
        times = [sent] + [at for at, _ in arrivals]
        longest_silence = max(b - a for a, b in itertools.pairwise(times))
        assert longest_silence < 0.6
        conn.send(Shutdown())
        receive(conn, 10.0)
        process.join(10.0)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join()


# ---- the engine dies with its parent ----

PARENT_SCRIPT = """
import multiprocessing, os, sys, time
from pathlib import Path

from engine.protocol.config import EngineConfig


def late_child(marker):
    from engine.parent_death import die_with_parent

    time.sleep(1.0)  # the parent is gone by now
    die_with_parent()
    Path(marker).write_text("outlived its parent")


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    kind, arg = sys.argv[1], sys.argv[2]
    if kind == "late":  # the parent dies before the child calls die_with_parent
        child = ctx.Process(target=late_child, args=(arg,))
        child.start()
        print(child.pid, flush=True)
        os._exit(0)
    if kind == "fake":
        from tests.support.fake_engine import fake_engine_main as target
    else:
        from engine.process import engine_main as target
    conn, child_conn = ctx.Pipe()
    config = EngineConfig(model=arg, device="cpu", dtype="float32")
    engine = ctx.Process(target=target, args=(config, child_conn))
    engine.start()
    conn.recv()  # Ready
    print(engine.pid, flush=True)
    time.sleep(120)
"""


def alive(pid: int) -> bool:
    """True while `pid` runs or is stopped; a zombie (dead, not yet reaped) counts as gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return state.split()[1] not in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def parent_process(tmp_path: Path, kind: str, arg: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """A python process that spawns a child (an engine, or `late_child`) and prints its pid;
    on exit both are killed if still there."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    parent = subprocess.Popen(
        [sys.executable, str(script), kind, arg], stdout=subprocess.PIPE, env=env, text=True
    )
    child_pid = None
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 60.0)
        assert ready, "the parent printed no child pid within 60 s"
        child_pid = int(parent.stdout.readline())
        yield parent, child_pid
    finally:
        parent.kill()
        parent.wait()
        if child_pid is not None and alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("kind", ["fake", "real"])
def test_a_stopped_engine_dies_when_its_parent_is_killed(
    tiny_llama: Path, tmp_path: Path, kind: str
) -> None:
    model = make_fake_model(tmp_path / "fake") if kind == "fake" else tiny_llama
    with parent_process(tmp_path, kind, str(model)) as (parent, engine_pid):
        os.kill(engine_pid, signal.SIGSTOP)  # hung: pipe EOF alone would never end it
        parent.kill()
        parent.wait()
        assert wait_gone(engine_pid, 5.0), "the engine outlived its killed parent"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_parent_died_before_it_asked_exits_at_once(tmp_path: Path) -> None:
    marker = tmp_path / "survived"
    with parent_process(tmp_path, "late", str(marker)) as (parent, child_pid):
        parent.wait()  # exits right after printing
        assert wait_gone(child_pid, 5.0)
        assert not marker.exists(), "die_with_parent returned with the parent gone"
