"""The soak's load generator: one process of mixed Generation traffic, every event checked.

`traffic_main` runs in a process of its own (multiprocessing spawn) until `plan.stop_at`, with
`plan.concurrency` requests in flight, a random mix of: Generate with random lengths, n, sampling,
logprobs, stop strings, short deadlines, a client-side cancel of the call, or a Cancel RPC by id
from a second channel; GenerateStream with several starts and sometimes a `cancel_request_id`;
and greedy canaries whose token ids the driver compares with running alone. It puts one summary
dict on the result queue.

Every event of every request goes through a `RequestCheck`: exactly one `started` (index 0)
before any tokens, at most one `finished` per index, nothing after an index's `finished`. A call
still open `plan.lost_after` seconds after `stop_at` is lost. Times are `time.monotonic()`,
which on Linux is one clock for every process of the machine: the driver places canaries on
its update timeline with them.
"""

from __future__ import annotations

import asyncio
import random
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc
from sluice_client import AsyncClient, build_request

from bench.soak.checks import Record, RequestCheck

RETRY_PAUSE_S = 0.25  # after UNAVAILABLE (an engine restart): do not spin
STOP_STRINGS = ("e", "th", ". ", "o", "an", "!")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "sea", "calm", "ships")


@dataclass(frozen=True)
class TrafficPlan:
    """What one load-generator process sends, and until when (monotonic seconds)."""

    target: str
    client: int
    concurrency: int
    seed: int
    stop_at: float
    lost_after: float  # a call still open this long after stop_at is lost
    vocab_size: int
    canaries: tuple[tuple[int, ...], ...]  # greedy prompts (token ids)
    canary_tokens: int
    canary_share: float = 0.15


class Traffic:
    """One process's traffic: `concurrency` workers, each sending one request (or one
    GenerateStream) at a time until `stop_at`."""

    def __init__(self, plan: TrafficPlan) -> None:
        self.plan = plan
        self.records: list[Record] = []
        self._ids = 0
        self._tasks: set[asyncio.Task[None]] = set()  # Cancel RPCs in the background

    async def run(self) -> dict[str, Any]:
        plan = self.plan
        # NOTE: retry=False: the soak checks the server's own answers (a refusal during a restart
        # included); gRPC's retries would hide them.
        self.client, self.canceller = (
            AsyncClient(plan.target, retry=False),
            AsyncClient(plan.target),
        )
        async with self.client, self.canceller:
            workers = [
                asyncio.create_task(self._worker(random.Random(plan.seed * 1000 + w)))
                for w in range(plan.concurrency)
            ]
            bound = plan.stop_at + plan.lost_after - time.monotonic()
            done, pending = await asyncio.wait(workers, timeout=max(bound, 0.0))
            lost = [r for r in self.records if r.t1 is None]  # before cancelling them
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, *self._tasks, return_exceptions=True)
            for task in done:
                task.result()  # a bug in the load generator: surface it
        return self.summary(lost)

    def _next_id(self, kind: str) -> str:
        self._ids += 1
        return f"soak-{self.plan.client}-{kind}-{self._ids}"

    async def _worker(self, rng: random.Random) -> None:
        while time.monotonic() < self.plan.stop_at:
            roll = rng.random()
            if roll < self.plan.canary_share:
                records = await self._canary(rng)
            elif roll < 0.65:
                records = [await self._generate(rng)]
            else:
                records = await self._stream(rng)
            if any("UNAVAILABLE" in r.outcome for r in records):
                await asyncio.sleep(RETRY_PAUSE_S)

    # ---- request builders ----

    def _random_request(self, rng: random.Random, kind: str) -> tuple[Any, Record]:
        rid = self._next_id(kind)
        if rng.random() < 0.6:
            prompt: Any = [
                rng.randrange(2, self.plan.vocab_size) for _ in range(rng.randint(1, 48))
            ]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
        n = rng.choice((1, 1, 2))
        logprobs = rng.random() < 0.3
        request = build_request(
            prompt,
            request_id=rid,
            max_tokens=rng.choice((1, 2, 4, 8, 16, 32, 64)),
            temperature=rng.choice((0.0, 0.7, 1.0)),
            seed=rng.randrange(2**32) if rng.random() < 0.5 else None,
            stop=rng.sample(STOP_STRINGS, rng.randint(1, 2)) if rng.random() < 0.25 else (),
            ignore_eos=rng.random() < 0.5,
            logprobs=logprobs,
            top_logprobs=rng.randint(0, 5) if logprobs else 0,
            n=n,
        )
        record = Record(rid, kind, RequestCheck(rid, n, logprobs))
        self.records.append(record)
        return request, record

    def _canary_request(self, rng: random.Random) -> tuple[Any, Record]:
        rid = self._next_id("canary")
        which = rng.randrange(len(self.plan.canaries))
        n = rng.choice((1, 2))
        request = build_request(
            list(self.plan.canaries[which]),
            request_id=rid,
            max_tokens=self.plan.canary_tokens,
            temperature=0.0,
            ignore_eos=True,
            n=n,
        )
        record = Record(rid, "canary", RequestCheck(rid, n), canary=which)
        self.records.append(record)
        return request, record

    # ---- the three kinds of traffic ----

    async def _generate(self, rng: random.Random) -> Record:
        request, record = self._random_request(rng, "generate")
        roll = rng.random()
        timeout = rng.uniform(0.05, 1.0) if roll < 0.15 else None
        cancel_after = rng.uniform(0.0, 0.5) if 0.15 <= roll < 0.27 else None
        if 0.27 <= roll < 0.39:
            self._spawn(self._cancel_rpc(record, rng.uniform(0.0, 0.5)))
        await self._call(request, record, timeout, cancel_after)
        return record

    async def _canary(self, rng: random.Random) -> list[Record]:
        if rng.random() < 0.7:
            request, record = self._canary_request(rng)
            await self._call(request, record, None, None)
            return [record]
        return await self._stream(rng, canary=True)

    async def _call(
        self, request: Any, record: Record, timeout: float | None, cancel_after: float | None
    ) -> None:
        """One Generate call read to its end, or cancelled by us after `cancel_after` s."""
        call = self.client.stub.Generate(request, timeout=timeout)

        async def read() -> None:
            async for event in call:
                record.check.add(event)
                if record.check.done:
                    record.end()

        reader = asyncio.ensure_future(read())
        try:
            if cancel_after is not None:
                await asyncio.wait({reader}, timeout=cancel_after)
                if not reader.done():
                    record.client_cancelled = True
                    call.cancel()
            await asyncio.wait({reader})
        finally:
            reader.cancel()  # only matters when this worker is cancelled (a lost call)
        if reader.cancelled():
            record.end("CANCELLED")
        elif isinstance(error := reader.exception(), grpc.aio.AioRpcError):
            record.end(error.code().name)
        elif error is not None:
            raise error
        else:
            record.end("OK")

    async def _stream(self, rng: random.Random, canary: bool = False) -> list[Record]:
        """One GenerateStream: 2-4 starts a few ms apart, sometimes one cancel_request_id."""
        starts = [
            self._canary_request(rng) if canary else self._random_request(rng, "stream")
            for _ in range(rng.randint(2, 4))
        ]
        by_id = {record.request_id: record for _, record in starts}
        unknown: Counter[str] = Counter()
        stream = self.client.stream(timeout=rng.uniform(0.2, 2.0) if rng.random() < 0.1 else None)

        async def read() -> None:
            async for event in stream.call:
                record = by_id.get(event.request_id)
                if record is None:
                    unknown["unknown_request_id"] += 1
                    continue
                record.check.add(event)
                if record.check.done:
                    record.end()

        reader = asyncio.ensure_future(read())
        try:
            for request, record in starts:
                record.t0 = time.monotonic()
                await stream.start(request)
                await asyncio.sleep(rng.uniform(0.0, 0.02))
            if not canary and rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                target = rng.choice(starts)[1]
                target.cancel = "stream"
                await stream.cancel(target.request_id)
            await stream.done_sending()
            await asyncio.wait({reader})
        finally:
            reader.cancel()
        if reader.cancelled():
            status = "CANCELLED"
        elif isinstance(error := reader.exception(), grpc.aio.AioRpcError):
            status = error.code().name
        elif error is not None:
            raise error
        else:
            status = "OK"
        records = [record for _, record in starts]
        for record in records:
            record.end(status)
        if unknown:
            records[0].check.violations.update(unknown)
        return records

    async def _cancel_rpc(self, record: Record, delay: float) -> None:
        """Cancel `record` by id over the second channel after `delay` s."""
        await asyncio.sleep(delay)
        try:
            reply = await self.canceller.cancel([record.request_id])
            record.cancel = "cancelled" if record.request_id in reply.cancelled else "not_found"
        except grpc.aio.AioRpcError as exc:
            record.cancel = f"error.{exc.code().name}"

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the summary sent back ----

    def summary(self, lost: list[Record]) -> dict[str, Any]:
        outcomes: Counter[str] = Counter()
        by_kind: Counter[str] = Counter()
        violations: Counter[str] = Counter()
        cancels: Counter[str] = Counter()
        examples: list[dict[str, Any]] = []
        canaries = []
        for record in self.records:
            outcome = "lost" if record in lost else record.outcome
            outcomes[outcome] += 1
            by_kind[f"{record.kind}.{outcome}"] += 1
            violations.update(record.check.violations)
            if record.cancel is not None:
                cancels[f"{record.cancel}->{outcome}"] += 1
            if (record.check.violations or outcome in ("lost", "missing_finished")) and len(
                examples
            ) < 10:
                examples.append(record.describe())
            if record.canary is not None and record.check.done:
                canaries.append(
                    {
                        "canary": record.canary,
                        "t0": record.t0,
                        "t1": record.t1,
                        "reasons": record.check.reasons,
                        "token_ids": record.check.token_ids,
                        "versions": record.check.versions,
                    }
                )
        return {
            "client": self.plan.client,
            "requests": len(self.records),
            "outcomes": dict(outcomes),
            "by_kind": dict(by_kind),
            "violations": dict(violations),
            "cancels": dict(cancels),
            "lost": len(lost),
            "examples": examples,
            "canaries": canaries,
        }


def traffic_main(plan: TrafficPlan, results: Any) -> None:
    """Process entry point: run the plan, put the summary (or the traceback) on `results`."""
    try:
        summary = asyncio.run(Traffic(plan).run())
    except BaseException:
        results.put({"client": plan.client, "error": traceback.format_exc()})
        raise
    results.put(summary)
