"""The draft model's vocabulary must be the target's: a proposal is a token id, so id i has to
mean the same token to both models.

Checked at load, before any weight is read: the same `vocab_size` (the embedding rows: every id
the target reads or samples is one the draft can read, and every id the draft proposes is one
the target can verify) and the same token for every id of `tokenizer.json` (its model's
vocabulary and its added tokens; merges, normalizer and templates are not compared: the draft
never tokenizes text, it only reads ids). Each refusal names the setting and what differs.

NOTE: pairs whose tokenizers agree but whose embedding tables are padded to different sizes
(Qwen2.5-0.5B's 151936 rows beside Qwen2.5-7B's 152064) are refused too: the first version
asks for equal tables rather than clamping ids past the draft's rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.models.hf_config import ModelConfig

TOKENIZER_FILE = "tokenizer.json"  # what the service tokenizes with (service/text/tokenizer.py)


def check_same_vocabulary(
    draft_dir: Path, draft_cfg: ModelConfig, target_dir: Path, target_cfg: ModelConfig
) -> None:
    """Raise ValueError naming `speculative_draft_model` when the draft's ids do not mean the
    target's tokens."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"speculative_draft_model: vocab_size {draft_cfg.vocab_size} differs from the "
            f"target's {target_cfg.vocab_size} (the draft needs the target's vocabulary)"
        )
    draft_file, target_file = draft_dir / TOKENIZER_FILE, target_dir / TOKENIZER_FILE
    if not target_file.is_file():
        return  # a target without one serves ids only: vocab_size is all there is to compare
    if not draft_file.is_file():
        raise ValueError(
            f"speculative_draft_model: {draft_dir} has no {TOKENIZER_FILE} to compare with "
            f"the target's (the draft needs the target's tokenizer)"
        )
    if _token_ids(draft_file) != _token_ids(target_file):
        raise ValueError(
            f"speculative_draft_model: {draft_file} maps tokens to ids other than the "
            f"target's {TOKENIZER_FILE} (the draft needs the target's tokenizer)"
        )


def _token_ids(path: Path) -> tuple[Any, list[tuple[int, str]]]:
    """What id means which token: the model's vocabulary (a token -> id map for BPE and
    WordPiece, a list of pieces for Unigram) and the added tokens."""
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
        vocab = [entry[0] for entry in vocab]
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens") or [])
    return vocab, added
