"""The real SMG gateway's fleet behaviour over two real Sluice workers: cache-aware routing by
prefix, a worker's engine killed and back, a weight update pushed to both.

Which worker served a request is read from the workers' own counters
(sluice_requests_finished_total, sluice_prefix_cache_hit_tokens_total), requests are sent one
after another, and each test leaves the fleet as it found it (both workers SERVING on
checkpoint A's weights).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import transformers
from sluice_client import update_all

from tests.support.gateway_workers import ADMIN_TOKEN, FINISHED, MODEL, PREFIX_HITS, metric
from tests.support.server_process import ServerProcess, wait_gone
from tests.support.smg_process import SmgProcess
from tests.support.tiny_models import hf_greedy, load_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PAGE = 16
FILLER = "apples, pears and plums lay on the table in the harbour house today"  # Sluice's default page size, which is also smg's default --block-size


@pytest.fixture(scope="module")
def api(gateway: SmgProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(checkpoint_a: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(checkpoint_a)


def served_by(workers: list[ServerProcess], call: Callable[[], Any]) -> tuple[Any, list[float]]:
    """What `call` returned and how many requests each worker finished meanwhile."""
    before = [metric(w, FINISHED) for w in workers]
    result = call()
    return result, [metric(w, FINISHED) - b for w, b in zip(workers, before, strict=True)]


def complete(api: openai.OpenAI, prompt: str, max_tokens: int = 1) -> str | None:
    answer = api.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens
    )
    return answer.choices[0].finish_reason


def test_requests_sharing_a_long_prefix_land_on_the_worker_that_holds_it(api, workers, tokenizer):
    prefix = "To be, or not to be, that is the question. " * 8
    pages = len(tokenizer.encode(prefix, add_special_tokens=False)) // PAGE
    assert pages >= 4
    before = [(metric(w, FINISHED), metric(w, PREFIX_HITS)) for w in workers]
    for i in range(6):
        assert complete(api, f"{prefix}Question {i}:") == "length"
    after = [(metric(w, FINISHED), metric(w, PREFIX_HITS)) for w in workers]
    served = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    hits = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert sorted(served) == [0, 6], served
    holder = served.index(6)
    # Every request after the first finds the prefix's full pages in the holder's cache.
    assert hits[holder] >= 5 * pages * PAGE and hits[1 - holder] == 0, hits


def test_a_workers_engine_killed_the_gateway_serves_through_the_other_then_routes_back(
    api, workers
):
    killed = workers[1]
    incarnation = len(killed.events("engine.spawned"))
    engine = killed.engine_pid(incarnation)
    os.kill(engine, signal.SIGKILL)
    assert wait_gone(engine, timeout=10)
    killed.wait_health("NOT_SERVING", timeout=10)

    during = []
    for i in range(6):
        reason, served = served_by(workers, lambda i=i: complete(api, f"While one is down {i}"))
        down = killed.health() == "NOT_SERVING"
        during.append((reason, served, down))
    # Every call succeeds; those that ended while the engine was still down were served by the
    # other worker (smg retries a worker's UNAVAILABLE elsewhere).
    assert all(reason == "length" for reason, _, _ in during), during
    assert all(served == [1, 0] for _, served, down in during if down), during
    assert any(down for _, _, down in during), "the engine was back before any call: no test"

    killed.wait_health("SERVING", timeout=60)
    assert killed.engine_pid(incarnation + 1) != engine
    # A prompt no worker holds (no two of these share more than their first few tokens) goes to
    # the worker smg has sent the fewest requests (cache_aware's min-load tie-break), so the
    # restarted worker gets one within as many requests as it is behind.
    routed_back = False
    for n in range(100, 164):
        reason, served = served_by(workers, lambda n=n: complete(api, f"{n} {FILLER}"))
        assert reason == "length"
        routed_back = served == [0, 1]
        if routed_back:
            break
    assert routed_back, "the gateway did not route to the restarted worker in 64 requests"


def serve_weights(workers: list[ServerProcess], checkpoint: Path) -> int:
    """Both workers updated to `checkpoint`'s weights; the policy version they then serve."""
    targets = [w.target for w in workers]
    results = update_all(targets, checkpoint_dir=str(checkpoint), admin_token=ADMIN_TOKEN)
    assert all(r.ok and r.applied is not None for r in results), results
    versions = {r.applied.policy_version for r in results if r.applied is not None}
    assert len(versions) == 1
    return versions.pop()


def test_a_weight_update_pushed_to_both_workers_shows_in_the_gateways_answers(
    api, workers, tokenizer, checkpoint_a, checkpoint_b
):
    prompts = ["The quick brown fox", "It was the best of times", "Call me Ishmael"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    def greedy_texts() -> list[str]:
        texts = []
        for prompt in prompts:
            answer = api.completions.create(
                model=MODEL,
                prompt=prompt,
                temperature=0,
                max_tokens=6,
                extra_body={"ignore_eos": True},
            )
            texts.append(answer.choices[0].text)
        return texts

    def reference(checkpoint: Path) -> list[str]:
        model = load_hf_model(checkpoint)
        return [str(tokenizer.decode(hf_greedy(model, p, 6)[0])).rstrip("\ufffd") for p in ids]

    expected_a, expected_b = reference(checkpoint_a), reference(checkpoint_b)
    assert expected_a != expected_b
    assert greedy_texts() == expected_a
    try:
        serve_weights(workers, checkpoint_b)
        assert greedy_texts() == expected_b
    finally:
        serve_weights(workers, checkpoint_a)
    assert greedy_texts() == expected_a
