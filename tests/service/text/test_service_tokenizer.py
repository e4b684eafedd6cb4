from __future__ import annotations

import random
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest

from service.text import fast_decode
from service.text.fast_decode import MetaspaceTable
from service.text.tokenizer import OFF_LOOP_ENCODE_CHARS, Tokenizer, WindowStream
from tests.support.tiny_models import make_llama2_tokenizer, make_tokenizer


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


# Incremental detokenization against `tokenizers` itself, on random id sequences. The per-id
# tables (service/text/fast_decode.py) must give, token by token, exactly the characters that are
# complete so far, and with flush() exactly `decode(all ids)`.

SAMPLE_TEXTS = [
    "日本語のテキスト。中文文本。",
    "Emoji: 😀 🚀 🌍 ✨ and more",
    "Café naïve façade jalapeño",
    "Ελληνικά. Русский текст.",
    "← → ∑ ∞ ≈ ≠ ± °C €100 £5 ¥300",
    "The quick brown fox jumps over the lazy dog.",
]
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def byte_level_with_added_tokens() -> Any:
    """The tiny byte-level BPE plus added tokens whose strings fall outside the byte alphabet
    (`tokenizers` decodes those as their own UTF-8) or inside it ("¡" alone is byte 0xA1, "é!"
    is 0xE9 0x21), and a normalized one that decodes in its normalized form ("école")."""
    from tokenizers import AddedToken, normalizers

    tok = make_tokenizer()
    tok.normalizer = normalizers.Lowercase()
    tok.add_tokens([AddedToken(" hello", normalized=False), "é!", "Ġx", "¡", "ÉCOLE"])
    tok.add_special_tokens(["<|im_end|>"])
    return tok


def load(tok: Any, directory: Path) -> Tokenizer:
    tok.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


@pytest.fixture(scope="module")
def tokenizers_under_test(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    builders = {
        "byte-level": make_tokenizer,
        "byte-level, added tokens": byte_level_with_added_tokens,
        "llama2": make_llama2_tokenizer,
    }
    return {name: load(build(), tmp_path_factory.mktemp("tok")) for name, build in builders.items()}


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    """The pieces `step` returns for ids, then flush()'s."""
    detok = tokenizer.detokenizer(skip_special_tokens)
    return [detok.step(i) for i in ids] + [detok.flush()]


def random_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    """Ids drawn from the whole vocabulary (single bytes of multi-byte characters, special and
    added tokens, ids past the vocabulary), from the tokens that are whole characters, and from
    encoded text cut at random places with random tokens inserted."""
    size = tokenizer.vocab_size
    match rng.randrange(3):
        case 0:
            return [rng.randrange(size + 3) for _ in range(rng.randrange(1, 16))]
        case 1:
            whole = [i for i in range(size) if not is_byte(tokenizer, i)]
            return [rng.choice(whole) for _ in range(rng.randrange(1, 16))]
    text = "".join(rng.choice(SAMPLE_TEXTS)[rng.randrange(8) :][:12] for _ in range(3))
    ids = tokenizer._tok.encode(text, add_special_tokens=False).ids
    for _ in range(rng.randrange(3)):
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(size))
    return ids


def is_byte(tokenizer: Tokenizer, token_id: int) -> bool:
    """Whether the token may stand for part of a character: a byte-fallback token, or one
    that decodes to U+FFFD alone."""
    token = tokenizer._tok.id_to_token(token_id) or ""
    return bool(BYTE_TOKEN.fullmatch(token)) or "\ufffd" in tokenizer.decode([token_id], False)


def dropped(tokenizer: Tokenizer, token_id: int, skip: bool) -> bool:
    """Whether `decode` drops the token before its decoder sees it."""
    special = tokenizer.decode([token_id], True) != tokenizer.decode([token_id], False)
    return tokenizer._tok.id_to_token(token_id) is None or (skip and special)


def complete_so_far(tokenizer: Tokenizer, ids: list[int], skip: bool) -> str:
    """The text a token stream without invalid UTF-8 has completed after `ids`: for byte-level,
    the decode without the incomplete character at its end; for byte fallback, the decode up
    to the last token that ends a run of byte tokens (a later byte may still turn the run into
    U+FFFDs), which a dropped token (unknown, or special while skipping them) does not."""
    if isinstance(tokenizer._decode_tables[skip], MetaspaceTable):
        ends = [
            i
            for i, t in enumerate(ids)
            if not dropped(tokenizer, t, skip) and not is_byte(tokenizer, t)
        ]
        return tokenizer.decode(ids[: ends[-1] + 1] if ends else [], skip)
    return tokenizer.decode(ids, skip).removesuffix("\ufffd")


@pytest.mark.parametrize("name", ["byte-level", "byte-level, added tokens", "llama2"])
def test_the_fast_path_serves_byte_level_and_llama2_tokenizers(tokenizers_under_test, name):
    tables = tokenizers_under_test[name]._decode_tables
    assert tables[False] is not None and tables[True] is not None


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", ["byte-level", "byte-level, added tokens", "llama2"])
def test_pieces_and_flush_concatenate_to_decode_for_random_ids(tokenizers_under_test, name, skip):
    tokenizer = tokenizers_under_test[name]
    rng = random.Random(f"{name}{skip}")
    for _ in range(300):
        ids = random_ids(tokenizer, rng)
        pieces = stream(tokenizer, ids, skip)
        full = tokenizer.decode(ids, skip)
        assert "".join(pieces) == full, ids
        for k in range(len(ids)):  # what a step returned is never taken back
            assert full.startswith("".join(pieces[: k + 1])), ids


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", ["byte-level", "byte-level, added tokens", "llama2"])
def test_each_step_releases_exactly_the_completed_text(tokenizers_under_test, name, skip):
    tokenizer = tokenizers_under_test[name]
    rng = random.Random(f"{name}{skip}")
    same_as_decode_stream = 0
    for _ in range(200):
        ids = random_ids(tokenizer, rng)
        if "\ufffd" in tokenizer.decode(ids, skip):
            continue  # invalid UTF-8: the contract test covers it
        pieces = stream(tokenizer, ids, skip)[:-1]
        released = list(accumulate(pieces))
        assert released == [complete_so_far(tokenizer, ids[: k + 1], skip) for k in range(len(ids))]
        # DecodeStream also holds back complete characters that share a token with the start
        # of the next one; where it does not, its pieces are the same.
        window = WindowStream(tokenizer, skip)
        theirs = [window.step(i) for i in ids]
        if list(accumulate(theirs)) == released:
            same_as_decode_stream += 1
            assert theirs == pieces
    assert same_as_decode_stream > 50


def test_a_lone_continuation_byte_is_replaced_where_decode_replaces_it(tokenizers_under_test):
    tokenizer = tokenizers_under_test["byte-level"]
    lone = tokenizer._tok.token_to_id("Ģ")  # the byte 0x80 alone
    head = [*tokenizer._tok.encode("ok ", add_special_tokens=False).ids, lone]
    ids = head + tokenizer._tok.encode("日本", add_special_tokens=False).ids
    pieces = stream(tokenizer, ids, True)
    assert "".join(pieces) == tokenizer.decode(ids) == "ok \ufffd日本"
    assert pieces[len(head) - 1] == "\ufffd"  # released at once, as decode would have it


def test_an_invalid_byte_run_turns_into_one_replacement_per_byte(tokenizers_under_test):
    tokenizer = tokenizers_under_test["llama2"]
    tokens = ["▁o", "<0xE6>", "<0x97>", "<0xA5>", "<0x80>", "k"]
    ids = [tokenizer._tok.token_to_id(t) for t in tokens]
    pieces = stream(tokenizer, ids, True)
    # The run's first three bytes are "日", but the fourth makes the whole run invalid.
    assert pieces == ["o", "", "", "", "", "\ufffd" * 4 + "k", ""]
    assert "".join(pieces) == tokenizer.decode(ids)


def test_a_skipped_special_token_does_not_end_a_byte_run(tokenizers_under_test):
    tokenizer = tokenizers_under_test["llama2"]
    tokens = ["<0xE6>", "<s>", "<0x97>", "<0xA5>", "▁o"]
    ids = [tokenizer._tok.token_to_id(t) for t in tokens]
    assert "".join(stream(tokenizer, ids, True)) == tokenizer.decode(ids, True) == "日 o"
    assert "".join(stream(tokenizer, ids, False)) == tokenizer.decode(ids, False)


def test_a_table_that_disagrees_with_decode_falls_back(tmp_path, monkeypatch):
    alphabet = fast_decode.byte_level_alphabet()
    alphabet["a"], alphabet["b"] = alphabet["b"], alphabet["a"]
    monkeypatch.setattr(fast_decode, "byte_level_alphabet", lambda: alphabet)
    tokenizer = load(make_tokenizer(), tmp_path)
    assert tokenizer._decode_tables == {False: None, True: None}
    ids = tokenizer._tok.encode("a b 😀", add_special_tokens=False).ids
    assert "".join(stream(tokenizer, ids, True)) == tokenizer.decode(ids)


def test_another_decoder_falls_back_to_decode_stream(tmp_path):
    from tokenizers import decoders

    tok = make_llama2_tokenizer()
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer = load(tok, tmp_path)
    assert tokenizer._decode_tables == {False: None, True: None}
    ids = tokenizer._tok.encode("the sea was calm", add_special_tokens=False).ids
    pieces = stream(tokenizer, ids, True)
    assert "".join(pieces) == tokenizer.decode(ids) == "the sea was calm"
