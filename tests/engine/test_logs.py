"""engine/logs.py: what a process writes on stderr once `configure_logging` has run.

Each test runs a short script in a fresh interpreter (logging is process-wide state) and reads
its stderr: one JSON event per line, whatever logged it, with tracebacks as a field.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine.protocol.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]


def run_logged(body: str, fmt: str = "json", level: str = "info") -> tuple[int, str]:
    """Exit status and stderr of `body` run after configure_logging(level, fmt, "engine")."""
    script = (
        "from engine.logs import configure_logging\n"
        f"configure_logging({level!r}, {fmt!r}, process='engine')\n" + textwrap.dedent(body)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=20
    )
    return run.returncode, run.stderr


def events(stderr: str) -> list[dict[str, Any]]:
    """Every line as a JSON object (json.loads fails the test on any other line)."""
    parsed = [json.loads(line) for line in stderr.splitlines()]
    for event in parsed:
        assert {"timestamp", "level", "event", "logger", "process", "pid"} <= event.keys(), event
        assert event["process"] == "engine"
    return parsed


def test_a_library_logger_s_exception_is_one_line_with_the_traceback_as_a_field():
    code, stderr = run_logged(
        """
        import logging
        try:
            raise KeyError("missing")
        except KeyError:
            logging.getLogger("torch.somewhere").exception("lookup %s failed", "x")
        """
    )
    assert code == 0
    [event] = events(stderr)
    assert event["event"] == "lookup x failed" and event["logger"] == "torch.somewhere"
    assert event["level"] == "error"
    assert event["exception"].startswith("Traceback (most recent call last):")
    assert event["exception"].endswith("KeyError: 'missing'")


def test_structlog_and_stdlib_lines_carry_the_bound_request_id_until_it_is_unbound():
    code, stderr = run_logged(
        """
        import logging, structlog
        with structlog.contextvars.bound_contextvars(request_id="r-7"):
            structlog.get_logger("sluice.x").info("inside", tokens=3)
            logging.getLogger("lib").warning("also inside")
        structlog.get_logger("sluice.x").info("outside")
        """
    )
    assert code == 0
    inside, also, outside = events(stderr)
    assert inside["request_id"] == "r-7" and inside["tokens"] == 3
    assert also["request_id"] == "r-7" and also["level"] == "warning"
    assert "request_id" not in outside


def test_warnings_are_log_lines():
    code, stderr = run_logged('import warnings\nwarnings.warn("old API", UserWarning)\n')
    assert code == 0
    [event] = events(stderr)
    assert event["logger"] == "py.warnings" and event["level"] == "warning"
    assert "UserWarning: old API" in event["event"]


def test_an_uncaught_exception_in_a_thread_and_then_in_the_main_thread_are_one_line_each():
    code, stderr = run_logged(
        """
        import threading
        def work():
            raise ValueError("in a worker")
        thread = threading.Thread(target=work, name="worker")
        thread.start()
        thread.join()
        raise RuntimeError("the end")
        """
    )
    assert code == 1
    in_thread, in_main = events(stderr)
    assert in_thread["event"] == in_main["event"] == "uncaught_exception"
    assert in_thread["level"] == in_main["level"] == "critical"
    assert in_thread["thread"] == "worker"
    assert in_thread["exception"].endswith("ValueError: in a worker")
    assert in_main["exception"].endswith("RuntimeError: the end")


def test_an_exception_raised_in_a_finalizer_is_one_line():
    code, stderr = run_logged(
        """
        class Leaky:
            def __del__(self):
                raise OSError("close failed")
        Leaky()
        """
    )
    assert code == 0
    [event] = events(stderr)
    assert event["event"] == "unraisable_exception" and "Leaky.__del__" in event["object"]
    assert event["exception"].endswith("OSError: close failed")


def test_lines_below_the_level_are_dropped_from_structlog_and_stdlib_alike():
    code, stderr = run_logged(
        """
        import logging, structlog
        structlog.get_logger("a").info("quiet")
        logging.getLogger("b").info("quiet too")
        structlog.get_logger("a").warning("loud")
        """,
        level="warning",
    )
    assert code == 0
    assert [e["event"] for e in events(stderr)] == ["loud"]


def test_console_format_writes_a_readable_line_and_a_multi_line_traceback():
    code, stderr = run_logged(
        """
        import structlog
        try:
            1 / 0
        except ZeroDivisionError:
            structlog.get_logger("sluice.x").exception("it broke", step=4)
        """,
        fmt="console",
    )
    assert code == 0
    first, *rest = stderr.splitlines()
    assert not first.startswith("{")
    assert "it broke" in first and "step=4" in first and "process=engine" in first
    assert "[error    ]" in first
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ZeroDivisionError: division by zero"


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_an_enum_field_is_written_as_its_value(fmt):
    code, stderr = run_logged(
        """
        import structlog
        from engine.protocol.messages import FinishReason
        structlog.get_logger("sluice.x").info(
            "done", reason=FinishReason.LENGTH, reasons=[FinishReason.STOP, None]
        )
        """,
        fmt=fmt,
    )
    assert code == 0 and "FinishReason" not in stderr, stderr
    if fmt == "json":
        [event] = events(stderr)
        assert (event["reason"], event["reasons"]) == ("length", ["stop", None])
    else:
        assert "reason=length" in stderr and "reasons=['stop', None]" in stderr, stderr


@pytest.mark.parametrize(
    ("field", "value"), [("log_format", "xml"), ("log_level", "verbose"), ("log_level", "INFO")]
)
def test_engine_config_refuses_an_unknown_log_setting(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **{field: value})


def test_auto_format_is_json_on_a_file_and_console_on_a_terminal(tmp_path):
    body = "import structlog; structlog.get_logger('sluice.x').info('hello', step=4)"
    code, stderr = run_logged(body, fmt="auto")  # stderr is a pipe here
    assert code == 0 and [e["event"] for e in events(stderr)] == ["hello"]

    import pty

    script = (
        "from engine.logs import configure_logging\n"
        "configure_logging('info', 'auto', process='engine')\n" + body
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    primary, secondary = pty.openpty()  # a terminal, as a person's shell gives
    try:
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, stderr=secondary, timeout=20, check=False
        )
        os.close(secondary)
        written = b""
        while chunk := _read_pty(primary):
            written += chunk
    finally:
        os.close(primary)
    line = re.sub(r"\x1b\[[0-9;]*m", "", written.decode()).strip()  # colours: a terminal
    assert run.returncode == 0 and not line.startswith("{"), line
    assert "hello" in line and "step=" in line and "process=" in line


def _read_pty(fd: int) -> bytes:
    """What is left to read of a terminal whose other end has closed (Linux ends it with EIO)."""
    try:
        return os.read(fd, 4096)
    except OSError:
        return b""


def test_an_in_process_engine_logs_on_stderr_and_leaves_stdout_to_its_caller(tiny_llama):
    # The compile workers log as they start: before, those lines went to the caller's stdout.
    script = textwrap.dedent(
        f"""
        from engine import EngineConfig, LLMEngine
        from engine.protocol.messages import Constraint
        eng = LLMEngine(EngineConfig(model={str(tiny_llama)!r}, device="cpu", warmup=False))
        eng.structured.grammars.compile(Constraint("regex", "[ab]+")).result(timeout=120)
        print("only this")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "only this\n"
    assert "engine.grammar_worker_started" in run.stderr
