"""Completion: engine outputs of several tokens each become chunks and a finish, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from sluice.v1 import generation_pb2 as pb

from engine.protocol.messages import FinishReason, RequestOutput
from service.text.completion import Completion, OutputSettings
from service.text.tokenizer import Tokenizer
from tests.support.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory: Path = tmp_path_factory.mktemp("tok")
    make_tokenizer().save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer._tok.encode(text, add_special_tokens=False).ids)


def test_a_stop_string_inside_a_multi_token_output_cuts_ids_and_text_there(tokenizer):
    ids = ids_of(tokenizer, "one two three four")
    assert len(ids) >= 4, "the test needs several tokens"
    # Where does " three" end? The stop string completes at that token.
    cut = next(n for n in range(1, len(ids) + 1) if "three" in tokenizer.decode(ids[:n]))
    completion = Completion("r", 0, tokenizer, OutputSettings(stop=("three",)))
    events = completion.absorb([RequestOutput("r", 0, ids, 3, logprobs=[-1.0] * len(ids))])
    chunk, finished = events[0].tokens, events[1].finished
    assert list(chunk.token_ids) == ids[:cut]
    assert list(chunk.logprobs) == [-1.0] * cut
    assert chunk.text == "one two "
    assert finished.matched_stop == "three"
    assert finished.usage.completion_tokens == cut
    assert [(s.policy_version, s.start, s.end) for s in finished.version_spans] == [(3, 0, cut)]
    assert completion.finished_early


def test_multi_token_outputs_keep_logprobs_aligned_and_split_chunks_by_version(tokenizer):
    ids = ids_of(tokenizer, "alpha beta gamma delta")
    first, second = ids[:3], ids[3:]
    tops = [([t, 0], [-0.5, -2.0]) for t in ids]
    completion = Completion("r", 0, tokenizer, OutputSettings())
    events = completion.absorb(
        [
            RequestOutput(
                "r",
                0,
                first,
                1,
                logprobs=[-0.5] * len(first),
                top_logprobs=tops[:3],
                prompt_tokens=4,
            ),
            RequestOutput(
                "r",
                0,
                second,
                2,
                logprobs=[-0.25] * len(second),
                top_logprobs=tops[3:],
                finish_reason=FinishReason.LENGTH,
            ),
        ]
    )
    old, new, finished = events[0].tokens, events[1].tokens, events[2].finished
    assert (old.policy_version, list(old.token_ids)) == (1, first)
    assert (new.policy_version, list(new.token_ids)) == (2, second)
    assert list(old.logprobs) + list(new.logprobs) == [-0.5] * 3 + [-0.25] * len(second)
    tops_sent = [list(t.token_ids) for t in [*old.top_logprobs, *new.top_logprobs]]
    assert tops_sent == [[t, 0] for t in ids]
    assert old.text + new.text == tokenizer.decode(ids)
    assert finished.usage.completion_tokens == len(ids)
    spans = [(s.policy_version, s.start, s.end) for s in finished.version_spans]
    assert spans == [(1, 0, 3), (2, 3, len(ids))]


def spec_counts(event: pb.GenerateResponse) -> tuple[int, int]:
    usage = event.finished.usage
    return usage.proposed_tokens, usage.accepted_tokens


def test_usage_carries_the_latest_speculative_counts_also_past_a_stop_string(tokenizer):
    ids = ids_of(tokenizer, "one two three four")
    last = RequestOutput("r", 0, ids, 0, finish_reason=FinishReason.LENGTH, spec_tokens=(12, 7))
    *_, finished = Completion("r", 0, tokenizer, OutputSettings()).absorb([last])
    assert spec_counts(finished) == (12, 7)
    # The engine's last output holds a stop string: the service cuts the tokens, not the counts.
    cut = Completion("r", 0, tokenizer, OutputSettings(stop=("three",)))
    *_, stopped = cut.absorb([last])
    assert stopped.finished.reason == pb.FINISH_REASON_STOP_STRING
    assert spec_counts(stopped) == (12, 7)
    # A stop string before the engine's last output: the service ends the sample with the
    # counts of the outputs it read.
    early = Completion("r", 0, tokenizer, OutputSettings(stop=("three",)))
    first = RequestOutput("r", 0, ids[:1], 0, spec_tokens=(4, 2))
    *_, ended = early.absorb([first, RequestOutput("r", 0, ids[1:], 0, spec_tokens=(8, 5))])
    assert ended.finished.reason == pb.FINISH_REASON_STOP_STRING
    assert spec_counts(ended) == (8, 5)
    # A request never proposed for reports none.
    plain = Completion("r", 0, tokenizer, OutputSettings())
    *_, none = plain.absorb([RequestOutput("r", 0, ids, 0, finish_reason=FinishReason.LENGTH)])
    assert spec_counts(none) == (0, 0)
