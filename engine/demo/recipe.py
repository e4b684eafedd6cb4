"""What determines each demo checkpoint's bytes (with the corpus text and the chat template):
the demo's recipe and those of its draft and copy models (checkpoint.py builds them)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from engine.demo.copy_units import CopyUnits


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines the demo checkpoint's bytes (with the corpus text)."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 2
    context: int = 128  # training window; also the served max_position_embeddings
    batch_size: int = 4  # small batches, many steps: the best loss per CPU-second measured
    steps: int = 1100
    warmup_steps: int = 50
    lr: float = 3e-3  # 4e-3 and up sometimes stall for hundreds of steps at the unigram loss
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    init_std: float = 0.02
    bare_space_rate: float = 0.05  # see checkpoint._token_stream
    seed: int = 0
    # Bump when the training code changes what a recipe produces, so caches built by the old
    # code are not mistaken for the new. 2: merged q/k/v and gate/up GEMMs (the same
    # initialisation; the training steps round differently).
    code_version: int = 2
    copy: CopyUnits | None = None  # copy units in the training stream (the copy model's)

    def __post_init__(self) -> None:
        assert self.hidden_size % self.num_heads == 0, "hidden_size must divide into heads"
        assert self.steps > 0 and self.batch_size > 0 and self.context > 1

    def fingerprint(self, corpus: str, chat_template: str) -> str:
        fields = dataclasses.asdict(self)
        if self.copy is None:  # NOTE: keeps the keys of caches built before the field existed
            del fields["copy"]
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
        digest.update(corpus.encode())
        digest.update(chat_template.encode())
        return digest.hexdigest()[:16]


RECIPE = DemoRecipe()
# The demo's draft model, for speculative decoding's `draft` method (--speculative-draft-model):
# the same corpus, steps and vocabulary size, hence the same tokenizer (trained from the same
# text at the same size: identical files), at half the width and half the depth.
DRAFT_RECIPE = dataclasses.replace(RECIPE, hidden_size=64, intermediate_size=192, num_layers=2)
# The demo's copy model, for bench/speculative.py's copy task: the demo, but for copy units in
# its training stream and the longer training they need (docs/benchmarks.md: what was measured).
# Copying (induction heads) formed only where copy units are most of the stream, short,
# repeated often and too many to memorise (the corpus tiled 8 times), after about a million
# tokens; copying random words alone gave way to the memorised corpus on a passage of it, so
# half the spans are running text with words that only copying predicts (`replaced`).
# About 630 CPU-seconds at one thread, once (never in CI).
COPY_RECIPE = dataclasses.replace(
    RECIPE,
    steps=5000,
    batch_size=8,
    copy=CopyUnits(
        share=0.7,
        min_words=4,
        max_words=24,
        min_repeats=3,
        max_repeats=6,
        scrambled=0.5,
        replaced=0.3,
        corpus_copies=8,
    ),
)
SIZES = ("demo", "draft", "copy")
