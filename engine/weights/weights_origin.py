"""WeightsOrigin: where the served weights can be read again, to wake from a level-2 sleep.

The weights at start come from the served checkpoint; each applied update changes that: a
checkpoint update replaces every tensor (its directory becomes the origin, alone), a tensor
file (inline tensors, written by the service) is read again after what came before it (the
service keeps those files until a later checkpoint update supersedes them), and in-process
tensors, live mutation or a trainer's broadcast (a distributed update) leave no copy to read:
the origin is then unknown, and the weights can only come back by an update that sets every
tensor.

A directory is read again as it is then: one rewritten since would serve other weights under
the same version. The service checks its fingerprints (ReplayLog.changed) before a Wake.
"""

from __future__ import annotations

from engine.parallel.step_channel import StepChannel
from engine.weights.sharded_update import UpdateSource, stage
from engine.weights.update_target import UpdateTarget


class WeightsOrigin:
    def __init__(self, checkpoint_dir: str) -> None:
        self.sources: list[UpdateSource] | None = [UpdateSource(checkpoint_dir=checkpoint_dir)]

    @property
    def known(self) -> bool:
        return self.sources is not None

    def record(self, source: UpdateSource) -> None:
        """An update from `source` was applied."""
        if source.checkpoint_dir is not None:
            self.sources = [source]
        elif source.tensor_file is not None and self.sources is not None:
            self.sources.append(source)
        else:
            self.forget()

    def forget(self) -> None:
        """The served weights changed in a way nothing can read again."""
        self.sources = None

    def reload(self, target: UpdateTarget, channel: StepChannel | None) -> None:
        """Fill every parameter from the origin, in order (a speculative draft model's
        tensors among them too); WeightUpdateError if a source is unreadable (what was
        already copied is then partial: the caller must not serve it)."""
        assert self.sources is not None, "reload() of an unknown origin"
        for source in self.sources:
            stage(target, source, lambda done, count: None, None, channel).apply()
