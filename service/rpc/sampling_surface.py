"""The sampling surface of a GenerateRequest: its bounds, and bad_words as token sequences.

Counts and lengths are judged first, before anything copies or tokenizes the lists, so a
request that is too large costs no more than receiving it. The engine has no tokenizer: each
bad word travels as token sequences (SamplingParams.bad_word_ids), made as vLLM makes them.
"""

from __future__ import annotations

from sluice.v1 import generation_pb2 as pb

from engine.protocol.messages import MAX_LOGIT_BIAS, MAX_TOKEN_ID_LIST
from service.text.tokenizer import Tokenizer

# Each bad word is two sequences at most (alone and after a space): the engine's
# MAX_BAD_WORD_IDS (128) sequences for 64 words.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 128


def surface_violations(s: pb.SamplingParams) -> list[tuple[str, str]]:
    """The surface's counts and bad words' lengths (the engine's SamplingParams.errors judges
    ids and values, from lists these bound)."""
    errors: list[tuple[str, str]] = []
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        errors.append(("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries"))
    for name in ("allowed_token_ids", "bad_token_ids"):
        if len(getattr(s, name)) > MAX_TOKEN_ID_LIST:
            errors.append((f"sampling.{name}", f"at most {MAX_TOKEN_ID_LIST} ids"))
    if len(s.bad_words) > MAX_BAD_WORDS:
        errors.append(("sampling.bad_words", f"at most {MAX_BAD_WORDS} strings"))
    elif any(len(w) > MAX_BAD_WORD_CHARS for w in s.bad_words):
        errors.append(("sampling.bad_words", f"at most {MAX_BAD_WORD_CHARS} characters each"))
    elif any(not w.strip() for w in s.bad_words):
        errors.append(("sampling.bad_words", "must not be empty or only spaces"))
    return errors


async def bad_word_ids(words: list[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, as vLLM's SamplingParams makes them: the word (leading
    spaces stripped) without special tokens, and " " + word when that starts with another
    token and has as many (the word in the middle of a text); duplicates once."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        word = word.lstrip()
        alone = tuple(await tokenizer.encode(word, add_special_tokens=False))
        spaced = tuple(await tokenizer.encode(" " + word, add_special_tokens=False))
        sequences.append(alone)
        if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(dict.fromkeys(s for s in sequences if s))
