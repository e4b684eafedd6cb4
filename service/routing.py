"""RequestRouter: which handler queue each engine output goes to.

A route lives from `add` until the engine has reported every index of the request finished (or
`fail_all` ended it). A handler that stops listening `detach`es: its outputs are dropped from
then on, but the id stays reserved until the engine's final output, so a reused id never
receives the old request's last output.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.messages import FinishReason, RequestOutput


@dataclass
class _Route:
    queue: asyncio.Queue[RequestOutput]
    open_indices: set[int]
    started: bool = False
    detached: bool = False


class RequestRouter:
    def __init__(self) -> None:
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

    def add(self, request_id: str, n: int) -> asyncio.Queue[RequestOutput]:
        assert request_id not in self._routes, request_id
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._routes[request_id] = _Route(queue, set(range(n)))
        self._not_started += 1
        return queue

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
            route.queue.put_nowait(output)
        return first

    def fail_all(self, message: str, policy_version: int) -> None:
        """End every open index of every route with ERROR `message`; forget them all."""
        for request_id, route in self._routes.items():
            if route.detached:
                continue
            for index in sorted(route.open_indices):
                route.queue.put_nowait(
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
