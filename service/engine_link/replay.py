"""Replaying the ReplayLog into a freshly started engine, before it serves.

Every update applied since start is re-applied in order, at its original version, so a crash
never silently rolls the weights back. Raises EngineStartError (the restart fails and is
retried: the server stays NOT_SERVING) if an update fails, or if the checkpoint directory to
replay changed since its update was applied: the engine must not serve older weights, nor other
weights under the same version. A log holding a distributed update is not replayed at all (its
bytes were broadcast once and kept nowhere): `replay` returns True, and the engine awaits an
update that replaces every tensor while generation is refused.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Protocol

import structlog

from engine.protocol.messages import UpdateWeights, WeightsPhase, WeightsProgress
from service.engine_link.engine_process import EngineStartError
from service.engine_link.replay_log import ReplayLog
from service.ops.metrics import Metrics

log = structlog.get_logger("sluice.engine_client")


class Replaying(Protocol):
    restarts: int
    policy_version: int

    @property
    def metrics(self) -> Metrics: ...
    def send_replay(self, update: UpdateWeights) -> asyncio.Queue[WeightsProgress]: ...


async def replay(client: Replaying, replay_log: ReplayLog) -> bool:
    """Re-apply `replay_log` through `client`; True if it cannot be (awaiting weights)."""
    if not replay_log.replayable:
        log.error(
            "engine.replay_impossible",
            policy_version=client.policy_version,
            reason="weights received over a process group cannot be replayed: generation "
            "is refused until an update replaces every tensor",
        )
        return True
    changed = await asyncio.to_thread(replay_log.changed)
    if changed is not None:
        client.metrics.weight_replay_refused()
        log.error(
            "engine.replay_refused",
            policy_version=changed.policy_version,
            checkpoint_dir=changed.checkpoint_dir,
            reason="the checkpoint directory changed since this version was applied from it",
        )
        raise EngineStartError(
            f"checkpoint_dir {changed.checkpoint_dir!r} changed since policy version "
            f"{changed.policy_version} was applied from it: not serving other weights under "
            "that version (restore the directory, or restart the server)"
        )
    for n, entry in enumerate(replay_log.entries()):
        update = replace(entry, update_id=f"replay-{client.restarts}-{n}")
        queue = client.send_replay(update)
        while not (final := await queue.get()).final:
            pass
        if final.phase is WeightsPhase.FAILED:
            raise EngineStartError(
                f"replaying policy version {entry.policy_version} failed: {final.message}"
            )
        log.info("engine.replayed", policy_version=entry.policy_version)
    return False
