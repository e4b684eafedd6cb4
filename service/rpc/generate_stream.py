"""GenerateStreamCall: many requests multiplexed over one GenerateStream call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from sluice.v1 import generation_pb2 as pb

from service.engine_link.buffer_meter import BufferMeter
from service.rpc.refusal import Refusal

log = structlog.get_logger("sluice.servicer")

# After the request stream fails: how long the engine may take to confirm the aborts of the
# stream's requests before the service ends them itself.
FINALS_TIMEOUT = 5.0


@dataclass(frozen=True)
class StreamLimits:
    """What one call may hold: `max_requests` requests in flight (admitted, their last event
    not yet written; unsent refusals count too), `max_buffer_bytes` of outputs not yet taken
    (BufferMeter), and `idle_timeout` seconds with nothing in flight and no message read."""

    max_requests: int
    max_buffer_bytes: int
    idle_timeout: float


@dataclass(frozen=True)
class Admitted:
    """A request handed to the engine, and the events it will produce."""

    request_id: str
    n: int
    prompt_tokens: int
    events: AsyncGenerator[pb.GenerateResponse, None]


_Event = tuple[pb.GenerateResponse, "_Pump | None"]  # None: a refusal, nobody waits
Start = Callable[[pb.GenerateRequest], Awaitable[Admitted]]  # raises Refusal
Cancel = Callable[[list[str]], object]  # aborts requests in the engine (reason CANCELLED)


@dataclass
class _Pump:
    """What one admitted request still owes the caller."""

    request_id: str
    prompt_tokens: int
    unfinished: set[int]
    started: bool = False
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # its last event is written


class GenerateStreamCall:
    """Reads `start` and `cancel_request_id` messages, runs each admitted request in a task of
    its own (a pump), and merges their events into one stream. A refused start yields one
    `refused` event (with its index among the stream's starts), never a `finished`; so does a
    start whose admission fails with an unexpected error (INTERNAL): it alone is refused.

    Every admitted request gets exactly one `finished` per index, however the stream ends. When
    reading the request stream fails (a message that does not parse, or a bug), no more starts
    are read; every request still running is cancelled in the engine and its `finished`
    (reason CANCELLED) delivered; if the engine has not confirmed within FINALS_TIMEOUT, the
    service sends those `finished` events itself (without usage). Then `failure` holds the
    status the call must end with (INVALID_ARGUMENT for an undecodable message, INTERNAL for a
    bug); it stays None when the caller closed its side and every request finished.

    Flow control (`limits`): with `max_requests` in flight, the next start is not read (the
    caller's sends back up) until one ends. A caller that does not read makes its requests'
    outputs pile up in their Inboxes: past `max_buffer_bytes` every request is cancelled and
    the call fails as above, with RESOURCE_EXHAUSTED. A call with nothing in flight that reads
    no message for `idle_timeout` seconds ends ABORTED.
    """

    def __init__(self, start: Start, cancel: Cancel, limits: StreamLimits) -> None:
        self.start = start
        self.cancel = cancel
        self.limits = limits
        self.failure: Refusal | None = None
        # The Inboxes of this call's requests count what they hold here (servicer sets it).
        self.meter = BufferMeter(limits.max_buffer_bytes, self._over_budget)
        # Events to send (with the pump that waits for each), and finished tasks (the reader's
        # and the pumps') to collect.
        self._events: asyncio.Queue[_Event | asyncio.Task[None]] = asyncio.Queue()
        self._pumps: dict[asyncio.Task[None], _Pump] = {}
        self._unsent_refusals = 0
        self._room = asyncio.Event()  # set when a request ends or a refusal is written
        self._admitting = False  # the reader is in `start`: a request may be on its way
        self._active_at = 0.0  # loop time of the last message read or request ended
        self._reader: asyncio.Task[None] | None = None
        self._task: asyncio.Task[Any] | None = None  # grpc.aio's, iterating `run`
        self._abandon_timer: asyncio.TimerHandle | None = None
        self._overflow: Refusal | None = None
        self._was_full = False

    async def run(
        self, requests: AsyncIterator[pb.GenerateStreamRequest]
    ) -> AsyncIterator[pb.GenerateResponse]:
        loop = asyncio.get_running_loop()
        self._active_at = loop.time()
        self._task = asyncio.current_task()
        reader = self._reader = asyncio.create_task(self._read(requests))
        reader.add_done_callback(self._events.put_nowait)  # collected below, like a pump
        reading, give_up_at = True, None
        try:
            while reading or self._pumps:
                if give_up_at is not None:
                    try:
                        timeout = max(0.0, give_up_at - loop.time())
                        item = await asyncio.wait_for(self._events.get(), timeout)
                    except TimeoutError:
                        for event in self._end_unconfirmed():
                            yield event
                        return
                elif self._pumps:
                    item = await self._events.get()  # (no wait_for: one frame less per event)
                else:
                    try:
                        timeout = max(0.0, self._active_at + self.limits.idle_timeout - loop.time())
                        item = await asyncio.wait_for(self._events.get(), timeout)
                    except TimeoutError:
                        if not self._pumps and not self._admitting:
                            self.failure = self._idle_refusal()
                            return
                        self._active_at = loop.time()  # a request is on its way: not idle
                        continue
                if isinstance(item, tuple):
                    event, pump = item
                    yield event  # grpc.aio resumes this generator once the event is written
                    if pump is not None:
                        pump.sent.set()
                    else:
                        self._unsent_refusals -= 1
                        self._room.set()
                elif item is reader:  # it ended, or (again) the call went over its budget
                    reading = False
                    if self.failure is None and give_up_at is None:
                        self.failure = self._overflow or _failure(reader)
                    if self.failure is not None and give_up_at is None:
                        self.cancel([pump.request_id for pump in self._pumps.values()])
                        give_up_at = loop.time() + FINALS_TIMEOUT
                else:
                    del self._pumps[item]
                    self._active_at = loop.time()
                    self._room.set()
                    item.result()  # a failed pump is a bug: surface it
        finally:
            if self._abandon_timer is not None:
                self._abandon_timer.cancel()
            # Client gone, the engine too slow, or a bug: cancelling a pump aborts its request.
            tasks = {reader, *self._pumps}
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0)

    async def _read(self, requests: AsyncIterator[pb.GenerateStreamRequest]) -> None:
        loop = asyncio.get_running_loop()
        starts = 0
        async for message in requests:
            self._active_at = loop.time()
            match message.WhichOneof("action"):
                case "start":
                    # NOTE: the flow control of the request side: while this waits, nothing
                    # more is read, and HTTP/2 stops the caller's sends once its window fills.
                    await self._wait_for_room()
                    start_index, starts = starts, starts + 1
                    # The request's log lines carry its id: its refusal here, and (the pump's
                    # task copies this context) every line of its run. `start` rebinds it when
                    # the server assigns the id.
                    with structlog.contextvars.bound_contextvars(
                        request_id=message.start.request_id
                    ):
                        await self._start(message.start, start_index)
                    self._active_at = loop.time()
                case "cancel_request_id":
                    self.cancel([message.cancel_request_id])

    async def _wait_for_room(self) -> None:
        """Until the call is below `max_requests`. Logged the first time only: a busy stream
        fed faster than its requests end waits before most of its starts."""
        while len(self._pumps) + self._unsent_refusals >= self.limits.max_requests:
            if not self._was_full:
                self._was_full = True
                log.info(
                    "stream.full",
                    in_flight=len(self._pumps),
                    unsent_refusals=self._unsent_refusals,
                    limit=self.limits.max_requests,
                )
            self._room.clear()
            await self._room.wait()

    def _idle_refusal(self) -> Refusal:
        timeout = self.limits.idle_timeout
        log.info("stream.idle", idle_timeout=timeout)
        return Refusal(
            grpc.StatusCode.ABORTED,
            f"the stream was idle: no request in flight and no message for {timeout:g} s "
            "(--stream-idle-timeout)",
        )

    def _over_budget(self) -> None:
        """The meter passed its budget (on the router's path: no await). Cancel every request
        and stop reading; `run` then ends the call as after a failed reader."""
        budget = self.limits.max_buffer_bytes
        log.warning(
            "stream.not_reading",
            held_bytes=self.meter.held,
            budget_bytes=budget,
            in_flight=len(self._pumps),
        )
        self._overflow = Refusal(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the caller did not read its responses: the outputs waiting to be sent passed "
            f"{budget} bytes (--max-stream-buffer-bytes); every request of the stream was "
            "cancelled",
        )
        self.cancel([pump.request_id for pump in self._pumps.values()])
        assert self._reader is not None  # the meter counts only requests the reader started
        if self._reader.done():
            self._events.put_nowait(self._reader)  # `run` sees the failure as the reader's
        else:
            self._reader.cancel()
        # NOTE: `run` may be suspended in a write the caller never lets finish (HTTP/2 flow
        # control), where no timeout of its own can fire: cancel the task writing.
        loop = asyncio.get_running_loop()
        self._abandon_timer = loop.call_later(2 * FINALS_TIMEOUT, self._abandon)

    def _abandon(self) -> None:
        """Cancelling grpc.aio's task ends the call CANCELLED and gives its slot back."""
        if self._task is not None and not self._task.done():
            log.warning("stream.abandoned", reason="the caller still does not read")
            self._task.cancel()

    async def _start(self, request: pb.GenerateRequest, start_index: int) -> None:
        """Admit one request and start its pump, or queue its `refused` event."""
        self._admitting = True
        try:
            admitted = await self.start(request)
        except Exception as exc:  # a bug admitting one request refuses that start alone
            refusal = exc if isinstance(exc, Refusal) else _admission_failure(exc, start_index)
            log.info(
                "request.refused",
                code=refusal.code.name,
                message=refusal.message,
                start=start_index,
            )
            self._unsent_refusals += 1
            self._events.put_nowait(
                (_refused_event(request.request_id, start_index, refusal), None)
            )
            return
        finally:
            self._admitting = False
        pump = _Pump(admitted.request_id, admitted.prompt_tokens, set(range(admitted.n)))
        task = asyncio.create_task(self._pump(admitted.events, pump))
        self._pumps[task] = pump
        task.add_done_callback(self._events.put_nowait)

    async def _pump(self, events: AsyncGenerator[pb.GenerateResponse, None], pump: _Pump) -> None:
        # NOTE: aclosing: a pump cancelled while it waits for `sent` must still close the
        # request's generator at once, which aborts the request in the engine.
        async with contextlib.aclosing(events):
            async for event in events:
                match event.WhichOneof("event"):
                    case "started":
                        pump.started = True
                    case "finished":
                        pump.unfinished.discard(event.index)
                pump.sent.clear()
                self._events.put_nowait((event, pump))
                # NOTE: the coalescing point. The request's next event is made only once this
                # one is written: what the engine produces meanwhile waits in the request's
                # queue and goes out as one chunk, as with Generate; an idle stream still
                # sends each token at once.
                await pump.sent.wait()

    def _end_unconfirmed(self) -> list[pb.GenerateResponse]:
        """The events still queued, then those the requests still running owe, made without
        the engine; their pumps are cancelled first, so that nothing follows a `finished`."""
        events: list[pb.GenerateResponse] = []
        while not self._events.empty():  # NOTE: wait_for can time out with items queued
            match self._events.get_nowait():
                case (event, _):
                    events.append(event)
                case task if task in self._pumps:
                    pump = self._pumps.pop(task)
                    if not task.cancelled() and task.exception() is not None:
                        log.error(
                            "stream.pump_failed",
                            request_id=pump.request_id,
                            exc_info=task.exception(),
                        )
        for task, pump in self._pumps.items():
            task.cancel()
            log.warning("request.unconfirmed_abort", request_id=pump.request_id)
            if not pump.started:
                started = pb.Started(prompt_tokens=pump.prompt_tokens)
                events.append(pb.GenerateResponse(request_id=pump.request_id, started=started))
            for index in sorted(pump.unfinished):
                finished = pb.Finished(
                    reason=pb.FINISH_REASON_CANCELLED,
                    message="the stream failed; the engine did not confirm the abort in time",
                )
                events.append(
                    pb.GenerateResponse(request_id=pump.request_id, index=index, finished=finished)
                )
        return events


def _failure(reader: asyncio.Task[None]) -> Refusal | None:
    """How the call must end after reading the request stream ended; None: normally."""
    error = None if reader.cancelled() else reader.exception()
    if error is None:
        return None
    if isinstance(error, Refusal):
        log.info("stream.failed", code=error.code.name, message=error.message)
        return error
    log.error("stream.reader_failed", exc_info=error)
    return Refusal(grpc.StatusCode.INTERNAL, f"reading the request stream failed: {error!r}")


def _admission_failure(error: Exception, start_index: int) -> Refusal:
    """A start whose admission raised something other than a Refusal (a bug): INTERNAL for it,
    as Generate would end; the stream and its other requests go on."""
    log.error("stream.admission_failed", start=start_index, exc_info=error)
    return Refusal(grpc.StatusCode.INTERNAL, f"admitting this request failed: {error!r}")


def _refused_event(request_id: str, start_index: int, refusal: Refusal) -> pb.GenerateResponse:
    refused = pb.Refused(
        code=refusal.code.value[0],  # grpc.StatusCode values are (google.rpc.Code, name)
        message=refusal.message,
        field_violations=[pb.FieldViolation(field=f, description=d) for f, d in refusal.violations],
        start_index=start_index,
    )
    if refusal.retry_delay_ms is not None:
        refused.retry_delay_ms = refusal.retry_delay_ms
    return pb.GenerateResponse(request_id=request_id, refused=refused)
