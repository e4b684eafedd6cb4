"""Shared fixtures: tiny checkpoints are built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import structlog

from tests.support.tiny_models import make_checkpoint

# In-process servers log to stderr, as `sluice serve` does: structlog's default is stdout, where
# their lines would mix with the output of the CLI verbs under test.
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA, untied embeddings) with its tokenizer."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")
