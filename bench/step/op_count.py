"""Ops a decode step dispatches outside the model forward and LM head (bench.decode's count).

A TorchDispatchMode around `step()` at some rows, greedy and in the RL setting; the forward,
LM head and a replayed graph are paused, and a launch of a fused sampler kernel counts once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any


class OpCounter:
    """Counts the aten ops dispatched while active, except inside paused calls; a call of a
    wrapped kernel launcher counts as one op however many it dispatches (the interpreter
    dispatches many)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if not counter.paused:
                    counter.ops[str(func)] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.paused = 0
        self.ops: defaultdict[str, int] = defaultdict(int)

    def excluded(self, fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name is not None and not self.paused:
                self.ops[name] += 1
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1

        return wrapped


RL_SETTING = {
    "temperature": 1.0,
    "top_p": 0.9,
    "top_k": 50,
    "logprobs": True,
    "top_logprobs": 5,
    "repetition_penalty": 1.1,
}


def count_step_ops(engine: Any, rows: int, context: int) -> dict[str, Any]:
    """Ops per decode step outside the forward, greedy and RL, at `rows` rows."""
    from engine import SamplingParams

    result: dict[str, Any] = {"rows": rows}
    model, runner = engine.runner.model, engine.runner
    for name, extra in (("greedy", {"temperature": 0.0}), ("rl", RL_SETTING)):
        params = SamplingParams(max_tokens=16, ignore_eos=True, seed=1, **extra)  # type: ignore[arg-type]
        ids = [f"ops-{name}-{i}" for i in range(rows)]
        for i, request_id in enumerate(ids):
            engine.add_request(request_id, [(i + j) % 97 for j in range(context)], params)
        while any(not r.output_token_ids for r in engine.scheduler.running) or (
            engine.scheduler.waiting
        ):
            engine.step()
        engine.step()  # a steady decode step first
        counter = OpCounter()
        patched = [(model, "forward", None), (model, "compute_logits", None)]
        if runner.graphs is not None:
            patched.append((runner.graphs, "run", None))
        if hasattr(runner.sampler, "launch"):
            patched.append((runner.sampler, "launch", "triton:fused_sample"))
        for obj, attr, op_name in patched:
            setattr(obj, attr, counter.excluded(getattr(obj, attr), op_name))
        try:
            with counter.mode:
                engine.step()
        finally:
            for obj, attr, _ in patched:
                delattr(obj, attr)
        result[name] = sum(counter.ops.values())
        result[f"{name}_ops"] = dict(sorted(counter.ops.items()))
        engine.abort(ids)
        engine.step()
    return result
