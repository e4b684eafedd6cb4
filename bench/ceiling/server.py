"""The service under bench.ceiling.run: the real server in front of an instant engine.

Run as a script, `python bench/ceiling/server.py MODEL_DIR`, with SLUICE_CEILING_TREE naming
the checkout whose `service/` is measured (the current one by default, or a baseline revision's
worktree: this file is then imported from outside that tree, which is why it is a script, not a
module of the `bench` package). It prints the port on stdout once SERVING, and drains and exits
on SIGTERM.

The engine is `ceiling_engine`, a stand-in that speaks engine/protocol/messages.py and costs almost
nothing: every running request gets one token per step, a step every `step_interval` seconds
(`<MODEL_DIR>/ceiling.json`), so the offered rate is streams / step_interval. It records when it
sent each step and at which step each request got its first token; at Shutdown it writes both to
`<MODEL_DIR>/steps.json`, from which the bench computes each token's delay from engine output to
client (time.monotonic is one clock for every process of the machine).

With `record_writes` in the knobs (the bench sets it at low load), the server also records when
each token reached the service's router and when the `tokens` event carrying it was written
(`record_writes` below), and writes both to `<MODEL_DIR>/writes.json` at exit: the service's own
share of a token's delay, from its arrival to grpc.aio's completed write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

TREE = os.environ.get("SLUICE_CEILING_TREE") or str(Path(__file__).resolve().parents[2])
sys.path[:0] = [TREE, os.path.join(TREE, "clients", "python")]

from engine.protocol.config import EngineConfig  # noqa: E402
from engine.protocol.messages import (  # noqa: E402
    AbortRequests,
    AddRequest,
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


def ceiling_engine(config: EngineConfig, conn: Connection) -> None:
    """The stand-in engine (spawned by the service like the real one)."""
    # NOTE: the stand-in keeps its pace ahead of the service and the clients on a busy
    # machine (a GPU engine's pace does not depend on the host's load); without the right
    # to raise its priority it runs at the default one, and the bench reports what it sent.
    with contextlib.suppress(PermissionError):
        os.nice(-10)
    model = Path(config.model)
    knobs = json.loads((model / "ceiling.json").read_text())
    interval: float = knobs["step_interval"]
    conn.send(Ready(_model_info(model, knobs["vocab_size"])))
    running: dict[str, tuple[AddRequest, int]] = {}  # id -> (request, tokens sent)
    ended: list[RequestOutput] = []
    steps: list[float] = []  # when step k was sent
    sizes: list[int] = []  # how many tokens it carried
    first_step: dict[str, int] = {}
    next_step = time.monotonic()
    while True:
        wait = max(0.0, next_step - time.monotonic()) if running else 0.5
        while conn.poll(wait):
            wait = 0.0
            match conn.recv():
                case AddRequest() as add:
                    running[add.request_id] = (add, 0)
                case AbortRequests(request_ids=ids, reason=reason):
                    for rid in ids:
                        if running.pop(rid, None) is not None:
                            ended.append(RequestOutput(rid, 0, [], 0, finish_reason=reason))
                case GetState():
                    conn.send(Heartbeat(EngineStats(running=len(running))))
                case Shutdown():
                    (model / "steps.json").write_text(
                        json.dumps({"steps": steps, "sizes": sizes, "first_step": first_step})
                    )
                    for rid in running:
                        ended.append(
                            RequestOutput(rid, 0, [], 0, finish_reason=FinishReason.ABORTED)
                        )
                    conn.send(StepOutput(ended, EngineStats()))
                    return
        if not running:
            if ended:
                conn.send(StepOutput(ended, EngineStats()))
                ended = []
            conn.send(Heartbeat(EngineStats()))
            continue
        outputs, ended = ended, []
        outputs += _one_token_each(running, first_step, len(steps))
        steps.append(time.monotonic())
        sizes.append(sum(1 for o in outputs if o.new_token_ids))
        conn.send(StepOutput(outputs, EngineStats(running=len(running))))
        # A fixed pace, like a GPU's step time; a late step does not make the next one early.
        next_step = max(next_step + interval, time.monotonic())


def _model_info(model: Path, vocab_size: int) -> ModelInfo:
    return ModelInfo(
        model="ceiling",
        path=str(model),
        architecture="Ceiling",
        max_model_len=1 << 20,
        vocab_size=vocab_size,
        eos_token_ids=[0],
        device="cpu",
        dtype="float32",
        page_size=16,
        total_pages=1 << 16,
        policy_version=0,
        max_num_seqs=4096,
    )


def _one_token_each(
    running: dict[str, tuple[AddRequest, int]], first_step: dict[str, int], step: int
) -> list[RequestOutput]:
    """One step's outputs: the next token of every running request (its prompt, cycled), which
    finishes LENGTH at its max_tokens; updates `running` and each new request's first step."""
    outputs = []
    for rid, (add, sent) in list(running.items()):
        prompt = add.prompt_token_ids
        done = sent + 1 >= (add.params.max_tokens or 1 << 30)
        if sent == 0:
            first_step[rid] = step
        outputs.append(
            RequestOutput(
                rid,
                0,
                [prompt[sent % len(prompt)]],
                0,
                finish_reason=FinishReason.LENGTH if done else None,
                prompt_tokens=len(prompt) if sent == 0 else 0,
                completion_tokens=sent + 1,
            )
        )
        if done:
            del running[rid]
        else:
            running[rid] = (add, sent + 1)
    return outputs


Write = tuple[str, int, int, float]  # request id, position of its first token, tokens, done


def record_writes(servicer_class: Any, router_class: Any) -> tuple[list[Write], dict[str, Any]]:
    """Wrap the servicer's per-request event generator so that, each time a `tokens` event has
    been written (grpc.aio resumes a handler only after its write; a GenerateStream pump only
    after the call wrote its event), (request id, position of its first token, tokens, now) is
    appended to the first list returned; and the router, so that the arrival of each request's
    k-th token is the second's ["request id k"]. One generator layer and a clock read per
    message: low load only."""
    writes: list[Write] = []
    arrivals: dict[str, float] = {}
    # The generator is `events` since the OpenAI and worker-protocol fronts share it; `_run` before.
    events_name = "events" if hasattr(servicer_class, "events") else "_run"
    run, route = getattr(servicer_class, events_name), router_class.route

    def timed_route(self: Any, output: Any) -> Any:
        # The stand-in numbers tokens by completion_tokens: this output's is the last.
        arrivals[f"{output.request_id} {output.completion_tokens - 1}"] = time.monotonic()
        return route(self, output)

    async def timed_run(self: Any, submitted: Any) -> AsyncIterator[Any]:
        request_id = submitted.admission.request.request_id
        position = 0
        async with contextlib.aclosing(run(self, submitted)) as events:
            async for event in events:
                yield event
                if event.WhichOneof("event") == "tokens":
                    count = len(event.tokens.token_ids)
                    writes.append((request_id, position, count, time.monotonic()))
                    position += count

    setattr(servicer_class, events_name, timed_run)
    router_class.route = timed_route
    return writes, arrivals


async def serve(model_dir: str) -> None:
    from engine.logs import configure_logging
    from service.config import ServiceConfig
    from service.server import create_server

    try:
        from service.engine_link.routing import RequestRouter
        from service.rpc.servicer import GenerationServicer
    except ModuleNotFoundError:  # a baseline revision from before service/ had subpackages
        from service.routing import RequestRouter
        from service.servicer import GenerationServicer

    writes: list[Write] = []
    arrivals: dict[str, float] = {}
    knobs = json.loads((Path(model_dir) / "ceiling.json").read_text())
    if knobs.get("record_writes"):
        writes, arrivals = record_writes(GenerationServicer, RequestRouter)
    # Only when set: a baseline revision's ServiceConfig may not have it.
    extra = {"stream_interval": knobs["stream_interval"]} if knobs.get("stream_interval") else {}
    engine = EngineConfig(model=model_dir, device="cpu", dtype="float32")
    config = ServiceConfig(
        engine=engine, host="127.0.0.1", port=0, max_concurrent_rpcs=100_000, **extra
    )
    configure_logging(engine.log_level, engine.log_format, process="service")
    server, port = create_server(config, ceiling_engine)
    await server.start()
    await server.wait_ready(timeout=60)
    print(port, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
    (Path(model_dir) / "writes.json").write_text(
        json.dumps({"writes": writes, "arrivals": arrivals})
    )


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(
            "usage: python bench/ceiling/server.py MODEL_DIR (bench.ceiling.run starts it)"
        )
    if os.environ.get("SLUICE_CEILING_PROFILE"):  # cProfile of the event loop's thread
        import cProfile

        cProfile.run("asyncio.run(serve(sys.argv[1]))", os.environ["SLUICE_CEILING_PROFILE"])
    else:
        asyncio.run(serve(sys.argv[1]))
