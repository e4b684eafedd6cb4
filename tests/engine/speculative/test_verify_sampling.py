"""Verification applies every sampling option at every verified position exactly as decoding
without speculation does: penalties and min_tokens over the history the proposals extend, bad
words that the proposals complete, the sampling surface, every logprob mode with top logprobs
and sampling supports, and structured-output grammars (each proposal checked against the
grammar before it is fed; the outputs stay in the constraint's language)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from engine import SamplingParams
from engine.protocol.messages import Constraint, LogprobMode, RequestOutput
from tests.support.overlap_runs import Request, make_engine, run
from tests.support.spec_runs import ReplayProposer, assert_same, compare, spec_engine

SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=14, ignore_eos=True, logprobs=True
)
PROMPTS = [[0, 5, 9, 14, 3, 3, 8], [0, 77, 78, 79, 80, 81, 82, 83, 84], [0, 200, 201]]


def requests(params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize(
    "options",
    [
        {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.3},
        {"logit_bias": {5: 3.0, 9: -100.0}, "bad_token_ids": (14, 15)},
        {"allowed_token_ids": tuple(range(2, 120))},
        {"logprob_mode": LogprobMode.RAW, "top_logprobs": 3},
        {"logprob_mode": LogprobMode.SAMPLED, "top_logprobs": 2},
        {"temperature": 0.0, "top_logprobs": 4},
    ],
    ids=["penalties", "surface", "allowed", "raw", "sampled-mode", "greedy-top"],
)
def test_sampling_options_give_the_same_tokens_and_logprobs(
    tiny_llama: Path, options: dict[str, object]
) -> None:
    plain, spec, _ = compare(tiny_llama, requests(replace(SEEDED, **options)))  # type: ignore[arg-type]
    assert_same(spec, plain)


def test_min_tokens_holds_back_stop_ids_at_every_verified_position(tiny_llama: Path) -> None:
    free = run(make_engine(tiny_llama, False), requests(SEEDED))
    stop = free[("r0", 0)].token_ids[1]  # a token r0 samples early: held back until 9
    params = replace(SEEDED, stop_token_ids=(stop,), min_tokens=9, max_tokens=30)
    plain, spec, _ = compare(tiny_llama, requests(params), wrong=0.1)
    assert_same(spec, plain)
    assert len(plain[("r0", 0)].token_ids) >= 9


def test_bad_words_the_proposals_would_complete_are_banned(tiny_llama: Path) -> None:
    free = run(make_engine(tiny_llama, False), requests(SEEDED))
    out = free[("r1", 0)].token_ids
    words = (tuple(out[2:4]), tuple(out[5:8]))  # what r1 says unbanned: it must not now
    plain, spec, _ = compare(tiny_llama, requests(replace(SEEDED, bad_word_ids=words)))
    assert_same(spec, plain)
    assert plain[("r1", 0)].token_ids != out


def test_sampling_supports_equal_decoding_without_speculation(tiny_llama: Path) -> None:
    params = replace(SEEDED, top_k=5, sampling_support=True)
    Supports = dict[tuple[str, int], list[list[int]]]
    supports: tuple[Supports, Supports] = ({}, {})

    def record(into: Supports):  # type: ignore[no-untyped-def]
        def hook(engine, out: RequestOutput, seen) -> None:  # type: ignore[no-untyped-def]
            into.setdefault((out.request_id, out.index), []).extend(out.sampling_support or [])

        return hook

    plain = run(make_engine(tiny_llama, False), requests(params), record(supports[0]))
    engine = spec_engine(tiny_llama, ReplayProposer(plain, 0.3))
    spec = run(engine, requests(params), record(supports[1]))
    assert_same(spec, plain)
    assert supports[1] == supports[0]
    assert all(len(supports[0][key]) == len(seen.token_ids) for key, seen in plain.items())


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
}


REGEX = r"[a-c]{2,6}-[0-9]{2,5}"
CHOICES = ("yes", "no", "maybe so")
CONSTRAINTS = {
    "regex": Constraint("regex", REGEX),
    "choice": Constraint("choice", choices=CHOICES),
    "json": Constraint("json_schema", json.dumps(SCHEMA)),
}


def test_constrained_outputs_equal_and_stay_in_the_language(tiny_llama: Path) -> None:
    from service.text.tokenizer import Tokenizer

    # One engine pair for every kind (each engine starts its grammar compile workers).
    reqs = [
        Request(
            f"{kind}{i}",
            [0, 4 + i, 9],
            SamplingParams(temperature=1.0, seed=11 + i, max_tokens=60, structured=c),
        )
        for kind, c in CONSTRAINTS.items()
        for i in range(3)
    ]
    plain_engine = make_engine(tiny_llama, False)
    plain = run(plain_engine, reqs)
    # Wrong proposals must be cut at the grammar before they are fed: a replay that is
    # wrong half the time proposes tokens the grammar refuses.
    engine = spec_engine(tiny_llama, ReplayProposer(plain, 0.5))
    spec = run(engine, reqs)
    for each in (plain_engine, engine):
        each.close()
    assert_same(spec, plain)
    assert engine.stats().spec_accepted_tokens > 0
    tokenizer = Tokenizer(tiny_llama)
    for (request_id, _), seen in spec.items():
        text = tokenizer.decode(seen.token_ids)
        if request_id.startswith("regex"):
            assert re.fullmatch(REGEX, text), text
        elif request_id.startswith("choice"):
            assert text in CHOICES, text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
