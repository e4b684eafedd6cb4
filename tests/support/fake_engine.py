"""A fake engine process that speaks engine/protocol/messages.py without torch, for service unit tests.

Spawnable as `fake_engine_main(config, conn)`. It "generates" by echoing the prompt's tokens
(without the first one) in a cycle, one token per request per step. Behaviour knobs live in
`<config.model>/fake.json`: step_delay (seconds per step), die_on_token (a prompt containing
this id kills the engine), hold_token (a prompt containing this id stays queued, producing
nothing, until aborted), max_model_len, vocab_size, update_delay (seconds between the progress
messages of a weight update), start_when (a path: the engine stays starting, its Ready unsent,
until that file exists). Like the real engine, it
sends a message at least every PROGRESS_S while it has work, even if nothing advanced.

Weight updates: PAUSED, two LOADING, APPLIED, like the real engine; ABORT ends running requests
ABORTED. A version not above the served one is FAILED (FAILED_PRECONDITION). A checkpoint_dir
named `fail-<CODE>` fails with that status code at once, `pause-fail-<CODE>` after PAUSED,
`die` kills the engine mid-update, and `slow` waits SLOW_UPDATE_S between messages. An inline update's tensors are read from the tensor file and
described in `<config.model>/last_update.json` ({name: {dtype, shape, sha256}}) for the tests.

LoRA adapters: a LoadAdapter succeeds (rank 8, never resident: nothing computes them), unless
its name is the knob die_on_adapter, which kills the engine (as an adapter whose application
crashes the real one); UnloadAdapter and ListAdapters answer as the real engine does.

Speculative decoding: with a --speculative-method other than "off", each step of a request
that did not opt out (SamplingParams.speculative) "proposes" --num-speculative-tokens tokens and
"accepts" the knob spec_accept of them (default 1; fewer near max_tokens), emitting one token
more than it accepted, as the real engine does. The counts are the final output's
RequestMetrics and the cumulative EngineStats.

Faults of an idle engine, by real signals: SIGUSR1 makes the main thread compute without a word
for `busy_silence` seconds (runnable all along, as a starved engine is), SIGUSR2 makes it wait
forever on a lock it holds (a deadlock: asleep, never runnable).
"""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from engine.parent_death import die_with_parent
from engine.protocol.config import EngineConfig
from engine.protocol.error_code import ErrorCode
from engine.protocol.messages import (
    AbortRequests,
    AdapterOutcome,
    AdapterState,
    AddRequest,
    EngineDead,
    EngineStats,
    FinishReason,
    GetState,
    Heartbeat,
    InflightPolicy,
    ListAdapters,
    LoadAdapter,
    ModelInfo,
    Ready,
    RequestMetrics,
    RequestOutput,
    Shutdown,
    StepOutput,
    UnloadAdapter,
    UpdateWeights,
    WeightsPhase,
    WeightsProgress,
)

TOTAL_PAGES = 64
EOS = 1
SLOW_UPDATE_S = 0.3
PROGRESS_S = 0.1


@dataclass
class _Request:
    add: AddRequest
    generated: list[int] = field(default_factory=list)
    reported: bool = False
    proposed: int = 0  # speculative decoding
    accepted: int = 0


@dataclass
class _Update:
    messages: Iterator[WeightsProgress | EngineDead]
    delay: float
    next_at: float = 0.0


class _FakeEngine:
    def __init__(self, config: EngineConfig, conn: Connection) -> None:
        self.config = config
        self.conn = conn
        self.knobs = json.loads((Path(config.model) / "fake.json").read_text())
        self.version = config.policy_version
        self.requests: dict[str, _Request] = {}
        self.finished: list[RequestOutput] = []
        self.update: _Update | None = None
        self.adapters: dict[str, AdapterState] = {}
        self.last_sent = time.monotonic()
        self.fault: int | None = None  # the signal of a fault to act out at the next iteration
        self.spec_proposed = 0  # cumulative, as EngineStats reports them
        self.spec_accepted = 0
        signal.signal(signal.SIGUSR1, self.on_fault)
        signal.signal(signal.SIGUSR2, self.on_fault)

    def on_fault(self, signum: int, frame: object) -> None:
        self.fault = signum

    def act_out_fault(self) -> None:
        fault, self.fault = self.fault, None
        if fault == signal.SIGUSR1:
            end = time.monotonic() + self.knobs.get("busy_silence", 0.0)
            while time.monotonic() < end:
                pass  # runnable and silent, like an engine that waits for a CPU
        elif fault == signal.SIGUSR2:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns

    def info(self) -> ModelInfo:
        return ModelInfo(
            model="fake",
            path=self.config.model,
            architecture="FakeForCausalLM",
            max_model_len=self.knobs.get("max_model_len", 64),
            vocab_size=self.knobs.get("vocab_size", 320),
            eos_token_ids=[EOS],
            device="cpu",
            dtype="float32",
            page_size=4,
            total_pages=TOTAL_PAGES,
            policy_version=self.version,
            max_num_seqs=8,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.requests),
            total_pages=TOTAL_PAGES,
            free_pages=TOTAL_PAGES - len(self.requests),
            policy_version=self.version,
            updating_weights=self.update is not None,
            spec_proposed_tokens=self.spec_proposed,
            spec_accepted_tokens=self.spec_accepted,
        )

    def finish(self, rid: str, reason: FinishReason, error: str | None = None) -> None:
        req = self.requests.pop(rid)
        self.finished.append(
            RequestOutput(
                rid,
                0,
                [],
                self.version,
                finish_reason=reason,
                error=error,
                prompt_tokens=len(req.add.prompt_token_ids),
                completion_tokens=len(req.generated),
            )
        )

    def run(self) -> None:
        if (release := self.knobs.get("start_when")) is not None:
            while not Path(release).exists():  # a test creates it once its client saw "starting"
                time.sleep(0.05)
        self.conn.send(Ready(self.info()))
        while True:
            self.act_out_fault()
            idle_wait = 0.0 if self.requests else 0.2
            if self.update is not None:
                idle_wait = min(idle_wait, max(0.0, self.update.next_at - time.monotonic()))
            while self.conn.poll(idle_wait):
                idle_wait = 0.0
                if not self.handle(self.conn.recv()):
                    return
            if not self.advance_update():
                return
            self.step()

    def handle(self, msg: object) -> bool:
        """False once the engine must exit."""
        match msg:
            case AddRequest():
                if self.knobs.get("die_on_token") in msg.prompt_token_ids:
                    self.conn.send(EngineDead("told to die", ""))
                    return False
                self.requests[msg.request_id] = _Request(msg)
            case AbortRequests():
                for rid in msg.request_ids:
                    if rid in self.requests:
                        self.finish(rid, msg.reason)
            case GetState():
                self.conn.send(Heartbeat(self.stats()))
            case UpdateWeights():
                assert self.update is None, "the service sent a second concurrent update"
                slow = msg.checkpoint_dir is not None and Path(msg.checkpoint_dir).name == "slow"
                delay = SLOW_UPDATE_S if slow else self.knobs.get("update_delay", 0.0)
                self.update = _Update(self.update_messages(msg), delay)
            case LoadAdapter() | UnloadAdapter() | ListAdapters():
                if isinstance(msg, LoadAdapter) and msg.name == self.knobs.get("die_on_adapter"):
                    self.conn.send(EngineDead(f"adapter {msg.name!r} killed the engine", ""))
                    return False
                self.conn.send(self.adapter_outcome(msg))
            case Shutdown():
                for rid in list(self.requests):
                    self.finish(rid, FinishReason.ABORTED, "the server is shutting down")
                self.conn.send(StepOutput(self.finished, self.stats()))
                return False
        return True

    def adapter_outcome(self, msg: LoadAdapter | UnloadAdapter | ListAdapters) -> AdapterOutcome:
        error: tuple[ErrorCode | None, str] = (None, "")
        match msg:
            case LoadAdapter(replace=False) if msg.name in self.adapters:
                error = (ErrorCode.ALREADY_EXISTS, f"adapter {msg.name!r}: already loaded")
            case LoadAdapter():
                version = msg.policy_version or 1
                self.adapters[msg.name] = AdapterState(
                    msg.name, msg.path, 8, 2.0, ("q_proj",), msg.pinned, False, version
                )
            case UnloadAdapter() if self.adapters.pop(msg.name, None) is None:
                error = (ErrorCode.NOT_FOUND, f"adapter {msg.name!r}: not loaded")
        return AdapterOutcome(msg.action_id, tuple(self.adapters.values()), *error)

    def advance_update(self) -> bool:
        """Send the pending update's next message when its time has come; False if it died."""
        update = self.update
        if update is None or time.monotonic() < update.next_at:
            return True
        msg = next(update.messages)
        if isinstance(msg, WeightsProgress) and msg.final:
            self.update = None
        if self.finished:  # outputs of requests an ABORT ended come before the progress
            self.conn.send(StepOutput(self.finished, self.stats()))
            self.finished = []
        self.conn.send(msg)
        update.next_at = time.monotonic() + update.delay
        return not isinstance(msg, EngineDead)

    def update_messages(self, msg: UpdateWeights) -> Iterator[WeightsProgress | EngineDead]:
        uid, started = msg.update_id, time.monotonic()
        source = Path(msg.checkpoint_dir).name if msg.checkpoint_dir else ""
        if source.startswith("fail-"):
            yield WeightsProgress(uid, WeightsPhase.FAILED, error_code=source[5:], message=source)
            return
        if msg.policy_version and msg.policy_version <= self.version:
            message = f"policy_version {msg.policy_version} <= served {self.version}"
            yield WeightsProgress(
                uid, WeightsPhase.FAILED, error_code=ErrorCode.FAILED_PRECONDITION, message=message
            )
            return
        running = list(self.requests)
        yield WeightsProgress(uid, WeightsPhase.PAUSED, in_flight=len(running))
        if source.startswith("pause-fail-"):
            yield WeightsProgress(uid, WeightsPhase.FAILED, error_code=source[11:], message=source)
            return
        if source == "die":
            yield EngineDead("told to die during a weight update")
            return
        total = sum(t.nbytes for t in msg.tensors) or 1000
        count = len(msg.tensors) or 3
        yield WeightsProgress(uid, WeightsPhase.LOADING, bytes_total=total, tensors_total=count)
        if msg.tensor_file is not None:
            self.describe_tensors(msg)
        yield WeightsProgress(
            uid,
            WeightsPhase.LOADING,
            bytes_done=total,
            bytes_total=total,
            tensors_done=count,
            tensors_total=count,
        )
        if msg.inflight is InflightPolicy.ABORT:
            for rid in running:
                if rid in self.requests:
                    self.finish(rid, FinishReason.ABORTED, "aborted by a weight update")
        previous = self.version
        self.version = msg.policy_version or previous + 1
        yield WeightsProgress(
            uid,
            WeightsPhase.APPLIED,
            previous_version=previous,
            policy_version=self.version,
            aborted=len(running) if msg.inflight is InflightPolicy.ABORT else 0,
            continued=len(running) if msg.inflight is InflightPolicy.CONTINUE else 0,
            recomputed=len(running) if msg.inflight is InflightPolicy.RECOMPUTE else 0,
            seconds=time.monotonic() - started,
        )

    def describe_tensors(self, msg: UpdateWeights) -> None:
        assert msg.tensor_file is not None
        data = Path(msg.tensor_file).read_bytes()
        described = {
            t.name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "offset": t.offset,
                "sha256": hashlib.sha256(data[t.offset : t.offset + t.nbytes]).hexdigest(),
            }
            for t in msg.tensors
        }
        (Path(self.config.model) / "last_update.json").write_text(json.dumps(described))

    def step(self) -> None:
        outputs, self.finished = self.finished, []
        for rid, req in list(self.requests.items()):
            if req.add.deadline is not None and time.time() > req.add.deadline:
                self.finish(rid, FinishReason.DEADLINE_EXCEEDED)
                continue
            if self.knobs.get("hold_token") in req.add.prompt_token_ids:
                continue
            outputs.append(self.generate_one(rid, req))
        outputs += self.finished
        self.finished = []
        if outputs:
            self.conn.send(StepOutput(outputs, self.stats()))
            self.last_sent = time.monotonic()
            time.sleep(self.knobs.get("step_delay", 0.0))
        elif not self.requests and self.update is None:
            self.conn.send(Heartbeat(self.stats()))
        else:
            # Only held requests or a slow update: do not spin, but show progress.
            if time.monotonic() - self.last_sent > PROGRESS_S:
                self.conn.send(StepOutput([], self.stats()))
                self.last_sent = time.monotonic()
            time.sleep(0.005)

    def generate_one(self, rid: str, req: _Request) -> RequestOutput:
        prompt = req.add.prompt_token_ids[1:] or req.add.prompt_token_ids
        params = req.add.params
        max_tokens = params.max_tokens or 16
        accepted = self.speculate(req, max_tokens)
        new: list[int] = []
        reason = None
        while reason is None and len(new) <= accepted:
            token = prompt[len(req.generated) % len(prompt)]
            req.generated.append(token)
            new.append(token)
            if token in params.stop_token_ids or (token == EOS and not params.ignore_eos):
                reason = FinishReason.STOP
            elif len(req.generated) >= max_tokens:
                reason = FinishReason.LENGTH
        req.accepted += len(new) - 1  # a stop token ends the step's accepted run early
        self.spec_accepted += len(new) - 1
        output = RequestOutput(
            rid,
            0,
            new,
            self.version,
            logprobs=[-0.5] * len(new) if params.logprobs else None,
            top_logprobs=[([t], [-0.5]) for t in new] if params.top_logprobs else None,
            finish_reason=reason,
            prompt_tokens=0 if req.reported else len(req.add.prompt_token_ids),
            completion_tokens=len(req.generated),
            metrics=None if reason is None else self.metrics(req),
            spec_tokens=(req.proposed, req.accepted) if req.proposed else None,
        )
        req.reported = True
        if reason is not None:
            del self.requests[rid]
        return output

    def speculate(self, req: _Request, max_tokens: int) -> int:
        """Propose for `req` this step, if it speculates; how many of the proposals to accept
        (at most the tokens it has left after this step's one)."""
        if self.config.speculative_method == "off" or not req.add.params.speculative:
            return 0
        proposed = self.config.num_speculative_tokens
        req.proposed += proposed
        self.spec_proposed += proposed
        left = max_tokens - len(req.generated) - 1
        return max(0, min(proposed, self.knobs.get("spec_accept", 1), left))

    @staticmethod
    def metrics(req: _Request) -> RequestMetrics:
        return RequestMetrics(
            0.0, 0.0, 0.0, proposed_tokens=req.proposed, accepted_tokens=req.accepted
        )


def fake_engine_main(config: EngineConfig, conn: Connection) -> None:
    die_with_parent()  # like the real engine: never outlive the service
    _FakeEngine(config, conn).run()
