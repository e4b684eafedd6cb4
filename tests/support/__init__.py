"""Helpers the tests share: tiny checkpoints and tokenizers, live servers, fake engines,
adapters and weight trainers. Imported as `tests.support.<module>`."""
