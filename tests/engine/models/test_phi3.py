"""Phi-3 and Phi-4 (`Phi3ForCausalLM`) from unchanged `save_pretrained` checkpoints of tiny
random Phi3Config models: greedy ids equal transformers' `generate`, logprobs within 1e-4 in
float32, through the engine and through gRPC. (test_phi3_fused.py: the fused tensors across
ranks, in updates and under adapters; test_phi3_configs.py: config.json read and refused.)

The cases: Phi-3-mini's shape (every layer's sliding window shorter than the prompts), and
Phi-4-mini's (LongRoPE, 0.75 partial rotary, tied embeddings, a window that never bites), with
prompts longer than LongRoPE's original context (so transformers uses the long factors, as
the engine does for a served context past it) and, served within it, shorter ones (the short
factors).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sluice_client import Client, build_request

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.support.server_process import server_process
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 24
ORIGINAL = 64  # LongRoPE's original_max_position_embeddings
SERVED = 256


def longrope(rotary_dim: int) -> dict[str, Any]:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.2 * i for i in range(half)],
        "long_factor": [1.5 + 1.5 * i for i in range(half)],
        "original_max_position_embeddings": ORIGINAL,
    }


CASES: dict[str, dict[str, Any]] = {
    "phi3_mini_sliding": {"sliding_window": 40},
    "phi4_mini_longrope_partial": {
        "partial_rotary_factor": 0.75,  # 12 of each head's 16 dimensions
        "original_max_position_embeddings": ORIGINAL,  # Phi3Config's own key (default 4096)
        "rope_parameters": {**longrope(12), "partial_rotary_factor": 0.75},
        "tie_word_embeddings": True,
        "sliding_window": 1024,  # past the served context: never bites
    },
}
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # peft's Phi-3 modules
# Everything at once, for the tensor-parallel and LoRA checks.
ALL = {**CASES["phi4_mini_longrope_partial"], "sliding_window": 40, "tie_word_embeddings": False}


def checkpoint_of(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    return make_checkpoint(
        directory, "phi3", seed=seed, max_position_embeddings=SERVED, **overrides
    )


def make_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", **overrides}
    return LLMEngine(EngineConfig(model=str(checkpoint), **config))


def long_prompts(vocab_size: int, count: int) -> list[list[int]]:
    """Prompts of 68..124 tokens: past the window (40) and LongRoPE's original context (64)."""
    return [p for p in prompts(vocab_size, 16) if len(p) > ORIGINAL][:count]


def assert_equal_hf(hf: Any, batch: list[list[int]], token_ids: list, logprobs: list) -> None:
    for prompt, ids, lps in zip(batch, token_ids, logprobs, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert list(ids) == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        got = torch.tensor(list(lps), dtype=torch.float32)
        torch.testing.assert_close(got, chosen, atol=1e-4, rtol=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """CASES' checkpoints by name, each written once."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = checkpoint_of(tmp_path_factory.mktemp(name), **CASES[name])
        return cache[name]

    return get


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, made: Callable[[str], Path]) -> Path:
    return made(request.param)


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint_of(tmp_path_factory.mktemp("phi_all"), **ALL)


@pytest.mark.parametrize("backend", ["cpu", "torch_ref"])
def test_greedy_ids_and_logprobs_equal_hf_generate(case: Path, backend: str) -> None:
    """On the cpu backend (its C rotary kernel; windowed decode rows on torch_ref's path) and
    on torch_ref, the reference."""
    engine = make_engine(case, attention_backend=backend)
    assert engine.model.backend.name == backend
    batch = long_prompts(engine.info.vocab_size, 3)
    results = engine.generate(batch, GREEDY)
    assert all(r.error is None for r in results)
    ids, lps = [r.token_ids for r in results], [r.logprobs for r in results]
    assert_equal_hf(load_hf_model(case), batch, ids, lps)
    assert engine.pool.num_free + engine.cache.num_cached == engine.pool.num_pages


def test_longrope_is_a_rope_type_of_the_llama_family_too(tmp_path: Path) -> None:
    """transformers' Llama takes any rope type its rotary class knows; LongRoPE reads the
    same there (rope.py is shared), for prompts past the original context."""
    rope = {**longrope(16), "partial_rotary_factor": 1.0}
    checkpoint = make_checkpoint(
        tmp_path / "llama", "llama", max_position_embeddings=SERVED, rope_parameters=rope
    )
    engine = make_engine(checkpoint)
    batch = long_prompts(engine.info.vocab_size, 2)
    results = engine.generate(batch, GREEDY)
    ids, lps = [r.token_ids for r in results], [r.logprobs for r in results]
    assert_equal_hf(load_hf_model(checkpoint), batch, ids, lps)


def test_served_within_the_original_context_longrope_uses_the_short_factors(
    made: Callable[[str], Path],
) -> None:
    case = made("phi4_mini_longrope_partial")
    short = make_engine(case, max_model_len=ORIGINAL)
    batch = [p for p in prompts(short.info.vocab_size, 6) if len(p) + NEW_TOKENS <= ORIGINAL]
    results = short.generate(batch, GREEDY)
    ids, lps = [r.token_ids for r in results], [r.logprobs for r in results]
    assert_equal_hf(load_hf_model(case), batch, ids, lps)
    # The long factors (a served context past the original) give other logprobs: the two
    # comparisons with transformers check different tables.
    other = make_engine(case).generate(batch, GREEDY)
    gaps = [
        abs(a - b)
        for r, o in zip(results, other, strict=True)
        for a, b in zip(r.logprobs, o.logprobs, strict=True)
    ]
    assert max(gaps) > 1e-3


def test_the_sliding_window_decides_tokens_the_prompts_reach_past_it(
    made: Callable[[str], Path], tmp_path: Path
) -> None:
    """Without the window the same weights give other tokens: the equality with transformers
    above checks the window."""
    case = made("phi3_mini_sliding")
    unwindowed = Path(shutil.copytree(case, tmp_path / "unwindowed"))
    raw = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    engine = make_engine(case)
    assert {engine.model.kv_layout.layer(i).sliding_window for i in range(2)} == {40}
    batch = long_prompts(engine.info.vocab_size, 4)
    windowed = [r.token_ids for r in engine.generate(batch, GREEDY)]
    assert [r.token_ids for r in make_engine(unwindowed).generate(batch, GREEDY)] != windowed


def test_chunked_prefill_preemption_and_the_prefix_cache_keep_the_windowed_tokens(
    everything: Path,
) -> None:
    """A sliding window over a cached prefix, prompts prefilled in chunks, preempted and
    resumed requests: the tokens of an engine with room for all at once."""
    shared = prompts(300, 16)[12]  # 100 tokens: 12 full pages of 8, past the window
    batch = [[*shared, 40 + k] for k in range(3)] + long_prompts(300, 2)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    expected = [r.token_ids for r in make_engine(everything).generate(batch, params)]
    # 12 pages of 8: each request's window (40 tokens) and a 32-token chunk fit alone, four
    # at once do not (pages behind the window go back as it moves on): preemptions.
    tight = make_engine(
        everything, num_kv_pages=12, page_size=8, max_num_seqs=4, max_num_batched_tokens=32
    )
    assert [r.token_ids for r in tight.generate(batch, params)] == expected
    stats = tight.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats


@pytest.mark.timeout(180)
def test_greedy_ids_and_logprobs_through_grpc_equal_hf(everything: Path, tmp_path) -> None:
    flags = ("--model", str(everything), "--device", "cpu", "--dtype", "float32")
    batch = long_prompts(300, 2)
    with server_process(tmp_path / "server.log", *flags) as server:
        server.wait_health("SERVING")
        with Client(server.target) as client:
            completions = [
                client.complete(
                    build_request(
                        p, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True
                    )
                )
                for p in batch
            ]
    ids = [c.token_ids for c in completions]
    assert_equal_hf(load_hf_model(everything), batch, ids, [c.logprobs for c in completions])
