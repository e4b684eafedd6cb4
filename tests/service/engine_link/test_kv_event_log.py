"""KvEventLog: numbered batches, a bounded history, subscribers as cursors into it."""

from __future__ import annotations

import asyncio

import pytest

from engine.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from service.engine_link.kv_event_log import CursorExpired, KvEventLog, SubscriberTooSlow


def stored(key: int, parent: int | None = None) -> BlockStored:
    return BlockStored([key], parent, [(key, key + 1)])


def add_many(log: KvEventLog, count: int) -> None:
    for key in range(count):
        log.add([stored(key), BlockRemoved([key])])


def test_batches_and_events_are_numbered_in_order() -> None:
    log = KvEventLog()
    log.add([AllBlocksCleared()])
    log.add(None)  # an engine message without events is no batch
    log.add([stored(1), stored(2, 1)])
    batches = log.after(0)
    assert [b.sequence_number for b in batches] == [1, 2]
    assert [list(b.event_ids) for b in batches] == [[1], [2, 3]]


async def test_a_subscriber_resumes_after_its_cursor_and_then_waits_for_new_ones() -> None:
    log = KvEventLog()
    add_many(log, 5)
    subscription = log.subscribe(3)
    assert [b.sequence_number for b in await subscription.next()] == [4, 5]
    waiting = asyncio.create_task(subscription.next())
    await asyncio.sleep(0)
    assert not waiting.done()
    log.add([AllBlocksCleared()])
    assert [b.sequence_number for b in await asyncio.wait_for(waiting, 5)] == [6]


async def test_zero_starts_from_the_whole_history_while_it_holds_the_first_batch() -> None:
    log = KvEventLog(max_batches=4)
    add_many(log, 3)
    assert [b.sequence_number for b in await log.subscribe(0).next()] == [1, 2, 3]
    add_many(log, 3)  # batch 1 left the history: zero is "from now"
    assert log.subscribe(0).cursor == 6


def test_a_cursor_outside_the_history_is_expired() -> None:
    log = KvEventLog(max_batches=4)
    add_many(log, 10)
    assert log.subscribe(6).cursor == 6  # batches 7..10 are all still held
    with pytest.raises(CursorExpired, match="outside the history"):
        log.subscribe(5)
    with pytest.raises(CursorExpired):
        log.subscribe(11)  # another service's numbering


async def test_a_slow_subscriber_is_dropped_and_the_history_stays_bounded() -> None:
    log = KvEventLog(max_batches=8)
    subscription = log.subscribe(0)
    add_many(log, 100)
    assert len(log.after(log.first_sequence - 1)) == 8
    with pytest.raises(SubscriberTooSlow, match=r"fell behind: batches 1\.\.92"):
        await subscription.next()


def test_the_history_is_bounded_by_its_token_ids_too() -> None:
    log = KvEventLog(max_tokens=10)
    events: list[KvEvent] = [BlockStored([1, 2], None, [(1, 2, 3), (4, 5, 6)])]  # 6 tokens
    log.add(events)
    log.add(events)
    assert log.first_sequence == 2  # 12 token ids are over the bound: the oldest went
    log.add([BlockStored([7], None, [tuple(range(50))])])
    assert log.first_sequence == 3  # the newest batch is kept whatever its size
