"""EngineCalls: the engine's one-answer calls that no other link owns.

A weight-transfer join (InitWeightTransfer, answered by WeightTransferJoined), a constraint
check (CheckConstraint, answered by ConstraintChecked), a prefix-cache flush (FlushCache,
answered by CacheFlushed) and a request for fresh stats (GetState, answered by the next
Heartbeat or StepOutput). The first three wait in AwaitingAnswers: a lost engine answers them
UNAVAILABLE (a flush: with its `error` set). A stats request needs no such answer: its caller falls back to
the last known stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import (
    AbandonCheck,
    CacheFlushed,
    CheckConstraint,
    Constraint,
    ConstraintChecked,
    FlushCache,
    GetState,
    InitWeightTransfer,
    ToEngine,
    TransferGroupSpec,
    WeightTransferJoined,
)
from service.engine_link.awaiting_answers import AwaitingAnswers
from service.engine_link.engine_process import EngineUnavailableError


class EngineCalls:
    def __init__(self, send: Callable[[ToEngine], None]) -> None:
        self._send = send  # raises EngineUnavailableError when the engine cannot take it
        self.joins: AwaitingAnswers[WeightTransferJoined] = AwaitingAnswers(
            lambda i, m: WeightTransferJoined(i, 0, ErrorCode.UNAVAILABLE, m)
        )
        self.checks: AwaitingAnswers[ConstraintChecked] = AwaitingAnswers(
            lambda i, m: ConstraintChecked(i, ErrorCode.UNAVAILABLE, m)
        )
        self.flushes: AwaitingAnswers[CacheFlushed] = AwaitingAnswers(
            lambda i, m: CacheFlushed(i, error=m)
        )
        self._stats_waiters: list[asyncio.Future[None]] = []

    @property
    def busy(self) -> bool:
        """A join, a check or a flush awaits its answer."""
        return bool(len(self.joins) or len(self.checks) or len(self.flushes))

    def route(self, answer: ConstraintChecked | CacheFlushed) -> None:
        """Hand a check's or a flush's answer to its waiter (none when its caller left)."""
        match answer:
            case ConstraintChecked():
                self.checks.route(answer.check_id, answer)
            case CacheFlushed():
                self.flushes.route(answer.flush_id, answer)

    async def flush_cache(self) -> CacheFlushed:
        """Have the engine forget its prefix cache now; its answer (`error` set: the engine was
        lost meanwhile), or EngineUnavailableError if it cannot be sent. The cache's
        AllBlocksCleared reaches the event log before the answer."""
        flush_id = uuid.uuid4().hex
        self._send(FlushCache(flush_id))
        try:
            return await self.flushes.expect(flush_id)
        except asyncio.CancelledError:
            self.flushes.discard(flush_id)  # the flush still happens; nobody hears of it
            raise

    async def join_weight_transfer(self, group: TransferGroupSpec | None) -> WeightTransferJoined:
        """Have the engine join a trainer's group (None: leave it); its answer, UNAVAILABLE if
        the engine is lost meanwhile. Raises EngineUnavailableError if it cannot be sent."""
        transfer_id = uuid.uuid4().hex
        self._send(InitWeightTransfer(transfer_id, group))
        return await self.joins.expect(transfer_id)

    async def check_constraint(self, constraint: Constraint, caller: str = "") -> ConstraintChecked:
        """Have the engine compile a structured-output constraint (cached for the request that
        follows); its answer (UNAVAILABLE: lost meanwhile), or EngineUnavailableError. `caller`
        (the gRPC peer) shares compiles out fairly; a caller that leaves abandons its compile."""
        check_id = uuid.uuid4().hex
        self._send(CheckConstraint(check_id, constraint, caller))
        try:
            return await self.checks.expect(check_id)
        except asyncio.CancelledError:
            self.checks.discard(check_id)
            with contextlib.suppress(EngineUnavailableError):  # a lost engine compiles nothing
                self._send(AbandonCheck(check_id))
            raise

    async def fresh_stats(self, timeout: float) -> None:
        """Ask for fresh stats and wait for them, at most `timeout` seconds; raises
        EngineUnavailableError if they cannot be asked for."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._send(GetState())
        self._stats_waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiter), timeout)

    def stats_arrived(self) -> None:
        for waiter in self._stats_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._stats_waiters.clear()

    def fail_all(self, message: str) -> None:
        """The engine is lost: every join, check and flush is answered UNAVAILABLE."""
        self.joins.fail_all(message)
        self.checks.fail_all(message)
        self.flushes.fail_all(message)
