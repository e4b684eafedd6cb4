"""DraftMemory: the speculative draft model's weights and KV pool (`--speculative-method
draft`), which a Sleep frees with the target's and a Wake brings back.

Level 1 frees the draft's KV pool (every request has ended, so its proposer holds no page),
level 2 its weights too. A Wake reads the weights again from the draft's checkpoint directory,
before the model's origin is replayed: the draft tensors of the update files replayed then
follow (engine/weights/update_target.py), and a draft set in-process or over a trainer's group
comes back as its checkpoint's. The draft has no CUDA graphs to capture again.
"""

from __future__ import annotations

from pathlib import Path

from engine.kv_cache.page_pool import PagePool
from engine.models.base import CausalLM
from engine.sleep.model_memory import ModelMemory
from engine.weights.loading import load_weights


class DraftMemory:
    def __init__(self, model: CausalLM, pool: PagePool, directory: Path) -> None:
        """The draft `model` loaded from `directory`, and its KV `pool`."""
        self.memory = ModelMemory(model, pool, None)
        self.directory = directory

    def release(self, level: int) -> int:
        """Free the KV pool (if still held) and, at level 2, the weights: the bytes freed."""
        freed = 0 if self.memory.kv_released else self.memory.release_kv()
        if level == 2 and not self.memory.weights_released:
            freed += self.memory.release_weights()
        return freed

    def restore(self) -> None:
        """Read the weights again if they were freed, then reallocate the KV pool. Raises what
        reading the checkpoint raises (the weights are then freed again)."""
        if self.memory.weights_released:
            self.memory.restore_weights()
            try:
                load_weights(self.memory.model, self.directory)
            except BaseException:
                self.memory.release_weights()  # NOTE: partly loaded weights never propose
                raise
            self.memory.mark_filled()
            self.memory.prepack_weights()
        if self.memory.kv_released:
            self.memory.restore_kv()
