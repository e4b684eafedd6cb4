"""RequestRouter: which handler's Inbox each engine output goes to.

A route lives from `add` until the engine has reported every index of the request finished (or
`fail_all` ended it). A handler that stops listening `detach`es: its outputs are dropped from
then on, but the id stays reserved until the engine's final output, so a reused id never
receives the old request's last output.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from engine.protocol.messages import FinishReason, RequestOutput
from service.engine_link.buffer_meter import BufferMeter, output_bytes


class Inbox:
    """The outputs waiting for one request's handler. The router puts them one by one; the
    handler takes everything waiting at once (what it sends as one chunk).

    An asyncio.Queue with fewer steps per output: every running request gets one per engine
    step, so this is on the service's per-token path. With an `interval` (seconds), a take
    comes no sooner than `interval` after the previous one, unless a final output is waiting:
    what arrives meanwhile goes out in the same chunk.

    With a `meter` (a GenerateStream's), what waits here is counted in it until it is taken
    or `release`d.
    """

    __slots__ = ("_held", "_holding", "_interval", "_outputs", "_taken_at", "_waiter", "meter")

    def __init__(self, interval: float = 0.0) -> None:
        self._outputs: list[RequestOutput] = []
        self._waiter: asyncio.Future[None] | None = None
        self._interval = interval
        self._taken_at = -math.inf
        self._holding = False  # waiting out the interval: only a final output cuts it short
        self.meter: BufferMeter | None = None
        self._held = 0  # what this inbox added to the meter and has not taken back

    def put_nowait(self, output: RequestOutput) -> None:
        self._outputs.append(output)
        if self.meter is not None:
            size = output_bytes(output)
            self._held += size
            self.meter.add(size)
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (not self._holding or output.finished):
            waiter.set_result(None)

    async def take(self) -> list[RequestOutput]:
        """Every output waiting, in arrival order; waits for one when there is none, then for
        the rest of the interval."""
        loop = asyncio.get_running_loop()
        while not self._outputs:
            await self._wait(loop)
        if self._interval:
            due = self._taken_at + self._interval
            if due > loop.time() and not any(o.finished for o in self._outputs):
                self._holding = True
                timer = loop.call_at(due, self._wake)
                try:
                    await self._wait(loop)
                finally:
                    self._holding = False
                    timer.cancel()
            self._taken_at = loop.time()
        outputs, self._outputs = self._outputs, []
        self._give_back()
        return outputs

    def release(self) -> None:
        """The handler is done with this inbox: what still waits is dropped and uncounted."""
        self._outputs = []
        self._give_back()
        self.meter = None

    def _give_back(self) -> None:
        if self.meter is not None and self._held:
            self.meter.remove(self._held)
            self._held = 0

    async def _wait(self, loop: asyncio.AbstractEventLoop) -> None:
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass
class _Route:
    inbox: Inbox
    open_indices: set[int]
    started: bool = False
    detached: bool = False


class RequestRouter:
    """`stream_interval`: each request's Inbox interval (seconds; 0: none)."""

    def __init__(self, stream_interval: float = 0.0) -> None:
        self._stream_interval = stream_interval
        self._routes: dict[str, _Route] = {}
        self._not_started = 0  # routes that have not received any output yet

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._routes

    def __len__(self) -> int:
        return len(self._routes)

    @property
    def waiting(self) -> int:
        """Admitted requests the engine has not produced anything for yet."""
        return self._not_started

    def add(self, request_id: str, n: int) -> Inbox:
        assert request_id not in self._routes, request_id
        inbox = Inbox(self._stream_interval)
        self._routes[request_id] = _Route(inbox, set(range(n)))
        self._not_started += 1
        return inbox

    def remove(self, request_id: str) -> None:
        """Forget a route whose request never reached the engine."""
        route = self._routes.pop(request_id)
        self._not_started -= not route.started

    def detach(self, request_id: str) -> None:
        route = self._routes.get(request_id)
        if route is not None:
            route.detached = True

    def route(self, output: RequestOutput) -> bool:
        """Deliver `output`; True when it is the request's first (it started the request)."""
        route = self._routes.get(output.request_id)
        if route is None:
            return False  # already ended by fail_all (an engine failure)
        first = not route.started
        if first:
            route.started = True
            self._not_started -= 1
        if output.finished:
            route.open_indices.discard(output.index)
            if not route.open_indices:
                del self._routes[output.request_id]
        if not route.detached:
            route.inbox.put_nowait(output)
        return first

    def fail_all(self, message: str, policy_version: int) -> None:
        """End every open index of every route with ERROR `message`; forget them all."""
        for request_id, route in self._routes.items():
            if route.detached:
                continue
            for index in sorted(route.open_indices):
                route.inbox.put_nowait(
                    RequestOutput(
                        request_id,
                        index,
                        [],
                        policy_version,
                        finish_reason=FinishReason.ERROR,
                        error=message,
                    )
                )
        self._routes.clear()
        self._not_started = 0
