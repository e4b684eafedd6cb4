from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tokenizer

from service.tokenizer import OFF_LOOP_ENCODE_CHARS, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory: Path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


@pytest.mark.parametrize(
    "text", ["Café naïve", "日本語のテキスト", "Emoji: 😀 🚀 ✨", "plain ascii"]
)
async def test_incremental_pieces_concatenate_to_the_full_decode(tokenizer, text):
    ids = await tokenizer.encode(text, add_special_tokens=True)
    detok = tokenizer.detokenizer(skip_special_tokens=True)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids) == text


async def test_a_multibyte_character_split_across_tokens_is_held_back(tokenizer):
    ids = await tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character spread over several tokens"
    detok = tokenizer.detokenizer()
    assert [detok.step(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1]) == "😀"


async def test_flush_releases_an_incomplete_tail(tokenizer):
    ids = await tokenizer.encode("a😀", add_special_tokens=False)
    detok = tokenizer.detokenizer()
    head = "".join(detok.step(i) for i in ids[:-1])
    assert head == "a"
    assert head + detok.flush() == tokenizer.decode(ids[:-1])


async def test_long_texts_encode_off_the_loop_to_the_same_ids(tokenizer):
    text = "The quick brown fox. " * (OFF_LOOP_ENCODE_CHARS // 10)
    fast = tokenizer._tok.encode(text).ids
    assert await tokenizer.encode(text) == fast
