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


def test_max_token_bytes_is_the_longest_token_string_in_utf8(tokenizer):
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    assert tokenizer.max_token_bytes == max(len(s.encode()) for s in vocab) == len("unhappy")


@pytest.mark.parametrize(
    "text", ["unhappy " * 30, "unhappyunhappy" * 20, "日本語 😀 " * 20, "x" * 500, "  \n\t " * 50]
)
async def test_no_text_encodes_to_fewer_tokens_than_its_size_allows(tokenizer, text):
    ids = await tokenizer.encode(text, add_special_tokens=False)
    assert len(text.encode()) <= tokenizer.max_text_bytes(len(ids))


def test_a_normalizer_that_shrinks_text_widens_the_bound(tmp_path):
    from tokenizers import normalizers

    tok = make_tokenizer()
    tok.normalizer = normalizers.NFKC()  # mathematical bold letters (4 bytes) become ASCII
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    # "unhappy " in mathematical bold letters (U+1D400 block), each 4 bytes in UTF-8
    text = "".join(chr(0x1D41A + ord(c) - ord("a")) for c in "unhappy") + " "
    text *= 20
    tokens = len(tok.encode(text, add_special_tokens=False).ids)
    assert len(text.encode()) > tokens * tokenizer.max_token_bytes  # one token, many bytes
    assert len(text.encode()) <= tokenizer.max_text_bytes(tokens)
