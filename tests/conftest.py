"""Shared fixtures: tiny checkpoints are built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA, untied embeddings) with its tokenizer."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")
