"""The step loop's bookkeeping: a token still being sampled is a count on its request, never an
id in its tokens; a step given back before a weight swap leaves no count behind."""

from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from engine.protocol.messages import InflightPolicy, UpdateWeights
from tests.support.overlap_runs import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[0, 17, 42, 99, 123, 7, 88, 5], [0, 9, 8, 7, 6, 5, 4, 3, 2, 1, 200]]


def test_a_launched_token_is_counted_as_pending_and_never_stored_as_an_id(
    tiny_llama: Path,
) -> None:
    engine = make_engine(tiny_llama, True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()  # launches the prefill: each request samples its first token
    seqs = [seqs[0] for seqs in engine.requests.values()]
    assert [s.num_pending for s in seqs] == [1, 1]
    assert [s.token_ids for s in seqs] == PROMPTS  # nothing appended before it is collected
    assert [s.num_tokens for s in seqs] == [len(p) + 1 for p in PROMPTS]
    engine.step()  # collects it, launches the next
    assert [s.num_pending for s in seqs] == [1, 1]
    assert [s.num_output_tokens for s in seqs] == [1, 1]
    while engine.has_work():
        engine.step()
    assert all(s.num_pending == 0 and min(s.token_ids) >= 0 for s in seqs)


def test_a_step_given_back_before_a_swap_is_never_counted(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, True)
    engine.add_request("r0", PROMPTS[0], GREEDY)
    engine.step()  # the prefill is in flight: its lookup and prompt tokens not counted yet
    assert engine.stats().prefix_cache_queries == 0
    assert engine.stats().prompt_tokens_computed == 0
    update = UpdateWeights("u", 0, InflightPolicy.CONTINUE, checkpoint_dir=str(tiny_llama))
    engine.start_weight_update(update)  # gives the prefill back: r0 is queued again
    seq = engine.requests["r0"][0]
    assert seq.num_pending == 0 and seq.num_computed_tokens == 0 and not seq.pages
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prompt_tokens_computed, stats.preemptions) == (
        0,
        0,
        0,
    )
    while engine.has_work():
        engine.step()
    stats = engine.stats()
    assert stats.prefix_cache_queries == stats.prompt_tokens_computed == len(PROMPTS[0])
