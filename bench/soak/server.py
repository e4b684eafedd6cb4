"""The soak's server: `python -m service` as a subprocess, its JSON log, its processes' RSS."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "soak-admin"


class ServerLog:
    """The server's JSON log lines (engine tracebacks land in the same file), read as they grow:
    the port, each engine pid, and a count of error and warning events by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self.port: int | None = None
        self.engine_pids: list[int] = []
        self.problems: Counter[str] = Counter()  # "error engine.lost" -> count
        self.examples: dict[str, str] = {}  # the first message of each problem
        self.other_lines = 0  # lines that are not one JSON event (there should be none)

    def poll(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a partly written last line waits for the next poll
        self._offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            self._parse(line)

    def summary(self) -> dict[str, Any]:
        self.poll()
        return {
            "problems": dict(self.problems),
            "examples": self.examples,
            "engines_spawned": len(self.engine_pids),
            "non_json_lines": self.other_lines,
        }

    def _parse(self, line: str) -> None:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            self.other_lines += 1
            return
        if not isinstance(event, dict):
            self.other_lines += 1
            return
        name = event.get("event", "")
        if name == "server.listening":
            self.port = int(event["port"])
        elif name == "engine.spawned":
            self.engine_pids.append(int(event["engine_pid"]))
        level = event.get("level", "")
        if level in ("warning", "error", "critical"):
            key = f"{level} {name}"
            self.problems[key] += 1
            details = {k: v for k, v in event.items() if k not in ("event", "level", "timestamp")}
            self.examples.setdefault(key, json.dumps(details)[:300])


class Server:
    """`python -m service` on 127.0.0.1 port 0 with Admin enabled, its log in `workdir`."""

    def __init__(self, model: Path, workdir: Path, args: argparse.Namespace) -> None:
        self.workdir = workdir
        self.weights_dir = workdir / "weights"
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        token = workdir / "admin-token"
        token.write_text(ADMIN_TOKEN)
        self.log = ServerLog(workdir / "server.log")
        self.command = [
            sys.executable,
            "-m",
            "service",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-kv-pages",
            str(args.num_kv_pages),
            "--admin-token-file",
            str(token),
            "--weights-dir",
            str(self.weights_dir),
            "--shutdown-grace",
            "5",
        ]
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""

    def start(self, timeout: float) -> None:
        with open(self.log.path, "wb") as out:
            self.proc = subprocess.Popen(
                self.command, cwd=REPO, env=self.env, stderr=out, stdout=out
            )
        deadline = time.monotonic() + timeout
        while self.log.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode}; see {self.log.path}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not log server.listening in time")
            time.sleep(0.1)
            self.log.poll()
        self.target = f"127.0.0.1:{self.log.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def engine_pid(self) -> int | None:
        """The engine process the server spawned last (a restart spawns a new one)."""
        self.log.poll()
        return self.log.engine_pids[-1] if self.log.engine_pids else None

    def stop(self) -> dict[str, Any]:
        """SIGTERM, then what is left behind: the exit code, a surviving engine (killed), the
        files in the weights dir."""
        if self.proc is None:
            return {"exit_code": None, "note": "never started"}
        engine = self.engine_pid()
        if engine is not None and parent_pid(engine) != self.proc.pid:
            engine = None  # already gone
        cmdline = _cmdline(engine)
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        seconds = time.monotonic() - start
        # NOTE: the same command line too, in case the pid was reused after the engine exited.
        orphan = engine is not None and process_alive(engine) and _cmdline(engine) == cmdline
        if orphan:
            assert engine is not None
            os.kill(engine, signal.SIGKILL)  # the engine this server spawned, left behind
        self.log.poll()
        return {
            "exit_code": code,  # None: it did not exit within 60 s of SIGTERM (killed)
            "seconds": round(seconds, 2),
            "engine_left_running": orphan,
            "weights_dir_files": len(list(self.weights_dir.iterdir())),
        }


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int | None) -> bytes | None:
    try:
        return None if pid is None else Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None  # the process is gone


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rss_mb(pid: int | None) -> float | None:
    """VmRSS of a process in MiB (Linux /proc), None if it is gone."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None  # the process is gone
    return None
