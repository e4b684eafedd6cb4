from __future__ import annotations

from service.stop_strings import StopMatch, StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, StopMatch | None]:
    sent = []
    for piece in pieces:
        result = matcher.feed(piece)
        if isinstance(result, StopMatch):
            return "".join(sent), result
        sent.append(result)
    return "".join(sent) + matcher.flush(), None


def test_stop_string_split_across_pieces_is_matched_and_excluded():
    sent, match = feed_all(StopStringMatcher(["STOP"]), ["abc S", "T", "OP tail"])
    assert sent == "abc "
    assert match == StopMatch(text="", stop="STOP")


def test_included_stop_string_ends_the_text():
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    sent, match = feed_all(matcher, ["abc ST", "OP tail"])
    assert match is not None and sent + match.text == "abc STOP"


def test_text_that_may_start_a_stop_string_is_held_back():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("hello </") == "hello "
    assert matcher.feed("b>") == "</b>"


def test_held_text_is_released_by_flush():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("x </en") == "x "
    assert matcher.flush() == "</en"


def test_earliest_stop_string_wins():
    sent, match = feed_all(StopStringMatcher(["world", "lo w"]), ["hello world"])
    assert sent == "" and match == StopMatch(text="hel", stop="lo w")


def test_without_stop_strings_text_passes_through():
    matcher = StopStringMatcher([])
    assert not matcher
    assert matcher.feed("anything") == "anything"
