"""The engine process over a real pipe: it is never silent for long while it works."""

from __future__ import annotations

import itertools
import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.messages import (
    FromEngine,
    Heartbeat,
    InflightPolicy,
    Ready,
    Shutdown,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
)
from engine.process import engine_main

STAGE_DELAY_S = 0.1  # per tensor; the tiny Llama has 21, so staging takes over 2 s


def slow_staging_engine_main(config: EngineConfig, conn: Connection) -> None:
    """engine_main whose weight staging takes STAGE_DELAY_S per tensor (a large checkpoint)."""
    from engine.weight_update import StagedWeights

    add = StagedWeights.add

    def slow_add(self: StagedWeights, *args: Any, **kwargs: Any) -> None:
        time.sleep(STAGE_DELAY_S)
        add(self, *args, **kwargs)

    StagedWeights.add = slow_add  # type: ignore[method-assign]
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
