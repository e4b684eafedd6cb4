"""Where a decode step's time goes, timed from outside the engine (bench.decode's breakdown).

`instrument` wraps the parts of `LLMEngine.step()` (scheduling, the model runner, the forward
and LM head, the sampler's inputs and the sampler, the device-to-host copy) in `Timers`, as
instance attributes only, so no engine code changes; `breakdown` turns the per-step totals
into milliseconds per part and the host's share.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class Timers:
    """Wraps methods of live objects in timers; `restore()` puts the originals back.

    Durations add up per key within one engine step; when the wrapped `step` returns, the
    step's totals are appended to `steps`.
    """

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.steps: list[dict[str, float]] = []
        self.current: defaultdict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, attr: str, key: str) -> bool:
        """Time obj.attr under `key`; False (and nothing wrapped) when it does not exist."""
        original = getattr(obj, attr, None) if obj is not None else None
        if original is None:
            return False
        had_own = attr in vars(obj)
        setattr(obj, attr, self.timed(original, key))
        self._undo.append(
            (lambda: setattr(obj, attr, original)) if had_own else (lambda: delattr(obj, attr))
        )
        return True

    def timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.current[key] += time.perf_counter() - start
                if key == "step":
                    self.steps.append(dict(self.current))
                    self.current.clear()

        return timed

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


# (part, path from the engine, attribute); the engine's internals move, so parts that are not
# there are skipped and named in the result. `step`, `schedule` and `run` are required.
TIMED = [
    ("step", "", "step"),
    ("schedule", "scheduler", "schedule"),
    ("run", "runner", "run"),
    ("forward", "runner.model", "forward"),
    ("forward", "runner.graphs", "run"),  # a replayed CUDA graph is the forward
    ("lm_head", "runner.model", "compute_logits"),
    ("sampling_inputs", "runner", "_sampling_batch"),
    ("sampler", "runner", "sampler"),
    ("to_host", "runner", "_to_host"),
]


def instrument(engine: Any, timers: Timers) -> list[str]:
    """Wrap the parts of a step in `timers` from outside (instance attributes only; no engine
    code changes). Returns the parts that could not be wrapped."""
    missing = []
    graphed = getattr(engine.runner, "graphs", None) is not None
    for part, path, attr in TIMED:
        if graphed and path == "runner.model":
            continue  # inside runner.graphs.run (eager when not captured): timed as the forward
        obj = engine
        for name in filter(None, path.split(".")):
            obj = getattr(obj, name, None)
        if part == "sampler" and obj is not None and hasattr(obj, attr):
            # called as runner.sampler(...): replace the attribute with a timed function
            timers._undo.append(_attribute_restorer(obj, "sampler"))
            obj.sampler = timers.timed(obj.sampler, part)
        elif not timers.wrap(obj, attr, part):
            missing.append(f"{path}.{attr}".lstrip("."))
    required = {"step", "scheduler.schedule", "runner.run"}
    if required & set(missing):
        raise RuntimeError(f"cannot time the engine's {sorted(required & set(missing))}")
    return missing


def _attribute_restorer(obj: Any, attr: str) -> Callable[[], None]:
    value = getattr(obj, attr)

    def restore() -> None:
        setattr(obj, attr, value)

    return restore


def breakdown(steps: list[dict[str, float]]) -> dict[str, float]:
    """Milliseconds per step of each part (median over steps), and the host share.

    Per step the parts add up to the step; medians of parts need not add up exactly.
    """
    rows = []
    for seconds in steps:
        ms = defaultdict(float, {k: v * 1e3 for k, v in seconds.items()})
        inner = ("forward", "lm_head", "sampling_inputs", "sampler", "to_host")
        parts = {
            "schedule": ms["schedule"],
            "prepare_inputs": ms["run"] - sum(ms[k] for k in inner),
            "forward": ms["forward"] + ms["lm_head"],
            "sampling": ms["sampling_inputs"] + ms["sampler"],
            "to_host": ms["to_host"],
            "postprocess": ms["step"] - ms["schedule"] - ms["run"],
            "step": ms["step"],
        }
        parts["host"] = parts["step"] - parts["forward"]
        parts["host_fraction"] = parts["host"] / parts["step"]
        rows.append(parts)
    return {k: statistics.median(p[k] for p in rows) for k in rows[0]}
