"""ReplayLog: the weight updates a restarted engine must re-apply to serve what was served.

A restarted engine loads the start-up checkpoint, so every update applied since has to be
replayed, in order and at its original version, before the engine serves again; otherwise a
crash would silently roll the weights back. A checkpoint update (or any update that replaced
every tensor) supersedes everything recorded before it. A distributed update cannot be
replayed (its tensors were broadcast once, by a trainer, and nothing kept them): a log that
holds one is not `replayable`, and the EngineClient then refuses generation rather than serve
older weights under its version. The log owns the tensor files of inline updates:
it deletes a file once its update is superseded, and all of them on `clear()` (clean shutdown).

A checkpoint update is replayed by reading its directory again, so the log keeps a fingerprint
of what the directory held when the update was sent; `changed()` tells that it has been
overwritten (or removed) since, and the replay must be refused rather than serve other weights
under the recorded version.
"""

from __future__ import annotations

from dataclasses import replace

from engine.protocol.messages import InflightPolicy, UpdateWeights
from service.engine_link.checkpoint_fingerprint import checkpoint_fingerprint
from service.engine_link.tensor_file import delete_file


class ReplayLog:
    def __init__(self) -> None:
        self._entries: list[UpdateWeights] = []
        self._fingerprint: str | None = None  # of the first entry's directory, if a checkpoint

    def record(
        self,
        update: UpdateWeights,
        policy_version: int,
        fingerprint: str | None = None,
        replaced_all: bool = False,
    ) -> None:
        """A live update was applied at `policy_version` (never call this for a replay).
        `fingerprint`: a checkpoint update's checkpoint_fingerprint, taken when it was sent.
        `replaced_all`: it replaced every tensor of the model."""
        if update.checkpoint_dir is not None or replaced_all:
            self.clear()
            self._fingerprint = fingerprint
        # Replayed between two steps of an engine with nothing in flight, at the same version.
        self._entries.append(
            replace(
                update,
                policy_version=policy_version,
                inflight=InflightPolicy.CONTINUE,
                drain_timeout=None,
            )
        )

    def entries(self) -> tuple[UpdateWeights, ...]:
        """A snapshot, oldest first: replaying never changes the log."""
        return tuple(self._entries)

    def changed(self) -> UpdateWeights | None:
        """The checkpoint update to replay, if its directory no longer holds what was applied
        (rewritten, replaced or removed); None if it does, or there is none. Reads the disk."""
        first = self._entries[0] if self._entries else None
        if first is None or first.checkpoint_dir is None:
            return None
        if checkpoint_fingerprint(first.checkpoint_dir) == self._fingerprint:
            return None
        return first

    @property
    def replayable(self) -> bool:
        """False if an entry's tensors cannot be had again (a distributed update)."""
        return all(entry.distributed is None for entry in self._entries)

    @property
    def policy_version(self) -> int | None:
        """The version the replay ends at; None when there is nothing to replay."""
        return self._entries[-1].policy_version if self._entries else None

    def clear(self) -> None:
        for entry in self._entries:
            if entry.tensor_file is not None:
                delete_file(entry.tensor_file)
        self._entries = []
        self._fingerprint = None
