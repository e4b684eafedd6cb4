"""The service process's one frozen configuration, resolved once at start by the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.process import HEARTBEAT_INTERVAL_S
from engine.protocol.config import EngineConfig
from engine.protocol.settings import (
    EXECUTION,
    MODEL,
    NETWORK,
    OBSERVABILITY,
    SECURITY,
    SUPERVISION,
    WEIGHTS,
    setting,
)

MAX_REQUEST_ID_LENGTH = 256
# OpenAI's bound on a chat's messages (its API refuses a longer `messages` array); a service
# flag, for agent traces of more turns.
DEFAULT_MAX_CHAT_MESSAGES = 2048
MIN_MESSAGE_BYTES = 64 * 1024  # below this even ordinary requests and weight chunks break
# The largest message the server sends: a chunk of many tokens with top logprobs, or a Started
# with prompt logprobs (requests whose scores could pass it are refused). The clients accept it.
MAX_SEND_MESSAGE_BYTES = 64 * 1024 * 1024
TLS_FILES = ("tls_cert_file", "tls_key_file", "tls_client_ca_file")
# The fields __post_init__ checks alike, by rule.
AT_LEAST_ONE = (
    "max_waiting",
    "max_pipe_backlog_bytes",
    "max_concurrent_rpcs",
    "max_stream_requests",
    "max_stream_buffer_bytes",
    "max_chat_messages",
)
AT_LEAST_ONE_WHEN_SET = (
    "max_generate_streams_per_connection",
    "max_concurrent_streams",
    "max_connections",
)
POSITIVE_DURATIONS = (
    "update_idle_timeout",
    "stream_idle_timeout",
    "keepalive_time",
    "keepalive_timeout",
    "keepalive_min_ping_interval",
    "handshake_timeout",
)
NON_NEGATIVE_DURATIONS = (
    "shutdown_grace",
    "ready_timeout",
    "heartbeat_timeout",
    "stall_timeout",
    "restart_backoff",
    "restart_backoff_max",
    "retry_after",
    "engine_exit_timeout",
    "stream_interval",
)


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the gRPC server needs; the engine's own settings travel in `engine`.

    Timeouts in seconds. `ready_timeout` covers the engine's load (the demo model is trained on
    first use, which takes a couple of minutes) and, after a restart, the replay of the weight
    updates applied since start; `heartbeat_timeout` applies while nothing is in flight (the
    engine sends a Heartbeat every second then; a late one gets a probe, and a stopped engine, or
    one not runnable for that long, is lost); `stall_timeout` while requests or a weight update
    are in flight (one engine step must finish within it; a weight update reports progress while
    it loads), and to an idle engine that is runnable but silent (starved of CPU). `engine_exit_timeout`: how long a stopping engine may take to
    end what is left before it is killed.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str | None = setting(
        None,
        "the model name GetServerInfo reports (default: the checkpoint directory's name)",
        group=MODEL,
    )
    chat_template: str | None = setting(
        None,
        "a Jinja chat template file for `chat` prompts and RenderChat, in place of the "
        "checkpoint's (chat_template.jinja or tokenizer_config.json's chat_template)",
        group=MODEL,
    )
    # Checked before any work per message: the byte bound (--max-message-bytes) alone lets
    # through millions of empty turns, each of them a Python dict for the template to loop over.
    max_chat_messages: int = setting(
        DEFAULT_MAX_CHAT_MESSAGES,
        "most messages in one `chat` prompt or RenderChat; more are INVALID_ARGUMENT "
        "(`chat.messages`) before any is read",
        group=MODEL,
    )
    # Off by default: with the engine's torch threads on every core (the CPU default) a service
    # below them only runs in the engine's gaps (health checks took 75-84 ms at p50 instead of
    # 3-5 ms under load). With a core left to it, the engine first in line is what lets 64 served
    # streams keep up with the offline engine on a 2-core machine (service/ops/priority.py).
    service_niceness: int = setting(
        0,
        "nice levels added to the service's own threads, not the engine's, so that the engine "
        "gets the CPU first where they share cores (Linux; 0: same priority); for an engine "
        "that leaves the service a core (--cpu-threads below the cores, or a GPU)",
        group=EXECUTION,
    )
    # Off by default: an idle stream sends each token alone at once. Under a load the service
    # cannot keep up with, a stream's tokens are sent at most once per interval: fewer, fuller
    # messages (each costs far more service CPU than a token in it), which leaves grpc.aio time
    # to accept new calls (docs/benchmarks.md: with 256 saturated Generate streams, the first
    # token came 1.3-2.4 s after the call at p50 without one, 0.19-0.24 s with 0.05).
    stream_interval: float = setting(
        0.0,
        "seconds between two token chunks of one request (0: each as soon as it can go); the "
        "first chunk and the last event go at once",
        group=EXECUTION,
    )
    host: str = setting(
        "127.0.0.1", "address to listen on (0.0.0.0: every interface)", group=NETWORK
    )
    port: int = setting(50051, "gRPC port; 0 picks a free one (logged)", group=NETWORK)
    openai_port: int | None = setting(
        None,
        "serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions, ...) on this port; 0 "
        "picks a free one (logged); default off",
        group=NETWORK,
    )
    openai_host: str = setting("127.0.0.1", "address of the OpenAI port", group=NETWORK)
    # The largest request message: a prompt of a million tokens is about 5 MiB as ids (4 MiB as
    # text); the clients send inline weights in chunks of 4 MiB.
    max_message_bytes: int = setting(
        16 * 2**20,
        "largest request message (prompt, weight chunk); larger: RESOURCE_EXHAUSTED",
        group=NETWORK,
        size=True,
    )
    max_concurrent_rpcs: int = setting(
        2048,
        "Generation calls running at once; more are RESOURCE_EXHAUSTED (Cancel exempt)",
        group=NETWORK,
    )
    # Only GenerateStream: it lasts as long as its caller likes (a Generate call ends with its
    # request), so without this one connection could hold every slot of --max-concurrent-rpcs.
    max_generate_streams_per_connection: int | None = setting(
        None,
        "GenerateStream calls one connection may run at once; more are RESOURCE_EXHAUSTED "
        "(default: half of --max-concurrent-rpcs)",
        group=NETWORK,
    )
    max_concurrent_streams: int | None = setting(
        None,
        "HTTP/2 streams (calls) at once per connection (default: gRPC's, no limit)",
        group=NETWORK,
    )
    keepalive_time: float = setting(
        7200.0, "seconds of connection silence before the server pings the client", group=NETWORK
    )
    keepalive_timeout: float = setting(
        20.0,
        "seconds the server waits for a ping's answer before closing the connection",
        group=NETWORK,
    )
    keepalive_min_ping_interval: float = setting(
        300.0,
        "the shortest interval between client pings the server accepts, seconds; a client "
        "pinging more often is disconnected (set your clients' keepalive time above it)",
        group=NETWORK,
    )
    # gRPC's own default is 120 s: a connection that never finishes its handshake (a scanner, a
    # slow-loris) holds one of the server's file descriptors that long.
    handshake_timeout: float = setting(
        5.0,
        "seconds a new connection has to finish its TLS and HTTP/2 handshake before it is closed",
        group=NETWORK,
    )
    max_connections: int | None = setting(
        None,
        "connections held at once, handshaking ones included; more are closed as they come "
        "(default: the open-file limit, ulimit -n, less 128 the server keeps for itself)",
        group=NETWORK,
    )
    api_token: str | None = setting(
        None,
        "file with the token Generation calls must send as 'authorization: Bearer <it>'",
        group=SECURITY,
        from_file=True,
    )
    admin_token: str | None = setting(
        None,
        "file with Admin's token; without it every Admin call is PERMISSION_DENIED",
        group=SECURITY,
        from_file=True,
    )
    weights_dir: str | None = setting(
        None,
        "where inline weight updates are assembled (default: a temporary directory)",
        group=WEIGHTS,
    )
    # UpdateWeights: the longest wait for the caller's next message (header, chunk, or the end
    # of its stream); a stalled upload must not hold the update slot.
    update_idle_timeout: float = setting(
        60.0,
        "seconds UpdateWeights waits for the caller's next message before ABORTED",
        group=WEIGHTS,
    )
    # GenerateStream flow control: a caller that sends starts and never reads must not make
    # the service admit (and buffer the outputs of) requests without bound.
    max_stream_requests: int = setting(
        256,
        "requests one GenerateStream may have in flight (its refusals unsent included); its "
        "next start is read once one ends",
        group=SUPERVISION,
    )
    max_stream_buffer_bytes: int = setting(
        64 * 2**20,
        "outputs (estimated bytes) one GenerateStream may hold unsent; past it its requests are "
        "cancelled and the call ends RESOURCE_EXHAUSTED",
        group=SUPERVISION,
        size=True,
    )
    stream_idle_timeout: float = setting(
        300.0,
        "seconds a GenerateStream with no request in flight waits for the caller's next "
        "message before it ends ABORTED",
        group=SUPERVISION,
    )
    max_waiting: int = setting(
        1024,
        "admitted requests not yet started by the engine; more are RESOURCE_EXHAUSTED",
        group=SUPERVISION,
    )
    # Seconds a Generation call refused RESOURCE_EXHAUSTED or UNAVAILABLE is told to wait before
    # retrying (RetryInfo and grpc-retry-pushback-ms), times a random 1 to 1.5 (jitter).
    retry_after: float = setting(
        1.0,
        "seconds a call refused RESOURCE_EXHAUSTED or UNAVAILABLE is told to wait before a retry "
        "(times a random 1 to 1.5)",
        group=SUPERVISION,
    )
    # Requests and updates queued for the engine but not yet written to its pipe; past this the
    # engine is not keeping up (or is hung) and new requests are refused UNAVAILABLE.
    max_pipe_backlog_bytes: int = setting(
        64 * 2**20,
        "bytes queued for the engine's pipe before requests are UNAVAILABLE",
        group=SUPERVISION,
        size=True,
    )
    shutdown_grace: float = setting(
        30.0, "seconds in-flight requests may run on after SIGTERM", group=SUPERVISION
    )
    ready_timeout: float = setting(
        600.0,
        "seconds the engine may take to load (and replay updates after a restart)",
        group=SUPERVISION,
    )
    heartbeat_timeout: float = setting(
        15.0,
        "seconds an idle engine's heartbeat may be late before it is probed; "
        "restarted if stopped or not runnable meanwhile",
        group=SUPERVISION,
    )
    stall_timeout: float = setting(
        120.0,
        "seconds without engine progress while work is in flight before it is restarted "
        "(must exceed the longest engine step)",
        group=SUPERVISION,
    )
    restart_backoff: float = setting(
        0.5,
        "seconds before restarting a dead engine; doubles per failed restart",
        group=SUPERVISION,
    )
    restart_backoff_max: float = setting(
        30.0, "the longest delay between restarts, seconds", group=SUPERVISION
    )
    engine_exit_timeout: float = setting(
        3.0, "seconds a stopping engine may take to exit before it is killed", group=SUPERVISION
    )
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics; 0 picks a free port "
        "(logged); default off",
        group=OBSERVABILITY,
    )
    metrics_host: str = setting("127.0.0.1", "address of the metrics port", group=OBSERVABILITY)
    # TLS: PEM files, read and checked at start. Certificate and key together, or neither
    # (plaintext). A client CA file needs them too, and then every client must present a
    # certificate that one of its CAs signed (mTLS). Tokens still apply on top.
    tls_cert_file: str | None = setting(
        None, "PEM certificate (chain) of the server: serve TLS", group=SECURITY
    )
    tls_key_file: str | None = setting(
        None, "PEM private key of --tls-cert-file (unencrypted)", group=SECURITY
    )
    tls_client_ca_file: str | None = setting(
        None,
        "PEM CA certificates: require client certificates they signed (mTLS)",
        group=SECURITY,
    )

    def __post_init__(self) -> None:
        self._check_endpoints()
        self._check_limits()
        self._check_durations()

    def _check_endpoints(self) -> None:
        """Ports, tokens, TLS files and the niceness."""
        if not 0 <= self.port <= 65535:
            raise ValueError("port: must be in [0, 65535]")
        for name in ("metrics_port", "openai_port"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: must be in [0, 65535]")
        for name in ("api_token", "admin_token", *TLS_FILES):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty when set")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file: give both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file: needs tls_cert_file and tls_key_file")
        if not 0 <= self.service_niceness <= 19:
            raise ValueError("service_niceness: must be in [0, 19]")

    def _check_limits(self) -> None:
        """Counts and sizes: each at least 1 (when set), the message size at least its floor."""
        for name in AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        for name in AT_LEAST_ONE_WHEN_SET:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1 when set")
        for name in ("chat_template", "served_model_name"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty when set")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes: must be at least {MIN_MESSAGE_BYTES}")

    def _check_durations(self) -> None:
        """Timeouts and intervals: positive, or not negative; the liveness ones above the
        engine's heartbeat interval."""
        for name in POSITIVE_DURATIONS:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0")
        for name in NON_NEGATIVE_DURATIONS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0")
        for name in ("heartbeat_timeout", "stall_timeout"):
            if not getattr(self, name) > HEARTBEAT_INTERVAL_S:
                raise ValueError(
                    f"{name}: must exceed the engine's heartbeat interval ({HEARTBEAT_INTERVAL_S} s)"
                )

    @property
    def generate_streams_per_connection(self) -> int:
        """--max-generate-streams-per-connection, or its default: half of --max-concurrent-rpcs."""
        if self.max_generate_streams_per_connection is not None:
            return self.max_generate_streams_per_connection
        return max(1, self.max_concurrent_rpcs // 2)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def tls_mode(self) -> str:
        """ "off" (plaintext), "tls", or "mtls" (client certificates required)."""
        if self.tls_cert_file is None:
            return "off"
        return "tls" if self.tls_client_ca_file is None else "mtls"
