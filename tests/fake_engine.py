"""A fake engine process that speaks engine/messages.py without torch, for service unit tests.

Spawnable as `fake_engine_main(config, conn)`. It "generates" by echoing the prompt's tokens
(without the first one) in a cycle, one token per request per step. Behaviour knobs live in
`<config.model>/fake.json`: step_delay (seconds per step), die_on_token (a prompt containing
this id kills the engine), hold_token (a prompt containing this id stays queued, producing
nothing, until aborted), max_model_len, vocab_size.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import EngineConfig
from engine.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineStats,
    FinishReason,
    GetState,
    Heartbeat,
    ModelInfo,
    Ready,
    RequestOutput,
    Shutdown,
    StepOutput,
)

TOTAL_PAGES = 64
EOS = 1


@dataclass
class _Request:
    add: AddRequest
    generated: list[int] = field(default_factory=list)
    reported: bool = False


def fake_engine_main(config: EngineConfig, conn: Connection) -> None:
    knobs = json.loads((Path(config.model) / "fake.json").read_text())
    info = ModelInfo(
        model="fake",
        path=config.model,
        architecture="FakeForCausalLM",
        max_model_len=knobs.get("max_model_len", 64),
        vocab_size=knobs.get("vocab_size", 320),
        eos_token_ids=[EOS],
        device="cpu",
        dtype="float32",
        page_size=4,
        total_pages=TOTAL_PAGES,
        policy_version=config.policy_version,
        max_num_seqs=8,
    )
    conn.send(Ready(info))
    requests: dict[str, _Request] = {}
    finished: list[RequestOutput] = []

    def stats() -> EngineStats:
        return EngineStats(
            running=len(requests),
            total_pages=TOTAL_PAGES,
            free_pages=TOTAL_PAGES - len(requests),
            policy_version=config.policy_version,
        )

    def finish(rid: str, reason: FinishReason, error: str | None = None) -> None:
        req = requests.pop(rid)
        finished.append(
            RequestOutput(
                rid,
                0,
                [],
                config.policy_version,
                finish_reason=reason,
                error=error,
                prompt_tokens=len(req.add.prompt_token_ids),
                completion_tokens=len(req.generated),
            )
        )

    while True:
        while conn.poll(0.0 if requests else 0.2):
            msg = conn.recv()
            match msg:
                case AddRequest():
                    if knobs.get("die_on_token") in msg.prompt_token_ids:
                        conn.send(EngineDead("told to die", ""))
                        return
                    requests[msg.request_id] = _Request(msg)
                case AbortRequests():
                    for rid in msg.request_ids:
                        if rid in requests:
                            finish(rid, msg.reason)
                case GetState():
                    conn.send(Heartbeat(stats()))
                case Shutdown():
                    for rid in list(requests):
                        finish(rid, FinishReason.ABORTED, "the server is shutting down")
                    conn.send(StepOutput(finished, stats()))
                    return
        outputs, finished = finished, []
        for rid, req in list(requests.items()):
            if req.add.deadline is not None and time.time() > req.add.deadline:
                finish(rid, FinishReason.DEADLINE_EXCEEDED)
                continue
            if knobs.get("hold_token") in req.add.prompt_token_ids:
                continue
            prompt = req.add.prompt_token_ids[1:] or req.add.prompt_token_ids
            token = prompt[len(req.generated) % len(prompt)]
            req.generated.append(token)
            params = req.add.params
            reason = None
            if token in params.stop_token_ids or (token == EOS and not params.ignore_eos):
                reason = FinishReason.STOP
            elif len(req.generated) >= (params.max_tokens or 16):
                reason = FinishReason.LENGTH
            outputs.append(
                RequestOutput(
                    rid,
                    0,
                    [token],
                    config.policy_version,
                    logprobs=[-0.5] if params.logprobs else None,
                    top_logprobs=[([token], [-0.5])] if params.top_logprobs else None,
                    finish_reason=reason,
                    prompt_tokens=0 if req.reported else len(req.add.prompt_token_ids),
                    completion_tokens=len(req.generated),
                )
            )
            req.reported = True
            if reason is not None:
                del requests[rid]
        outputs += finished
        finished = []
        if outputs:
            conn.send(StepOutput(outputs, stats()))
            time.sleep(knobs.get("step_delay", 0.0))
        elif not requests:
            conn.send(Heartbeat(stats()))
        else:
            time.sleep(0.005)  # only held requests: do not spin
