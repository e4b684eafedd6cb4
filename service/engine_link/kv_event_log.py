"""KvEventLog: the prefix cache's events, numbered, kept for a while, and read by subscribers.

Every StepOutput or Heartbeat that carries events becomes one batch: sequence numbers count
batches from 1 and event ids count events from 1, both increasing over the service's life
(an engine restarted by the supervisor begins its events with AllBlocksCleared, so the
numbering goes on across engines). The log keeps the latest batches, at most `max_batches` of
them and at most `max_tokens` token ids among their stored pages (the newest batch always):
memory is bounded whatever the traffic.

A subscriber is a cursor into that history (the sequence number it has read up to), not a
queue of its own: a subscriber that falls so far behind that the batches after its cursor left
the history is dropped (`Subscription.next` raises SubscriberTooSlow) instead of holding memory.
`subscribe(start)` resumes after `start` when the history still holds every batch after it;
`start` 0 starts from the whole history when it reaches back to the first batch (the subscriber
learns every page the engine ever published and did not drop), else from now. A cursor the
history no longer covers (or one ahead of it: another service's numbering) raises
CursorExpired: the subscriber must drop what it knows and subscribe from 0.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from engine.protocol.kv_events import BlockStored, KvEvent

MAX_BATCHES = 1024  # SMG's replay window is 1024 batches too
MAX_TOKENS = 1 << 20  # token ids of stored pages held in the history


@dataclass(frozen=True)
class KvEventBatch:
    """The events of one engine message: `event_ids[i]` numbers `events[i]`."""

    sequence_number: int
    timestamp: float  # time.time() when the service received it
    event_ids: range
    events: list[KvEvent]

    @property
    def tokens(self) -> int:
        return sum(len(e.token_ids) * len(e.token_ids[0]) for e in _stored(self.events))


class CursorExpired(Exception):
    """The history does not hold every batch after the subscriber's cursor."""


class SubscriberTooSlow(Exception):
    """Batches the subscriber had not read yet left the history."""


class KvEventLog:
    def __init__(self, max_batches: int = MAX_BATCHES, max_tokens: int = MAX_TOKENS) -> None:
        self._history: deque[KvEventBatch] = deque()
        self._max_batches = max_batches
        self._max_tokens = max_tokens
        self._tokens = 0
        self.last_sequence = 0  # the newest batch's number (0: none yet)
        self._next_event_id = 1
        self._changed = asyncio.Event()  # set and replaced on every batch: wakes subscribers

    @property
    def first_sequence(self) -> int:
        """The oldest batch the history holds (last_sequence + 1 when it holds none)."""
        return self._history[0].sequence_number if self._history else self.last_sequence + 1

    def add(self, events: list[KvEvent] | None) -> None:
        """Number the events of one engine message as a batch and wake the subscribers."""
        if not events:
            return
        first = self._next_event_id
        self._next_event_id += len(events)
        self.last_sequence += 1
        batch = KvEventBatch(
            self.last_sequence, time.time(), range(first, self._next_event_id), events
        )
        self._history.append(batch)
        self._tokens += batch.tokens
        while len(self._history) > 1 and (
            len(self._history) > self._max_batches or self._tokens > self._max_tokens
        ):
            self._tokens -= self._history.popleft().tokens
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def subscribe(self, start: int) -> Subscription:
        """A cursor after batch `start` (0: see the module docstring); CursorExpired when the
        history cannot resume there."""
        if start == 0:
            whole = self.first_sequence == 1
            return Subscription(self, 0 if whole else self.last_sequence)
        if start > self.last_sequence or start < self.first_sequence - 1:
            raise CursorExpired(
                f"start_sequence_number {start} is outside the history "
                f"({self.first_sequence - 1}..{self.last_sequence}); subscribe from 0"
            )
        return Subscription(self, start)

    def after(self, cursor: int) -> list[KvEventBatch]:
        """The batches after `cursor`; SubscriberTooSlow if some left the history."""
        first = self.first_sequence
        if cursor < first - 1:
            raise SubscriberTooSlow(
                f"the subscriber fell behind: batches {cursor + 1}..{first - 1} left the "
                f"history ({self._max_batches} batches); resubscribe"
            )
        history = self._history
        return [history[i] for i in range(cursor - first + 1, len(history))]

    async def changed(self) -> None:
        """Wait for the next batch."""
        await self._changed.wait()


class Subscription:
    """One subscriber's cursor into a KvEventLog."""

    def __init__(self, log: KvEventLog, cursor: int) -> None:
        self._log = log
        self.cursor = cursor

    async def next(self) -> list[KvEventBatch]:
        """The batches after the cursor, waiting for one when there is none; the cursor moves
        past them. Raises SubscriberTooSlow when some left the history unread."""
        while self._log.last_sequence <= self.cursor:
            await self._log.changed()
        batches = self._log.after(self.cursor)
        self.cursor = batches[-1].sequence_number
        return batches


def _stored(events: list[KvEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]
