"""AdapterLink: the service's side of LoRA adapters (engine/lora/).

It sends LoadAdapter, UnloadAdapter and ListAdapters and waits for each one's AdapterOutcome
(UNAVAILABLE when the engine is lost meanwhile). It keeps what the service knows of the
engine's adapters: their states as the last answer reported them (`states`, `names`: admission
refuses an adapter not among them; `versions`: their policy versions, which a request's
min_policy_version compares with), and the loads that succeeded, to replay into a restarted
engine (`replay`), in load order. An adapter replaced in place is replayed as one load of its
latest directory at its latest version.

Before a load is sent, its `adapter_config.json` is read and checked here
(service/engine_link/adapter_files.py, engine/protocol/validation/adapter_config.py): a config the engine
could not serve is answered INVALID_ARGUMENT, naming the field, and never reaches the engine.

A load is replayed by reading its directory again, so each is recorded with a fingerprint of
what the directory held when it was sent (adapter_config.json and the safetensors files'
names, sizes and times); an adapter whose directory changed or vanished since is not loaded
again under its name (other weights would serve it): it is dropped, with an error log, and
its requests become NOT_FOUND. A failed replay of one adapter never keeps the base model from
serving.

An operation whose application killed the engine is never re-applied: a replayed load the
engine is lost while applying is quarantined (dropped from the replay, logged
`engine.adapter_quarantined`, counted in `sluice_adapters_quarantined`; its requests become
NOT_FOUND), and the restart goes on without it. A live load that kills the engine answers its
caller UNAVAILABLE and, never having succeeded, is never recorded for the replay.

A streamed adapter's directory (LoadAdapterStream: service/engine_link/adapter_spool.py) is
handed to the link with `owned=True`: it deletes it when the load fails, when the adapter is
unloaded, replaced by another directory or dropped from the replay, and at `delete_spools`
(the server's shutdown); until then the directory serves the replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import uuid
from collections.abc import Callable
from dataclasses import replace

import structlog

from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import (
    AdapterOutcome,
    AdapterState,
    ListAdapters,
    LoadAdapter,
    ToEngine,
    UnloadAdapter,
)
from service.engine_link.adapter_files import AdapterFiles
from service.engine_link.awaiting_answers import AwaitingAnswers
from service.engine_link.engine_process import EngineUnavailableError

log = structlog.get_logger("sluice.engine_client")


class AdapterLink:
    def __init__(
        self,
        send: Callable[[ToEngine], None],
        max_rank: int,
        on_quarantine: Callable[[], None] = lambda: None,
    ) -> None:
        self._send = send  # raises EngineUnavailableError when the engine cannot take it
        self.files = AdapterFiles(max_rank)  # config checks, fingerprints and spool writes
        self._on_quarantine = on_quarantine  # counts a replayed load that killed the engine
        self.states: tuple[AdapterState, ...] = ()
        self._loads: dict[str, tuple[LoadAdapter, str | None]] = {}  # name -> (load, print)
        self._spools: set[str] = set()  # the owned directories: deleted once no load needs them
        self._answers: AwaitingAnswers[AdapterOutcome] = AwaitingAnswers(
            lambda i, m: AdapterOutcome(i, error_code=ErrorCode.UNAVAILABLE, message=m)
        )

    @property
    def names(self) -> frozenset[str]:
        return frozenset(state.name for state in self.states)

    @property
    def versions(self) -> dict[str, int]:
        """Each loaded adapter's policy version, by name."""
        return {state.name: state.policy_version for state in self.states}

    @property
    def busy(self) -> bool:
        return bool(len(self._answers))

    async def load(self, msg: LoadAdapter, owned: bool = False) -> AdapterOutcome:
        """Load (or with `replace` update in place) the adapter `msg` names; the engine's
        answer (recorded for replay when it succeeds, also if the caller has gone by then: a
        plain load of the path, at the version it reached). `owned`: msg.path is a spool the
        link deletes once no load needs it (at once if this one fails). Raises
        EngineUnavailableError if it cannot be sent. A config the engine could not serve is
        answered INVALID_ARGUMENT here, unsent."""
        if owned:
            self._spools.add(msg.path)
        try:
            try:
                fingerprint = await self.files.check(msg.path)
            except ValueError as exc:
                self._forget_spool(msg.path)
                return AdapterOutcome(
                    msg.action_id, self.states, ErrorCode.INVALID_ARGUMENT, str(exc)
                )

            def record(outcome: AdapterOutcome) -> None:
                state = next(s for s in outcome.adapters if s.name == msg.name)
                load = LoadAdapter(
                    "", msg.name, msg.path, state.pinned, False, state.policy_version
                )
                before = self._loads.get(msg.name)
                self._loads[msg.name] = (load, fingerprint)  # a replace keeps the first's place
                if before is not None and before[0].path != msg.path:
                    self._forget_spool(before[0].path)

            outcome = await self._ask(msg, record, on_failure=lambda: self._forget_spool(msg.path))
        except EngineUnavailableError:
            self._forget_spool(msg.path)
            raise
        return outcome

    async def unload(self, name: str) -> AdapterOutcome:
        """Forget `name`; the engine's answer. Raises EngineUnavailableError if it cannot be
        sent."""
        return await self._ask(UnloadAdapter(uuid.uuid4().hex, name), lambda _: self._drop(name))

    def delete_spools(self) -> None:
        """Delete every owned directory (the server stops: nothing will replay them); the
        adapters' file pool takes no more work."""
        self.files.close()
        for path in list(self._spools):
            self._forget_spool(path)

    def _drop(self, name: str) -> None:
        load = self._loads.pop(name, None)
        if load is not None:
            self._forget_spool(load[0].path)

    def _forget_spool(self, path: str) -> None:
        if path in self._spools:
            self._spools.discard(path)
            shutil.rmtree(path, ignore_errors=True)

    async def refresh(self, timeout: float) -> tuple[AdapterState, ...]:
        """The engine's adapters now (which are resident changes with every request); the last
        known ones if it does not answer within `timeout` seconds or cannot be asked."""
        with contextlib.suppress(TimeoutError, EngineUnavailableError):
            await asyncio.wait_for(
                self._ask(ListAdapters(uuid.uuid4().hex), lambda _: None), timeout
            )
        return self.states

    async def _ask(
        self,
        msg: LoadAdapter | UnloadAdapter | ListAdapters,
        on_ok: Callable[[AdapterOutcome], object],
        on_failure: Callable[[], object] = lambda: None,
    ) -> AdapterOutcome:
        """Send `msg` and wait for its answer; `on_ok` (or `on_failure`) runs when it succeeds
        (or fails), also when the caller has gone by then (the answer is shielded from the
        caller's cancellation)."""
        self._send(msg)
        future = self._answers.expect(msg.action_id)

        def settle(done: asyncio.Future[AdapterOutcome]) -> None:
            outcome = done.result()
            if outcome.ok:
                on_ok(outcome)
            else:
                on_failure()
            if (
                outcome.error_code is not ErrorCode.UNAVAILABLE
            ):  # a lost engine's answer reports nothing
                self.states = outcome.adapters

        future.add_done_callback(settle)
        return await asyncio.shield(future)

    def route(self, outcome: AdapterOutcome) -> bool:
        """Resolve the call `outcome` answers; False if none waits."""
        return self._answers.route(outcome.action_id, outcome)

    def fail_all(self, message: str) -> None:
        """The engine is lost: every waiting call is answered UNAVAILABLE."""
        self._answers.fail_all(message)

    async def replay(self) -> None:
        """Load the recorded adapters into a freshly started engine, in load order."""
        self.states = ()
        for name, (msg, fingerprint) in list(self._loads.items()):
            now = await self.files.fingerprint(msg.path)
            if now is None or now != fingerprint:
                self._drop(name)
                log.error(
                    "engine.adapter_dropped",
                    adapter=name,
                    path=msg.path,
                    reason="its directory changed or vanished since it was loaded",
                )
                continue
            outcome = await self._ask(replace(msg, action_id=uuid.uuid4().hex), lambda _: None)
            if outcome.error_code is ErrorCode.UNAVAILABLE:
                # NOTE: sent, then the engine was lost before it answered: applying this load
                # may be what killed it (a replay otherwise re-applies it after every restart,
                # a crash loop). It goes; the restart is retried without it.
                self._quarantine(name, outcome.message)
                raise EngineUnavailableError(outcome.message)
            if not outcome.ok:
                self._drop(name)
                log.error("engine.adapter_dropped", adapter=name, reason=outcome.message)
            else:
                log.info("engine.adapter_replayed", adapter=name)

    def _quarantine(self, name: str, reason: str) -> None:
        self._drop(name)
        self._on_quarantine()
        log.error(
            "engine.adapter_quarantined",
            adapter=name,
            reason=f"the engine was lost while replaying its load ({reason}): never replayed again",
        )
