"""The service process's one frozen configuration, resolved once at start by the CLI."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.process import HEARTBEAT_INTERVAL_S

MAX_REQUEST_ID_LENGTH = 256
MIN_MESSAGE_BYTES = 64 * 1024  # below this even ordinary requests and weight chunks break


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the gRPC server needs; the engine's own settings travel in `engine`.

    Timeouts in seconds. `ready_timeout` covers the engine's load (the demo model is trained on
    first use, which takes a couple of minutes) and, after a restart, the replay of the weight
    updates applied since start; `heartbeat_timeout` applies while nothing is in flight (the
    engine sends a Heartbeat every second then); `stall_timeout` while requests or a weight
    update are in flight (one engine step must finish within it; a weight update reports
    progress while it loads). `engine_exit_timeout`: how long a stopping engine may take to
    end what is left before it is killed.
    """

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port
    api_token: str | None = None  # when set, Generation needs `authorization: Bearer <token>`
    admin_token: str | None = None  # Admin needs it; unset = every Admin call PERMISSION_DENIED
    weights_dir: str | None = None  # where inline weight tensors are assembled; None = temp dir
    max_waiting: int = 1024  # admitted requests not yet started by the engine
    max_concurrent_rpcs: int = 2048  # Generation calls running at once (Cancel not counted)
    shutdown_grace: float = 30.0  # SIGTERM: how long in-flight requests may keep running
    ready_timeout: float = 600.0
    heartbeat_timeout: float = 15.0
    stall_timeout: float = 120.0
    restart_backoff: float = 0.5  # first delay before restarting a dead engine; doubles
    restart_backoff_max: float = 30.0
    # Seconds a Generation call refused RESOURCE_EXHAUSTED or UNAVAILABLE is told to wait before
    # retrying (RetryInfo and grpc-retry-pushback-ms), times a random 1 to 1.5 (jitter).
    retry_after: float = 1.0
    engine_exit_timeout: float = 3.0
    # Requests and updates queued for the engine but not yet written to its pipe; past this the
    # engine is not keeping up (or is hung) and new requests are refused UNAVAILABLE.
    max_pipe_backlog_bytes: int = 64 * 2**20
    # The largest request message: a prompt of a million tokens is about 5 MiB as ids (4 MiB as
    # text); the clients send inline weights in chunks of 4 MiB.
    max_message_bytes: int = 16 * 1024 * 1024
    # UpdateWeights: the longest wait for the caller's next message (header, chunk, or the end
    # of its stream); a stalled upload must not hold the update slot.
    update_idle_timeout: float = 60.0
    # Prometheus metrics over HTTP at /metrics: None = off, 0 = any free port (logged).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port: must be in [0, 65535]")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port: must be in [0, 65535]")
        for name in ("api_token", "admin_token"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty when set")
        if self.max_waiting < 1:
            raise ValueError("max_waiting: must be at least 1")
        if self.max_pipe_backlog_bytes < 1:
            raise ValueError("max_pipe_backlog_bytes: must be at least 1")
        if self.max_concurrent_rpcs < 1:
            raise ValueError("max_concurrent_rpcs: must be at least 1")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes: must be at least {MIN_MESSAGE_BYTES}")
        if not self.update_idle_timeout > 0:
            raise ValueError("update_idle_timeout: must be > 0")
        for name in (
            "shutdown_grace",
            "ready_timeout",
            "heartbeat_timeout",
            "stall_timeout",
            "restart_backoff",
            "restart_backoff_max",
            "retry_after",
            "engine_exit_timeout",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0")
        for name in ("heartbeat_timeout", "stall_timeout"):
            if not getattr(self, name) > HEARTBEAT_INTERVAL_S:
                raise ValueError(
                    f"{name}: must exceed the engine's heartbeat interval ({HEARTBEAT_INTERVAL_S} s)"
                )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
