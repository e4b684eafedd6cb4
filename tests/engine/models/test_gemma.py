"""Gemma 2 and Gemma 3 (text) through the engine: greedy ids and logprobs equal transformers' on
prompts longer than the sliding window (each kind of layer present), with a tight cache
(preemption, chunked prefill, a shared prefix) too; each layer declares its window in the KV
layout; a weight update serves the new checkpoint's tokens; a key Sluice cannot honour is
refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.gemma_config import gemma_config
from engine.models.hf_config import UnsupportedModelError, load_model_config
from engine.protocol.messages import WeightsPhase
from tests.support.tiny_models import hf_greedy, load_hf_model, make_checkpoint, prompts

NEW_TOKENS = 24
WINDOW = 8  # tiny_models' Gemma window: the prompts, and 24 new tokens, exceed it
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # Attention and final logit soft caps, query_pre_attn_scalar 256 (scale 1/16, not 1/4).
    "gemma2": ("gemma2", {}),
    # q/k norms, local (10k) and global (1M) rope bases, scale 1/16.
    "gemma3": ("gemma3_text", {}),
    # Gemma-3-4B's linear rope scaling (x8) on the full layers, the default scale
    # (query_pre_attn_scalar = head_dim), a final soft cap, an untied head, 6 layers with
    # transformers' default layer_types (five sliding, one full); an attention soft cap in the
    # config, which transformers' Gemma 3 never applies (a cap of 1 would flatten every score).
    "gemma3_scaled_untied": (
        "gemma3_text",
        {
            "num_hidden_layers": 6,
            "attn_logit_softcapping": 1.0,
            "layer_types": None,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
}
DELETE = object()  # with_config: the key is left out
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5
)


def make_engine(checkpoint: Path, **overrides: Any) -> LLMEngine:
    config = {"device": "cpu", "dtype": "float32", "page_size": 4, **overrides}
    return LLMEngine(EngineConfig(model=str(checkpoint), **config))


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CASES[request.param]
    return make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3_text")


def check_against_hf(checkpoint: Path, batch: list[list[int]], results: list[Any]) -> None:
    hf = load_hf_model(checkpoint)
    for prompt, result in zip(batch, results, strict=True):
        expected, hf_logprobs = hf_greedy(hf, prompt, NEW_TOKENS)
        assert result.error is None
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        chosen = hf_logprobs.gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), chosen, atol=1e-4, rtol=0)
        if result.top_logprobs is not None:
            hf_top_lps, hf_top_ids = hf_logprobs.topk(5, dim=-1)
            assert torch.equal(torch.tensor([ids for ids, _ in result.top_logprobs]), hf_top_ids)
            lps = torch.tensor([lps for _, lps in result.top_logprobs])
            torch.testing.assert_close(lps, hf_top_lps, atol=1e-4, rtol=0)


def test_greedy_ids_and_logprobs_equal_hf_generate(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    batch = prompts(engine.info.vocab_size, count=8)[::2]  # 4..52 tokens, batched together
    check_against_hf(checkpoint, batch, engine.generate(batch, GREEDY))
    assert engine.pool.num_free + engine.cache.num_cached == engine.pool.num_pages


def test_each_layer_declares_its_window_in_the_kv_layout(checkpoint: Path) -> None:
    cfg = load_model_config(checkpoint)
    kinds = gemma_config(cfg).layer_types
    assert "sliding_attention" in kinds and "full_attention" in kinds
    layout = make_engine(checkpoint).model.kv_layout
    windows = [layout.layer(i).sliding_window for i in range(layout.num_layers)]
    assert windows == [WINDOW if k == "sliding_attention" else None for k in kinds]


def test_preemption_chunked_prefill_and_a_shared_prefix_keep_hf_tokens(gemma2: Path) -> None:
    shared = prompts(320, count=3)[2]  # 20 tokens: five full pages, past the window
    batch = [[*shared, 40 + k] for k in range(2)] + prompts(320, count=6)[4:]
    # 24 pages of 4 tokens for 4 sequences of 45..68 tokens: preempted; 12 tokens a step:
    # prefilled in chunks; the shared prompt's pages: prefix-cache hits.
    engine = make_engine(gemma2, num_kv_pages=24, max_num_seqs=6, max_num_batched_tokens=12)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    check_against_hf(gemma2, batch, engine.generate(batch, greedy))
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats


def test_a_weight_update_serves_the_new_checkpoints_tokens(gemma2: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "other", "gemma2", seed=1)
    engine = make_engine(gemma2)
    batch = prompts(engine.info.vocab_size, count=4)[2:]
    before = [r.token_ids for r in engine.generate(batch, GREEDY)]
    assert engine.update_weights(other).phase is WeightsPhase.APPLIED
    results = engine.generate(batch, GREEDY)
    assert [r.token_ids for r in results] != before
    check_against_hf(other, batch, results)


def test_the_final_soft_cap_rounds_as_transformers_in_bfloat16(gemma2: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma2, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompts(320, count=8)[7]])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state[0]  # [tokens, hidden] bfloat16
        expected = hf(ids).logits[0].float()
        logits = make_engine(gemma2, dtype="bfloat16").model.compute_logits(hidden)
    assert torch.equal(logits, expected)


def with_config(checkpoint: Path, directory: Path, **changes: Any) -> Path:
    """A copy of `checkpoint` whose config.json has `changes` (DELETE: without the key)."""
    directory.mkdir()
    for path in checkpoint.iterdir():
        (directory / path.name).symlink_to(path)
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").unlink()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_transformers_4_gemma3_config_is_read_as_transformers_5_reads_it(
    gemma3: Path, tmp_path: Path
) -> None:
    """The published Gemma 3 checkpoints' config.json (transformers 4.5x): top-level rope keys,
    `rope_local_base_freq`, `sliding_window_pattern` and no `layer_types`."""
    changed = with_config(
        gemma3,
        tmp_path / "v4",
        rope_parameters=DELETE,
        layer_types=DELETE,
        rope_theta=500000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=3,  # layers 0, 1 and 3 slide, layer 2 is full
    )
    gemma = gemma_config(load_model_config(changed))
    assert gemma.layer_types == ("sliding_attention",) * 2 + ("full_attention", "sliding_attention")
    engine = make_engine(changed)
    batch = prompts(engine.info.vocab_size, count=6)[4:]  # 36 and 44 tokens
    check_against_hf(changed, batch, engine.generate(batch, GREEDY))


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4},
                }
            },
            "sliding_attention.rope_type='dynamic'",
        ),
    ],
)
def test_a_key_sluice_cannot_honour_is_refused_by_name(
    changes: dict[str, Any], key: str, gemma3: Path, tmp_path: Path
) -> None:
    changed = with_config(gemma3, tmp_path / "changed", **changes)
    with pytest.raises(UnsupportedModelError, match=key):
        make_engine(changed)
