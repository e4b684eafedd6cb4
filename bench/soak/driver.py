"""The soak's driver: what the benchmark does to the server while the traffic runs (weight
updates, engine kills, RSS samples, a watch on the served policy version) and what it saw."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import log
from bench.soak.server import ADMIN_TOKEN, Server, parent_pid, rss_mb

INFLIGHT = ("drain", "continue", "recompute", "abort")  # update k uses INFLIGHT[k % 4]
CANARIES = ((0, 17, 42, 99, 123, 7), (0, 5, 6, 7, 8, 9, 10, 11), (0, 200, 3, 77), (0, 64, 65))
CANARY_TOKENS = 16
RSS_EVERY_S = 10.0
DRAIN_TIMEOUT_MS = 20_000


def read_checkpoint_tensors(directory: Path) -> dict[str, tuple[str, list[int], memoryview]]:
    """Every tensor of a checkpoint's safetensors files, for an inline update."""
    from sluice_client import read_safetensors

    tensors: dict[str, tuple[str, list[int], memoryview]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(read_safetensors(path))
    return tensors


@dataclass(frozen=True)
class Served:
    """Weights the driver applied: `version` serves `weights` from an update that began at
    `begin` and returned Applied at `end` (monotonic s)."""

    version: int
    weights: str  # "A" | "B"
    begin: float
    end: float


@dataclass
class Driver:
    """Everything this process does to the server during the soak, and what it saw."""

    server: Server
    checkpoints: dict[str, Path]
    args: argparse.Namespace
    start: float = field(default_factory=time.monotonic)  # reset when the traffic starts
    served: list[Served] = field(default_factory=list)
    busy: list[tuple[float, float]] = field(default_factory=list)  # every update's interval
    updates: list[dict[str, Any]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    rss: list[dict[str, Any]] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)
    regressions: list[dict[str, Any]] = field(default_factory=list)
    transient_versions: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        from sluice_client import Client

        self.admin = Client(self.server.target, admin_token=ADMIN_TOKEN)
        self._tensors = {w: read_checkpoint_tensors(p) for w, p in self.checkpoints.items()}

    def at(self) -> float:
        return round(time.monotonic() - self.start, 2)

    # ---- health and greedy runs alone ----

    async def wait_serving(self, timeout: float, not_pid: int | None = None) -> float | None:
        """Seconds until health says SERVING (and the engine pid is not `not_pid`); None if
        that did not happen within `timeout`."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        begin = time.monotonic()
        async with grpc.aio.insecure_channel(self.server.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() - begin < timeout:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and (not_pid is None or self.server.engine_pid() != not_pid):
                        return time.monotonic() - begin
                await asyncio.sleep(0.05)
        return None

    async def greedy_alone(self, client: Any) -> tuple[list[list[int]], set[int], set[str]]:
        """Each canary prompt alone, one after another: the token ids, the versions their
        chunks report, and the finish reasons (LENGTH unless something failed)."""
        from sluice_client import build_request

        ids, versions, reasons = [], set(), set()
        for prompt in CANARIES:
            request = build_request(
                list(prompt), max_tokens=CANARY_TOKENS, temperature=0.0, ignore_eos=True
            )
            completion = await client.complete(request, timeout=60)
            ids.append(completion.token_ids)
            versions.update(completion.policy_versions)
            reasons.add(completion.reason)
        return ids, versions, reasons

    async def expectations(self, client: Any) -> dict[str, list[list[int]]]:
        """Greedy canaries alone on A (served at start), then on B (a checkpoint update)."""
        info = await client.info()
        self.served.append(Served(info.policy_version, "A", -math.inf, -math.inf))
        expected_a, _, reasons_a = await self.greedy_alone(client)
        record = await self.update(-1, "B", "checkpoint", "drain")
        if record["outcome"] != "applied":
            raise RuntimeError(f"the setup update to B failed: {record}")
        expected_b, _, reasons_b = await self.greedy_alone(client)
        if reasons_a | reasons_b != {"LENGTH"}:
            raise RuntimeError(f"canaries alone ended {reasons_a | reasons_b}, not LENGTH")
        return {"A": expected_a, "B": expected_b}

    # ---- updates, kills, samples ----

    async def update(self, k: int, weights: str, source: str, inflight: str) -> dict[str, Any]:
        import grpc

        at = "setup" if k < 0 else self.at()
        record: dict[str, Any] = {"k": k, "at_s": at, "weights": weights}
        record |= {"source": source, "inflight": inflight}
        begin = time.monotonic()
        try:
            applied = await asyncio.to_thread(self._update, weights, source, inflight)
        except grpc.RpcError as exc:
            record |= {"outcome": exc.code().name, "message": exc.details()}
        else:
            record |= {
                "outcome": "applied",
                "previous_version": applied.previous_version,
                "policy_version": applied.policy_version,
                "aborted": applied.aborted,
                "continued": applied.continued,
                "recomputed": applied.recomputed,
            }
            self.served.append(Served(applied.policy_version, weights, begin, time.monotonic()))
        end = time.monotonic()
        self.busy.append((begin, end))
        record["seconds"] = round(end - begin, 2)
        self.updates.append(record)
        log(f"update {k}: {weights} by {source} ({inflight}): {record['outcome']}")
        return record

    def _update(self, weights: str, source: str, inflight: str) -> Any:
        drain = DRAIN_TIMEOUT_MS if inflight == "drain" else None
        options: dict[str, Any] = {"inflight": inflight, "drain_timeout_ms": drain, "timeout": 120}
        if source == "checkpoint":
            return self.admin.update_weights(str(self.checkpoints[weights]), **options)
        return self.admin.update_weights_inline(self._tensors[weights], **options)

    async def kill_engine(self) -> None:
        pid = self.server.engine_pid()
        record: dict[str, Any] = {"at_s": self.at(), "pid": pid}
        # NOTE: only ever the engine this benchmark's server spawned.
        if pid is None or parent_pid(pid) != self.server.pid:
            record["skipped"] = "no engine process of the server found"
            self.kills.append(record)
            return
        os.kill(pid, signal.SIGKILL)
        seconds = await self.wait_serving(120.0, not_pid=pid)
        record |= {"serving_again_s": None if seconds is None else round(seconds, 2)}
        record["new_pid"] = self.server.engine_pid()
        self.kills.append(record)
        log(f"kill -9 engine {pid}: SERVING again after {record['serving_again_s']} s")

    async def schedule(self, duration: float) -> None:
        """Updates every --update-every s (first at a third of it), kills every --kill-every s
        (each a sixth of it early); a run shorter than a period gets one of each anyway."""
        events: list[tuple[float, str]] = []
        every_u, every_k = self.args.update_every, self.args.kill_every
        events += [(every_u * (k + 1 / 3), "update") for k in range(int(duration / every_u) + 1)]
        events += [(every_k * (k + 5 / 6), "kill") for k in range(int(duration / every_k) + 1)]
        events = [e for e in events if e[0] < duration]
        if not any(kind == "update" for _, kind in events):
            events.append((duration / 3, "update"))
        if not any(kind == "kill" for _, kind in events):
            events.append((duration * 2 / 3, "kill"))
        tasks: list[asyncio.Task[Any]] = []
        k = 0
        for when, kind in sorted(events):
            await asyncio.sleep(max(0.0, self.start + when - time.monotonic()))
            if kind == "kill":
                tasks.append(asyncio.create_task(self.kill_engine()))
                continue
            # A and B alternate (B is served now). Sources run checkpoint, inline, inline,
            # checkpoint, ...: each source follows each (a restart after a checkpoint update
            # then an inline one replays both).
            weights = "AB"[k % 2]
            source = ("checkpoint", "inline")[(k // 2 + k) % 2]
            tasks.append(asyncio.create_task(self.update(k, weights, source, INFLIGHT[k % 4])))
            k += 1
        await asyncio.gather(*tasks)

    async def sample_rss(self, until: float) -> None:
        n = 0
        while (when := self.start + n * RSS_EVERY_S) <= until:
            await asyncio.sleep(max(0.0, when - time.monotonic()))
            self.sample_rss_once()
            n += 1

    def sample_rss_once(self) -> None:
        engine = self.server.engine_pid()
        self.rss.append(
            {
                "t_s": self.at(),
                "server_mb": rss_mb(self.server.pid),
                "engine_mb": rss_mb(engine),
                "engine_pid": engine,
            }
        )

    async def watch_versions(self, client: Any, until: float) -> None:
        """GetServerInfo once a second: the policy version must not go backwards while the
        server says SERVING (during a restart the new engine reports its start-up version
        until the replay finishes; those are recorded apart)."""
        import grpc
        from sluice_client import pb

        highest: int | None = None
        while time.monotonic() < until:
            try:
                info = await client.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=2)
            except grpc.aio.AioRpcError as exc:
                self.states[f"error.{exc.code().name}"] += 1
            else:
                state = pb.ServingState.Name(info.state).removeprefix("SERVING_STATE_")
                self.states[state] += 1
                version = info.policy_version
                if highest is not None and version < highest:
                    entry = {"at_s": self.at(), "from": highest, "to": version, "state": state}
                    if state in ("SERVING", "UPDATING_WEIGHTS"):
                        self.regressions.append(entry)
                        highest = version  # report each step down once
                    else:
                        self.transient_versions.append(entry)
                        version = highest
                highest = version if highest is None else max(highest, version)
            await asyncio.sleep(1.0)

    # ---- after the traffic ----

    async def final_canaries(
        self, client: Any, expected: dict[str, list[list[int]]]
    ) -> dict[str, Any]:
        """The canaries alone once more: they must show the weights and version applied last."""
        import grpc

        last = self.served[-1]
        final: dict[str, Any] = {"weights": last.weights, "expected_version": last.version}
        try:
            ids, versions, reasons = await self.greedy_alone(client)
        except grpc.aio.AioRpcError as exc:
            return final | {"error": f"{exc.code().name}: {exc.details()}"}
        mismatches = sum(a != b for a, b in zip(ids, expected[last.weights], strict=True))
        return final | {
            "versions": sorted(versions),
            "reasons": sorted(reasons),
            "mismatches": mismatches,
        }

    async def idle_pages(self, client: Any, timeout: float = 30.0) -> dict[str, Any]:
        """KV pages in use once nothing runs or waits (total - free - cached)."""
        from sluice_client import pb

        deadline = time.monotonic() + timeout
        while True:
            info = await client.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            kv = info.kv_cache
            in_use = kv.total_pages - kv.free_pages - kv.cached_pages
            idle = info.running == 0 and info.waiting == 0
            if (idle and in_use == 0) or time.monotonic() > deadline:
                return {
                    "pages_in_use": in_use,
                    "total_pages": kv.total_pages,
                    "free_pages": kv.free_pages,
                    "cached_pages": kv.cached_pages,
                    "running": info.running,
                    "waiting": info.waiting,
                    "policy_version": info.policy_version,
                }
            await asyncio.sleep(0.5)
