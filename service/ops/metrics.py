"""Metrics: the Prometheus metrics of one server, in a registry of its own.

Each server owns a `CollectorRegistry` (not prometheus_client's global one), so several servers
can run in one process. The service reports into it at a few points, none per token:
- per StepOutput or Heartbeat: the engine's cumulative counters (`engine_stats`), as deltas;
- per request: its prompt when it starts, its timings and lengths when the engine ends it, its
  finish reason when its `finished` event is made (one per index); with a LoRA adapter, the
  adapter's request when it is submitted and its generated tokens when it ends;
- per weight update, per engine restart and per gRPC call, when it ends.
Gauges are read when the page is scraped (`watch`), so they cost nothing in between.

docs/metrics.md describes every metric; keep the two in step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from engine.protocol.messages import EngineStats, RequestOutput

# Request latencies: from a few milliseconds (a cached short prompt) to minutes (long outputs
# behind a deep queue).
LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
    640.0,
)  # fmt: skip
# The gap between two tokens of one request: about one engine step.
INTER_TOKEN_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000,
    200_000, 500_000, 1_000_000,
)  # fmt: skip
WEIGHT_UPDATE_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

SERVING_STATES = ("starting", "serving", "updating_weights", "restarting", "draining", "sleeping")
UNKNOWN_METHOD = "unknown"  # the method label of calls to a method the server does not have


@dataclass(frozen=True)
class Gauges:
    """What the gauges show, read at scrape time."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of KV pages held by requests
    policy_version: int
    serving_state: str  # one of SERVING_STATES
    engine_up: bool
    max_loras: int = 0  # adapter slots (--max-loras); 0: LoRA is off
    running_adapters: tuple[str, ...] = ()  # adapters of running requests
    waiting_adapters: tuple[str, ...] = ()  # adapters of waiting requests


class Metrics:
    def __init__(self, speculative_method: str = "off") -> None:
        """`speculative_method`: the server's --speculative-method, the label of the
        speculative-decoding counters."""
        self.registry = CollectorRegistry()
        self._declare_token_counters(self.registry)
        self._declare_speculative_counters(self.registry, speculative_method)
        self._declare_event_counters(self.registry)
        self._declare_histograms(self.registry)
        self._engine_totals = EngineStats()  # the current engine's counters, as last reported

    def _declare_token_counters(self, r: CollectorRegistry) -> None:
        """Requests and tokens, as the engine reports them."""
        self.requests_finished = Counter(
            "sluice_requests_finished",
            "Completions (one per index of a request) that ended, by finish reason.",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens", "Prompt tokens of requests the engine started on.", registry=r
        )
        self.prefill_tokens = Counter(
            "sluice_prefill_tokens",
            "Prompt tokens run through the model (prefix-cache hits are not computed).",
            registry=r,
        )
        self.generation_tokens = Counter(
            "sluice_generation_tokens", "Tokens sampled by the engine.", registry=r
        )
        self.prefix_cache_queried_tokens = Counter(
            "sluice_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_cache_hit_tokens = Counter(
            "sluice_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.preemptions = Counter(
            "sluice_preemptions",
            "Running requests preempted for lack of KV pages (recomputed later).",
            registry=r,
        )

    def _declare_speculative_counters(self, r: CollectorRegistry, method: str) -> None:
        """Speculative decoding's proposals and acceptances, labelled with the one configured
        method: its series exist from the start (at 0), also with "off"."""
        self.spec_proposed_tokens = Counter(
            "sluice_spec_proposed_tokens",
            "Tokens proposed by speculative decoding and verified by the model, by method.",
            ["method"],
            registry=r,
        ).labels(method)
        self.spec_accepted_tokens = Counter(
            "sluice_spec_accepted_tokens",
            "Proposed tokens the model accepted (each one a token without a forward pass of "
            "its own), by method.",
            ["method"],
            registry=r,
        ).labels(method)

    def _declare_event_counters(self, r: CollectorRegistry) -> None:
        """The service's events: restarts, weight updates, adapters, gRPC calls."""
        self.engine_restarts = Counter(
            "sluice_engine_restarts",
            "Engines started to replace a lost one, that came up and serve.",
            registry=r,
        )
        self.weight_updates = Counter(
            "sluice_weight_updates",
            "UpdateWeights calls by outcome: applied, failed (by the engine), refused (before "
            "the engine saw it).",
            ["outcome"],
            registry=r,
        )
        self.weight_replays_refused = Counter(
            "sluice_weight_replays_refused",
            "Restarts that refused to replay the last checkpoint update: its directory "
            "changed since it was applied (the server stays NOT_SERVING and retries).",
            registry=r,
        )
        self.adapters_quarantined = Counter(
            "sluice_adapters_quarantined",
            "LoRA adapter loads dropped from the replay because the engine was lost while "
            "replaying them (never re-applied: no crash loop).",
            registry=r,
        )
        self.grpc_calls = Counter(
            "sluice_grpc_calls",
            "gRPC calls that ended, by method and status code.",
            ["method", "code"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "sluice_adapter_requests",
            "Requests admitted with a LoRA adapter, by adapter name (base-model requests are "
            "not counted here).",
            ["adapter"],
            registry=r,
        )
        self.adapter_generation_tokens = Counter(
            "sluice_adapter_generation_tokens",
            "Tokens generated for requests with a LoRA adapter, by adapter name, counted when "
            "each request ends.",
            ["adapter"],
            registry=r,
        )

    def _declare_histograms(self, r: CollectorRegistry) -> None:
        """Latencies and lengths, one observation per request (or per update)."""
        self.time_to_first_token = Histogram(
            "sluice_time_to_first_token_seconds",
            "From a request's arrival in the engine to its first sampled token.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "sluice_inter_token_latency_seconds",
            "Mean gap between consecutive tokens of a request (one observation per request "
            "with at least two tokens).",
            buckets=INTER_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.request_time = Histogram(
            "sluice_request_duration_seconds",
            "From a request's arrival in the engine to its end there.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_time = Histogram(
            "sluice_request_queue_time_seconds",
            "From a request's arrival in the engine until it was first scheduled (or ended).",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_length = Histogram(
            "sluice_request_prompt_tokens",
            "Prompt length of the requests the engine started, in tokens.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_length = Histogram(
            "sluice_request_generation_tokens",
            "Tokens generated for a request (per index) by the time the engine ended it.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.weight_update_time = Histogram(
            "sluice_weight_update_duration_seconds",
            "From handing an update to the engine until it was applied or failed.",
            buckets=WEIGHT_UPDATE_BUCKETS_S,
            registry=r,
        )

    # ---- the engine ----

    def engine_started(self) -> None:
        """A new engine process: its cumulative counters start again from zero."""
        self._engine_totals = EngineStats()

    def engine_stats(self, stats: EngineStats) -> None:
        """Add what the current engine counted since its last report (StepOutput, Heartbeat)."""
        last, self._engine_totals = self._engine_totals, stats
        for counter, now, before in (
            (self.prefill_tokens, stats.prompt_tokens_computed, last.prompt_tokens_computed),
            (self.generation_tokens, stats.tokens_generated, last.tokens_generated),
            (
                self.prefix_cache_queried_tokens,
                stats.prefix_cache_queries,
                last.prefix_cache_queries,
            ),
            (self.prefix_cache_hit_tokens, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions, stats.preemptions, last.preemptions),
            (self.spec_proposed_tokens, stats.spec_proposed_tokens, last.spec_proposed_tokens),
            (self.spec_accepted_tokens, stats.spec_accepted_tokens, last.spec_accepted_tokens),
        ):
            if now > before:
                counter.inc(now - before)

    def engine_restarted(self) -> None:
        self.engine_restarts.inc()

    # ---- requests ----

    def request_started(self, prompt_tokens: int) -> None:
        """The engine's first output for a request (any index)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_length.observe(prompt_tokens)

    def request_ended(self, output: RequestOutput) -> None:
        """The engine's final output for one index, with its timings (`output.metrics`)."""
        timings = output.metrics
        assert timings is not None and output.finished
        tokens = output.completion_tokens
        self.queue_time.observe(timings.queue_time)
        self.request_time.observe(timings.time_to_first_token + timings.decode_time)
        self.output_length.observe(tokens)
        if tokens:  # with none, the engine's "first token" time is its end
            self.time_to_first_token.observe(timings.time_to_first_token)
        if tokens >= 2:
            self.inter_token_latency.observe(timings.decode_time / (tokens - 1))

    def completion_finished(self, reason: str) -> None:
        """A `finished` event was made for one index, or its caller left (CANCELLED,
        DEADLINE_EXCEEDED)."""
        self.requests_finished.labels(reason).inc()

    def adapter_request(self, adapter: str) -> None:
        """A request naming a LoRA adapter was handed to the engine."""
        self.adapter_requests.labels(adapter).inc()

    def adapter_tokens(self, adapter: str, tokens: int) -> None:
        """A request naming a LoRA adapter ended with `tokens` generated (all its samples)."""
        self.adapter_generation_tokens.labels(adapter).inc(tokens)

    # ---- weight updates and calls ----

    def weight_update_ended(self, outcome: str, seconds: float | None = None) -> None:
        self.weight_updates.labels(outcome).inc()
        if seconds is not None:
            self.weight_update_time.observe(seconds)

    def weight_replay_refused(self) -> None:
        self.weight_replays_refused.inc()

    def adapter_quarantined(self) -> None:
        self.adapters_quarantined.inc()

    def grpc_call_ended(self, method: str, code: str) -> None:
        self.grpc_calls.labels(method, code).inc()

    # ---- gauges ----

    def watch(self, read: Callable[[], Gauges]) -> None:
        """Show `read()` as the gauges; called on the scraping thread at every scrape.

        NOTE: `read` runs off the event loop: it may only read attributes (each read is
        atomic), never call into asyncio or mutate anything."""
        self.registry.register(_GaugeCollector(read))


class _GaugeCollector:
    def __init__(self, read: Callable[[], Gauges]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        g = self._read()
        yield _gauge("sluice_requests_running", "Requests the engine is running.", g.running)
        yield _gauge(
            "sluice_requests_waiting", "Requests waiting in the engine's queue.", g.waiting
        )
        yield _gauge(
            "sluice_kv_cache_usage_ratio",
            "Fraction of KV cache pages held by requests (pages the prefix cache keeps "
            "unreferenced are free to reclaim and not counted).",
            g.kv_cache_usage,
        )
        yield _gauge(
            "sluice_policy_version", "Policy version of the served weights.", g.policy_version
        )
        yield _gauge("sluice_engine_up", "1 while an engine is ready and serving.", g.engine_up)
        state = GaugeMetricFamily(
            "sluice_serving_state",
            "1 for the server's serving state (as GetServerInfo reports it), 0 for the others.",
            labels=["state"],
        )
        for name in SERVING_STATES:
            state.add_metric([name], float(name == g.serving_state))
        yield state
        if g.max_loras:
            yield _lora_requests_info(g)


def _lora_requests_info(g: Gauges) -> GaugeMetricFamily:
    """vLLM's `lora_requests_info` shape, which routers (llm-d's inference scheduler) read: one
    series whose labels name the running and waiting requests' adapters (comma-separated) and
    the adapter slots; its value is when it was read (a router keeps the newest series)."""
    info = GaugeMetricFamily(
        "sluice_lora_requests_info",
        "LoRA adapters of the running and waiting requests (labels, comma-separated) and the "
        "adapter slots; the value is the Unix time it was read.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    labels = [",".join(g.running_adapters), ",".join(g.waiting_adapters), str(g.max_loras)]
    info.add_metric(labels, time.time())
    return info


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))
