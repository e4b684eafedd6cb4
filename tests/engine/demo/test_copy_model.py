"""The demo's copy model (bench/speculative.py's copy task): the demo's shape and tokenizer,
trained on the corpus plus copy units, cached under its own key while the demo's stays as it was.

Builds use a couple of training steps, as test_demo.py's do: the full recipe differs only in its
step count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from engine.attention.torch_ref import TorchRefAttention
from engine.demo import checkpoint as demo
from engine.demo.checkpoint import ensure_demo_checkpoint
from engine.demo.copy_units import CopyUnits, copy_units
from engine.models.hf_config import load_model_config
from engine.models.llama import LlamaForCausalLM
from engine.weights.loading import load_weights
from tests.support.tiny_models import load_hf_model

STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_copy_size_builds_the_demo_shape_with_the_demo_tokenizer(tmp_path: Path) -> None:
    demo_dir = ensure_demo_checkpoint(tmp_path, train_steps=STEPS)
    copy_dir = ensure_demo_checkpoint(tmp_path, train_steps=STEPS, size="copy")
    assert copy_dir.name.startswith("demo-copy-") and copy_dir.parent == tmp_path
    assert sorted(p.name for p in copy_dir.iterdir()) == sorted(p.name for p in demo_dir.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (copy_dir / name).read_bytes() == (demo_dir / name).read_bytes(), name
    assert load_model_config(copy_dir) == load_model_config(demo_dir)
    tokenizer = Tokenizer.from_file(str(copy_dir / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode("The fox\nThe").ids])
    with torch.no_grad():  # every tensor loads by its checkpoint name; transformers agrees
        ours = load_ours(copy_dir).dense_forward(ids)
        theirs = load_hf_model(copy_dir)(ids).logits
        demos = load_ours(demo_dir).dense_forward(ids)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-5)
    assert not torch.equal(ours, demos)  # trained on another stream


def test_copy_units_repeat_a_span_of_the_corpus_after_a_newline() -> None:
    corpus = demo.load_corpus()
    tokenizer = demo.train_tokenizer(corpus, demo.RECIPE.vocab_size)
    eos = tokenizer.token_to_id(demo.EOS)
    units = CopyUnits(share=0.25, min_words=3, max_words=6, min_repeats=2, max_repeats=3)
    ids = copy_units(
        units, demo.paragraphs(corpus), lambda t: tokenizer.encode(t).ids, eos, 3000, seed=0
    )
    assert 1000 <= len(ids) < 1000 + 40  # a third of the plain tokens: a quarter of the stream
    texts = tokenizer.decode_batch(_split(ids, eos))
    assert len(texts) > 20
    running = " ".join(corpus.split())
    for text in texts:
        lines = text.split("\n")
        assert 2 <= len(lines) <= 3 and len(set(lines)) == 1, text
        assert 3 <= len(lines[0].split()) <= 6
        assert lines[0] in running  # a span of running text (none scrambled here)


def test_replaced_words_are_copied_too() -> None:
    """A running-text span with words replaced: each copy the same, the replaced words drawn
    from the corpus's words, about the share asked of them no longer the corpus's text."""
    corpus = demo.load_corpus()
    tokenizer = demo.train_tokenizer(corpus, demo.RECIPE.vocab_size)
    eos = tokenizer.token_to_id(demo.EOS)
    assert eos is not None
    units = CopyUnits(share=0.25, min_words=8, max_words=8, replaced=0.5)
    ids = copy_units(
        units, demo.paragraphs(corpus), lambda t: tokenizer.encode(t).ids, eos, 6000, seed=0
    )
    vocabulary = set(corpus.split())
    running = " ".join(corpus.split())
    kept = total = 0
    for text in tokenizer.decode_batch(_split(ids, eos)):
        lines = text.split("\n")
        assert len(set(lines)) == 1, text
        words = lines[0].split()
        assert len(words) == 8 and set(words) <= vocabulary
        # a word kept where it and its neighbour are a pair of running text
        kept += sum(f"{a} {b}" in running for a, b in itertools.pairwise(words))
        total += len(words) - 1
    assert 0.15 < kept / total < 0.5  # both of a pair kept: about (1 - 0.5)^2 of them


def test_the_copy_units_are_in_the_copy_recipe_stream_only() -> None:
    corpus = demo.load_corpus()
    tokenizer = demo.train_tokenizer(corpus, demo.RECIPE.vocab_size)
    plain = demo.training_stream(tokenizer, corpus, demo.RECIPE)
    with_copies = demo.training_stream(tokenizer, corpus, demo.COPY_RECIPE)
    units = demo.COPY_RECIPE.copy
    assert units is not None
    tiled = len(plain) * units.corpus_copies  # the corpus, that many times over
    assert torch.equal(with_copies[:tiled], plain.repeat(units.corpus_copies))
    share = 1 - tiled / len(with_copies)
    assert share == pytest.approx(units.share, abs=0.01)


def test_corpus_copies_multiply_the_units_not_the_corpus_share() -> None:
    """Tiling the corpus k times makes k times as many units (a pool too large to memorise)
    while a window is still a unit `share` of the time."""
    corpus = demo.load_corpus()
    tokenizer = demo.train_tokenizer(corpus, demo.RECIPE.vocab_size)
    plain = demo.training_stream(tokenizer, corpus, demo.RECIPE)
    lengths = {}
    for copies in (1, 3):
        units = CopyUnits(share=0.5, scrambled=1.0, corpus_copies=copies)
        recipe = dataclasses.replace(demo.RECIPE, copy=units)
        stream = demo.training_stream(tokenizer, corpus, recipe)
        assert torch.equal(stream[: len(plain) * copies], plain.repeat(copies))
        lengths[copies] = len(stream) - len(plain) * copies
        assert lengths[copies] / len(stream) == pytest.approx(0.5, abs=0.01)
    assert lengths[3] == pytest.approx(3 * lengths[1], rel=0.01)


def test_the_demo_cache_key_is_the_one_before_copy_units_existed() -> None:
    """.ci builds the demo under its key: a recipe without copy units hashes as the fields it had
    before the `copy` field (CI's cache and time budget stay as they were)."""
    corpus, template = demo.load_corpus(), demo.load_chat_template()
    for recipe in (demo.RECIPE, demo.DRAFT_RECIPE):
        before = {k: v for k, v in dataclasses.asdict(recipe).items() if k != "copy"}
        digest = hashlib.sha256(json.dumps(before, sort_keys=True).encode())
        digest.update(corpus.encode())
        digest.update(template.encode())
        assert recipe.fingerprint(corpus, template) == digest.hexdigest()[:16]
    copied = demo.COPY_RECIPE.fingerprint(corpus, template)
    assert copied != dataclasses.replace(demo.COPY_RECIPE, copy=None).fingerprint(corpus, template)


def load_ours(directory: Path) -> LlamaForCausalLM:
    cfg = load_model_config(directory)
    model = LlamaForCausalLM(cfg, TorchRefAttention(scale=cfg.head_dim**-0.5))
    load_weights(model, directory)  # every tensor by its checkpoint name, none left over
    return model.eval()


def _split(ids: list[int], eos: int) -> list[list[int]]:
    units, current = [], []
    for token in ids:
        if token == eos:
            units.append(current)
            current = []
        else:
            current.append(token)
    assert current == []  # every unit ends with EOS
    return units
