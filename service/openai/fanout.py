"""FanOut: the sluice.v1 requests of one OpenAI request (one per prompt), admitted through
GenerationServicer.submit and read through its `events`, merged into one stream.

An OpenAI completion may carry several prompts; each is its own GenerateRequest (with its own
`n`), and choice `prompt * n + index` of the answer is index `index` of prompt `prompt`.
Admission is all or nothing: if one prompt is refused, those already admitted are cancelled
and their events drained (their generators' cleanup detaches them), then the refusal is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from sluice.v1 import generation_pb2 as pb

from service.rpc.servicer import GenerationServicer, Submitted


@dataclass(frozen=True)
class Event:
    prompt: int  # which of the request's prompts
    response: pb.GenerateResponse


class FanOut:
    def __init__(self, servicer: GenerationServicer, submitted: list[Submitted]) -> None:
        self.servicer = servicer
        self.submitted = submitted

    @classmethod
    async def submit(
        cls, servicer: GenerationServicer, requests: list[pb.GenerateRequest], caller: str
    ) -> FanOut:
        """Admit every request, or none (raises the first Refusal)."""
        submitted: list[Submitted] = []
        try:
            for request in requests:
                submitted.append(await servicer.submit(request, None, caller))
        except BaseException:
            await _discard(servicer, submitted)
            raise
        return cls(servicer, submitted)

    def prompt_ids(self, prompt: int) -> list[int]:
        return list(self.submitted[prompt].admission.request.prompt_token_ids)

    async def events(self) -> AsyncGenerator[Event, None]:
        """Every request's events, interleaved as they come. Closing (or cancelling) this
        generator cancels the requests still running, as a gRPC caller leaving does."""
        if len(self.submitted) == 1:
            async for response in self.servicer.events(self.submitted[0]):
                yield Event(0, response)
            return
        # Unbounded: each reader's events generator already coalesces what waits in the
        # engine's inbox, and a bounded queue could lose the end marker of a cancelled reader.
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        readers = [
            asyncio.create_task(self._read(i, s, queue), name=f"openai-fanout-{i}")
            for i, s in enumerate(self.submitted)
        ]
        try:
            running = len(readers)
            while running:
                event = await queue.get()
                if event is None:
                    running -= 1
                    continue
                yield event
            for reader in readers:
                reader.result()  # surface a reader's failure
        finally:
            for reader in readers:
                reader.cancel()
            # NOTE: waited for: a cancelled reader aborts its request in its generator's
            # cleanup, which must run before this response is reported finished.
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read(
        self, prompt: int, submitted: Submitted, queue: asyncio.Queue[Event | None]
    ) -> None:
        try:
            async for response in self.servicer.events(submitted):
                queue.put_nowait(Event(prompt, response))
        finally:
            queue.put_nowait(None)  # this reader's end, failed or not

    async def collect(self) -> list[Event]:
        return [event async for event in self.events()]


async def _discard(servicer: GenerationServicer, submitted: list[Submitted]) -> None:
    """Cancel admitted requests whose answer will never be sent, and read their events to the
    end (the events generator's cleanup detaches them from the engine)."""
    servicer.cancel([s.admission.request.request_id for s in submitted])
    for s in submitted:
        events: AsyncIterator[pb.GenerateResponse] = servicer.events(s)
        async for _ in events:
            pass
