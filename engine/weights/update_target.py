"""UpdateTarget: the tensors a weight update may set, by name: the served model's checkpoint
names, and, with `--speculative-method draft`, the draft model's under `draft.`.

A trainer that trains its draft beside its policy sends the draft's tensors in the same update
as the policy's, each named `draft.` + its name in the draft's checkpoint
(`draft.model.layers.0.mlp.up_proj.weight`): inline, from a tensor file, in-process or over a
trainer's group, under the update's one version. A checkpoint directory holds the model's
tensors alone (every one of them, as without a draft). "Every tensor" (an update that must set
all of them, APPLIED's replaced_all) always means the model's: the draft's are optional.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.base import CausalLM
from engine.parallel.shard_layout import ShardLayout, Split
from engine.parallel.tensor_parallel import TensorParallel
from engine.weights.in_format import InFormatTensors, in_format

DRAFT_PREFIX = "draft."


class UpdateTarget:
    def __init__(self, model: CausalLM, draft: CausalLM | None = None) -> None:
        self.model = model
        self.draft = draft
        self.tp: TensorParallel = model.tp
        self.sharding: ShardLayout = (
            model.sharding if draft is None else _DraftLayout(model.sharding, draft.sharding)
        )

    def for_source(self, checkpoint_dir: str | None) -> UpdateTarget:
        """What a source may set: a checkpoint directory, the model's tensors alone."""
        return UpdateTarget(self.model) if checkpoint_dir is not None else self

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """CausalLM.checkpoint_tensors of the model, then of the draft (prefixed)."""
        tensors = self.model.checkpoint_tensors()
        if self.draft is not None:
            draft = self.draft.checkpoint_tensors()
            tensors |= {DRAFT_PREFIX + name: t for name, t in draft.items()}
        return tensors

    def in_format(self) -> InFormatTensors:
        """The in-format tensors of the model and the draft (prefixed)."""
        slots = in_format(self.model).slots
        if self.draft is not None:
            draft = in_format(self.draft).slots
            slots |= {DRAFT_PREFIX + name: slot for name, slot in draft.items()}
        return InFormatTensors(slots)

    def model_tensors(self, names: Iterable[str]) -> int:
        """How many of `names` are the model's (not the draft's)."""
        return sum(not name.startswith(DRAFT_PREFIX) for name in names)


class _DraftLayout(ShardLayout):
    """The model's layout, and the draft's for names under DRAFT_PREFIX."""

    def __init__(self, model: ShardLayout, draft: ShardLayout) -> None:
        self.model, self.draft = model, draft
        self.rank, self.size = model.rank, model.size

    def split(self, name: str) -> Split | None:
        if name.startswith(DRAFT_PREFIX):
            return self.draft.split(name.removeprefix(DRAFT_PREFIX))
        return self.model.split(name)

    def for_rank(self, rank: int) -> ShardLayout:
        return _DraftLayout(self.model.for_rank(rank), self.draft.for_rank(rank))
