"""The state that lives across steps: block-table rows, sampling rows, columnar outputs.

Each engine here runs against a reference engine with room for everything (no preemption,
no slot reuse): tokens must match exactly, and after every step the persistent state must
equal what the requests hold.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.output_columns import OutputColumns
from engine.protocol.messages import RequestOutput
from engine.sampling.sampling_slots import _row

SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PENALISED = SamplingParams(
    temperature=0.7, top_p=0.8, repetition_penalty=1.3, min_tokens=4, max_tokens=12, seed=5
)


def make_engine(checkpoint: Path, **overrides: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", **overrides)
    )


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(6 + 3 * i)] for i in range(count)]


def assert_state_matches(engine: LLMEngine) -> None:
    """Block-table rows equal pages; a request that sampled has its own sampling row."""
    table = engine.scheduler.block_table
    slots = engine.runner.sampling_slots
    holders = [r for seqs in engine.requests.values() for r in seqs if r.pages]
    for seqs in engine.requests.values():
        for req in seqs:
            if not req.pages:
                assert req.slot is None, f"{req.key} holds a slot without pages"
                continue
            assert req.slot is not None and table.row(req) == req.pages, f"{req.key}: stale row"
            if slots.epochs.shape[0] and slots.epochs[req.slot] == table.epochs[req.slot]:
                floats, ints, flags, _, _ = _row(req)
                assert np.allclose(slots.floats[req.slot], floats), f"{req.key}: stale floats"
                assert slots.ints[req.slot].tolist()[:2] == list(ints[:2])  # its seed
                assert slots.ints[req.slot].tolist()[3:] == list(ints[3:])
                assert slots.flags[req.slot] == flags
    held = [r.slot for r in holders]
    assert len(set(held)) == len(held), "two requests share a slot"
    assert len(table.free) + len(held) == table.num_slots, "a slot leaked"


def run_checked(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams, int]]) -> dict:
    """Run to completion, checking the state after every step; tokens per (prompt, index)."""
    tokens: dict[tuple[str, int], list[int]] = {}
    for k, (prompt, params, n) in enumerate(requests):
        engine.add_request(f"req-{k}", prompt, params, n=n)
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        assert_state_matches(engine)
    return tokens


def test_preemption_forks_and_slot_reuse_keep_rows_and_tokens_exact(tiny_llama: Path) -> None:
    work = [
        (p, [SEEDED, GREEDY, PENALISED][i % 3], 1 + (i % 3 == 0)) for i, p in enumerate(prompts(7))
    ]
    expected = run_checked(make_engine(tiny_llama), work)
    # 3 sequences at a time and 16 pages of 4 tokens: slots are reused, requests preempted.
    tight = make_engine(
        tiny_llama, num_kv_pages=16, page_size=4, max_num_seqs=3, enable_prefix_cache=False
    )
    got = run_checked(tight, work)
    assert tight.stats().preemptions > 0
    assert got == expected


def test_a_slot_taken_over_by_other_params_samples_them(tiny_llama: Path) -> None:
    # One slot: each request in turn inherits the previous one's row and must refill it.
    alone = [
        run_checked(make_engine(tiny_llama), [(p, params, 1)])
        for p, params in zip(prompts(3, seed=1), [GREEDY, SEEDED, PENALISED], strict=True)
    ]
    shared = make_engine(tiny_llama, max_num_seqs=1)
    work = [
        (p, params, 1)
        for p, params in zip(prompts(3, seed=1), [GREEDY, SEEDED, PENALISED], strict=True)
    ]
    got = run_checked(shared, work)
    for k, result in enumerate(alone):
        assert got[(f"req-{k}", 0)] == result[("req-0", 0)]


def test_step_outputs_read_later_keep_the_values_of_their_step(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    engine.add_request("a", prompts(1)[0], GREEDY)
    produced = []
    while len(produced) < 2:  # overlapped steps return a step's outputs with the next one
        if outputs := engine.step():
            produced.append(outputs)
    first, second = produced
    assert isinstance(first, OutputColumns)
    for _ in range(3):
        engine.step()
    # Read only now: each still reports its own step's count.
    assert [o.completion_tokens for o in first] == [1]
    assert [o.completion_tokens for o in second] == [2]
    copy = pickle.loads(pickle.dumps(second))
    assert type(copy) is list and copy == list(second) and second == copy
    assert all(isinstance(o, RequestOutput) for o in copy)


def test_the_pipe_message_carries_every_output_of_the_step(tiny_llama: Path) -> None:
    from engine.process import step_message

    engine = make_engine(tiny_llama)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for k, params in enumerate([GREEDY, with_logprobs, short, SEEDED]):
        engine.add_request(f"r{k}", prompts(4)[k], params, n=2 if k == 3 else 1)
    columns_seen = 0
    while engine.has_work():
        outputs = engine.step()
        expected = {(o.request_id, o.index): o for o in outputs}
        msg = pickle.loads(pickle.dumps(step_message(outputs, engine.stats())))
        got = {(o.request_id, o.index): o for o in msg.all_outputs()}
        assert got == expected and len(msg.all_outputs()) == len(outputs)
        columns_seen += len(msg.columns.token_ids) if msg.columns else 0
        # Only plain rows travel as columns: none ended, none asked for logprobs.
        assert all(
            o.finish_reason is None and o.logprobs is None
            for o in msg.all_outputs()[len(msg.outputs) :]
        )
    assert columns_seen > 0
