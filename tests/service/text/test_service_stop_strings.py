from __future__ import annotations

import random

from service.text.stop_strings import StopMatch, StopStringMatcher


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


def test_a_longer_stop_string_at_the_same_start_wins():
    sent, match = feed_all(StopStringMatcher(["ab", "abc"]), ["xabcx"])
    assert sent == "" and match == StopMatch(text="x", stop="abc")


def test_a_stop_string_completed_by_an_earlier_piece_wins_over_a_longer_one():
    # "bc" is complete when "xabc" arrives; "abcd" would have started earlier but is not yet.
    sent, match = feed_all(StopStringMatcher(["abcd", "bc"]), ["xabc", "d"])
    assert sent == "" and match == StopMatch(text="xa", stop="bc")
    sent, match = feed_all(StopStringMatcher(["abcd", "bc"]), ["xabcd"])
    assert match == StopMatch(text="x", stop="abcd")


def test_a_failed_partial_match_keeps_the_suffix_that_may_still_match():
    matcher = StopStringMatcher(["aab"])
    assert [matcher.feed(p) for p in ["a", "a", "a"]] == ["", "", "a"]
    assert matcher.feed("b") == StopMatch(text="", stop="aab")


def test_overlapping_stop_strings_split_over_many_pieces():
    stops = ["abac", "bab", "cabx"]
    sent, match = feed_all(StopStringMatcher(stops), ["ab", "a", "ba", "c"])
    assert (sent, match) == ("", StopMatch(text="a", stop="bab"))
    sent, match = feed_all(StopStringMatcher(stops), ["c", "ab", "ac", "aby"])
    assert (sent, match) == ("", StopMatch(text="c", stop="abac"))


def test_text_is_held_while_it_may_still_become_a_long_stop_string():
    matcher = StopStringMatcher(["hello world", "low"])
    assert matcher.feed("say hel") == "say "
    assert matcher.feed("lo wor") == ""  # contains "lo w", not "low"
    assert matcher.feed("ms") == "hello worms"


def _reference(stops: list[str], pieces: list[str]) -> tuple[str, StopMatch | None]:
    """The spec, by brute force: after each piece, the stop string that starts first (then the
    longest) among those in the text so far ends it; else all text is released in the end."""
    text = ""
    for piece in pieces:
        text += piece
        found = [(text.find(s), -len(s), s) for s in stops if s and s in text]
        if found:
            start, _, stop = min(found)
            return "", StopMatch(text=text[:start], stop=stop)
    return text, None


def test_matches_a_brute_force_search_on_random_streams():
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc"])
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))
        ]
        pieces = [
            "".join(rng.choices(alphabet, k=rng.randint(0, 4))) for _ in range(rng.randint(1, 6))
        ]
        sent, match = feed_all(StopStringMatcher(stops), pieces)
        expected_sent, expected = _reference(stops, pieces)
        if expected is None:
            assert (sent, match) == (expected_sent, None), (stops, pieces)
        else:
            assert match is not None and sent + match.text == expected.text, (stops, pieces)
            assert match.stop == expected.stop, (stops, pieces)


def test_held_text_is_never_longer_than_the_longest_stop_string_but_one():
    matcher = StopStringMatcher(["a" * 255 + "b", *(f"{i:02d}" * 128 for i in range(31))])
    released = "".join(matcher.feed("aaaa") for _ in range(100))
    assert released == "a" * (400 - 255) and matcher.flush() == "a" * 255
