"""Structured output through the engine: every output is in the constraint's language (checked
with the language's own tools: `re.fullmatch`, `json.loads` and a JSON Schema validator, the
choice list), and the logprobs are those of the constrained distribution: the Hugging Face
model's log-softmax after xgrammar's own mask, step by step."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar

from engine import FinishReason, LLMEngine, SamplingParams
from engine.protocol.messages import Constraint
from service.text.tokenizer import Tokenizer
from tests.support.overlap_runs import Request, Seen, make_engine, run
from tests.support.tiny_models import load_hf_model

PROMPT_TEXT = "The answer, in one word:"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "size", "tags"],
}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
CHOICES = ("yes", "no", "maybe so", 'quote " and \\ backslash')
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[LLMEngine]:
    engine = make_engine(tiny_llama, overlap=False)
    yield engine
    engine.close()  # its compile workers


@pytest.fixture
def new_engine(tiny_llama: Path) -> Iterator[Callable[..., LLMEngine]]:
    """make_engine for one test; each engine it made is closed after the test (its compile
    workers with it)."""
    made: list[LLMEngine] = []

    def make(**options: Any) -> LLMEngine:
        made.append(make_engine(tiny_llama, **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    return list(tokenizer._tok.encode(PROMPT_TEXT).ids)


def sampled(constraint: Constraint, **extra: object) -> SamplingParams:
    options = {"temperature": 1.0, "seed": 7, "max_tokens": 200, **extra}
    return SamplingParams(structured=constraint, **options)  # type: ignore[arg-type]


def texts(engine: LLMEngine, tokenizer: Tokenizer, prompt: list[int], c: Constraint, n: int = 4):  # type: ignore[no-untyped-def]
    results = engine.generate([prompt], sampled(c), n=n)
    for r in results:
        assert r.finish_reason is FinishReason.STOP, (r.finish_reason, r.error)
        assert r.token_ids[-1] in engine.model_config.eos_token_ids  # EOS only at the end
    return [tokenizer._tok.decode(r.token_ids[:-1]) for r in results]


def test_choice_outputs_are_one_of_the_choices(engine, tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    outputs = texts(engine, tokenizer, prompt, Constraint("choice", choices=CHOICES), n=8)
    assert set(outputs) <= set(CHOICES)
    assert len(set(outputs)) > 1  # sampled, not stuck on one


def test_regex_outputs_fully_match(engine, tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    for text in texts(engine, tokenizer, prompt, Constraint("regex", REGEX)):
        assert re.fullmatch(REGEX, text), text


def test_json_schema_outputs_parse_and_validate(engine, tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    for text in texts(engine, tokenizer, prompt, Constraint("json_schema", json.dumps(SCHEMA))):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_outputs_are_objects(engine, tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    results = engine.generate([prompt], sampled(Constraint("json_object"), max_tokens=40), n=4)
    for r in results:
        if r.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(tokenizer._tok.decode(r.token_ids[:-1])), dict)
        else:  # a valid prefix of an object
            assert r.finish_reason is FinishReason.LENGTH
            assert tokenizer._tok.decode(r.token_ids).lstrip().startswith("{")


def test_grammar_outputs_derive_from_root(engine, tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    for text in texts(engine, tokenizer, prompt, Constraint("grammar", GRAMMAR)):
        assert re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text), text


def test_logprobs_are_of_the_constrained_distribution(engine, tiny_llama, prompt) -> None:  # type: ignore[no-untyped-def]
    """Greedy: each token is the argmax of HF's logits under xgrammar's mask, and its logprob
    is the masked log-softmax (the matcher built here from xgrammar directly)."""
    c = Constraint("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(temperature=0.0, max_tokens=300, logprobs=True, structured=c)
    result = engine.generate([prompt], params)[0]
    compiled = engine.structured.grammars.compile(c).result()
    matcher = xgrammar.GrammarMatcher(compiled)
    vocab = engine.model_config.vocab_size
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    hf = load_hf_model(tiny_llama)
    tokens, expected = list(prompt), []
    for token in result.token_ids:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1:].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        assert token == int(logits.argmax())
        expected.append(float(logits.log_softmax(-1)[0, token]))
        assert matcher.accept_token(token)
        tokens.append(token)
    assert matcher.is_terminated() and result.finish_reason is FinishReason.STOP
    torch.testing.assert_close(
        torch.tensor(result.logprobs), torch.tensor(expected), atol=1e-4, rtol=0
    )


def test_raw_logprobs_are_the_models(engine, tiny_llama, prompt) -> None:  # type: ignore[no-untyped-def]
    c = Constraint("choice", choices=("maybe so",))
    params = SamplingParams(
        temperature=0.0, max_tokens=10, logprobs=True, raw_logprobs=True, structured=c
    )
    result = engine.generate([prompt], params)[0]
    hf = load_hf_model(tiny_llama)
    ids = torch.tensor([prompt + result.token_ids])
    with torch.no_grad():
        raw = hf(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    expected = raw.gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


def test_constrained_and_free_requests_share_steps(new_engine, prompt) -> None:  # type: ignore[no-untyped-def]
    """Mixed in one batch, with the overlapped loop, preemption (a small KV pool) and the
    prefix cache, every request gets what it gets alone in a plain engine."""
    requests = [
        Request(f"r{i}", prompt + [i + 5] * (i * 7), p)
        for i, p in enumerate(
            [
                sampled(Constraint("regex", REGEX)),
                SamplingParams(temperature=1.0, seed=3, max_tokens=60, ignore_eos=True),
                sampled(Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=60),
                sampled(Constraint("choice", choices=CHOICES)),
            ]
        )
    ]
    alone = {}
    for r in requests:
        alone.update(run(new_engine(overlap=False), [r]))
    # 16 pages of 8 tokens hold any one of them (at most 18 + 21 + 60 tokens), not all four.
    busy = new_engine(overlap=True, num_kv_pages=16, page_size=8)
    for r in requests:  # compiled first, as the service's check does: all four start together
        if r.params.structured is not None:
            busy.structured.grammars.compile(r.params.structured).result()
    together = run(busy, requests)
    assert busy.scheduler.num_preemptions > 0
    for key, seen in alone.items():
        assert together[key].token_ids == seen.token_ids, key
        assert together[key].finish_reason == seen.finish_reason


def test_a_constraint_that_does_not_compile_ends_only_its_request(engine, prompt) -> None:  # type: ignore[no-untyped-def]
    bad = SamplingParams(max_tokens=5, structured=Constraint("regex", "a(b"))
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    failed, fine = engine.generate([prompt, prompt], [bad, good], n=2)[::2]
    assert failed.finish_reason is FinishReason.ERROR
    assert failed.error.startswith("structured.regex: ") and "parenthesis" in failed.error
    assert fine.finish_reason is FinishReason.LENGTH and len(fine.token_ids) == 5


def test_no_token_can_continue_ends_the_request_with_error(engine, tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    """After "yes" only EOS continues the text; min_tokens bans it: nothing can follow."""
    params = sampled(Constraint("choice", choices=("yes",)), min_tokens=20)
    other = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    failed, fine = engine.generate([prompt, prompt], [params, other])
    assert failed.finish_reason is FinishReason.ERROR
    assert tokenizer._tok.decode(failed.token_ids) == "yes"  # the refused token is not sent
    count = len(failed.token_ids)
    assert failed.error == f"structured.choice: no token can continue the text after {count} tokens"
    assert fine.finish_reason is FinishReason.LENGTH and len(fine.token_ids) == 8
    assert engine.pool.num_free == engine.pool.num_pages - engine.cache.num_cached


def test_a_request_waits_for_its_grammar_while_the_others_run(new_engine, prompt) -> None:  # type: ignore[no-untyped-def]
    """A grammar still compiling holds up its own request only: the free one runs to its end,
    then the constrained one starts once its grammar is there."""
    engine = new_engine(overlap=False)
    c = Constraint("regex", REGEX)
    compiled = engine.structured.grammars.compile(c).result()
    slow: Future[object] = Future()
    real_compile = engine.structured.grammars.compile
    engine.structured.grammars.compile = lambda constraint: (
        slow if constraint == c else real_compile(constraint)
    )  # type: ignore[method-assign]
    engine.add_request("constrained", prompt, sampled(c))
    engine.add_request(
        "free", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    seen = run_until(
        engine, lambda s: ("free", 0) in s and s[("free", 0)].finish_reason is not None
    )
    assert seen[("free", 0)].token_ids and ("constrained", 0) not in seen
    assert engine.stats().waiting == 1 and engine.has_work() and not engine.can_step()
    slow.set_result(compiled)
    seen = run_until(
        engine,
        lambda s: ("constrained", 0) in s and s[("constrained", 0)].finish_reason is not None,
    )
    assert seen[("constrained", 0)].finish_reason is FinishReason.STOP


def run_until(engine: LLMEngine, done) -> dict[tuple[str, int], Seen]:  # type: ignore[no-untyped-def]
    seen: dict[tuple[str, int], Seen] = {}
    for _ in range(500):
        for out in engine.step():
            s = seen.setdefault((out.request_id, out.index), Seen())
            s.token_ids += out.new_token_ids
            s.finish_reason = out.finish_reason
        if done(seen):
            return seen
        engine.wait_for_grammars()
    raise AssertionError(f"not done after 500 steps: {seen}")


def test_a_weight_update_mid_request_keeps_the_text_valid(new_engine, tokenizer, prompt) -> None:  # type: ignore[no-untyped-def]
    """Weights change under a constrained request (in place, CONTINUE): its grammar state
    follows its tokens, so the text stays in the language."""
    engine = new_engine(overlap=True)
    engine.add_request("r", prompt, sampled(Constraint("json_schema", json.dumps(SCHEMA))))
    seen = run_until(engine, lambda s: len(s.get(("r", 0), Seen()).token_ids) >= 3)
    with engine.live_weights(policy_version=1) as params:
        for tensor in params.values():
            tensor.mul_(1.05)
    seen_after = run_until(engine, lambda s: s.get(("r", 0), Seen()).finish_reason is not None)
    tokens = seen[("r", 0)].token_ids + seen_after[("r", 0)].token_ids
    assert seen_after[("r", 0)].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(tokenizer._tok.decode(tokens[:-1])), SCHEMA)


# Real schemas with length-bounded strings (jsonschemabench/README.md): xgrammar alone let raw
# control characters into such strings, and those outputs did not parse.
LENGTH_SCHEMAS = [
    "Github_trivial---o12240.json",
    "Github_trivial---o6021.json",
    "Github_easy---o20466.json",
]


@pytest.mark.parametrize("name", LENGTH_SCHEMAS)
def test_real_schema_outputs_that_stop_parse_and_validate(engine, tokenizer, prompt, name) -> None:  # type: ignore[no-untyped-def]
    schema = json.loads((Path(__file__).parent / "jsonschemabench" / name).read_text())["schema"]
    c = Constraint("json_schema", json.dumps(schema))
    results = engine.generate([prompt], sampled(c, max_tokens=120), n=4)
    stopped = [r for r in results if r.finish_reason is FinishReason.STOP]
    for r in stopped:
        jsonschema.validate(json.loads(tokenizer._tok.decode(r.token_ids[:-1])), schema)
    assert stopped and all(
        r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for r in results
    )
